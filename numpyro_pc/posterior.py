r"""The dual-form posterior: a Gaussian written as a product of per-example sites.

At a variational optimum (paper eq. ``qdualform``)

.. math::

    q(z) \propto \exp(-\hat\ell_0(z)) \prod_{i=1}^N \exp(-\hat\ell_i(z)), \qquad
    S = \sum_{i=0}^N \hat H_i, \qquad \sum_{i=0}^N \hat g_i = 0 .

:func:`dual_form` turns a fitted NumPyro guide into a :class:`DualPosterior` (sites
computed, then refined to the fixed point); :func:`fit` reaches the same fixed point from
the prior without SVI.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

from typing import NamedTuple

from . import guides as _guides

from .errors import (ConvergenceError, DataShapeError, IncompatiblePosteriorsError, InvalidOptionError,
                     MonteCarloErrorWarning, NonFiniteResultError, PointEstimateWarning)
from .expectations import get_rule, prepare_rule
from .families import Gaussian, add_site, get_family
from .likelihood import bind_model, constrain, example_site_log_likelihoods, prior_loss
from .rowops import to_device
from .rows import pad_to_bucket, positions, take_data
from .start import map_laplace
from .solvers import SiteProblem, default_tol, dual_residual, solve

__all__ = ["DualPosterior", "dual_form", "fit", "build_posterior"]


def _in_own_precision(method):
    """Run a method in the floating precision the posterior was built with.

    A posterior created inside ``jax.enable_x64()`` keeps computing in float64 when used
    after the context has closed (and a float32 posterior stays float32), without
    changing the global setting.
    """
    import functools

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with jax.enable_x64(self.state.mean.dtype == jnp.float64):
            return method(self, *args, **kwargs)

    return wrapper


class DualPosterior:
    """A Gaussian posterior over the flat unconstrained latents with its cached sites.

    Instances are immutable: :meth:`refine` returns a new object.

    :ivar spec: the model binding (:class:`~numpyro_pc.likelihood.ModelSpec`).
    :ivar data: the bound data (:class:`~numpyro_pc.likelihood.ModelData`).
    :ivar family: the :class:`~numpyro_pc.families.ExponentialFamily`.
    :ivar state: the :class:`~numpyro_pc.families.Gaussian` ``(mean, precision)``.
    :ivar sites: the :class:`~numpyro_pc.sites.Sites` at ``state``.
    :ivar rule: the expectation rule used for the sites and the refinement.
    :ivar history: the refinement record (list of dicts).
    :ivar offset: natural parameters not attributed to any single site (left by weighted
        corrections), or ``None``: ``λ = offset + Σ_i λ̂_i``.
    """

    _FIELDS = ("spec", "data", "family", "state", "sites", "rule", "curvature", "storage", "chunk_size",
               "history", "guide", "data_ids", "tombstones", "next_id", "record", "offset")
    __slots__ = tuple(f"_{name}" if name in ("sites", "data") else name for name in _FIELDS)

    def __init__(self, spec, data, family, state, sites, rule, curvature="hessian", storage="auto",
                 chunk_size=None, history=(), guide=None, data_ids=None, tombstones=(), next_id=None, record=None,
                 offset=None):
        if data_ids is None:
            data_ids = _site_ids(sites)
        if next_id is None:
            site_ids = _site_ids(sites)
            next_id = int(np.max(site_ids)) + 1 if site_ids.size else 0
        for name, value in dict(spec=spec, _data=data, family=family, state=state, _sites=sites, rule=rule,
                                curvature=curvature, storage=storage, chunk_size=chunk_size,
                                history=tuple(history), guide=guide, data_ids=to_device(data_ids),
                                tombstones=tuple(int(t) for t in tombstones), next_id=int(next_id),
                                record=record, offset=offset).items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        raise AttributeError("DualPosterior is immutable; methods return new posteriors")

    # ------------------------------------------------------------------ views
    @property
    def sites(self):
        """The :class:`~numpyro_pc.sites.Sites` (gathered on first use after a site removal)."""
        return self._sites.value() if isinstance(self._sites, RowSelection) else self._sites

    @property
    def data(self):
        """The retained data (gathered on first use after a deletion)."""
        return self._data.value() if isinstance(self._data, RowSelection) else self._data

    @property
    def latent(self):
        """The :class:`~numpyro_pc.latent.LatentSpace` (site names, shapes, order)."""
        return self.spec.latent

    @property
    def dim(self):
        """Dimension ``d`` of the flat unconstrained latent vector."""
        return self.spec.latent.dim

    @property
    def num_examples(self):
        """Number of examples ``N`` with a site."""
        return int(_site_ids(self._sites).size)

    @property
    def ids(self):
        """Stable integer ids of the examples, aligned with the sites."""
        return to_device(_site_ids(self._sites)) if isinstance(self._sites, RowSelection) else self._sites.ids

    @property
    def num_retained(self):
        """Number of examples whose data is kept (and can be corrected)."""
        return int(np.asarray(self.data_ids).size)

    @property
    def mean(self):
        """Posterior mean ``m`` (unconstrained, flat, model trace order)."""
        return self.state.mean

    @property
    @_in_own_precision
    def precision(self):
        """Posterior precision ``S`` as a dense ``(d, d)`` matrix."""
        return self.family.dense_precision(self.state)

    @property
    @_in_own_precision
    def covariance(self):
        """Posterior covariance ``S⁻¹`` as a dense ``(d, d)`` matrix."""
        return self.family.dense_covariance(self.state)

    @property
    @_in_own_precision
    def natural(self):
        """Natural parameters ``(S m, S)`` (see :class:`~numpyro_pc.families.GaussianNatural`)."""
        return self.family.natural(self.state)

    @property
    @_in_own_precision
    def residual(self):
        """Relative dual-form residual (max of the mean and precision identities)."""
        return dual_residual(self.family, self.state, self.sites, self.offset)[0]

    @property
    @_in_own_precision
    def residual_parts(self):
        """``{"mean": ..., "precision": ...}`` relative residuals of the two identities."""
        return dual_residual(self.family, self.state, self.sites, self.offset)[1]

    def _split_frozen(self):
        """Rows of sites with retained data, rows without, and the latter's natural-parameter sum."""
        live = positions(self.sites.ids, self.data_ids)
        frozen = np.setdiff1d(np.arange(self.num_examples), live)
        base = self.sites.take(frozen).natural_sum(self.family) if frozen.size else None
        if self.offset is not None:
            base = self.offset if base is None else add_site(base, self.offset)
        return live, frozen, base

    def _problem(self):
        """The refinement problem over the retained data, padded to a bucket (weight-0 copies of
        the last example), and the number of real examples."""
        _, _, base = self._split_frozen()
        ids = np.asarray(self.data_ids)
        num = int(ids.size)
        data, weights, ids = pad_to_bucket(self.data, None, ids, self.state.mean.dtype)
        problem = SiteProblem(replace(self.spec, num_examples=int(ids.size)), data, self.family, self.rule,
                              self.curvature, self.sites.storage, self.chunk_size, to_device(ids), base, True, weights)
        return problem, num

    def _replace(self, **changes):
        fields = {name: getattr(self, f"_{name}" if name in ("sites", "data") else name) for name in self._FIELDS}
        fields.update(changes)
        return DualPosterior(**fields)

    # ------------------------------------------------------------------ refine
    @_in_own_precision
    def refine(self, tol=None, max_iters=100, step_size=1.0, raise_on_failure=True, progress=False, _start=None):
        """Natural-gradient steps until the dual-form residual is below ``tol``.

        :param float tol: default ``1e-8`` in float64, ``1e-5`` in float32.
        :param int max_iters: maximum number of accepted steps.
        :param float step_size: initial damping ``ρ ∈ (0, 1]`` of every step.
        :param bool raise_on_failure: raise :class:`~numpyro_pc.errors.ConvergenceError`
            (carrying the last posterior as ``err.posterior``) when ``tol`` is not reached;
            ``False`` warns instead.
        :param bool progress: show a progress bar.
        :return: a new :class:`DualPosterior` whose ``history`` records every step.
        """
        _, frozen, _ = self._split_frozen()
        problem, num_live = self._problem()

        def assemble(fresh):
            fresh = fresh.take(np.arange(num_live))  # drop the bucket padding
            return self.sites.take(frozen).concat(fresh) if frozen.size else fresh

        try:
            start_sites, start_sums = _start if _start is not None else (None, None)
            if start_sites is not None and start_sites.num_examples != problem.spec.num_examples:
                start_sites = start_sites.padded(problem.spec.num_examples, start_sites.ref_means.shape[0])
            q, sites, history = solve(problem, self.state, tol=tol, max_iters=max_iters,
                                      step_size=step_size, raise_on_failure=True, progress=progress,
                                      sites=start_sites, sums=start_sums)
        except ConvergenceError as err:
            q, sites = err.posterior
            partial = self._replace(state=q, sites=assemble(sites), history=err.history)
            if raise_on_failure:
                raise type(err)(str(err), posterior=partial, history=err.history) from None
            warnings.warn(str(err), RuntimeWarning, stacklevel=2)
            return partial
        return self._replace(state=q, sites=assemble(sites), history=history)

    # ------------------------------------------------------------------ adaptation
    def update(self, *args, correction="exact", memory=None, selection="random", keep="all", seed=0, tol=None,
               max_iters=100, progress=False, raise_on_failure=True, batch_fraction=0.1, epochs=None, **kwargs):
        """Add a batch of examples: the corrected streaming update (paper §3.1; docs/adapting.md).

        New examples get the next free ids. ``correction`` chooses the past terms whose
        stale sites are replaced by their true losses: ``"none"`` (VCL), ``"prior"``,
        ``"exact"`` (every retained example: the batch posterior), ``"memory"`` (``memory``
        is a list of ids, or a size chosen by ``selection`` in ``"random"``,
        ``"residual"``, ``"curvature"``, ``"leverage"``), ``"weighted"`` (the memory scaled
        to stand for all retained data, falling back to ``"memory"`` if that loses positive
        definiteness) or ``"stochastic"`` (the exact correction from a random
        ``batch_fraction`` of the retained data per iteration, SAG-style; ``epochs`` caps
        the passes over the retained data, trading accuracy for time).

        :param args: the new batch, passed to the model like the original data.
        :param keep: data retention: ``"all"``, ``"none"`` or a reservoir size (int);
            sites of examples whose data is dropped stay in the posterior, frozen.
        :param int seed: seed of random memory selection and of the reservoir.
        :return: a new :class:`DualPosterior`; ``record`` holds the operation's diagnostics.
        """
        from .streaming import update

        return update(self, *args, correction=correction, memory=memory, selection=selection, keep=keep, seed=seed,
                      tol=tol, max_iters=max_iters, progress=progress, raise_on_failure=raise_on_failure,
                      batch_fraction=batch_fraction, epochs=epochs, **kwargs)

    @_in_own_precision
    def delete(self, ids, method="remove_site", damping=False, tol=None, max_iters=100, raise_on_failure=True):
        """Remove examples from the posterior (unlearning); see :mod:`numpyro_pc.unlearning`.

        :param ids: example ids to delete (any number).
        :param str method: ``"remove_site"`` (memory-perturbation equation, default),
            ``"influence"``, ``"tracin"``, ``"corrected"`` or ``"retrain"``.
        :param bool damping: when the result would not be positive definite, shrink the
            removal and report the factor in ``record["damping"]`` instead of raising.
        """
        from .unlearning import delete

        return delete(self, ids, method=method, damping=damping, tol=tol, max_iters=max_iters,
                      raise_on_failure=raise_on_failure)

    def save(self, path, key=None):
        """Write the posterior atomically to ``path`` (see :mod:`numpyro_pc.io`); ``key`` signs it (HMAC)."""
        from .io import save

        return save(self, path, key=key)

    # ------------------------------------------------------------------ probability
    @_in_own_precision
    def log_prob(self, z):
        """Log-density of flat unconstrained values ``z`` (trailing axis ``d``)."""
        return self.family.log_prob(self.state, jnp.asarray(z))

    @_in_own_precision
    def entropy(self):
        """Entropy of the posterior in unconstrained space."""
        return self.family.entropy(self.state)

    @_in_own_precision
    def kl(self, other):
        """``KL(self ‖ other)`` for two posteriors of the same family and model."""
        if other.latent.signature() != self.latent.signature():
            raise IncompatiblePosteriorsError("the posteriors belong to models with different latent sites")
        if other.family.name != self.family.name:
            raise IncompatiblePosteriorsError(f"KL between different families ({self.family.name} vs {other.family.name})")
        return self.family.kl(self.state, other.state)

    @property
    def is_point_estimate(self):
        """Whether this posterior is a point estimate (MAP / ERM): the isotropic family with the
        delta rule, e.g. from ``AutoDelta``. Its fixed precision is the base measure of the
        isotropic family (paper appendix "non-constant base measures"), not a posterior
        uncertainty, so its samples are the point itself."""
        return self.family.name == "isotropic" and self.rule.kind == "delta"

    @_in_own_precision
    def sample_unconstrained(self, key, num_samples):
        """Draws of the flat unconstrained vector, shape ``(num_samples, d)``.

        A point estimate (:attr:`is_point_estimate`, e.g. from ``AutoDelta``) returns its
        point ``num_samples`` times, like NumPyro's ``AutoDelta.sample_posterior``, with a
        :class:`~numpyro_pc.errors.PointEstimateWarning`.
        """
        if self.is_point_estimate:
            warnings.warn("this posterior is a point estimate (AutoDelta / isotropic family with the delta rule): "
                          "its samples are the point itself and carry no uncertainty; fit a Gaussian family "
                          "(AutoNormal, AutoMultivariateNormal, pc.fit) for posterior uncertainty.",
                          PointEstimateWarning, stacklevel=3)
            return jnp.broadcast_to(self.state.mean, (num_samples,) + self.state.mean.shape)
        return self.family.sample(self.state, key, num_samples)

    @_in_own_precision
    def sample(self, key, num_samples):
        """Constrained samples per latent site, like ``Predictive``: ``{name: (num_samples, *shape)}``."""
        z = self.sample_unconstrained(key, num_samples)
        return jax.vmap(lambda zz: constrain(self.spec, zz, self.data))(z)

    @_in_own_precision
    def log_likelihood(self, z):
        """Per-site, per-example log-likelihood at flat values ``z`` (``{site: (..., N)}``)."""
        z = jnp.asarray(z)
        fn = lambda zz: jax.vmap(lambda ex: example_site_log_likelihoods(self.spec, zz, ex, self.data.shared))(  # noqa: E731
            self.data.per_example)
        values = jax.vmap(fn)(jnp.reshape(z, (-1, self.dim)))
        return {name: jnp.reshape(v.T if v.ndim == 1 else v, z.shape[:-1] + (-1,))
                for name, v in zip(self.spec.observed, values)}

    @_in_own_precision
    def to_arviz(self, key, num_samples=1000):
        """ArviZ ``InferenceData`` with ``posterior``, ``log_likelihood`` and ``observed_data`` groups (one chain).

        ``log_likelihood`` holds one ``(chain, draw, N)`` variable per observed site of the
        data plate (each site's values summed within an example, whatever its event or
        inner-plate shape) and, when an example has several observed sites, their sum
        ``"joint"`` — the per-example log density that ``az.loo(idata, var_name="joint")``
        and :func:`numpyro_pc.loo` score.
        """
        import arviz as az

        z = self.sample_unconstrained(key, num_samples)
        values = jax.vmap(lambda zz: constrain(self.spec, zz, self.data))(z)
        loglik = self.log_likelihood(z)
        if len(loglik) > 1 and "joint" not in loglik:
            loglik["joint"] = sum(loglik.values())
        posterior = {k: np.asarray(v)[None] for k, v in values.items()}
        log_likelihood = {k: np.asarray(v)[None] for k, v in loglik.items()}
        dims = {k: [f"{self.spec.plate}"] for k in log_likelihood}
        trace = _observed_trace(self.spec, self.state.mean, self.data)
        observed = {k: np.asarray(trace[k]["value"]) for k in self.spec.observed}
        for k, v in observed.items():
            dims.setdefault(k, [f"{self.spec.plate}"] + [f"{k}_dim_{j}" for j in range(v.ndim - 1)])
        return az.from_dict(posterior=posterior, log_likelihood=log_likelihood, observed_data=observed, dims=dims)

    @_in_own_precision
    def to_guide_params(self, guide=None):
        """Parameters of ``guide`` (default: the guide this posterior came from) describing it."""
        guide = guide if guide is not None else self.guide
        if guide is None:
            raise InvalidOptionError("this posterior was not built from a guide; pass the guide to fill")
        return _guides.to_guide_params(guide, self.family, self.state, self.latent,
                                       constrain_fn=lambda z: constrain(self.spec, z, self.data))

    @_in_own_precision
    def site_curvature(self):
        """Per-example ``tr Ĥ_i`` — how much each example contributes to the precision."""
        return self.sites.curvature_trace()

    def __repr__(self):
        return (f"DualPosterior(family={self.family.name}, d={self.dim}, N={self.num_examples}, "
                f"retained={self.num_retained}, rule={self.rule.kind}, storage={self.sites.storage}, "
                f"residual={self.residual:.2e})")


