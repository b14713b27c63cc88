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

import os
import time
from collections.abc import Callable, Iterable, Mapping

import jax.numpy as jnp
import numpy as np

from numpyro_pc.dual.base import DualPosteriorBase, by_posterior_kind, in_own_precision
from numpyro_pc.dual.build import build_posterior
from numpyro_pc.dual.expfam import EFPosterior
from numpyro_pc.dual.expfam_fit import dual_form_ef, fit_ef
from numpyro_pc.families.registry import GaussianFamily, get_family
from numpyro_pc.guides import expfam as _ef_guides
from numpyro_pc.guides import gaussian as _guides
from numpyro_pc.io.save_load import load as _load
from numpyro_pc.model.likelihood import bind_model
from numpyro_pc.model.local_binding import refuse_guide_over_locals
from numpyro_pc.ops.boosting import boosted_start
from numpyro_pc.ops.prior_change import change_prior
from numpyro_pc.ops.streaming import update as _update
from numpyro_pc.ops.unlearning import delete as _delete
from numpyro_pc.protocols.capabilities import FixedPrecision, capability
from numpyro_pc.protocols.posterior import Posterior
from numpyro_pc.protocols.records import BoostInfo, StartInfo
from numpyro_pc.sites.expectations import ExpectationRule, get_rule
from numpyro_pc.solvers.boundary import check_boundary, warn_if_worse_optimum
from numpyro_pc.solvers.start import default_start

from .errors import ConvergenceError, IncompatiblePosteriorsError, InvalidOptionError, NonFiniteResultError
from .options import MAX_SEED, SolverOptions, check_count, check_flag, check_solver_options, resolve_solver, solver_group

__all__ = ["Posterior", "DualPosterior", "EFPosterior", "dual_form", "fit", "boost", "load", "change_prior"]


class DualPosterior(DualPosteriorBase):
    """A Gaussian posterior over the flat unconstrained latents with its cached sites.

    Instances are immutable: :meth:`refine` returns a new object.

    :ivar spec: the model binding (:class:`~numpyro_pc.model.likelihood.ModelSpec`).
    :ivar data: the bound data (:class:`~numpyro_pc.model.likelihood.ModelData`).
    :ivar family: the :class:`~numpyro_pc.families.registry.GaussianFamily`.
    :ivar state: the :class:`~numpyro_pc.families.registry.Gaussian` ``(mean, precision)``.
    :ivar sites: the :class:`~numpyro_pc.sites.gaussian.Sites` at ``state``.
    :ivar rule: the expectation rule used for the sites and the refinement.
    :ivar history: the last solve's iterates (a tuple of :class:`~numpyro_pc.protocols.records.IterationInfo`).
    :ivar offset: natural parameters not attributed to any single site (left by weighted
        corrections), or ``None``: ``λ = offset + Σ_i λ̂_i``.
    """

    __slots__ = ()

    @classmethod
    def adopt(cls, posterior: DualPosteriorBase) -> DualPosterior:
        """``posterior`` (a :class:`~numpyro_pc.dual.base.DualPosteriorBase`) as a :class:`DualPosterior`."""
        return posterior if isinstance(posterior, cls) else cls(**posterior.constructor_fields())

    # ------------------------------------------------------------------ adaptation
    @solver_group
    def update(self, *args, correction: str = "exact", memory=None, selection: str = "random",
               keep: str | int = "all", seed: int = 0, tol: float | None = None, max_iters: int | None = None,
               progress: bool = False, raise_on_failure: bool = True, batch_fraction: float = 0.1,
               epochs: int | None = None, **kwargs) -> DualPosterior:
        """Add a batch of examples: the corrected streaming update (paper §3.1; docs/adapting.md).

        New examples get the next free ids. ``correction`` chooses the past terms whose
        stale sites are replaced by their true losses: ``"none"`` (VCL), ``"prior"``,
        ``"exact"`` (every retained example: the batch posterior), ``"memory"`` (``memory``
        is a list of ids, or a size — an integer count, or a fraction in ``(0, 1]`` of the retained
        examples, ``1.0`` being all of them — chosen by ``selection`` in ``"random"``,
        ``"residual"``, ``"curvature"``, ``"leverage"``: :mod:`numpyro_pc.sites.memory_sets`, the same
        rules for every family), ``"weighted"`` (the memory scaled
        to stand for all retained data, falling back to ``"memory"`` if that loses positive
        definiteness), ``"stochastic"`` (the exact correction from a random
        ``batch_fraction`` of the retained data per iteration, SAG-style; ``epochs`` caps
        the passes over the retained data, trading accuracy for time) or ``"kprior"``
        (every retained example matched in function space, without its label — the K-prior;
        ``memory`` of the new batch's examples, chosen by ``selection``, join the memory:
        :mod:`numpyro_pc.ops.kprior`, ``keep_memory``, ``memory``).

        :param args: the new batch, passed to the model like the original data.
        :param keep: data retention: ``"all"``, ``"none"`` or a reservoir size (int);
            sites of examples whose data is dropped stay in the posterior, frozen.
        :param int seed: seed of random memory selection and of the reservoir.
        :return: a new :class:`DualPosterior`; ``record`` holds the operation's diagnostics.
        """
        check_solver_options(tol, max_iters)
        check_count(seed, "seed", minimum=0, allow_none=False, maximum=MAX_SEED)
        return _update(self, *args, correction=correction, memory=memory, selection=selection, keep=keep, seed=seed,
                      tol=tol, max_iters=max_iters, progress=progress, raise_on_failure=raise_on_failure,
                      batch_fraction=batch_fraction, epochs=epochs, **kwargs)

    @solver_group
    @in_own_precision
    def delete(self, ids: Iterable[int], method: str = "remove_site", damping: bool = False, tol: float | None = None,
               max_iters: int | None = None, raise_on_failure: bool = True) -> DualPosterior:
        """Remove examples from the posterior (unlearning); see :mod:`numpyro_pc.ops.unlearning`.

        :param ids: example ids to delete (any number).
        :param str method: ``"remove_site"`` (memory-perturbation equation, default),
            ``"influence"``, ``"tracin"``, ``"corrected"`` or ``"retrain"``.
        :param bool damping: when the result would not be positive definite, shrink the
            removal and report the factor in ``record["damping"]`` instead of raising.
        """
        check_solver_options(tol, max_iters)
        if not isinstance(damping, (bool, np.bool_)):
            raise InvalidOptionError(f"damping must be True or False; got {damping!r} ({type(damping).__name__})")
        return _delete(self, ids, method=method, damping=damping, tol=tol, max_iters=max_iters,
                      raise_on_failure=raise_on_failure)



