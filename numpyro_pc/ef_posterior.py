r"""Dual-form posteriors in mean-field exponential-family products.

The posterior is a product of one factor per latent site (Beta, Gamma, Dirichlet on the
constrained value; Normal or full Gaussian blocks on the unconstrained value; Bernoulli or
Categorical on a discrete latent; :mod:`numpyro_pc.ef_product`), a family member
:math:`q(x) = \exp(\langle\lambda, T(x)\rangle - A(\lambda))` written as its sites
(paper eq. ``qdualform``):

.. math::

    \lambda = -g_0 - \sum_{i=1}^N g_i, \qquad g_i = \nabla_\mu E_q[\ell_i],

held in :class:`EFState` (a pytree; the sites in an
:class:`~numpyro_pc.ef_site_table.EFSiteTable`). :class:`EFPosterior` is a thin immutable wrapper:
:func:`~numpyro_pc.ef_fit.fit_ef` reaches the fixed point from the prior, :func:`~numpyro_pc.ef_fit.dual_form_ef` from a fitted
hand-written guide; :meth:`EFPosterior.update`, :meth:`~EFPosterior.delete` and
:meth:`~EFPosterior.merge` are the paper's operations in these families (§3.1 streaming with the
exact correction or none, §3.2 deletion by site removal or corrected, Bayesian arithmetic
:math:`\lambda_a + \lambda_b - \lambda_0`). With a conjugate-form prior and likelihood the
sites are exact and constant, so all of these are exact Bayes.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from .ef_product import ProductFamily, family_for_model, site_names  # noqa: F401  (importable from here, as before)
from .ef_eval import inference_data
from .ef_guides import read_guide, write_params
from .fixed_point import default_tol
from .ef_sites import EFConfig, blr_solve, compute_sites, model_point, relative_residual  # noqa: F401  (EFConfig: as before)
from .ef_site_table import EFSiteTable, EFState
from .errors import (DataShapeError, InvalidOptionError, MonteCarloErrorWarning,
                     OutOfDomainError, UnknownExampleError)
from .likelihood import ModelData, bind_model
from .posterior_protocol import Posterior
from .rowops import as_ids, join_rows, take_rows
from .rows import concat_data, pad_to_bucket

__all__ = ["EFState", "EFPosterior", "merge_ef", "default_tol"]

_MOVED_TO_EF_FIT = ("fit_ef", "dual_form_ef")


def __getattr__(name: str):
    """``fit_ef`` and ``dual_form_ef`` moved to :mod:`numpyro_pc.ef_fit`; importing them from here
    still works for one release, with a ``FutureWarning``."""
    if name in _MOVED_TO_EF_FIT:
        from . import ef_fit  # ef_fit builds on this module
        warnings.warn(f"numpyro_pc.ef_posterior.{name} moved to numpyro_pc.ef_fit.{name} (or call pc.fit / "
                      "pc.dual_form); the old location is removed in the next release", FutureWarning, stacklevel=2)
        return getattr(ef_fit, name)
    raise AttributeError(f"module 'numpyro_pc.ef_posterior' has no attribute {name!r}")


@partial(jax.jit, static_argnums=(0, 3))
def _target(config, lam, data, prior_active, const, weights, seed):
    """:math:`\\tau(\\lambda) = c - \\sum_i w_i g_i(\\lambda) [- g_0(\\lambda)]` and the sites at ``lam``
    (``weights`` 0 on the rows that only pad the data to its bucket)."""
    sites = compute_sites(config, lam, data, seed)
    tau = const - weights @ sites.grads
    if prior_active:
        tau = tau - sites.prior
    return tau, sites


def bucketed_target(config, data, prior_active, const, seed=None) -> Callable:
    """``λ -> (τ(λ), sites)`` over ``data`` padded to :func:`numpyro_pc.rows.bucket_size` rows
    (repeats of the last row with weight 0), so that batches of other sizes reuse the same
    compiled site computation; the sites returned are those of the real rows."""
    num = int(data.per_example[0].shape[0])
    padded, weights, _ = pad_to_bucket(data, None, np.arange(num), const.dtype)
    cfg = _rows(config, int(weights.shape[0]))
    seed = jnp.asarray(config.seed if seed is None else seed, jnp.uint32)

    def target(lam):
        tau, sites = _target(cfg, lam, padded, prior_active, const, weights, seed)
        return tau, sites._replace(grads=sites.grads[:num], residual=sites.residual[:num])

    return target


def _called(name):
    warnings.warn(f"EFPosterior.{name} is a property, as on Gaussian posteriors: write post.{name} instead of "
                  f"post.{name}(); the call form will be removed in the next release", FutureWarning, stacklevel=3)


class _Residual(float):
    """The residual as a float that can still be called (the pre-property spelling, deprecated)."""

    def __call__(self):
        _called("residual")
        return self


class _Means(dict):
    """The posterior means as a dict that can still be called (the pre-property spelling, deprecated);
    a pytree like a dict."""

    def __call__(self):
        _called("mean")
        return self


jax.tree_util.register_pytree_with_keys(
    _Means, lambda d: ([(jax.tree_util.DictKey(k), v) for k, v in d.items()], tuple(d)),
    lambda keys, values: _Means(zip(keys, values)))


class EFPosterior(Posterior):
    """A mean-field exponential-family posterior with one cached site per example
    (a :class:`~numpyro_pc.posterior_protocol.Posterior`).

    :ivar config: :class:`~numpyro_pc.ef_sites.EFConfig` (model binding, family, rule).
    :ivar data: the retained examples (:class:`~numpyro_pc.likelihood.ModelData`).
    :ivar state: :class:`EFState`.
    :ivar conjugate_prior: whether the prior term is conjugate-form (constant :math:`\\lambda_0`).
    :ivar guide_map: the hand-written guide's :class:`~numpyro_pc.ef_guides.GuideMap`, if any.
    :ivar record: the last operation's diagnostics.
    :ivar tombstones: ids of deleted examples, sorted (never given to a new example).
    :ivar next_id: the id the next new example gets: past every id held or deleted.
    """

    __slots__ = ("config", "data", "state", "conjugate_prior", "guide_map", "record", "stale_sites", "tombstones",
                 "next_id")

    def __init__(self, config, data, state, conjugate_prior, guide_map=None, record=None, stale_sites=False,
                 tombstones=(), next_id=0):
        tombstones = tuple(sorted({int(i) for i in tombstones}))
        held = np.asarray(state.sites.ids)
        floor = max(int(held.max()) + 1 if held.size else 0, tombstones[-1] + 1 if tombstones else 0)
        for k, v in dict(config=config, data=data, state=state, conjugate_prior=conjugate_prior,
                         guide_map=guide_map, record=record or {}, stale_sites=bool(stale_sites),
                         tombstones=tombstones, next_id=max(int(next_id), floor)).items():
            object.__setattr__(self, k, v)

    def __setattr__(self, name, value):
        raise AttributeError("EFPosterior is immutable; operations return a new posterior")

    def evolve(self, **changes):
        fields = {k: getattr(self, k) for k in self.__slots__}
        fields.update(changes)
        return type(self)(**fields)

    # ------------------------------------------------------------------ the distribution
    @property
    def family(self) -> ProductFamily:
        return self.config.family

    @property
    def natural(self):
        return self.state.natural

    @property
    def sites(self) -> EFSiteTable:
        """The cached sites (a :class:`~numpyro_pc.site_protocol.SiteTable`)."""
        return self.state.sites

    @property
    def prior_natural(self):
        """:math:`\\lambda_0 = -g_0` (constant for a conjugate-form prior, else at the current ``q``)."""
        return self.sites.prior_natural()

    @property
    def ids(self):
        return self.sites.ids

    @property
    def num_examples(self):
        return self.sites.num_examples

    @property
    def spec(self):
        """The model binding (:class:`~numpyro_pc.likelihood.ModelSpec`), as on Gaussian posteriors."""
        return self.config.spec

    @property
    def data_ids(self):
        """Ids of the examples whose data is retained: every example's (the sites need their data)."""
        return self.sites.ids

    @property
    def num_retained(self) -> int:
        """Examples whose data is retained (all of them)."""
        return self.num_examples

    @property
    def residual(self) -> float:
        """Relative dual-form residual :math:`\\|\\lambda + g_0 + \\sum_i g_i\\| / (1 + \\|\\lambda\\|)`
        (a property, as on Gaussian posteriors; calling it is deprecated), with fresh sites after
        ``delete(method="remove_site")`` (:attr:`Posterior.residual <numpyro_pc.posterior_protocol.Posterior.residual>`)."""
        return _Residual(super().residual)

    def fresh_site_residual(self) -> float:
        """The residual with every site recomputed at the current ``λ`` (one site pass)."""
        const = self.sites.prior_natural() if self.conjugate_prior else jnp.zeros_like(self.natural)
        tau, _ = bucketed_target(self.config, self.data, not self.conjugate_prior, const)(self.natural)
        return _Residual(relative_residual(self.natural, tau))

    @property
    def site_identity_residual(self) -> float:
        """The identity's residual with the sites as stored."""
        return _Residual(relative_residual(self.natural, self.sites.prior_natural() + self.sites.natural_sum()))

    @property
    def mean(self) -> dict:
        """:math:`E_q[x]` per latent site (constrained values; the category probabilities of a
        categorical site); a property, as on Gaussian posteriors (calling it is deprecated)."""
        return _Means(self.family.mean(self.natural))

    def sample(self, key, num_samples):
        """``num_samples`` draws per latent site (constrained values, as the model's sites hold them)."""
        return self.family.to_constrained(self.family.sample(key, self.natural, num_samples))

    @property
    def q(self) -> jax.Array:
        """The family member: the natural parameters ``λ``."""
        return self.natural

    def point_of(self, values: dict) -> dict:
        """Each factor's coordinate of the latent sites' constrained ``values``."""
        return {f.site: f.from_constrained(jnp.asarray(values[f.site])) for f in self.family.factors}

    def model_point(self, point) -> tuple:
        """``(z, discrete, log_det)`` at factor coordinates ``point`` (:func:`numpyro_pc.ef_sites.model_point`)."""
        return model_point(self.spec, self.family, point)

    def probe_points(self, num: int) -> list:
        """``num`` draws of the posterior (key 7) in the model's coordinates."""
        draws = self.family.sample(jax.random.PRNGKey(7), self.natural, num)
        return [self.model_point({name: v[k] for name, v in draws.items()})[:2] for k in range(num)]

    def latent_factors(self) -> dict:
        """:meth:`distributions`: the product's factors."""
        return self.distributions()

    def recompute_sites(self, q) -> EFSiteTable:
        """Every example's site (and the prior term) recomputed at natural parameters ``q``."""
        fresh = compute_sites(self.config, q, self.data)  # the config is sized to the data
        return EFSiteTable(fresh.grads, fresh.prior, self.ids)

    def distributions(self):
        """Each latent site's factor as a NumPyro distribution of the site's constrained value
        (a Gaussian factor on a constrained site is a ``TransformedDistribution``)."""
        return {f.site: f.distribution(p) for f, p in zip(self.family.factors, self.family.split(self.natural))}

    def entropy(self):
        return self.family.entropy(self.natural)

    def kl(self, other):
        """:math:`KL(q \\| q_{other})` to a posterior of the same model and family.

        :raises IncompatiblePosteriorsError: ``other`` is not one.
        """
        self.check_comparable(other, "KL")
        return self.family.kl(self.natural, other.natural)

    def to_arviz(self, key, num_samples=1000):
        """ArviZ ``InferenceData`` with ``posterior`` (constrained draws of each latent site),
        ``log_likelihood`` (one ``(chain, draw, N)`` variable per observed site of the data plate
        and their sum ``"joint"`` when an example has several) and ``observed_data`` groups, one
        chain of ``num_samples`` draws; see :func:`numpyro_pc.ef_eval.inference_data`.

        :param key: a ``jax.random.PRNGKey``.
        """
        with jax.enable_x64(self.natural.dtype == jnp.float64):
            return inference_data(self, key, num_samples)

    def to_guide_params(self, guide=None, args=(), kwargs=None):
        """The hand-written guide's params describing this posterior.

        :param guide: a guide to write for (default: the guide read by :func:`~numpyro_pc.ef_fit.dual_form_ef`);
            it is traced with its own initial params to find which param feeds which argument.
        """
        gmap = self.guide_map
        if guide is not None:
            gmap, _ = read_guide(guide, None, self.family.names, args, kwargs)
        if gmap is None:
            raise InvalidOptionError("this posterior was not read from a guide; pass guide= to to_guide_params")
        return write_params(gmap, self.family, self.natural)

    # ------------------------------------------------------------------ operations
    def update(self, *args, correction="exact", memory=None, seed=0, batch_fraction=0.1, epochs=1, tol=None,
               max_iters=200, raise_on_failure=True, **kwargs):
        """Add a batch (paper §3.1, eq. ``vcl_correction``).

        :param str correction: which stale sites are recomputed at the new fixed point —
            ``"exact"``: all of them (the batch posterior); ``"none"``: none (VCL: the old sites
            and prior term stay frozen, only the new sites are solved for); ``"prior"``: the
            prior term (differs from ``"none"`` only for a prior that is not conjugate-form);
            ``"memory"``: the prior term and the sites of a memory set of past examples;
            ``"stochastic"``: after the ``"prior"`` update, ``epochs`` passes over all examples in
            random blocks of ``batch_fraction`` of them, each block's sites recomputed at the
            fixed point with the others held (block Gauss–Seidel on the dual form: it tends to
            the exact update as the passes grow).
        :param memory: for ``"memory"``: a fraction of the retained examples drawn with ``seed``,
            or the example ids to correct.
        """
        if correction not in ("exact", "none", "prior", "memory", "stochastic"):
            raise InvalidOptionError(f"correction for exponential-family posteriors is 'exact', 'none', 'prior', "
                                     f"'memory' or 'stochastic'; got {correction!r} (the weighted correction rescales "
                                     "a memory set's sites, which would break λ = -g_0 - Σ g_i for the stored sites)")
        if correction == "stochastic":
            if not 0.0 < float(batch_fraction) <= 1.0 or int(epochs) < 1:
                raise InvalidOptionError(f"the stochastic correction needs 0 < batch_fraction ≤ 1 and epochs ≥ 1; got "
                                         f"{batch_fraction}, {epochs}")
            post = self.update(*args, correction="prior", tol=tol, max_iters=max_iters,
                               raise_on_failure=raise_on_failure, **kwargs)
            rng = np.random.default_rng(seed)
            blocks = int(np.ceil(1.0 / float(batch_fraction)))
            for _ in range(int(epochs)):
                for rows in np.array_split(rng.permutation(post.num_examples), blocks):
                    post = post._recompute(np.sort(rows), tol, max_iters, raise_on_failure)
            return post.evolve(record=dict(post.record, operation="update", correction="stochastic",
                                           batch_fraction=float(batch_fraction), epochs=int(epochs)))
        if (memory is not None) != (correction == "memory"):
            raise InvalidOptionError("memory= goes with correction='memory' (and that correction needs it)")
        spec, new = bind_model(self.config.spec.model, args, kwargs, data_plate=self.config.spec.plate,
                               allow_discrete=True)
        if spec.latent != self.config.spec.latent or spec.observed != self.config.spec.observed:
            raise DataShapeError("the new batch binds the model to other latent or observed sites")
        start = self.next_id  # never an id held or deleted before
        ids = jnp.arange(start, start + spec.num_examples)
        if correction == "exact":
            data = concat_data(self.data, new)
            post = solve_every_site(self, data, jnp.concatenate([self.ids, ids]), self.natural, tol, max_iters,
                          raise_on_failure)
            return post.evolve(record=dict(post.record, operation="update", correction="exact"))
        rows = self._memory_rows(memory, seed) if correction == "memory" else np.zeros(0, int)
        prior_active = correction != "none" and not self.conjugate_prior
        const = self.natural - self.sites.take(rows).natural_sum()  # the corrected sites leave the constant
        if prior_active:
            const = const + self.sites.prior
        active = ModelData(tuple(join_rows(take_rows(x, rows), y) for x, y in zip(self.data.per_example,
                                                                                  new.per_example)), new.shared)
        tol = default_tol(const.dtype) if tol is None else tol
        lam, sites, info = blr_solve(bucketed_target(self.config, active, prior_active, const),
                                     self.family.in_domain, self.natural, tol, max_iters,
                                     raise_on_failure=raise_on_failure)
        added = EFSiteTable(sites.grads[rows.size:], sites.prior if prior_active else self.sites.prior, ids)
        state = EFState(lam, self.sites.with_rows(rows, sites.grads[:rows.size]).concat(added))
        return self.evolve(config=_rows(self.config, self.num_examples + spec.num_examples),
                           data=concat_data(self.data, new), state=state,
                           record=dict(operation="update", correction=correction, corrected=int(rows.size),
                                       **info._asdict()))

    def _recompute(self, rows, tol, max_iters, raise_on_failure):
        """The sites at ``rows`` (and the prior term unless conjugate-form) recomputed at the fixed
        point with every other site held."""
        prior_active = not self.conjugate_prior
        const = self.natural - self.sites.take(rows).natural_sum()
        if prior_active:
            const = const + self.sites.prior
        active = ModelData(tuple(take_rows(x, rows) for x in self.data.per_example), self.data.shared)
        tol = default_tol(const.dtype) if tol is None else tol
        lam, sites, info = blr_solve(bucketed_target(self.config, active, prior_active, const),
                                     self.family.in_domain, self.natural, tol, max_iters,
                                     raise_on_failure=raise_on_failure)
        table = self.sites.with_rows(rows, sites.grads)
        state = EFState(lam, replace(table, prior=sites.prior) if prior_active else table)
        return self.evolve(state=state, record=info._asdict())

    def _memory_rows(self, memory, seed):
        """Positions of the memory set: a fraction drawn with ``seed``, or the rows of given ids."""
        num = self.num_examples
        if isinstance(memory, float) and not isinstance(memory, bool):
            if not 0.0 <= memory <= 1.0:
                raise InvalidOptionError(f"memory as a fraction must lie in [0, 1]; got {memory}")
            count = int(round(memory * num))
            return np.sort(np.random.default_rng(seed).choice(num, count, replace=False))
        wanted = np.asarray(as_ids(memory))
        held = np.asarray(self.ids)
        missing = sorted(set(wanted.tolist()) - set(held.tolist()))
        if missing:
            raise UnknownExampleError(f"memory ids {missing[:10]} are not in this posterior")
        return np.flatnonzero(np.isin(held, wanted))

    def delete(self, ids, method="remove_site", tol=None, max_iters=200, raise_on_failure=True):
        """Remove examples (paper §3.2). ``"remove_site"``: :math:`\\lambda + \\sum_{j\\in J} g_j`;
        ``"corrected"``: then the retained sites are recomputed to the fixed point (exact);
        ``"retrain"``: the fixed point of the retained data solved again from the prior (the
        reference the others are measured against).

        ``"influence"`` and ``"tracin"`` are refused: they approximate a removal by a Newton or a
        gradient step in a Gaussian's mean, while here removing the sites is exact in the natural
        parameters and ``"corrected"`` recomputes the others.

        :raises OutOfDomainError: ``"remove_site"`` leaving a shape parameter non-positive.
        :raises UnknownExampleError: ids that are not held.
        """
        if method in ("influence", "tracin"):
            raise InvalidOptionError(
                f"method={method!r} approximates a deletion by a {'Newton' if method == 'influence' else 'gradient'} "
                "step in a Gaussian's mean; an exponential-family posterior removes the sites exactly in its natural "
                "parameters (λ + Σ g_j). Use 'remove_site', 'corrected' (the retained sites recomputed) or 'retrain'.")
        if method not in ("remove_site", "corrected", "retrain"):
            raise InvalidOptionError(f"method for exponential-family posteriors is 'remove_site', 'corrected' or "
                                     f"'retrain'; got {method!r}")
        wanted = np.asarray(as_ids(ids))
        held = np.asarray(self.ids)
        missing = sorted(set(wanted.tolist()) - set(held.tolist()))
        if missing:
            raise UnknownExampleError(f"example ids {missing[:10]} are not in this posterior")
        drop = np.isin(held, wanted)
        keep = np.flatnonzero(~drop)
        tombstones = self.tombstones + tuple(held[drop].tolist())
        removed = self.natural - self.sites.take(np.flatnonzero(drop)).natural_sum()
        inside = bool(self.family.in_domain(removed))
        data = ModelData(tuple(take_rows(x, keep) for x in self.data.per_example), self.data.shared)
        if method == "remove_site":
            if not inside:
                raise OutOfDomainError("removing the sites leaves a non-positive shape parameter "
                                       f"({self.family.describe(removed)}); use method='corrected'")
            state = EFState(removed, self.sites.take(keep))
            return self.evolve(config=_rows(self.config, int(keep.size)), data=data, state=state,
                               record=dict(operation="delete", method=method), stale_sites=True, tombstones=tombstones)
        if keep.size == 0:
            raise DataShapeError(f"{method} deletion needs at least one retained example")
        start = removed if inside else self.natural
        if method == "retrain":
            start = self.sites.prior_natural() if self.conjugate_prior else self.family.default_natural(self.natural.dtype)
        post = solve_every_site(self, data, self.ids[keep], start, tol, max_iters, raise_on_failure)
        return post.evolve(record=dict(post.record, operation="delete", method=method), tombstones=tombstones)

    def merge(self, *others, alphas=None, method="bayesian", refine=False, tol=None, max_iters=200) -> EFPosterior:
        r"""Bayesian arithmetic with posteriors of the same model, family and prior fitted on other
        examples: :math:`\lambda = \lambda_0 + \sum_k \alpha_k (\lambda_k - \lambda_0)`, sites
        concatenated (exact for conjugate models; :func:`numpyro_pc.merging.merge`). Ids that collide
        with earlier posteriors' are shifted past them (``record["renumbered"]``). ``refine=True`` then
        recomputes every site at the fixed point.

        :raises IncompatiblePosteriorsError: other models, families, priors or site designs.
        """
        merged = super().merge(*others, alphas=alphas, method=method)
        if refine:
            merged = solve_every_site(merged, merged.data, merged.ids, merged.natural, tol, max_iters, True)
        return merged

    def __repr__(self):
        return (f"EFPosterior({', '.join(f'{n}: {fam}' for n, (fam, _) in self.family.describe(self.natural).items())}"
                f", N={self.num_examples})")