class RowSelection:
    """Rows ``rows`` of ``source`` (:class:`~numpyro_pc.sites.Sites` or
    :class:`~numpyro_pc.likelihood.ModelData`), gathered on first use.

    Deleting examples by site removal touches only the removed sites; copying the
    remaining ``N`` sites and data rows is deferred until something reads them, and
    consecutive deletions compose their row lists instead of copying every time.
    """

    __slots__ = ("source", "rows", "_value")

    def __init__(self, source, rows):
        self.source, self.rows, self._value = source, np.asarray(rows, dtype=np.int64), None

    @classmethod
    def of(cls, current, rows):
        """``rows`` of ``current`` (a value or a selection; selections compose)."""
        if isinstance(current, RowSelection):
            return cls(current.source, current.rows[np.asarray(rows, dtype=np.int64)])
        return cls(current, rows)

    def value(self):
        if self._value is None:
            if hasattr(self.source, "take"):
                self._value = self.source.take(self.rows)
            else:

                self._value = take_data(self.source, self.rows)
        return self._value


def _observed_trace(spec, z, data):
    """The model's trace on all retained data at ``z`` (observed values for ``to_arviz``)."""
    from .likelihood import _trace_at

    return _trace_at(spec, z, data.per_example, data.shared)


def _site_ids(sites):
    """Ids of ``sites`` (or of a :class:`RowSelection` of sites) as a NumPy array."""
    if isinstance(sites, RowSelection):
        return np.asarray(sites.source.ids)[sites.rows]
    return np.asarray(sites.ids)