def load(path: str | os.PathLike, model: Callable, key: bytes | str | None = None) -> DualPosterior | EFPosterior:
    """Load a posterior saved with :meth:`DualPosterior.save` or :func:`numpyro_pc.io.save_load.save`; see
    :func:`numpyro_pc.io.save_load.load`, which checks the file and the model, for the parameters and the
    errors raised. A file saved from an :class:`~numpyro_pc.dual.expfam.EFPosterior` loads as one."""
    return _as_held(_load(path, model, key=key))


_as_held = by_posterior_kind("pc.load")
_as_held.register(EFPosterior, lambda post: post)
_as_held.register(DualPosteriorBase, DualPosterior.adopt)


def dual_form(model: Callable, guide, params: dict, *args, expectation: str | ExpectationRule | None = None,
              curvature: str = "hessian",
              storage: str = "auto", refine: bool = True, tol: float | None = None, max_iters: int | None = None,
              num_samples: int | None = None, seed: int = 0, num_nodes: int | None = None,
              chunk_size: int | None = None,
              data_plate: str | None = None, shared: tuple = (), progress: bool = False,
              raise_on_failure: bool = True, solver: SolverOptions | None = None,
              **kwargs) -> DualPosterior | EFPosterior:
    """Turn a fitted guide into a :class:`DualPosterior` (sites computed, refined to the optimum).

    A hand-written guide (a plain function, not an autoguide) or an ``AutoGuideList`` whose
    every sample site is a Beta, Gamma, Dirichlet, Normal/LogNormal, MultivariateNormal,
    Bernoulli or Categorical distribution with ``numpyro.param`` arguments (or an AutoNormal
    part) gives an :class:`~numpyro_pc.dual.expfam.EFPosterior` in those families instead
    (:func:`numpyro_pc.dual.expfam_fit.dual_form_ef`; ``expectation`` is then ``"auto"``,
    ``"quadrature"``, ``"cubature"``, ``"mixed"`` or ``"mc"`` — :meth:`numpyro_pc.sites.expfam.EFConfig.make` —,
    ``num_nodes`` the Gauss nodes per site, default 32, and ``num_samples`` the draws of ``"mc"``,
    default 2048, or of the vector sites of ``"mixed"``, default 64).

    A guide whose optimiser let a scale collapse (a constrained latent's mean far beyond its
    prior's 1–99 % range) gives a genuine fixed point that is still a local optimum; when the
    default start of :func:`fit` scores better on the variational objective,
    :class:`~numpyro_pc.errors.BoundaryOptimumWarning` says so with both scores, and
    ``record["boundary"]`` keeps what was flagged (:func:`numpyro_pc.solvers.boundary.check_boundary`;
    like the rest of ``record``, it describes this call and is not saved or carried by ``update``).
    The check runs after a converged refinement, not with ``refine=False`` or the delta rule.

    :param model: the NumPyro model the guide was fitted to.
    :param guide: the fitted autoguide (see :data:`numpyro_pc.guides.gaussian.SUPPORTED_GUIDES`).
    :param dict params: the guide's parameters, e.g. ``SVI(...).run(...).params``.
    :param args: the model's positional arguments (the data).
    :param str expectation: ``"delta"``, ``"mc"``, ``"gh"`` or an
        :class:`~numpyro_pc.sites.expectations.ExpectationRule` (default per guide, see
        :func:`numpyro_pc.guides.gaussian.default_expectation`).
    :param str curvature: ``"hessian"`` or ``"ggn"``.
    :param str storage: per-example curvature storage, see :mod:`numpyro_pc.sites.gaussian`.
    :param bool refine: run natural-gradient steps to the dual-form fixed point. If they fail
        from the guide (a guide far from the optimum), they restart from the MAP/Laplace
        start of :func:`fit` and ``record["start"]`` says why.
    :param bool progress: show a progress bar during refinement.
    :param bool raise_on_failure: raise if the refinement misses ``tol`` (else warn).
    :param float tol: residual tolerance of the refinement.
    :param int max_iters: refinement iterations (default: 100, extended while the run converges linearly; see
        :func:`~numpyro_pc.solvers.gaussian.solve`).
    :param int num_samples: Monte Carlo draws (``"mc"``; default 64).
    :param int seed: seed of the fixed Monte Carlo noise.
    :param int num_nodes: Gauss–Hermite nodes (``"gh"``; default 64).
    :param int chunk_size: examples per chunk of the site computation.
    :param str data_plate: the plate indexing examples when ambiguous. A model with no plate
        around its observed sites gets an implicit one over their leading batch dimension when
        that equals the per-example arguments' length (the rule of
        :func:`~numpyro_pc.model.likelihood.bind_model`, docs/models.md).
    :param tuple shared: names of array arguments that are not per-example.
    :param SolverOptions solver: ``tol``, ``max_iters``, ``progress`` and ``raise_on_failure`` as one
        group (:class:`~numpyro_pc.options.SolverOptions`); give either it or those keywords.
    :param kwargs: the model's keyword arguments.
    """
    options = resolve_solver(solver, tol, max_iters, progress, raise_on_failure)
    tol, max_iters, progress, raise_on_failure = (options.tol, options.max_iters, options.progress,
                                                  options.raise_on_failure)
    _check_fit_options(tol, max_iters, num_samples, num_nodes, chunk_size, seed)
    check_flag(refine, "refine")
    if _ef_guides.is_hand_written(guide) and not _guides.is_registered(guide):
        return dual_form_ef(model, guide, params, *args, expectation=expectation or "auto",
                            **_given(num_nodes=num_nodes, num_samples=num_samples), seed=seed,
                            tol=tol, max_iters=max_iters, refine=refine,
                            raise_on_failure=raise_on_failure, data_plate=data_plate, shared=shared, **kwargs)
    spec, data = bind_model(model, args, kwargs, data_plate=data_plate, shared=shared)
    refuse_guide_over_locals(spec)
    family, q = _guides.from_guide(guide, params, spec.latent, args, kwargs, dtype=_float_dtype())
    if expectation is None:
        expectation = _guides.default_expectation(guide, spec)
    rule = get_rule(expectation, **_rule_options(expectation, num_samples, seed, num_nodes))
    try:
        post = build_posterior(spec, data, family, q, rule, curvature, storage, chunk_size, guide, refine, tol,
                               max_iters, progress, True, cls=DualPosterior,
                               operation="dual_form" if refine else "read")
    except (ConvergenceError, NonFiniteResultError) as err:
        if not refine:
            raise
        # the fixed point does not depend on the start: a guide far from it (SVI stopped early,
        # unscaled data) is replaced by the MAP/Laplace start, and the record says so
        start = default_start(spec, data, family, None, q.mean.dtype, curvature)
        post = build_posterior(spec, data, family, start.start, rule, curvature, storage, chunk_size, guide, refine,
                               tol, max_iters, progress, raise_on_failure, cls=DualPosterior,
                               operation="dual_form" if refine else "read")
        reason = f"refinement from the guide stopped ({type(err).__name__}: {str(err).split(';')[0]})"
        return post.evolve(record=post.record.replace(start=start.info(reason)))
    if not refine or rule.kind == "delta":  # unrefined: nothing converged; delta: the MAP is its fixed point
        return post
    # a converged guide can still sit where a scale collapsed: a fixed point, but a local optimum
    found = check_boundary(spec, data, family, post.state, seed=seed)
    warn_if_worse_optimum(found)
    if not (found.flagged or found.skipped):
        return post
    return post.evolve(record=post.record.replace(boundary=found.as_record()))