def _rows(config, num):
    """``config`` for ``num`` examples (the static size the site computation is compiled for)."""
    return replace(config, spec=replace(config.spec, num_examples=num))


def solve_every_site(post, data, ids, start, tol, max_iters, raise_on_failure) -> EFPosterior:
    """``post`` solved to the fixed point over all ``data`` (every site active, ids ``ids``) from the
    natural parameters ``start``; the prior term is active unless conjugate-form."""
    num = int(ids.shape[0])
    cfg = _rows(post.config, num)
    tol = default_tol(start.dtype) if tol is None else tol
    const = post.sites.prior_natural() if post.conjugate_prior else jnp.zeros_like(start)
    lam, sites, info = blr_solve(bucketed_target(cfg, data, not post.conjugate_prior, const),
                                 post.family.in_domain, start, tol, max_iters, raise_on_failure=raise_on_failure)
    prior = post.sites.prior if post.conjugate_prior else sites.prior
    state = EFState(lam, EFSiteTable(sites.grads, prior, ids))
    record = dict(info._asdict(), max_site_nonlinearity=float(jnp.max(sites.residual)))
    if cfg.rule != "quadrature" and info.converged:
        record["expectation_error"] = _draw_error(cfg, data, not post.conjugate_prior, const, lam, tol)
    return post.evolve(config=cfg, data=data, state=state, record=record, stale_sites=False)


