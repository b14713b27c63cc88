"""Adapters between fitted NumPyro autoguides and exponential-family posteriors.

=====================================  =============  =====================
guide                                  family         default expectation
=====================================  =============  =====================
``AutoNormal``                         diagonal       ``gh`` if GLM else ``mc``
``AutoDiagonalNormal``                 diagonal       ``gh`` if GLM else ``mc``
``AutoMultivariateNormal``             full           ``gh`` if GLM else ``mc``
``AutoLowRankMultivariateNormal``      lowrank-r      ``gh`` if GLM else ``mc``
``AutoLaplaceApproximation``           full           ``delta`` (its fixed point is the Laplace approximation)
``AutoDelta``                          isotropic      ``delta`` (ERM / MAP)
=====================================  =============  =====================

``AutoLowRankMultivariateNormal`` of rank ``r`` (NumPyro's default ``round(√d)``) maps to
:class:`~numpyro_pc.families.lowrank.LowRankGaussian` of the same rank, both ways in ``O(d r²)``
without a ``d × d`` array: its covariance ``diag(c) + WWᵀ`` is read as the precision
``diag(1/c) − VVᵀ`` (Woodbury) projected onto ``diag(D) + UUᵀ``, and written back as the
projection of the posterior's covariance onto ``diag(c) + WWᵀ``; both are exact when
``r ≥ d − 1`` (see :mod:`numpyro_pc.families.lowrank`).

The flat vector follows the guide's own latent order (model trace order), checked
against the model binding.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from functools import partial

import jax
import jax.numpy as jnp
from numpyro import handlers
from numpyro.infer.autoguide import (
    AutoDelta,
    AutoDiagonalNormal,
    AutoLaplaceApproximation,
    AutoLowRankMultivariateNormal,
    AutoMultivariateNormal,
    AutoNormal,
)

from numpyro_pc.errors import GuideParamsError, InvalidOptionError, NotPositiveDefiniteError, UnsupportedGuideError
from numpyro_pc.families.lowrank import lowrank_from_covariance, project_operator
from numpyro_pc.families.registry import Gaussian, get_family
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

    from numpyro_pc.families.registry import GaussianFamily

__all__ = ["GuideAdapter", "register_guide", "SUPPORTED_GUIDES", "guide_family", "default_expectation",
           "from_guide", "to_guide_params", "is_registered"]


class GuideAdapter(ABC):
    """How one autoguide class maps to an exponential family, in both directions.

    An adapter reads a fitted guide's parameters as a family member (:meth:`read`) and
    writes a family member back as parameters the guide accepts (:meth:`write`). Adding a
    guide is one subclass and one :func:`register_guide` call; nothing else in the package
    looks at guide classes.

    :cvar str family: the family name (:func:`numpyro_pc.families.registry.get_family`).
    :cvar str expectation: the default expectation rule (``"auto"`` or ``"delta"``).
    """

    family = "full"
    expectation = "auto"

    def family_for(self, guide, latent) -> GaussianFamily:
        """The family instance this guide maps to (``latent``: the model's latent space, or ``None``)."""
        return get_family(self.family)

    @abstractmethod
    def read(self, guide, params, latent, dtype) -> Gaussian:
        """``Gaussian(mean, precision)`` of ``dtype`` in the family's format from the guide's ``params``."""

    @abstractmethod
    def write(self, guide, family, q, latent, constrain_fn) -> dict[str, Any]:
        """The guide's parameter dict describing ``q``."""


class _MultivariateNormal(GuideAdapter):
    def read(self, guide, params, latent, dtype) -> Gaussian:
        cast = partial(jnp.asarray, dtype=dtype)
        loc = _param(params, f"{guide.prefix}_loc", (latent.dim,), guide)
        tril = cast(_param(params, f"{guide.prefix}_scale_tril", (latent.dim, latent.dim), guide))
        return Gaussian(cast(loc), _inverse_spd(tril @ tril.T, "covariance from scale_tril"))

    def write(self, guide, family, q, latent, constrain_fn) -> dict[str, Any]:
        cov = family.dense_covariance(q)
        return {f"{guide.prefix}_loc": q.mean, f"{guide.prefix}_scale_tril": jnp.linalg.cholesky(cov)}


def _guide_rank(guide, dim) -> int:
    """The guide's rank (NumPyro's default ``round(√d)``), at least 1 and at most ``d``."""
    rank = guide.rank if guide.rank is not None else int(round(dim**0.5))
    return max(1, min(int(rank), dim))


class _LowRankMultivariateNormal(GuideAdapter):
    family = "lowrank"

    def family_for(self, guide, latent) -> GaussianFamily:
        dim = latent.dim if latent is not None else guide.latent_dim
        return get_family("lowrank", rank=_guide_rank(guide, dim))

    def read(self, guide, params, latent, dtype) -> Gaussian:
        cast = partial(jnp.asarray, dtype=dtype)
        d, prefix = latent.dim, guide.prefix
        loc = _param(params, f"{prefix}_loc", (d,), guide)
        factor = jnp.asarray(params.get(f"{prefix}_cov_factor", jnp.zeros((d, 0))))
        _param(params, f"{prefix}_cov_factor", (d, factor.shape[-1]), guide)
        scale = cast(_param(params, f"{prefix}_scale", (d,), guide))
        if not bool(jnp.all(jnp.isfinite(scale)) & jnp.all(scale != 0)):
            raise NotPositiveDefiniteError("the low-rank covariance is not positive definite (a zero scale)")
        rank = self.family_for(guide, latent).rank
        return Gaussian(cast(loc), lowrank_from_covariance(scale**2, cast(factor), rank))

    def write(self, guide, family, q, latent, constrain_fn) -> dict[str, Any]:
        d = latent.dim
        operand = family.covariance_operand(q)
        variance = family.marginal_variance(q)
        proj = project_operator(lambda v: family.cov_times(q, operand, v), variance, _guide_rank(guide, d), d,
                                q.mean.dtype)
        return {f"{guide.prefix}_loc": q.mean, f"{guide.prefix}_cov_factor": proj[:, 1:],
                f"{guide.prefix}_scale": jnp.sqrt(jnp.maximum(proj[:, 0], 1e-6 * variance))}


class _Laplace(GuideAdapter):
    expectation = "delta"  # its fixed point is the Laplace approximation

    def read(self, guide, params, latent, dtype) -> Gaussian:
        cast = partial(jnp.asarray, dtype=dtype)
        loc = _param(params, f"{guide.prefix}_loc", (latent.dim,), guide)
        tril = cast(guide.get_transform(params).scale_tril)
        if not bool(jnp.all(jnp.isfinite(tril))) or bool(jnp.any(jnp.diag(tril) <= 0)):
            raise NotPositiveDefiniteError("the Laplace approximation's Hessian at the MAP point is singular")
        return Gaussian(cast(loc), _inverse_spd(tril @ tril.T, "Laplace covariance"))

    def write(self, guide, family, q, latent, constrain_fn) -> dict[str, Any]:
        return {f"{guide.prefix}_loc": q.mean}


class _DiagonalNormal(GuideAdapter):
    family = "diagonal"

    def read(self, guide, params, latent, dtype) -> Gaussian:
        cast = partial(jnp.asarray, dtype=dtype)
        loc = _param(params, f"{guide.prefix}_loc", (latent.dim,), guide)
        scale = _param(params, f"{guide.prefix}_scale", (latent.dim,), guide)
        return Gaussian(cast(loc), 1.0 / cast(scale) ** 2)

    def write(self, guide, family, q, latent, constrain_fn) -> dict[str, Any]:
        return {f"{guide.prefix}_loc": q.mean, f"{guide.prefix}_scale": _marginal_sd(family, q)}


class _Normal(GuideAdapter):
    family = "diagonal"

    def read(self, guide, params, latent, dtype) -> Gaussian:
        cast = partial(jnp.asarray, dtype=dtype)
        sites = list(zip(latent.names, latent.unconstrained_shapes))
        locs = {n: _param(params, f"{n}_{guide.prefix}_loc", s, guide) for n, s in sites}
        scales = {n: _param(params, f"{n}_{guide.prefix}_scale", s, guide) for n, s in sites}
        return Gaussian(cast(latent.ravel(locs)), 1.0 / cast(latent.ravel(scales)) ** 2)

    def write(self, guide, family, q, latent, constrain_fn) -> dict[str, Any]:
        locs, scales = latent.unravel(q.mean), latent.unravel(_marginal_sd(family, q))
        out = {f"{n}_{guide.prefix}_loc": locs[n] for n in latent.names}
        out.update({f"{n}_{guide.prefix}_scale": scales[n] for n in latent.names})
        return out


class _Delta(GuideAdapter):
    family = "isotropic"  # ERM / MAP
    expectation = "delta"

    def read(self, guide, params, latent, dtype) -> Gaussian:  # locs are constrained values
        cast = partial(jnp.asarray, dtype=dtype)
        values = {n: _param(params, f"{n}_{guide.prefix}_loc", s, guide) for n, s in zip(latent.names, latent.shapes)}
        return Gaussian(cast(latent.unconstrain(values)), jnp.asarray(1.0, dtype))

    def write(self, guide, family, q, latent, constrain_fn) -> dict[str, Any]:
        if constrain_fn is None:
            raise InvalidOptionError("AutoDelta parameters are constrained values; pass constrain_fn")
        values = constrain_fn(q.mean)
        return {f"{n}_{guide.prefix}_loc": values[n] for n in latent.names}


_REGISTRY: dict[Any, Any] = {}


def register_guide(guide_class, adapter) -> None:
    """Register ``adapter`` (a :class:`GuideAdapter`) for guides whose type is exactly ``guide_class``."""
    if not isinstance(adapter, GuideAdapter):
        raise InvalidOptionError(f"adapter must be a GuideAdapter instance, got {type(adapter).__name__}")
    _REGISTRY[guide_class] = adapter


for _cls, _adapter in ((AutoNormal, _Normal()), (AutoDiagonalNormal, _DiagonalNormal()),
                       (AutoMultivariateNormal, _MultivariateNormal()),
                       (AutoLowRankMultivariateNormal, _LowRankMultivariateNormal()),
                       (AutoLaplaceApproximation, _Laplace()), (AutoDelta, _Delta())):
    register_guide(_cls, _adapter)

SUPPORTED_GUIDES = tuple(_REGISTRY)


def is_registered(guide) -> bool:
    """Whether an adapter is registered for ``guide``'s exact type."""
    return type(guide) in _REGISTRY


def _adapter(guide) -> GuideAdapter:
    adapter = _REGISTRY.get(type(guide))
    if adapter is None:
        names = ", ".join(c.__name__ for c in _REGISTRY)
        raise UnsupportedGuideError(
            f"{type(guide).__name__} is not an exponential-family guide numpyro_pc can turn into a dual form; "
            f"supported guides: {names} (others can be added with numpyro_pc.guides.register_guide)."
        )
    return adapter


def guide_family(guide) -> GaussianFamily:
    """The :class:`~numpyro_pc.families.registry.GaussianFamily` a guide maps to.

    :raises UnsupportedGuideError: for any other guide (AutoIAFNormal, AutoBNAFNormal, AutoDAIS, ...).
    """
    return _adapter(guide).family_for(guide, None)


def default_expectation(guide, spec) -> str:
    """Default expectation rule for a guide: ``delta`` for Laplace/Delta, else ``auto`` (Gauss–Hermite
    over the dependence subspace where the model has one, else Monte Carlo; see
    :func:`numpyro_pc.sites.expectations.prepare_rule`)."""
    return _adapter(guide).expectation


def _marginal_sd(family, q) -> jax.Array:
    return jnp.sqrt(family.marginal_variance(q))


def _ensure_setup(guide, args, kwargs) -> None:
    # runs the guide once on its own initial values (not the user's params, which may be invalid)
    if getattr(guide, "prototype_trace", None) is None:
        with handlers.block():
            handlers.seed(guide, 0)(*args, **kwargs)


def _param(params, key, shape, guide) -> jax.Array:
    if key not in params:
        raise GuideParamsError(
            f"parameter {key!r} expected by {type(guide).__name__} is missing; the parameters given have keys "
            f"{sorted(params)} — were they fitted with another guide or another prefix?"
        )
    value = jnp.asarray(params[key])
    if tuple(value.shape) != tuple(shape):
        raise GuideParamsError(f"parameter {key!r} has shape {tuple(value.shape)}, expected {tuple(shape)} for "
                               f"{type(guide).__name__} on this model")
    return value


def _check_order(guide, latent) -> None:
    locs = getattr(guide, "_init_locs", None)
    if locs is not None and tuple(locs) != latent.names:
        raise GuideParamsError(f"the guide's latent sites {tuple(locs)} differ from the model's {latent.names}; "
                               "was the guide built for another model?")


def from_guide(guide, params, latent, args=(), kwargs=None, dtype=None) -> tuple[Any, Any]:
    """Read a fitted guide's parameters as a family member ``(family, Gaussian)``.

    :param guide: a fitted autoguide of :data:`SUPPORTED_GUIDES`.
    :param dict params: its parameters (``SVIRunResult.params`` / ``svi.get_params``).
    :param latent: the model's :class:`~numpyro_pc.model.latent.LatentSpace`.
    :param args: the model's positional arguments (to set up a guide that has not run yet).
    :param kwargs: the model's keyword arguments (likewise).
    :param dtype: floating dtype of the result (default: the params' dtype promoted with JAX's default).
    :raises UnsupportedGuideError, GuideParamsError, NotPositiveDefiniteError:
    """
    adapter = _adapter(guide)
    kwargs = dict(kwargs or {})
    if not isinstance(params, dict):
        raise GuideParamsError(f"params must be a dict of guide parameters, got {type(params).__name__}")
    _ensure_setup(guide, args, kwargs)
    _check_order(guide, latent)
    family = adapter.family_for(guide, latent)
    dtype = dtype or jnp.result_type(float)
    q = adapter.read(guide, params, latent, dtype)
    if not bool(jnp.all(jnp.isfinite(q.mean))):
        raise GuideParamsError("the guide's location parameters contain NaN or infinite values")
    family.check_positive_definite(q.precision, "precision read from the guide")
    return family, q


def _inverse_spd(matrix, what) -> jax.Array:
    chol = jnp.linalg.cholesky(matrix)
    if not bool(jnp.all(jnp.isfinite(chol))):
        raise NotPositiveDefiniteError(f"the {what} is not positive definite")
    inv = jax.scipy.linalg.cho_solve((chol, True), jnp.eye(matrix.shape[0], dtype=matrix.dtype))
    return 0.5 * (inv + inv.T)


def to_guide_params(guide, family, q, latent, constrain_fn=None) -> dict[str, Any]:
    """Parameters for ``guide`` describing ``q`` (so ``Predictive(model, guide=guide, params=...)`` works).

    For diagonal guides built from a full posterior the marginal variances are used; for
    ``AutoLowRankMultivariateNormal`` the covariance is approximated by its top
    ``rank`` eigenpairs plus a diagonal (exact when the covariance has that form).

    :param constrain_fn: ``z -> dict`` of constrained values (needed for ``AutoDelta``).
    """
    return _adapter(guide).write(guide, family, q, latent, constrain_fn)