def fit(model: Callable, *args, family: str | GaussianFamily | dict = "full",
        expectation: str | ExpectationRule | None = None,
        curvature: str = "hessian", storage: str = "auto", tol: float | None = None, max_iters: int | None = None,
        num_samples: int | None = None, seed: int = 0, num_nodes: int | None = None, init=None,
        chunk_size: int | None = None,
        data_plate: str | None = None, shared: tuple = (), progress: bool = False, raise_on_failure: bool = True,
        rank: int | None = None, solver: SolverOptions | None = None, **kwargs) -> DualPosterior | EFPosterior:
    """Variational Bayes with the natural-gradient solver, from a MAP/Laplace or mean-field ELBO start.

    The default start (``init=None`` or ``"map"``) is the MAP found by L-BFGS from ``0`` in
    unconstrained space, with the Laplace precision there. When that search does not converge —
    a centred hierarchy has no MAP: its density grows without bound as a group scale goes to 0 —
    a mean-field Gaussian is also fitted by deterministic ADVI on fixed draws
    (:func:`numpyro_pc.solvers.start.mean_field_elbo`), both are scored on the same variational objective
    and the better one starts the solver; ``record["start"]`` says which (``kind``) and, when
    compared, both scores (``candidates``). ``init="prior"`` starts from ``m = 0`` with the prior's
    curvature as precision. The data are
    padded internally to a bucket size with weight-0 copies of the last example, so fits
    at nearby sizes (cross-validation folds, refits of growing data) reuse the compiled
    site computation; the posterior holds exactly one site per real example.

    :param family: ``"full"``, ``"diagonal"``, ``"isotropic"`` (the isotropic family with
        the delta rule is MAP / ERM) or ``"lowrank"`` with ``rank`` (precision
        ``diag(D) + UUᵀ``, :class:`~numpyro_pc.families.lowrank.LowRankGaussian`); or a dict
        ``{latent site: "beta" | "gamma" | "dirichlet"}`` naming every latent site: a
        mean-field product of those families over the constrained values, fitted by the BLR
        in natural parameters (:func:`numpyro_pc.dual.expfam_fit.fit_ef`, docs/expfam.md),
        returning an :class:`~numpyro_pc.dual.expfam.EFPosterior`.
    :param int rank: the number of columns of ``U`` for ``family="lowrank"`` (``1 ≤ rank ≤ d``);
        a family that takes no rank refuses one.
    :param expectation: default ``"auto"``: Gauss–Hermite over each example's dependence
        subspace where the model has one of at most three dimensions (GLMs, regressions with a
        learned scale, hierarchical examples), else Monte Carlo with its error estimated
        (``"delta"`` for the isotropic family); see :mod:`numpyro_pc.sites.expectations`.
    :param init: ``"map"`` (default): L-BFGS on the negative log joint from ``0`` and the
        Laplace precision at its minimum, or the mean-field ELBO start where that search fails
        (:mod:`numpyro_pc.solvers.start`); ``"prior"``: mean ``0`` with the prior's curvature as
        precision; an array: the MAP search (and the ELBO start's mean) starts there.

    See :func:`dual_form` for the other options.
    """
    options = resolve_solver(solver, tol, max_iters, progress, raise_on_failure)
    tol, max_iters, progress, raise_on_failure = (options.tol, options.max_iters, options.progress,
                                                  options.raise_on_failure)
    _check_fit_options(tol, max_iters, num_samples, num_nodes, chunk_size, seed)
    if isinstance(family, dict):
        if rank is not None:
            raise InvalidOptionError(f"rank={rank} is an option of family='lowrank'; a dict of per-site families takes none")
        return fit_ef(model, *args, family=family, expectation=expectation or "auto",
                      **_given(num_nodes=num_nodes, num_samples=num_samples), seed=seed,
                      tol=tol, max_iters=max_iters, raise_on_failure=raise_on_failure,
                      data_plate=data_plate, shared=shared, **kwargs)
    spec, data = bind_model(model, args, kwargs, data_plate=data_plate, shared=shared)
    fam = get_family(family, rank=rank)
    fam.check_dimension(spec.latent.dim)
    dtype = _float_dtype()
    start = default_start(spec, data, fam, init, dtype, curvature)
    if expectation is None:
        expectation = "delta" if capability(fam, FixedPrecision) else "auto"
    rule = get_rule(expectation, **_rule_options(expectation, num_samples, seed, num_nodes))
    post = build_posterior(spec, data, fam, start.start, rule, curvature, storage, chunk_size, None, True, tol,
                           max_iters, progress, raise_on_failure, cls=DualPosterior)
    return post.evolve(record=post.record.replace(start=start.info()))