def build_posterior(spec, data, family, q, rule, curvature, storage, chunk_size, guide, refine, tol, max_iters,
                    progress, raise_on_failure):
    """A :class:`DualPosterior` of ``q``: sites computed for ``data`` and, with ``refine``, solved to the fixed point.

    The constructor shared by :func:`fit`, :func:`dual_form`, merging and the federated run; the
    data are padded to a bucket internally and the result holds one site per real example.
    """
    rule = prepare_rule(rule, spec, data, q.mean)
    num = spec.num_examples
    padded, weights, ids = pad_to_bucket(data, None, np.arange(num), q.mean.dtype)
    problem = SiteProblem(replace(spec, num_examples=int(ids.size)), padded, family, rule, curvature, storage,
                          chunk_size, to_device(ids), None, True, weights)
    sites, sums = problem.sites(q, need_hessian_sum=family.needs_dense_sum)
    post = DualPosterior(spec, data, family, q, sites.take(np.arange(num)), rule, curvature, storage, chunk_size, (),
                         guide)
    if refine:  # the solver starts from the sites just computed
        post = post.refine(tol=tol, max_iters=max_iters, progress=progress, raise_on_failure=raise_on_failure,
                           _start=(sites, sums))
        if rule.kind == "mc":
            post = post._replace(record=dict(expectation_error=_monte_carlo_error(post, problem, num)))
    return post


