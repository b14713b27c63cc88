r"""The three dense-storage Gaussian families (docs/notation.md):

=========================== ============================ ===============================
family                      precision representation     sufficient statistics ``T(z)``
=========================== ============================ ===============================
:class:`FullGaussian`       ``(d, d)`` matrix ``S``      ``(z, z zᵀ)``
:class:`DiagonalGaussian`   ``(d,)`` vector ``s``        ``(z, z²)``
:class:`IsotropicGaussian`  scalar ``τ`` (fixed)         ``z`` (base measure ``e^{-τ‖z‖²/2}``)
=========================== ============================ ===============================

Each implements :class:`~numpyro_pc.protocols.family.GaussianFamily`; they are
registered by name in :mod:`numpyro_pc.families.registry`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import cho_solve, solve_triangular

from numpyro_pc.errors import InvalidOptionError, UnsupportedModelError
from numpyro_pc.protocols.capabilities import (
    DIAGONAL_CURVATURE,
    FULL_CURVATURE,
    NO_CURVATURE,
    FixedPrecision,
    GaussianSolver,
    SiteCurvature,
    SiteDivision,
    SiteSum,
)
from numpyro_pc.protocols.family import GaussianFamily, Gaussian, GaussianNatural

from .newton_cg import DiagonalNewton, newton_cg, newton_diagonal
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["FullGaussian", "DiagonalGaussian", "IsotropicGaussian", "FULL_MAX_DIM"]

#: the largest latent dimension the full family accepts: its state and solver hold about four ``(d, d)``
#: matrices (the precision, its Cholesky factor, the curvature sum and a covariance), 8 GB in float64 here
FULL_MAX_DIM = 16_384

_LOG_2PI = math.log(2.0 * math.pi)


@dataclass(frozen=True, repr=False)
class FullGaussian(GaussianFamily):
    """Gaussian with a dense precision matrix (low-rank guides map here too)."""

    name: str = "full"

    def natural(self, q) -> GaussianNatural:
        return GaussianNatural(q.precision @ q.mean, q.precision)

    def from_natural(self, natural) -> Gaussian:
        chol = jnp.linalg.cholesky(natural.precision)
        return Gaussian(cho_solve((chol, True), natural.linear), natural.precision)

    def expectation(self, q) -> tuple[Any, Any]:
        cov = self.dense_covariance(q)
        return (q.mean, jnp.outer(q.mean, q.mean) + cov)

    def from_expectation(self, mu) -> Gaussian:
        mean, second = mu
        cov = second - jnp.outer(mean, mean)
        return Gaussian(mean, jnp.linalg.inv(cov))

    def _chol(self, q) -> jax.Array:
        return jnp.linalg.cholesky(q.precision)

    def log_prob(self, q, z) -> jax.Array:
        chol = self._chol(q)
        white = (z - q.mean) @ chol  # (z-m)ᵀ L  so that ‖·‖² = (z-m)ᵀ S (z-m)
        d = q.mean.shape[-1]
        return -0.5 * jnp.sum(white**2, -1) + jnp.sum(jnp.log(jnp.diag(chol))) - 0.5 * d * _LOG_2PI

    def entropy(self, q) -> jax.Array:
        d = q.mean.shape[-1]
        return 0.5 * d * (1.0 + _LOG_2PI) - jnp.sum(jnp.log(jnp.diag(self._chol(q))))

    def kl(self, q, p) -> jax.Array:
        d = q.mean.shape[-1]
        lq, lp = self._chol(q), self._chol(p)
        # tr(S_p Σ_q) = ‖L_q⁻¹ L_p‖_F²
        trace = jnp.sum(solve_triangular(lq, lp, lower=True) ** 2)
        diff = p.mean - q.mean
        maha = jnp.sum((lp.T @ diff) ** 2)
        logdet = 2.0 * (jnp.sum(jnp.log(jnp.diag(lq))) - jnp.sum(jnp.log(jnp.diag(lp))))
        return 0.5 * (trace + maha - d + logdet)

    def draws(self, q, noise) -> jax.Array:
        # z = m + L⁻ᵀ ε has covariance (L Lᵀ)⁻¹ = S⁻¹
        return q.mean + solve_triangular(self._chol(q).T, noise.T, lower=False).T

    def site_natural(self, grad, curvature, ref_mean) -> GaussianNatural:
        return GaussianNatural(curvature @ ref_mean - grad, curvature)

    def dense_precision(self, q) -> jax.Array:
        return q.precision

    def dense_covariance(self, q) -> jax.Array:
        chol = self._chol(q)
        inv_chol = solve_triangular(chol, jnp.eye(chol.shape[0], dtype=chol.dtype), lower=True)
        return inv_chol.T @ inv_chol

    def project_curvature(self, dense) -> Any:
        return dense

    def check_dimension(self, dim) -> None:
        """Refuse ``dim > FULL_MAX_DIM``, saying the memory the ``(d, d)`` matrices would need."""
        if dim > FULL_MAX_DIM:
            need = 4 * dim * dim * 8
            raise InvalidOptionError(
                f"the full family holds (d, d) matrices (its precision, their Cholesky factor, the solver's curvature "
                f"sum, a covariance: about 4·d² numbers), {need / 2**30:.3g} GB in float64 ({need / 2**31:.3g} GB in "
                f"float32) at d = {dim:,}; it accepts d <= {FULL_MAX_DIM:,}. Use family='lowrank' with rank=r "
                "(O(d·r)), 'diagonal' or 'isotropic' (O(d)), whose default paths form no (d, d) array")

    def is_positive_definite(self, precision) -> jax.Array:
        chol = jnp.linalg.cholesky(precision)
        return jnp.all(jnp.isfinite(chol)) & jnp.all(jnp.diag(chol) > 0)

    capabilities = (SiteSum(), SiteDivision(), SiteCurvature(FULL_CURVATURE), GaussianSolver(dense_sum=False))

    def curvature_sum(self, store, weights) -> Any:
        return store.weighted_dense(weights)

    def site_curvatures(self, store) -> Any:
        return store.dense()

    def fixed_point(self, q, target, dense) -> tuple[Any, Any]:
        return target, target

    def accepts_target(self, target) -> bool:
        return bool(self.is_positive_definite(target))

    def covariance_operand(self, q) -> jax.Array:
        return self.dense_covariance(q)

    def quad_form_cov(self, q, cov, a) -> jax.Array:
        return a @ cov @ a

    def cov_times(self, q, cov, mat) -> jax.Array:
        return cov @ mat

    def precision_shape(self, dim) -> tuple[Any, Any]:
        return (dim, dim)

    def noisy_precision(self, precision, key, scale) -> Any:
        z = jnp.triu(jax.random.normal(key, precision.shape, precision.dtype))
        w, v = jnp.linalg.eigh(precision + scale * (z + jnp.triu(z, 1).T))
        projected = (v * jnp.maximum(w, 0.0)) @ v.T
        return 0.5 * (projected + projected.T)

    def saved_precision_problem(self, precision) -> str | None:
        p = np.asarray(precision, np.float64)
        tol = 10 * np.sqrt(np.finfo(precision.dtype).eps) * max(float(np.max(np.abs(p), initial=0.0)), 1e-300)
        if p.size and np.max(np.abs(p - p.T)) > tol:
            return "asymmetric"
        try:
            np.linalg.cholesky(p)
            return None
        except np.linalg.LinAlgError:
            return "indefinite"

    def precision_spectrum(self, precision) -> tuple[bool, np.ndarray | None]:
        precision = np.asarray(precision)
        atol = 1e-8 * max(1.0, float(np.max(np.abs(precision)))) if precision.size else 0.0
        if not np.allclose(precision, precision.T, rtol=1e-6, atol=atol):
            return False, None
        return True, np.linalg.eigvalsh(0.5 * (precision + precision.T))


class _MatrixFreeNewton:
    """The mean's Newton step by conjugate gradients where the family's sites are matrix-free
    (:mod:`numpyro_pc.families.newton_cg`); the dense Cholesky step of the protocol otherwise."""

    def newton_operator(self, store, weights, prior_curvature=None, base=None) -> Any:
        return DiagonalNewton(store, weights, prior_curvature, base)

    def precondition(self, pre, grad) -> jax.Array:
        return newton_cg(pre, grad) if isinstance(pre, DiagonalNewton) else super().precondition(pre, grad)  # type: ignore[misc]

    def traced_precondition(self, pre, grad) -> jax.Array:
        if isinstance(pre, DiagonalNewton):
            return newton_cg(pre, grad)
        return super().traced_precondition(pre, grad)  # type: ignore[misc]

    def inner_preconditioner(self, pre) -> Any:
        """``v ↦ v / diag T`` for the operator (a CG solve per inner step would nest CG), else Cholesky."""
        if isinstance(pre, DiagonalNewton):
            diag = newton_diagonal(pre)
            return lambda v: v / diag
        return super().inner_preconditioner(pre)  # type: ignore[misc]


@dataclass(frozen=True, repr=False)
class DiagonalGaussian(_MatrixFreeNewton, GaussianFamily):
    """Gaussian with a diagonal precision (mean-field)."""

    name: str = "diagonal"

    def natural(self, q) -> GaussianNatural:
        return GaussianNatural(q.precision * q.mean, q.precision)

    def from_natural(self, natural) -> Gaussian:
        return Gaussian(natural.linear / natural.precision, natural.precision)

    def expectation(self, q) -> tuple[Any, Any]:
        return (q.mean, q.mean**2 + 1.0 / q.precision)

    def from_expectation(self, mu) -> Gaussian:
        mean, second = mu
        return Gaussian(mean, 1.0 / (second - mean**2))

    def log_prob(self, q, z) -> jax.Array:
        d = q.mean.shape[-1]
        return (
            -0.5 * jnp.sum(q.precision * (z - q.mean) ** 2, -1)
            + 0.5 * jnp.sum(jnp.log(q.precision))
            - 0.5 * d * _LOG_2PI
        )

    def entropy(self, q) -> jax.Array:
        d = q.mean.shape[-1]
        return 0.5 * d * (1.0 + _LOG_2PI) - 0.5 * jnp.sum(jnp.log(q.precision))

    def kl(self, q, p) -> jax.Array:
        ratio = p.precision / q.precision
        return 0.5 * jnp.sum(ratio + p.precision * (p.mean - q.mean) ** 2 - 1.0 - jnp.log(ratio))

    def draws(self, q, noise) -> jax.Array:
        return q.mean + noise / jnp.sqrt(q.precision)

    def site_natural(self, grad, curvature, ref_mean) -> GaussianNatural:
        return GaussianNatural(curvature * ref_mean - grad, curvature)

    def dense_precision(self, q) -> jax.Array:
        return jnp.diag(q.precision)

    def dense_covariance(self, q) -> jax.Array:
        return jnp.diag(1.0 / q.precision)

    def project_curvature(self, dense) -> jax.Array:
        return jnp.diagonal(dense, axis1=-2, axis2=-1)

    def project_diagonal(self, diag) -> jax.Array:
        return diag

    def is_positive_definite(self, precision) -> jax.Array:
        return jnp.all(jnp.isfinite(precision)) & jnp.all(precision > 0)

    capabilities = (SiteSum(), SiteDivision(), SiteCurvature(DIAGONAL_CURVATURE, "diag"), GaussianSolver())

    def relative_eigenvalues(self, q, curvature) -> jax.Array:
        return curvature / q.precision

    def trace_with_covariance(self, q, precision) -> jax.Array:
        return jnp.sum(precision / q.precision)

    def marginal_variance(self, q) -> jax.Array:
        return 1.0 / q.precision

    def curvature_sum(self, store, weights) -> Any:
        return store.weighted_diagonal(weights)

    def site_curvatures(self, store) -> Any:
        return store.diagonals()

    def prior_natural(self, prior, tau=None) -> GaussianNatural:
        off = prior.precision - jnp.diag(jnp.diag(prior.precision))
        if bool(jnp.any(off != 0)):
            raise UnsupportedModelError("the diagonal family needs a prior with independent coordinates "
                                        "(a diagonal prior precision in unconstrained space)")
        return super().prior_natural(prior)

    def precision_shape(self, dim) -> tuple[Any]:
        return (dim,)

    def noisy_precision(self, precision, key, scale) -> jax.Array:
        return jnp.maximum(precision + scale * jax.random.normal(key, precision.shape, precision.dtype), 0.0)


@dataclass(frozen=True, repr=False)
class IsotropicGaussian(_MatrixFreeNewton, GaussianFamily):
    """Gaussian ``N(m, τ⁻¹ I)`` with a fixed precision ``τ`` (the ERM / MAP case).

    Only the mean is learned, ``T(z) = z``, and the base measure ``exp(−τ‖z‖²/2)`` is
    carried by the prior site (paper appendix "non-constant base measures"): a site has
    no curvature and ``λ = τ m = −Σ_{i≥0} ĝ_i + τ m`` reduces to ``Σ_{i≥0} ĝ_i = 0``.
    """

    name: str = "isotropic"
    capabilities = (SiteSum(), FixedPrecision(), SiteCurvature(NO_CURVATURE, "none"), GaussianSolver())
    lacks = MappingProxyType({SiteDivision: "the precision is a fixed base measure: its sites carry no curvature, "
                                            "so there is no precision to remove"})

    def natural(self, q) -> GaussianNatural:
        return GaussianNatural(q.precision * q.mean, q.precision)

    def from_natural(self, natural) -> Gaussian:
        return Gaussian(natural.linear / natural.precision, natural.precision)

    def expectation(self, q) -> tuple[Any]:
        return (q.mean,)

    def from_expectation(self, mu, precision=1.0) -> Gaussian:
        (mean,) = mu
        return Gaussian(mean, jnp.asarray(precision, mean.dtype))

    def log_prob(self, q, z) -> jax.Array:
        d = q.mean.shape[-1]
        return -0.5 * q.precision * jnp.sum((z - q.mean) ** 2, -1) + 0.5 * d * (jnp.log(q.precision) - _LOG_2PI)

    def entropy(self, q) -> jax.Array:
        d = q.mean.shape[-1]
        return 0.5 * d * (1.0 + _LOG_2PI - jnp.log(q.precision))

    def kl(self, q, p) -> jax.Array:
        d = q.mean.shape[-1]
        ratio = p.precision / q.precision
        return 0.5 * (d * (ratio - 1.0 - jnp.log(ratio)) + p.precision * jnp.sum((p.mean - q.mean) ** 2))

    def draws(self, q, noise) -> jax.Array:
        return q.mean + noise / jnp.sqrt(q.precision)

    def site_natural(self, grad, curvature, ref_mean) -> GaussianNatural:
        return GaussianNatural(-grad, jnp.zeros((), grad.dtype))

    def dense_precision(self, q) -> jax.Array:
        d = q.mean.shape[-1]
        return q.precision * jnp.eye(d, dtype=q.mean.dtype)

    def dense_covariance(self, q) -> jax.Array:
        d = q.mean.shape[-1]
        return jnp.eye(d, dtype=q.mean.dtype) / q.precision

    def project_curvature(self, dense) -> jax.Array:
        return jnp.zeros(jnp.shape(dense)[:-2], jnp.result_type(dense))

    def is_positive_definite(self, precision) -> jax.Array:
        return jnp.isfinite(precision) & (precision > 0)

    def relative_eigenvalues(self, q, curvature) -> jax.Array:
        return jnp.zeros((1,), q.mean.dtype)

    def trace_with_covariance(self, q, precision) -> jax.Array:
        return q.mean.shape[-1] * precision / q.precision

    def marginal_variance(self, q) -> jax.Array:
        return jnp.full(q.mean.shape, 1.0 / q.precision)

    def curvature_sum(self, store, weights) -> jax.Array:
        return jnp.zeros((), weights.dtype)

    def site_curvatures(self, store) -> jax.Array:
        return jnp.zeros(store.num_examples, jax.tree.leaves(store)[0].dtype)

    def precision_residual(self, precision, target) -> jax.Array:
        return jnp.zeros((), jnp.result_type(precision))

    def fixed_point(self, q, target, dense) -> tuple[Any, Any]:
        return q.precision, dense

    def keep_fixed(self, current, new) -> Any:
        return current

    def prior_natural(self, prior, tau=None) -> GaussianNatural:
        tau = jnp.asarray(1.0 if tau is None else tau, prior.mean.dtype)
        return GaussianNatural(tau * prior.mean, tau)

    def prior_tau(self, prior) -> jax.Array:
        return jnp.mean(jnp.diag(prior.precision))

    def precision_shape(self, dim) -> tuple[()]:
        return ()

    def noisy_precision(self, precision, key, scale) -> Any:
        return precision

    def precision_spectrum(self, precision) -> tuple[bool, None]:
        return True, None