def boost(model: Callable, *args, checkpoint: DualPosteriorBase, mapping: Mapping | None = None,
          family: str | GaussianFamily | None = None, rank: int | None = None,
          expectation: str | ExpectationRule | None = None, curvature: str = "hessian", storage: str = "auto",
          tol: float | None = None, max_iters: int | None = None, num_samples: int | None = None, seed: int = 0,
          num_nodes: int | None = None, chunk_size: int | None = None, data_plate: str | None = None,
          shared: tuple = (), progress: bool = False, raise_on_failure: bool = True,
          solver: SolverOptions | None = None, **kwargs) -> DualPosterior:
    r"""Boost the training of ``model`` on ``args`` with a checkpoint: :func:`fit`'s answer, started at ``q_chk``.

    The checkpoint in dual form, :math:`q_{chk} \propto p_0 \prod_{i \in C} \exp(-\hat\ell_{i|chk})`,
    replaces the prior, and each loss :math:`\ell_i` it holds a site for is corrected to
    :math:`\ell_i - \hat\ell_{i|chk}` (paper §4.2):

    .. math::

        p_0 \prod_i e^{-\ell_i} = q_{chk} \prod_{i \in C} e^{-(\ell_i - \hat\ell_{i|chk})}
            \prod_{i \notin C} e^{-\ell_i},

    so the fixed point is :func:`fit`'s for the same model, data and options, while the BLR iteration
    starts at :math:`q_{chk}` and its damping pulls towards :math:`q_{chk}^\alpha q_{old}^{1-\alpha}`
    instead of :math:`p_0^\alpha q_{old}^{1-\alpha}`: from a good checkpoint, fewer steps and no
    MAP/Laplace search (:mod:`numpyro_pc.ops.boosting`). The checkpoint may be of the same data, of a
    subset (the other examples enter with their full loss) or of other data, of a neighbouring model
    read through ``mapping``, or several checkpoints combined by :func:`~numpyro_pc.ops.merging.merge`.
    If the solve from the checkpoint fails (a checkpoint far from this posterior), it is repeated from
    :func:`fit`'s default start and ``record.start.reason`` says why.

    :param checkpoint: a Gaussian dual-form posterior (:class:`DualPosterior`).
    :param dict mapping: for a model whose latents differ from the checkpoint's, ``{site: positions}``
        or ``{site: (checkpoint site, positions)}``: ``positions[k]`` is where the checkpoint site's
        ``k``-th flat unconstrained coordinate goes in the model's site; unmapped coordinates start
        from the prior (:func:`~numpyro_pc.ops.boosting.checkpoint_map`).
    :param family: the boosted posterior's family (default: the checkpoint's); ``rank`` as in :func:`fit`.
    :return: a :class:`DualPosterior` whose ``record`` is a
        :class:`~numpyro_pc.protocols.records.BoostInfo` (iterations, what the start took from the checkpoint).
    :raises ModelMismatchError: latents that differ from the checkpoint's without a ``mapping`` saying how.
    :raises DataShapeError: a ``mapping`` whose positions do not fit the two sites.
    :raises IncompatiblePosteriorsError: a checkpoint that is not a Gaussian dual-form posterior.

    See :func:`fit` for the other options (the same defaults, so that ``boost`` and ``fit`` with the same
    options reach the same posterior).
    """
    started = time.perf_counter()
    options = resolve_solver(solver, tol, max_iters, progress, raise_on_failure)
    tol, max_iters, progress, raise_on_failure = (options.tol, options.max_iters, options.progress,
                                                  options.raise_on_failure)
    _check_fit_options(tol, max_iters, num_samples, num_nodes, chunk_size, seed)
    if not isinstance(checkpoint, DualPosteriorBase):
        raise IncompatiblePosteriorsError(f"checkpoint must be a Gaussian dual-form posterior (pc.fit, pc.dual_form, "
                                          f"an update or a merge of them); got {type(checkpoint).__name__}")
    spec, data = bind_model(model, args, kwargs, data_plate=data_plate, shared=shared)
    fam = checkpoint.family if family is None and rank is None else get_family(
        checkpoint.family if family is None else family, rank=rank)
    fam.check_dimension(spec.latent.dim)
    dtype = _float_dtype()
    boosted = boosted_start(checkpoint, spec, data, fam, dtype, mapping)
    if expectation is None:
        expectation = "delta" if capability(fam, FixedPrecision) else "auto"
    rule = get_rule(expectation, **_rule_options(expectation, num_samples, seed, num_nodes))
    start = StartInfo(kind="checkpoint")
    solve = (curvature, storage, chunk_size, None, True, tol, max_iters, progress)
    try:
        post = build_posterior(spec, data, fam, boosted.start, rule, *solve, True, cls=DualPosterior)
    except (ConvergenceError, NonFiniteResultError) as err:
        cold = default_start(spec, data, fam, None, dtype, curvature)
        post = build_posterior(spec, data, fam, cold.start, rule, *solve, raise_on_failure, cls=DualPosterior)
        start = cold.info(f"the solve from the checkpoint stopped ({type(err).__name__}: {str(err).split(';')[0]})")
    cmap = boosted.map
    record = BoostInfo(**post.record.solve_fields(), start=start, mapped=int(cmap.target.size),
                       from_prior=int(cmap.from_prior.size), precision_from_checkpoint=boosted.precision_from_checkpoint,
                       checkpoint_examples=int(checkpoint.sites.num_examples),
                       start_residual=float(post.history[0]["residual"]), seconds=time.perf_counter() - started)
    return post.evolve(record=record)