def _monte_carlo_error(post, problem, num):
    """The dual-form residual of the posterior under an independent set of Monte Carlo draws.

    The solver reaches the fixed point of the expectations under *its* fixed draws; the
    residual a second, independent set of draws sees at that point estimates how far the
    answer is from the true variational optimum. Reported in ``record["expectation_error"]``
    and warned about when it is well above the tolerance.
    """
    other = replace(post.rule, seed=post.rule.seed + 1)
    fresh, _ = problem._replace(rule=other).sites(post.state)
    residual = dual_residual(post.family, post.state, fresh.take(np.arange(num)), post.offset)[0]
    tol = default_tol(post.state.mean.dtype)
    if residual > 100 * tol:
        warnings.warn(f"Monte Carlo expectations ({post.rule.num_samples} fixed draws): the fixed point's residual is "
                      f"{post.residual:.1e} for its own draws but {residual:.1e} for independent draws, so the answer is "
                      "only as accurate as the Monte Carlo error; raise num_samples, or use a model whose examples "
                      "have a low-dimensional dependence subspace (expectation='gh').", MonteCarloErrorWarning,
                      stacklevel=4)
    return dict(independent_draws_residual=float(residual), num_samples=int(post.rule.num_samples))


def dual_form(model, guide, params, *args, expectation=None, curvature="hessian", storage="auto", refine=True,
              tol=None, max_iters=100, num_samples=64, seed=0, num_nodes=64, chunk_size=None, data_plate=None,
              shared=(), progress=False, raise_on_failure=True, **kwargs):
    """Turn a fitted guide into a :class:`DualPosterior` (sites computed, refined to the optimum).

    :param model: the NumPyro model the guide was fitted to.
    :param guide: the fitted autoguide (see :data:`numpyro_pc.guides.SUPPORTED_GUIDES`).
    :param dict params: the guide's parameters, e.g. ``SVI(...).run(...).params``.
    :param args: the model's positional arguments (the data).
    :param str expectation: ``"delta"``, ``"mc"``, ``"gh"`` or an
        :class:`~numpyro_pc.expectations.ExpectationRule` (default per guide, see
        :func:`numpyro_pc.guides.default_expectation`).
    :param str curvature: ``"hessian"`` or ``"ggn"``.
    :param str storage: per-example curvature storage, see :mod:`numpyro_pc.sites`.
    :param bool refine: run natural-gradient steps to the dual-form fixed point. If they fail
        from the guide (a guide far from the optimum), they restart from the MAP/Laplace
        start of :func:`fit` and ``record["start"]`` says why.
    :param bool progress: show a progress bar during refinement.
    :param bool raise_on_failure: raise if the refinement misses ``tol`` (else warn).
    :param float tol: residual tolerance of the refinement.
    :param int max_iters: refinement iterations.
    :param int num_samples: Monte Carlo draws (``"mc"``).
    :param int seed: seed of the fixed Monte Carlo noise.
    :param int num_nodes: Gauss–Hermite nodes (``"gh"``).
    :param int chunk_size: examples per chunk of the site computation.
    :param str data_plate: the plate indexing examples when ambiguous.
    :param tuple shared: names of array arguments that are not per-example.
    :param kwargs: the model's keyword arguments.
    """
    spec, data = bind_model(model, args, kwargs, data_plate=data_plate, shared=shared)
    family, q = _guides.from_guide(guide, params, spec.latent, args, kwargs, dtype=_float_dtype())
    if expectation is None:
        expectation = _guides.default_expectation(guide, spec)
    rule = get_rule(expectation, **_rule_options(expectation, num_samples, seed, num_nodes))
    try:
        return build_posterior(spec, data, family, q, rule, curvature, storage, chunk_size, guide, refine, tol, max_iters,
                     progress, True)
    except (ConvergenceError, NonFiniteResultError) as err:
        if not refine:
            raise
        # the fixed point does not depend on the start: a guide far from it (SVI stopped early,
        # unscaled data) is replaced by the MAP/Laplace start, and the record says so
        start = _start(spec, data, family, None, q.mean.dtype)
        post = build_posterior(spec, data, family, start.start, rule, curvature, storage, chunk_size, guide, refine, tol,
                     max_iters, progress, raise_on_failure)
        reason = f"refinement from the guide stopped ({type(err).__name__}: {str(err).split(';')[0]})"
        return post._replace(record=dict(post.record or {}, start=dict(kind=start.kind, reason=reason)))


