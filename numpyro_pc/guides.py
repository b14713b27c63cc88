"""Adapters between fitted NumPyro autoguides and exponential-family posteriors.

=====================================  =============  =====================
guide                                  family         default expectation
=====================================  =============  =====================
``AutoNormal``                         diagonal       ``gh`` if GLM else ``mc``
``AutoDiagonalNormal``                 diagonal       ``gh`` if GLM else ``mc``
``AutoMultivariateNormal``             full           ``gh`` if GLM else ``mc``
``AutoLowRankMultivariateNormal``      full           ``gh`` if GLM else ``mc``
``AutoLaplaceApproximation``           full           ``delta`` (its fixed point is the Laplace approximation)
``AutoDelta``                          isotropic      ``delta`` (ERM / MAP)
=====================================  =============  =====================

The flat vector follows the guide's own latent order (model trace order), checked
against the model binding.
"""

from __future__ import annotations

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

from .errors import GuideParamsError, InvalidOptionError, NotPositiveDefiniteError, UnsupportedGuideError
from .families import Gaussian, get_family

__all__ = ["SUPPORTED_GUIDES", "guide_family", "default_expectation", "from_guide", "to_guide_params"]

SUPPORTED_GUIDES = (AutoNormal, AutoDiagonalNormal, AutoMultivariateNormal, AutoLowRankMultivariateNormal,
                    AutoLaplaceApproximation, AutoDelta)

_FAMILY = {AutoNormal: "diagonal", AutoDiagonalNormal: "diagonal", AutoMultivariateNormal: "full",
           AutoLowRankMultivariateNormal: "full", AutoLaplaceApproximation: "full", AutoDelta: "isotropic"}


def _guide_class(guide):
    for cls in (AutoLaplaceApproximation, AutoLowRankMultivariateNormal, AutoMultivariateNormal,
                AutoDiagonalNormal, AutoNormal, AutoDelta):
        if type(guide) is cls:
            return cls
    names = ", ".join(c.__name__ for c in SUPPORTED_GUIDES)
    raise UnsupportedGuideError(
        f"{type(guide).__name__} is not an exponential-family guide numpyro_pc can turn into a dual form; "
        f"supported guides: {names}."
    )


def guide_family(guide):
    """The :class:`~numpyro_pc.families.ExponentialFamily` a guide maps to.

    :raises UnsupportedGuideError: for any other guide (AutoIAFNormal, AutoBNAFNormal, AutoDAIS, ...).
    """
    return get_family(_FAMILY[_guide_class(guide)])


def default_expectation(guide, spec):
    """Default expectation rule for a guide: ``delta`` for Laplace/Delta, else ``auto`` (Gauss–Hermite
    over the dependence subspace where the model has one, else Monte Carlo; see
    :func:`numpyro_pc.expectations.prepare_rule`)."""
    cls = _guide_class(guide)
    if cls in (AutoLaplaceApproximation, AutoDelta):
        return "delta"
    return "auto"


def _ensure_setup(guide, args, kwargs):
    # runs the guide once on its own initial values (not the user's params, which may be invalid)
    if getattr(guide, "prototype_trace", None) is None:
        with handlers.block():
            handlers.seed(guide, 0)(*args, **kwargs)


def _param(params, key, shape, guide):
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


def _check_order(guide, latent):
    locs = getattr(guide, "_init_locs", None)
    if locs is not None and tuple(locs) != latent.names:
        raise GuideParamsError(f"the guide's latent sites {tuple(locs)} differ from the model's {latent.names}; "
                               "was the guide built for another model?")