def _draw_error(config, data, prior_active, const, lam, tol):
    """The fixed point's residual under an independent set of points (seed + 1): other draws,
    or the cubature rotated by another orthogonal matrix.

    The solver reaches the fixed point of the expectations under *its* points; the residual a
    second set sees at that point estimates how far the answer is from the family's true
    optimum (0 up to rounding for conjugate losses, whose sites are exact whatever the
    points, and, under ``"cubature"``, for losses of degree at most 3 in the Gaussian blocks; the
    second cubature has another rotation *and* radius, so that an error depending on the radius
    alone shows too).
    Warned about when well above the tolerance.
    """
    other, _ = bucketed_target(config, data, prior_active, const, config.seed + 1)(lam)
    residual = relative_residual(lam, other)
    cubature = config.rule == "cubature"
    if not residual <= 100 * tol:  # a NaN residual warns too
        if cubature:
            what = (f"its own cubature points but {residual:.1e} for a rotated cubature: the loss is far from a "
                    "polynomial of degree 3 in the Gaussian blocks over q, and the degree-3 rule's error shows; pass "
                    "expectation='mixed' (num_samples draws) or 'mc'")
        else:
            what = (f"its own {config.num_samples} draws but {residual:.1e} for independent draws: the answer is "
                    "only as accurate as the Monte Carlo error of the draws; raise num_samples (or give vector "
                    "sites scalar factors with Gauss rules)")
        warnings.warn(f"the fixed point's residual is below {tol:g} for {what}", MonteCarloErrorWarning, stacklevel=4)
    if cubature:
        return dict(rotated_cubature_residual=residual, num_points=config.family.cubature_size())
    return dict(independent_draws_residual=residual, num_samples=int(config.num_samples))


def merge_ef(a, b, refine=False, tol=None, max_iters=200):
    """Deprecated: ``a.merge(b, refine=refine)`` (:meth:`EFPosterior.merge`, which also takes several
    posteriors and weights); this alias stays for one release."""
    warnings.warn("numpyro_pc.ef_posterior.merge_ef is deprecated: write a.merge(b) or pc.merge(None, [a, b]); "
                  "the alias will be removed in the next release", FutureWarning, stacklevel=2)
    return a.merge(b, refine=refine, tol=tol, max_iters=max_iters)