def _check_fit_options(tol, max_iters, num_samples, num_nodes, chunk_size, seed) -> None:
    """Range checks of the numeric options of :func:`fit` and :func:`dual_form`."""
    check_solver_options(tol, max_iters)
    for name, value in (("num_samples", num_samples), ("num_nodes", num_nodes), ("chunk_size", chunk_size)):
        check_count(value, name)
    check_count(seed, "seed", minimum=0, allow_none=False, maximum=MAX_SEED)


def _float_dtype():
    """Floating dtype of the computation: float64 if x64 is enabled, else float32."""
    return jnp.result_type(float)


def _given(**options):
    """The options that were given (``None`` leaves the Beta/Gamma/Dirichlet path its own defaults)."""
    return {k: v for k, v in options.items() if v is not None}


def _rule_options(expectation, num_samples, seed, num_nodes):
    num_samples = 64 if num_samples is None else num_samples  # the Gaussian rules' defaults
    num_nodes = 64 if num_nodes is None else num_nodes
    kind = getattr(expectation, "kind", expectation)
    if not isinstance(expectation, str):
        return {}
    return {"mc": dict(num_samples=num_samples, seed=seed), "gh": dict(num_nodes=num_nodes, seed=seed),
            "auto": dict(num_samples=num_samples, seed=seed, num_nodes=num_nodes)}.get(kind, {})