def from_guide(guide, params, latent, args=(), kwargs=None, dtype=None):
    """Read a fitted guide's parameters as a family member ``(family, Gaussian)``.

    :param guide: a fitted autoguide of :data:`SUPPORTED_GUIDES`.
    :param dict params: its parameters (``SVIRunResult.params`` / ``svi.get_params``).
    :param latent: the model's :class:`~numpyro_pc.latent.LatentSpace`.
    :param args, kwargs: the model arguments (to set up a guide that has not run yet).
    :param dtype: floating dtype of the result (default: the params' dtype promoted with JAX's default).
    :raises UnsupportedGuideError, GuideParamsError, NotPositiveDefiniteError:
    """
    cls = _guide_class(guide)
    kwargs = dict(kwargs or {})
    if not isinstance(params, dict):
        raise GuideParamsError(f"params must be a dict of guide parameters, got {type(params).__name__}")
    _ensure_setup(guide, args, kwargs)
    _check_order(guide, latent)
    family = get_family(_FAMILY[cls])
    d, prefix = latent.dim, guide.prefix
    dtype = dtype or jnp.result_type(float)
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    if cls is AutoMultivariateNormal:
        loc = _param(params, f"{prefix}_loc", (d,), guide)
        tril = _param(params, f"{prefix}_scale_tril", (d, d), guide)
        cov = cast(tril) @ cast(tril).T
        q = Gaussian(cast(loc), _inverse_spd(cov, "covariance from scale_tril"))
    elif cls is AutoLowRankMultivariateNormal:
        loc = _param(params, f"{prefix}_loc", (d,), guide)
        factor = jnp.asarray(params.get(f"{prefix}_cov_factor", jnp.zeros((d, 0))))
        _param(params, f"{prefix}_cov_factor", (d, factor.shape[-1]), guide)
        scale = _param(params, f"{prefix}_scale", (d,), guide)
        cov = cast(factor) @ cast(factor).T + jnp.diag(cast(scale) ** 2)
        q = Gaussian(cast(loc), _inverse_spd(cov, "low-rank covariance"))
    elif cls is AutoLaplaceApproximation:
        loc = _param(params, f"{prefix}_loc", (d,), guide)
        tril = cast(guide.get_transform(params).scale_tril)
        if not bool(jnp.all(jnp.isfinite(tril))) or bool(jnp.any(jnp.diag(tril) <= 0)):
            raise NotPositiveDefiniteError("the Laplace approximation's Hessian at the MAP point is singular")
        q = Gaussian(cast(loc), _inverse_spd(tril @ tril.T, "Laplace covariance"))
    elif cls is AutoDiagonalNormal:
        loc = _param(params, f"{prefix}_loc", (d,), guide)
        scale = _param(params, f"{prefix}_scale", (d,), guide)
        q = Gaussian(cast(loc), 1.0 / cast(scale) ** 2)
    elif cls is AutoNormal:
        locs = {n: _param(params, f"{n}_{prefix}_loc", s, guide) for n, s in zip(latent.names, latent.unconstrained_shapes)}
        scales = {n: _param(params, f"{n}_{prefix}_scale", s, guide)
                  for n, s in zip(latent.names, latent.unconstrained_shapes)}
        q = Gaussian(cast(latent.ravel(locs)), 1.0 / cast(latent.ravel(scales)) ** 2)
    else:  # AutoDelta: locs are constrained values
        values = {n: _param(params, f"{n}_{prefix}_loc", s, guide) for n, s in zip(latent.names, latent.shapes)}
        q = Gaussian(cast(latent.unconstrain(values)), jnp.asarray(1.0, dtype))
    if not bool(jnp.all(jnp.isfinite(q.mean))):
        raise GuideParamsError("the guide's location parameters contain NaN or infinite values")
    family.check_positive_definite(q.precision, "precision read from the guide")
    return family, q


def _inverse_spd(matrix, what):
    chol = jnp.linalg.cholesky(matrix)
    if not bool(jnp.all(jnp.isfinite(chol))):
        raise NotPositiveDefiniteError(f"the {what} is not positive definite")
    inv = jax.scipy.linalg.cho_solve((chol, True), jnp.eye(matrix.shape[0], dtype=matrix.dtype))
    return 0.5 * (inv + inv.T)


def to_guide_params(guide, family, q, latent, constrain_fn=None):
    """Parameters for ``guide`` describing ``q`` (so ``Predictive(model, guide=guide, params=...)`` works).

    For diagonal guides built from a full posterior the marginal variances are used; for
    ``AutoLowRankMultivariateNormal`` the covariance is approximated by its top
    ``rank`` eigenpairs plus a diagonal (exact when the covariance has that form).

    :param constrain_fn: ``z -> dict`` of constrained values (needed for ``AutoDelta``).
    """
    cls = _guide_class(guide)
    prefix = guide.prefix
    cov = family.dense_covariance(q)
    std = jnp.sqrt(jnp.diag(cov))
    if cls is AutoMultivariateNormal:
        return {f"{prefix}_loc": q.mean, f"{prefix}_scale_tril": jnp.linalg.cholesky(cov)}
    if cls is AutoLowRankMultivariateNormal:
        rank = guide.rank if guide.rank is not None else int(round(latent.dim**0.5))
        vals, vecs = jnp.linalg.eigh(cov)
        vals, vecs = vals[::-1][:rank], vecs[:, ::-1][:, :rank]
        factor = vecs * jnp.sqrt(jnp.maximum(vals, 0.0))
        resid = jnp.diag(cov) - jnp.sum(factor**2, 1)
        floor = 1e-6 * jnp.diag(cov)
        return {f"{prefix}_loc": q.mean, f"{prefix}_cov_factor": factor,
                f"{prefix}_scale": jnp.sqrt(jnp.maximum(resid, floor))}
    if cls is AutoLaplaceApproximation:
        return {f"{prefix}_loc": q.mean}
    if cls is AutoDiagonalNormal:
        return {f"{prefix}_loc": q.mean, f"{prefix}_scale": std}
    if cls is AutoNormal:
        locs, scales = latent.unravel(q.mean), latent.unravel(std)
        out = {f"{n}_{prefix}_loc": locs[n] for n in latent.names}
        out.update({f"{n}_{prefix}_scale": scales[n] for n in latent.names})
        return out
    if constrain_fn is None:
        raise InvalidOptionError("AutoDelta parameters are constrained values; pass constrain_fn")
    values = constrain_fn(q.mean)
    return {f"{n}_{prefix}_loc": values[n] for n in latent.names}