def fit(model, *args, family="full", expectation=None, curvature="hessian", storage="auto", tol=None,
        max_iters=100, num_samples=64, seed=0, num_nodes=64, init=None, chunk_size=None, data_plate=None,
        shared=(), progress=False, raise_on_failure=True, **kwargs):
    """Variational Bayes with the natural-gradient solver, starting from the prior.

    The start is ``m = 0`` in unconstrained space (or ``init``) with the prior's curvature
    there as precision (the identity where that is not positive definite). The data are
    padded internally to a bucket size with weight-0 copies of the last example, so fits
    at nearby sizes (cross-validation folds, refits of growing data) reuse the compiled
    site computation; the posterior holds exactly one site per real example.

    :param family: ``"full"``, ``"diagonal"`` or ``"isotropic"`` (the isotropic family with
        the delta rule is MAP / ERM).
    :param expectation: default ``"auto"``: Gauss–Hermite over each example's dependence
        subspace where the model has one of at most three dimensions (GLMs, regressions with a
        learned scale, hierarchical examples), else Monte Carlo with its error estimated
        (``"delta"`` for the isotropic family); see :mod:`numpyro_pc.expectations`.
    :param init: ``"map"`` (default): L-BFGS on the negative log joint from ``0`` and the
        Laplace precision at its minimum (:mod:`numpyro_pc.start`); ``"prior"``: mean ``0`` with
        the prior's curvature as precision; an array: the MAP search starts there.

    See :func:`dual_form` for the other options.
    """
    spec, data = bind_model(model, args, kwargs, data_plate=data_plate, shared=shared)
    fam = get_family(family)
    dtype = _float_dtype()
    start = _start(spec, data, fam, init, dtype)
    if expectation is None:
        expectation = "delta" if fam.fixed_precision else "auto"
    rule = get_rule(expectation, **_rule_options(expectation, num_samples, seed, num_nodes))
    post = build_posterior(spec, data, fam, start.start, rule, curvature, storage, chunk_size, None, True, tol,
                 max_iters, progress, raise_on_failure)
    info = {k: v for k, v in start._asdict().items() if k != "start"}
    return post._replace(record=dict(post.record or {}, start=info))


