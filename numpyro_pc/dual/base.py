r"""The dual-form posterior's data, state and queries (the layer below the operations).

:class:`DualPosteriorBase` holds a Gaussian ``q`` written as a product of per-example
sites (paper eq. ``qdualform``) with the data the sites came from, and answers everything
that does not change the data: moments, densities, KL, sampling, export, the dual-form
residual and refinement to the fixed point. The operations (``numpyro_pc.ops.streaming``,
``numpyro_pc.ops.unlearning``, ``numpyro_pc.ops.merging``, ``numpyro_pc.io.save_load``, …) take and return
such posteriors; :class:`numpyro_pc.posterior.DualPosterior`, the class users hold, adds
them as methods (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NoReturn, Self

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from numpyro_pc.errors import (ConvergenceError, InvalidOptionError, MissingCapabilityError, PointEstimateWarning,
                               UnsupportedGuideError)
from numpyro_pc.families.registry import GaussianFamily, GaussianNatural, add_site
from numpyro_pc.guides import gaussian as _guides
from numpyro_pc.model.terms import ModelSpec, local_draws, site_log_likelihoods
from numpyro_pc.model.likelihood import ModelData, constrain, trace_at
from numpyro_pc.model.rows import RowSelection, pad_to_bucket, positions, stand_in_row, to_device
from numpyro_pc.options import check_count, check_finite, check_key, check_solver_options, solver_group
from numpyro_pc.protocols.capabilities import FixedPrecision, capability
from numpyro_pc.protocols.posterior import Posterior
from numpyro_pc.protocols.records import RefineInfo
from numpyro_pc.sites.gaussian import Sites, compute_sites
from numpyro_pc.solvers.gaussian import solve, solve_init
from numpyro_pc.solvers.site_problem import SiteProblem, dual_residual

from .marginals import site_marginals
from .state import PosteriorConfig, PosteriorState

if TYPE_CHECKING:
    from arviz import InferenceData
    from numpyro.distributions import Distribution

__all__ = ["DualPosteriorBase", "PosteriorConfig", "PosteriorState", "RowSelection", "by_posterior_kind"]


def by_posterior_kind(operation: str, error: type = UnsupportedGuideError) -> Callable:
    """A :func:`functools.singledispatch` function over the class of its first argument, a posterior,
    anything else refused with ``error`` naming ``operation``: for the facade
    (:mod:`numpyro_pc.posterior`), which hands users its own classes. Operations dispatch on the
    family's site table instead (:func:`numpyro_pc.protocols.posterior.by_site_table`).
    """

    def refuse(post, *args, **kwargs) -> NoReturn:
        raise error(f"{operation} needs a dual-form posterior (from pc.fit or pc.dual_form); found "
                    f"{type(post).__name__}")

    return functools.singledispatch(refuse)


def in_own_precision(method) -> Callable[..., Any]:
    """Run a method in the floating precision the posterior was built with.

    A posterior created inside ``jax.enable_x64()`` keeps computing in float64 when used
    after the context has closed (and a float32 posterior stays float32), without
    changing the global setting.
    """
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs) -> Any:
        with jax.enable_x64(self.state.mean.dtype == jnp.float64):
            return method(self, *args, **kwargs)

    return wrapper


class DualPosteriorBase(Posterior):
    """What a Gaussian dual-form posterior is and answers (a
    :class:`~numpyro_pc.protocols.posterior.Posterior`): its data, state and sites, densities,
    sampling, export and refinement (:class:`numpyro_pc.posterior.DualPosterior` spells out the
    options of the operations that change its data: ``update``, ``delete``).

    Operations build results with :meth:`evolve`, which keeps the caller's class.
    """

    _FIELDS = ("spec", "data", "family", "state", "sites", "rule", "curvature", "storage", "chunk_size",
               "history", "guide", "data_ids", "tombstones", "next_id", "record", "offset", "stale_sites")
    __slots__ = tuple(f"_{name}" if name in ("sites", "data") else name for name in _FIELDS) + ("_fresh_residual_cache",)
    # the slots' types (set once, by __init__ through object.__setattr__)
    spec: ModelSpec
    family: GaussianFamily
    stale_sites: bool
    history: tuple
    offset: GaussianNatural | None

    def __init__(self, spec, data, family, state, sites, rule, curvature="hessian", storage="auto",
                 chunk_size=None, history=(), guide=None, data_ids=None, tombstones=(), next_id=None, record=None,
                 offset=None, stale_sites=False):
        if data_ids is None:
            data_ids = _site_ids(sites)
        if next_id is None:
            site_ids = _site_ids(sites)
            next_id = int(np.max(site_ids)) + 1 if site_ids.size else 0
        for name, value in dict(spec=spec, _data=data, family=family, state=state, _sites=sites, rule=rule,
                                curvature=curvature, storage=storage, chunk_size=chunk_size,
                                history=tuple(history), guide=guide, data_ids=to_device(data_ids),
                                tombstones=tuple(int(t) for t in tombstones), next_id=int(next_id),
                                record=record, offset=offset, stale_sites=bool(stale_sites)).items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_fresh_residual_cache", [None, None])  # (state, residual with fresh sites)

    def __setattr__(self, name, value) -> NoReturn:
        raise AttributeError("DualPosterior is immutable; methods return new posteriors")

    # ------------------------------------------------------------------ views
    @property
    def sites(self) -> Sites:
        """The :class:`~numpyro_pc.sites.gaussian.Sites` (gathered on first use after a site removal)."""
        return self._sites.value() if isinstance(self._sites, RowSelection) else self._sites

    @property
    def data(self) -> ModelData:
        """The retained data (gathered on first use after a deletion)."""
        return self._data.value() if isinstance(self._data, RowSelection) else self._data

    @property
    def num_examples(self) -> int:
        """Number of examples ``N`` with a site."""
        return int(_site_ids(self._sites).size)

    @property
    def ids(self) -> jax.Array:
        """Stable integer ids of the examples, aligned with the sites."""
        return to_device(_site_ids(self._sites)) if isinstance(self._sites, RowSelection) else self._sites.ids

    @property
    def num_retained(self) -> int:
        """Number of examples whose data is kept (and can be corrected)."""
        return int(np.asarray(self.data_ids).size)

    @property
    def mean(self) -> jax.Array:
        """Posterior mean ``m`` (unconstrained, flat, model trace order)."""
        return self.state.mean

    @property
    @in_own_precision
    def precision(self) -> jax.Array:
        """Posterior precision ``S`` as a dense ``(d, d)`` matrix."""
        return self.family.dense_precision(self.state)

    @property
    @in_own_precision
    def covariance(self) -> jax.Array:
        """Posterior covariance ``S⁻¹`` as a dense ``(d, d)`` matrix."""
        return self.family.dense_covariance(self.state)

    @property
    @in_own_precision
    def natural(self) -> GaussianNatural:
        """Natural parameters ``(S m, S)`` (see :class:`~numpyro_pc.families.registry.GaussianNatural`)."""
        return self.family.natural(self.state)

    @property
    @in_own_precision
    def residual(self) -> float:
        """Relative dual-form residual (max of the mean and precision identities), with every
        retained site recomputed after an approximate deletion (``remove_site``, ``influence``,
        ``tracin``): :attr:`Posterior.residual <numpyro_pc.protocols.posterior.Posterior.residual>`."""
        return super().residual

    @property
    @in_own_precision
    def residual_parts(self) -> dict[str, float]:
        """``{"mean": ..., "precision": ...}`` relative residuals of the two identities (with
        fresh sites after an approximate deletion, as :attr:`residual`)."""
        if self.stale_sites:
            return self._fresh_residual_and_parts()[1]
        return dual_residual(self.family, self.state, self.sites, self.offset)[1]

    @property
    @in_own_precision
    def site_identity_residual(self) -> float:
        """The residual of ``λ = λ₀ + Σᵢ λ̂ᵢ`` with the sites as stored (what a saved file records
        and what the corrected models of :mod:`numpyro_pc.ops.handlers` rely on)."""
        return dual_residual(self.family, self.state, self.sites, self.offset)[0]

    @in_own_precision
    def fresh_site_residual(self) -> float:
        """The residual with every retained example's site recomputed at the current ``q`` (one site
        pass, kept for this ``q``)."""
        return self._fresh_residual_and_parts()[0]

    def _fresh_residual_and_parts(self) -> tuple:
        cache = self._fresh_residual_cache
        if cache[0] is not self.state:
            problem, _ = self._problem()
            point = solve_init(problem, self.state, memory=0).point
            cache[:] = [self.state, (float(point.residual), dict(point.parts))]
        return cache[1]

    def recompute_sites(self, q) -> Sites:
        """The retained examples' sites (rows in :attr:`data_ids` order) and the prior site recomputed
        at the Gaussian ``q`` of this posterior's family, with its rule, curvature and storage."""
        sites, _ = compute_sites(self.spec, self.data, self.family, q, self.rule, curvature=self.curvature,
                                 storage=self.sites.storage, chunk_size=self.chunk_size,
                                 ids=jnp.asarray(self.data_ids))
        return sites

    def _split_frozen(self) -> tuple[np.ndarray, np.ndarray, GaussianNatural | None]:
        """Rows of sites with retained data, rows without, and the latter's natural-parameter sum."""
        live = positions(self.sites.ids, self.data_ids)
        frozen = np.setdiff1d(np.arange(self.num_examples), live)
        base = self.sites.take(frozen).natural_sum(self.family) if frozen.size else None
        if self.offset is not None:
            base = self.offset if base is None else add_site(base, self.offset)
        return live, frozen, base

    def _problem(self) -> tuple[SiteProblem, int]:
        """The refinement problem over the retained data, padded to a bucket (weight-0 copies of
        the last example), and the number of real examples."""
        _, _, base = self._split_frozen()
        ids = np.asarray(self.data_ids)
        num = int(ids.size)
        data, weights, ids = (pad_to_bucket(self.data, None, ids, self.state.mean.dtype) if num else  # else: no data
                              (stand_in_row(self.data), jnp.zeros(1, self.state.mean.dtype), np.array([-1])))
        problem = SiteProblem(replace(self.spec, num_examples=int(ids.size)), data, self.family, self.rule,
                              self.curvature, self.sites.storage, self.chunk_size, to_device(ids), base, True, weights)
        return problem, num

    @property
    def raw_sites(self) -> Sites | RowSelection:
        """The sites as held: :class:`~numpyro_pc.sites.gaussian.Sites`, or a :class:`RowSelection` of them
        not gathered yet (operations pass it on without copying)."""
        return self._sites

    @property
    def raw_data(self) -> ModelData | RowSelection:
        """The retained data as held: :class:`~numpyro_pc.model.likelihood.ModelData` or a :class:`RowSelection`."""
        return self._data

    def constructor_fields(self) -> dict[str, Any]:
        """``{argument: value}`` of the constructor that rebuilds this posterior."""
        return {name: getattr(self, f"_{name}" if name in ("sites", "data") else name) for name in self._FIELDS}

    def evolve(self, **changes) -> Self:
        """A copy with the given constructor fields changed, of this posterior's class.

        For operations: nothing is recomputed or checked, so the caller keeps the fields
        consistent (sites aligned with ``data_ids``, ``state`` the sites' fixed point or a
        refinement start).
        """
        fields = self.constructor_fields()
        fields.update(changes)
        return type(self)(**fields)

    @property
    def config(self) -> PosteriorConfig:
        """The static configuration (:class:`PosteriorConfig`)."""
        return PosteriorConfig(self.spec, self.family, self.rule, self.curvature, self.storage, self.chunk_size)

    def tree(self) -> tuple[PosteriorConfig, PosteriorState, ModelData]:
        """The posterior as ``(config, state, data)``: static configuration, numeric pytree state
        and retained data (deferred site and data selections are gathered).

        :meth:`from_tree` rebuilds it; the provenance (``history``, ``guide``, ``record``) is
        not part of the state and is passed to :meth:`from_tree` separately.
        """
        dtype = np.asarray(self.data_ids).dtype
        state = PosteriorState(self.state, self.sites, self.offset, self.data_ids,
                               to_device(np.asarray(self.tombstones, dtype)), to_device(np.asarray(self.next_id, dtype)),
                               to_device(np.asarray(self.stale_sites)))
        return self.config, state, self.data

    @classmethod
    def from_tree(cls, config: PosteriorConfig, state: PosteriorState, data: ModelData, history=(), guide=None,
                  record=None) -> DualPosteriorBase:
        """The posterior of ``(config, state, data)`` (see :meth:`tree`), of this class."""
        return cls(config.spec, data, config.family, state.q, state.sites, config.rule, config.curvature,
                   config.storage, config.chunk_size, history, guide, state.data_ids,
                   tuple(int(t) for t in np.asarray(state.tombstones)), int(state.next_id), record, state.offset,
                   state.stale_sites is not None and bool(np.asarray(state.stale_sites)))

    # ------------------------------------------------------------------ refine
    @in_own_precision
    @solver_group
    def refine(self, tol: float | None = None, max_iters: int | None = None, step_size: float = 1.0,
               raise_on_failure: bool = True, progress: bool = False, _start=None) -> DualPosteriorBase:
        """Natural-gradient steps until the dual-form residual is below ``tol``.

        :param float tol: default ``1e-8`` in float64, ``1e-5`` in float32.
        :param int max_iters: maximum number of accepted steps (default: automatic, see
            :func:`~numpyro_pc.solvers.gaussian.solve`).
        :param float step_size: initial damping ``ρ ∈ (0, 1]`` of every step.
        :param bool raise_on_failure: raise :class:`~numpyro_pc.errors.ConvergenceError`
            (carrying the last posterior as ``err.posterior``) when ``tol`` is not reached;
            ``False`` warns instead.
        :param bool progress: show a progress bar.
        :return: a new :class:`DualPosterior` whose ``history`` records every step
            (:class:`~numpyro_pc.protocols.records.IterationInfo`) and ``record`` the solve
            (:class:`~numpyro_pc.protocols.records.RefineInfo`).
        """
        check_solver_options(tol, max_iters)
        step_size = check_finite(step_size, "step_size", low=2.0**-30, high=1.0)
        _, frozen, _ = self._split_frozen()
        problem, num_live = self._problem()

        def assemble(fresh) -> Sites:
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
            partial = self.evolve(state=q, sites=assemble(sites), history=err.history, stale_sites=False,
                                  record=RefineInfo(iterations=len(err.history) - 1, converged=False))
            if raise_on_failure:
                raise type(err)(str(err), posterior=partial, history=err.history) from None
            warnings.warn(str(err), RuntimeWarning, stacklevel=2)
            return partial
        return self.evolve(state=q, sites=assemble(sites), history=history, stale_sites=False,
                           record=RefineInfo(iterations=len(history) - 1, converged=True))

    # ------------------------------------------------------------------ probability
    @in_own_precision
    def log_prob(self, z: ArrayLike) -> jax.Array:
        """Log-density of flat unconstrained values ``z`` (trailing axis ``d``)."""
        return self.family.log_prob(self.state, jnp.asarray(z))

    @in_own_precision
    def entropy(self) -> jax.Array:
        """Entropy of the posterior in unconstrained space."""
        return self.family.entropy(self.state)

    @in_own_precision
    def kl(self, other: DualPosteriorBase) -> jax.Array:
        """``KL(self ‖ other)`` for two posteriors of the same family and model."""
        self.check_comparable(other, "KL")
        return self.family.kl(self.state, other.state)

    @property
    def site_table_type(self) -> type:
        """The class of the sites, read from a lazy row selection's source without gathering it."""
        raw = self.raw_sites
        return type(raw.source if isinstance(raw, RowSelection) else raw)

    @property
    def q(self) -> Any:
        """The family member: the Gaussian state ``(mean, precision)``."""
        return self.state

    def point_of(self, values: dict) -> jax.Array:
        """The flat unconstrained ``z`` of the latent sites' constrained ``values``."""
        return self.latent.unconstrain(values)

    def model_point(self, point) -> tuple:
        """``(z, None, 0)``: a Gaussian family's coordinates are the model's flat latents."""
        return point, None, 0.0

    def probe_points(self, num: int) -> list:
        """``num`` points ``mean + ½ ε`` with ``ε`` standard normal (key 7)."""
        offsets = jax.random.normal(jax.random.PRNGKey(7), (num, self.dim), self.mean.dtype)
        return [(z, None) for z in self.mean[None, :] + 0.5 * offsets]

    @in_own_precision
    def distributions(self) -> dict[str, Distribution]:
        """Each latent site's marginal under ``q`` as a NumPyro distribution of the site's constrained
        value: the Gaussian block of its unconstrained coordinates pushed through the site's bijection
        (an exponential-family product's :meth:`~numpyro_pc.dual.expfam.EFPosterior.distributions` gives
        its factors, which are its marginals). A diagonal or isotropic family's blocks are independent
        normals (``O(d)``); a full or low-rank family's block of a site with ``s`` coordinates is a dense
        ``(s, s)`` covariance, read from ``Σ E`` for the site's selection ``E`` (``O(d s)``). A point
        estimate (:attr:`is_point_estimate`) gives a ``Delta`` at its point.

        :raises MissingCapabilityError: a site's support depends on other latents (``Uniform(0, tau)``):
            its marginal is not a transformed Gaussian of its own coordinates (:meth:`sample` draws it).
        """
        return site_marginals(self)

    def latent_factors(self) -> None:
        """``None``: one joint density over the flat latents."""
        return None

    @property
    def is_point_estimate(self) -> bool:
        """Whether this posterior is a point estimate (MAP / ERM): the isotropic family with the
        delta rule, e.g. from ``AutoDelta``. Its fixed precision is the base measure of the
        isotropic family (paper appendix "non-constant base measures"), not a posterior
        uncertainty, so its samples are the point itself."""
        return capability(self.family, FixedPrecision) is not None and self.rule.kind == "delta"

    @in_own_precision
    def sample_unconstrained(self, key: jax.Array, num_samples: int) -> jax.Array:
        """Draws of the flat unconstrained vector, shape ``(num_samples, d)``.

        A point estimate (:attr:`is_point_estimate`, e.g. from ``AutoDelta``) returns its
        point ``num_samples`` times, like NumPyro's ``AutoDelta.sample_posterior``, with a
        :class:`~numpyro_pc.errors.PointEstimateWarning`.
        """
        check_key(key)
        num_samples = check_count(num_samples, "num_samples", allow_none=False)
        if self.is_point_estimate:
            warnings.warn("this posterior is a point estimate (AutoDelta / isotropic family with the delta rule): "
                          "its samples are the point itself and carry no uncertainty; fit a Gaussian family "
                          "(AutoNormal, AutoMultivariateNormal, pc.fit) for posterior uncertainty.",
                          PointEstimateWarning, stacklevel=3)
            return jnp.broadcast_to(self.state.mean, (num_samples,) + self.state.mean.shape)
        return self.family.sample(self.state, key, num_samples)

    @in_own_precision
    def sample(self, key: jax.Array, num_samples: int) -> dict[str, jax.Array]:
        """Constrained samples per latent site, like ``Predictive``: ``{name: (num_samples, *shape)}``; local
        latents (docs/hierarchical.md) one value per row, from ``N(u*_i(z), H_i^{-1})`` given each global draw.

        :raises MissingCapabilityError: local latents of a posterior that no longer holds all its rows."""
        z = self.sample_unconstrained(key, num_samples)
        values = jax.vmap(lambda zz: constrain(self.spec, zz, self.data))(z)
        if self.spec.local is not None:
            if self.num_retained != self.num_examples:
                raise MissingCapabilityError(f"the local latents {list(self.spec.local.names)} are drawn per row, and "
                                             f"this posterior holds {self.num_retained} of its {self.num_examples} rows")
            values.update(local_draws(self.spec, self.data, z, jax.random.fold_in(key, 1)))
        return values

    @in_own_precision
    def log_likelihood(self, z: ArrayLike) -> dict[str, jax.Array]:
        """Per-site, per-example log-likelihood at flat values ``z`` (``{site: (..., N)}``)."""
        return site_log_likelihoods(self.spec, self.data, z)

    @in_own_precision
    def to_arviz(self, key: jax.Array, num_samples: int = 1000) -> InferenceData:
        """ArviZ ``InferenceData`` with ``posterior``, ``log_likelihood`` and ``observed_data`` groups (one chain).

        ``log_likelihood`` holds one ``(chain, draw, N)`` variable per observed site of the
        data plate (each site's values summed within an example, whatever its event or
        inner-plate shape) and, when an example has several observed sites, their sum
        ``"joint"`` — the per-example log density that ``az.loo(idata, var_name="joint")``
        and :func:`numpyro_pc.loo` score.
        """
        import arviz as az

        z = self.sample_unconstrained(key, num_samples)
        values = self.sample(key, num_samples) if self.spec.local is not None else \
            jax.vmap(lambda zz: constrain(self.spec, zz, self.data))(z)
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

    @in_own_precision
    def to_guide_params(self, guide=None) -> dict[str, jax.Array]:
        """Parameters of ``guide`` (default: the guide this posterior came from) describing it."""
        guide = guide if guide is not None else self.guide
        if guide is None:
            raise InvalidOptionError("this posterior was not built from a guide; pass the guide to fill")
        return _guides.to_guide_params(guide, self.family, self.state, self.latent,
                                       constrain_fn=lambda z: constrain(self.spec, z, self.data))

    @in_own_precision
    def site_curvature(self) -> jax.Array:
        """Per-example ``tr Ĥ_i`` — how much each example contributes to the precision."""
        return self.sites.curvature_trace()

    def __repr__(self) -> str:
        return (f"DualPosterior(family={self.family.name}, d={self.dim}, N={self.num_examples}, "
                f"retained={self.num_retained}, rule={self.rule.kind}, storage={self.sites.storage}, "
                f"residual={self._shown_residual()})")

    def _shown_residual(self) -> str:
        """The residual for ``repr``: a representation never runs a site pass."""
        if self.stale_sites and self._fresh_residual_cache[0] is not self.state:
            return "stale sites (post.residual computes it)"
        return f"{self.residual:.2e}"


def _observed_trace(spec, z, data) -> dict[str, Any]:
    """The model's trace on all retained data at ``z`` (observed values for ``to_arviz``)."""
    return trace_at(spec, z, data.per_example, data.shared)


def _site_ids(sites) -> np.ndarray:
    """Ids of ``sites`` (or of a :class:`RowSelection` of sites) as a NumPy array."""
    if isinstance(sites, RowSelection):
        return np.asarray(sites.source.ids)[sites.rows]
    return np.asarray(sites.ids)