class _Start(NamedTuple):
    start: Gaussian
    kind: str
    iterations: int = 0
    grad_norm: float = float("nan")
    value: float = float("nan")
    converged: bool = False
    saddle_escapes: int = 0


def _start(spec, data, family, init, dtype):
    """The solver's starting point: the MAP/Laplace start, or the prior's curvature at ``init``.

    ``init="map"`` (default) runs L-BFGS from ``0`` (or from an array ``init``); if the search
    leaves the region where the log joint is finite, the prior start is used instead
    (recorded as ``record["start"]["start"] == "prior"``).
    """
    z0 = jnp.zeros(spec.latent.dim, dtype)
    if init is None or isinstance(init, str):
        kind = "map" if init is None else str(init)
        if kind not in ("map", "prior"):
            raise InvalidOptionError(f"init must be 'map', 'prior' or an array of {spec.latent.dim} values; "
                                     f"got {init!r}")
    else:
        z0 = jnp.asarray(init, dtype)
        if z0.shape != (spec.latent.dim,):
            raise DataShapeError(f"init must be a flat unconstrained vector of shape ({spec.latent.dim},) in the "
                                 f"order {spec.latent.labels()[:6]}...; got shape {z0.shape}")
        kind = "map"
    if kind == "map":
        padded, weights, ids = pad_to_bucket(data, None, np.arange(spec.num_examples), dtype)
        found = map_laplace(replace(spec, num_examples=int(ids.size)), padded, family, z0, weights)
        if found.start.precision is not None and bool(family.is_positive_definite(found.start.precision)):
            return _Start(found.start, "map", found.iterations, found.grad_norm, found.value, found.converged,
                          found.saddle_escapes)
    if family.fixed_precision:
        return _Start(Gaussian(z0, jnp.asarray(1.0, dtype)), "prior")
    hess = jax.hessian(lambda z: prior_loss(spec, z, data))(z0)
    precision = family.project_curvature(0.5 * (hess + hess.T))
    if not bool(family.is_positive_definite(precision)):
        precision = family.project_curvature(jnp.eye(spec.latent.dim, dtype=dtype))
    return _Start(Gaussian(z0, precision), "prior")


def _float_dtype():
    """Floating dtype of the computation: float64 if x64 is enabled, else float32."""
    return jnp.result_type(float)


def _rule_options(expectation, num_samples, seed, num_nodes):
    kind = getattr(expectation, "kind", expectation)
    if not isinstance(expectation, str):
        return {}
    return {"mc": dict(num_samples=num_samples, seed=seed), "gh": dict(num_nodes=num_nodes, seed=seed),
            "auto": dict(num_samples=num_samples, seed=seed, num_nodes=num_nodes)}.get(kind, {})
