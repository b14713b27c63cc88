r"""Exponential-family algebra over the flat unconstrained latent vector ``z``.

Three Gaussian families are provided, all sharing one interface so that the rest of
the package never branches on the family:

=========================== ============================ ===============================
family                      precision representation     sufficient statistics ``T(z)``
=========================== ============================ ===============================
:class:`FullGaussian`       ``(d, d)`` matrix ``S``      ``(z, z zᵀ)``
:class:`DiagonalGaussian`   ``(d,)`` vector ``s``        ``(z, z²)``
:class:`IsotropicGaussian`  scalar ``τ`` (fixed)         ``z`` (base measure ``e^{-τ‖z‖²/2}``)
=========================== ============================ ===============================

A distribution is the pytree :class:`Gaussian` ``(mean, precision)``; its natural
parameters are :class:`GaussianNatural` ``(linear, precision)`` meaning
:math:`\lambda = (S m, -\tfrac12 S)` — the ``precision`` field stores ``S`` itself
rather than ``-S/2`` so that sums of sites read as sums of precisions.

A Gaussian *site* ``ℓ̂(z) = zᵀĝ + ½ (z − m_t)ᵀ Ĥ (z − m_t)`` (paper Table 1) has natural
parameters ``(Ĥ m_t − ĝ, Ĥ)``: ``exp(−ℓ̂)`` is an unnormalised Gaussian factor. Adding,
removing and scaling sites is arithmetic on these pairs (:func:`add_site`,
:func:`remove_site`, :func:`scale_site`).

A fourth, :class:`~numpyro_pc.lowrank.LowRankGaussian` (precision ``diag(D) + UUᵀ`` as a
``(d, r + 1)`` array), lives in :mod:`numpyro_pc.lowrank` and is registered through
:func:`register_family_factory` (names ``"lowrank-r"``). New exponential families
(Bernoulli, categorical, ...) subclass :class:`ExponentialFamily` and provide the same methods
(docs/architecture.md, "Adding a family").
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import cho_solve, solve_triangular

from .errors import InvalidOptionError, NonFiniteResultError, NotPositiveDefiniteError, UnsupportedModelError

__all__ = [
    "Gaussian",
    "GaussianNatural",
    "ExponentialFamily",
    "FullGaussian",
    "DiagonalGaussian",
    "IsotropicGaussian",
    "get_family",
    "register_family",
    "register_family_factory",
    "registered_families",
    "regularised_chol",
    "add_site",
    "remove_site",
    "scale_site",
]

_LOG_2PI = math.log(2.0 * math.pi)


class Gaussian(NamedTuple):
    """A Gaussian ``N(mean, precision⁻¹)`` in its family's compact precision format."""

    mean: jax.Array
    precision: jax.Array


class GaussianNatural(NamedTuple):
    """Natural parameters ``λ = (linear, −½ precision)`` with ``linear = S m``."""

    linear: jax.Array
    precision: jax.Array


def add_site(natural, site, alpha=1.0):
    """Multiply a distribution by ``exp(−α ℓ̂)``: ``λ + α λ_site``."""
    return jax.tree.map(lambda a, b: a + alpha * b, natural, site)


def remove_site(natural, site, alpha=1.0):
    """Divide a distribution by ``exp(−α ℓ̂)``: ``λ − α λ_site``."""
    return jax.tree.map(lambda a, b: a - alpha * b, natural, site)


def scale_site(site, alpha):
    """Raise a site to the power ``α`` (tempering): ``α λ_site``."""
    return jax.tree.map(lambda a: alpha * a, site)


class ExponentialFamily(ABC):
    """Interface every variational family implements.

    All methods are pure functions of pytrees and may be used under ``jit``/``vmap``.

    :cvar fixed_precision: the family's precision is a fixed base measure, not learned
        (the isotropic family): its sites carry no curvature.
    """

    name: str
    fixed_precision = False
    #: what the family needs of the stored site curvature (0 nothing, 1 diagonals, 2 matrices)
    curvature_detail = 2
    #: storage chosen for ``storage="auto"`` (``None``: the model decides, factorised or dense)
    default_storage = None
    #: the solver needs the dense curvature sum ``Σ Ĥ_i`` beside the family's own (to precondition the mean)
    needs_dense_sum = True

    @abstractmethod
    def natural(self, q):
        """Natural parameters of ``q``."""

    @abstractmethod
    def from_natural(self, natural):
        """Distribution with the given natural parameters (no positivity check)."""

    @abstractmethod
    def expectation(self, q):
        """Expectation parameters ``μ = E_q[T(z)]``."""

    @abstractmethod
    def from_expectation(self, mu):
        """Distribution with the given expectation parameters."""

    @abstractmethod
    def log_prob(self, q, z):
        """Log-density of ``z`` (trailing axis ``d``) under ``q``."""

    @abstractmethod
    def entropy(self, q):
        """Differential entropy of ``q``."""

    @abstractmethod
    def kl(self, q, p):
        """``KL(q ‖ p)`` for two members of this family."""

    def sample(self, q, key, num_samples):
        """``num_samples`` draws, shape ``(num_samples, d)``."""
        return self.draws(q, jax.random.normal(key, (num_samples,) + q.mean.shape, q.mean.dtype))

    @abstractmethod
    def draws(self, q, noise):
        """Draws ``z = m + Cε`` of ``q`` from standard-normal ``noise`` ``ε`` (shape ``(K, d)``), ``CCᵀ = S⁻¹``."""

    @abstractmethod
    def site_natural(self, grad, curvature, ref_mean):
        """Natural parameters of the site ``zᵀĝ + ½(z−m)ᵀĤ(z−m)`` (``Ĥ`` in family format)."""

    @abstractmethod
    def dense_precision(self, q):
        """Precision as a dense ``(d, d)`` matrix."""

    @abstractmethod
    def dense_covariance(self, q):
        """Covariance as a dense ``(d, d)`` matrix."""

    @abstractmethod
    def project_curvature(self, dense):
        """Map a dense ``(..., d, d)`` curvature to this family's precision format."""

    @abstractmethod
    def is_positive_definite(self, precision):
        """Boolean (traceable) test of the precision format."""

    # --- what the solver, sites and operations ask of a family (docs/notation.md) ---------

    @abstractmethod
    def curvature_sum(self, store, weights):
        """``Σ_i w_i Ĥ_i`` of a :class:`~numpyro_pc.curvature.CurvatureStore` in this family's precision format."""

    @abstractmethod
    def site_curvatures(self, store):
        """Per-example site precisions ``Ĥ_i`` in this family's format (leading axis ``N``)."""

    def precision_residual(self, precision, target):
        """Relative residual ``‖S − Σ Ĥ_i‖ / ‖S‖`` of the precision identity."""
        return jnp.linalg.norm(precision - target) / jnp.linalg.norm(precision)

    def fixed_point(self, q, target, dense):
        """``(precision, mean preconditioner)`` of the undamped step to the target ``Σ Ĥ_i``.

        ``dense`` is the dense sum ``Σ E_q[∇²ℓ_i]``: a Newton step on ``E_q[Σ ℓ_i]`` (paper
        App. A.3), which reaches the fixed point far faster than a step preconditioned by a
        diagonal or fixed precision.
        """
        return target, dense

    def accepts_target(self, target):
        """Whether a full step to the precision ``target`` stays in the family (host-side)."""
        return True

    #: the precision is linear in the site precisions (``S = Σ Ĥ_i`` in the family's format), so
    #: dividing some sites out of a posterior (a cavity) is defined; ``False`` for a family whose
    #: precision is a non-linear projection of the site sum (the low-rank family)
    linear_precision = True
    #: the fixed point is a stationary point of the variational objective, so the solver may judge a
    #: step by the objective; ``False`` (a projected fixed point): by the dual-form residual alone
    minimises_objective = True
    #: host-side checks may materialise the dense ``(d, d)`` precision (the float32 representability check)
    dense_checks = True

    def check_dimension(self, dim):
        """Raise :class:`~numpyro_pc.errors.InvalidOptionError` if the family cannot describe ``dim`` latents."""

    def target_precision(self, store, weights, prior_curvature=None, base=None):
        """``Σ_i w_i Ĥ_i`` (``+ Ĥ_0`` from the dense ``prior_curvature``, ``+ B`` a precision in
        the family's format) in the family's format: the precision the fixed point asks for."""
        curv = self.curvature_sum(store, weights)
        if prior_curvature is not None:
            curv = curv + self.project_curvature(prior_curvature)
        if base is not None:
            curv = curv + base
        return curv

    def precondition(self, pre, grad):
        """``P⁻¹ grad`` for the mean preconditioner ``P`` of :meth:`fixed_point` (a dense
        matrix here: Cholesky, with the smallest jitter in a geometric ladder that works)."""
        chol, _ = regularised_chol(pre)
        return cho_solve((chol, True), grad)

    def blend(self, current, target, rho):
        """The precision ``(1 − ρ) S + ρ T`` of a damped step, in the family's format."""
        return (1.0 - rho) * current + rho * target

    def arithmetic(self, base, naturals, alphas):
        """Bayesian arithmetic ``λ_base + Σ_k α_k (λ_k − λ_base)`` of natural parameters (merging)."""
        total = base
        for a, lam in zip(alphas, naturals):
            total = jax.tree.map(lambda acc, x, b: acc + a * (x - b), total, lam, base)
        return total

    def marginal_variance(self, q):
        """The diagonal of the covariance ``Σ``, ``(d,)``."""
        return jnp.diag(self.dense_covariance(q))

    def trace_with_covariance(self, q, precision):
        """``tr(B Σ_q)`` for a precision ``B`` in the family's format."""
        return jnp.sum(self.dense_precision(Gaussian(q.mean, precision)) * self.dense_covariance(q))

    def trace_dense_with_covariance(self, q, dense):
        """``tr(H Σ_q)`` for a dense ``(d, d)`` matrix ``H``."""
        return jnp.sum(dense * self.dense_covariance(q))

    def relative_eigenvalues(self, q, curvature):
        """Eigenvalues of ``Σ^{1/2} H Σ^{1/2}`` for a curvature ``H`` in this family's format
        (``H``'s share of the precision, direction by direction; all below 1 iff ``S − H ≻ 0``)."""
        chol = jnp.linalg.cholesky(self.dense_precision(q))
        dense = self.dense_precision(Gaussian(q.mean, curvature))
        white = solve_triangular(chol, solve_triangular(chol, dense, lower=True).T, lower=True)
        return jnp.linalg.eigvalsh(0.5 * (white + white.T))

    def covariance_operand(self, q):
        """What :meth:`quad_form_cov` and :meth:`cov_times` take as ``cov`` (formed once per call)."""
        return None

    def quad_form_cov(self, q, cov, a):
        """``aᵀ Σ a`` for a vector ``a``."""
        return jnp.sum(a**2 / q.precision)

    def cov_times(self, q, cov, mat):
        """``Σ @ mat`` for a ``(d, r)`` matrix."""
        return mat / (q.precision[:, None] if jnp.ndim(q.precision) else q.precision)

    def keep_fixed(self, current, new):
        """The precision after an update to ``new`` (a fixed precision stays ``current``)."""
        return new

    def prior_natural(self, prior, tau=None):
        """Natural parameters of a dense Gaussian ``prior`` in this family's format."""
        return self.natural(Gaussian(prior.mean, self.project_curvature(prior.precision)))

    def prior_tau(self, prior):
        """The fixed precision a dense Gaussian prior gives the family (``None``: not fixed)."""
        return None

    @abstractmethod
    def precision_shape(self, dim):
        """Shape of a precision (and of a site's precision) in this family's format."""

    @abstractmethod
    def noisy_precision(self, precision, key, scale):
        """``precision`` plus symmetric Gaussian noise of sd ``scale``, projected to positive semi-definite."""

    def precision_spectrum(self, precision):
        """``(symmetric, eigenvalues)`` of a host-side precision (``eigenvalues`` ``None``: nothing to check)."""
        return True, np.sort(np.asarray(precision))

    def saved_precision_problem(self, precision):
        """Host-side check of a precision read from a file: ``None`` if valid, else ``"asymmetric"``
        or ``"indefinite"`` (here: every entry must be positive)."""
        return None if np.all(np.asarray(precision, np.float64) > 0) else "indefinite"

    def check_positive_definite(self, precision, what="precision"):
        """Raise :class:`NotPositiveDefiniteError` unless the precision is positive definite."""
        if not bool(self.is_positive_definite(precision)):
            raise NotPositiveDefiniteError(
                f"the {what} of the {self.name} Gaussian is not positive definite "
                "(a Cholesky factorisation failed or a variance is not positive)."
            )

    def __repr__(self):
        return f"{type(self).__name__}()"


@dataclass(frozen=True, repr=False)
class FullGaussian(ExponentialFamily):
    """Gaussian with a dense precision matrix (low-rank guides map here too)."""

    name: str = "full"

    def natural(self, q):
        return GaussianNatural(q.precision @ q.mean, q.precision)

    def from_natural(self, natural):
        chol = jnp.linalg.cholesky(natural.precision)
        return Gaussian(cho_solve((chol, True), natural.linear), natural.precision)

    def expectation(self, q):
        cov = self.dense_covariance(q)
        return (q.mean, jnp.outer(q.mean, q.mean) + cov)

    def from_expectation(self, mu):
        mean, second = mu
        cov = second - jnp.outer(mean, mean)
        return Gaussian(mean, jnp.linalg.inv(cov))

    def _chol(self, q):
        return jnp.linalg.cholesky(q.precision)

    def log_prob(self, q, z):
        chol = self._chol(q)
        white = (z - q.mean) @ chol  # (z-m)ᵀ L  so that ‖·‖² = (z-m)ᵀ S (z-m)
        d = q.mean.shape[-1]
        return -0.5 * jnp.sum(white**2, -1) + jnp.sum(jnp.log(jnp.diag(chol))) - 0.5 * d * _LOG_2PI

    def entropy(self, q):
        d = q.mean.shape[-1]
        return 0.5 * d * (1.0 + _LOG_2PI) - jnp.sum(jnp.log(jnp.diag(self._chol(q))))

    def kl(self, q, p):
        d = q.mean.shape[-1]
        lq, lp = self._chol(q), self._chol(p)
        # tr(S_p Σ_q) = ‖L_q⁻¹ L_p‖_F²
        trace = jnp.sum(solve_triangular(lq, lp, lower=True) ** 2)
        diff = p.mean - q.mean
        maha = jnp.sum((lp.T @ diff) ** 2)
        logdet = 2.0 * (jnp.sum(jnp.log(jnp.diag(lq))) - jnp.sum(jnp.log(jnp.diag(lp))))
        return 0.5 * (trace + maha - d + logdet)

    def draws(self, q, noise):
        # z = m + L⁻ᵀ ε has covariance (L Lᵀ)⁻¹ = S⁻¹
        return q.mean + solve_triangular(self._chol(q).T, noise.T, lower=False).T

    def site_natural(self, grad, curvature, ref_mean):
        return GaussianNatural(curvature @ ref_mean - grad, curvature)

    def dense_precision(self, q):
        return q.precision

    def dense_covariance(self, q):
        chol = self._chol(q)
        inv_chol = solve_triangular(chol, jnp.eye(chol.shape[0], dtype=chol.dtype), lower=True)
        return inv_chol.T @ inv_chol

    def project_curvature(self, dense):
        return dense

    def is_positive_definite(self, precision):
        chol = jnp.linalg.cholesky(precision)
        return jnp.all(jnp.isfinite(chol)) & jnp.all(jnp.diag(chol) > 0)

    curvature_detail = 2
    needs_dense_sum = False

    def curvature_sum(self, store, weights):
        return store.weighted_dense(weights)

    def site_curvatures(self, store):
        return store.dense()

    def fixed_point(self, q, target, dense):
        return target, target

    def accepts_target(self, target):
        return bool(self.is_positive_definite(target))

    def covariance_operand(self, q):
        return self.dense_covariance(q)

    def quad_form_cov(self, q, cov, a):
        return a @ cov @ a

    def cov_times(self, q, cov, mat):
        return cov @ mat

    def precision_shape(self, dim):
        return (dim, dim)

    def noisy_precision(self, precision, key, scale):
        z = jnp.triu(jax.random.normal(key, precision.shape, precision.dtype))
        w, v = jnp.linalg.eigh(precision + scale * (z + jnp.triu(z, 1).T))
        projected = (v * jnp.maximum(w, 0.0)) @ v.T
        return 0.5 * (projected + projected.T)

    def saved_precision_problem(self, precision):
        p = np.asarray(precision, np.float64)
        tol = 10 * np.sqrt(np.finfo(precision.dtype).eps) * max(float(np.max(np.abs(p), initial=0.0)), 1e-300)
        if p.size and np.max(np.abs(p - p.T)) > tol:
            return "asymmetric"
        try:
            np.linalg.cholesky(p)
            return None
        except np.linalg.LinAlgError:
            return "indefinite"

    def precision_spectrum(self, precision):
        precision = np.asarray(precision)
        atol = 1e-8 * max(1.0, float(np.max(np.abs(precision)))) if precision.size else 0.0
        if not np.allclose(precision, precision.T, rtol=1e-6, atol=atol):
            return False, None
        return True, np.linalg.eigvalsh(0.5 * (precision + precision.T))


@dataclass(frozen=True, repr=False)
class DiagonalGaussian(ExponentialFamily):
    """Gaussian with a diagonal precision (mean-field)."""

    name: str = "diagonal"

    def natural(self, q):
        return GaussianNatural(q.precision * q.mean, q.precision)

    def from_natural(self, natural):
        return Gaussian(natural.linear / natural.precision, natural.precision)

    def expectation(self, q):
        return (q.mean, q.mean**2 + 1.0 / q.precision)

    def from_expectation(self, mu):
        mean, second = mu
        return Gaussian(mean, 1.0 / (second - mean**2))

    def log_prob(self, q, z):
        d = q.mean.shape[-1]
        return (
            -0.5 * jnp.sum(q.precision * (z - q.mean) ** 2, -1)
            + 0.5 * jnp.sum(jnp.log(q.precision))
            - 0.5 * d * _LOG_2PI
        )

    def entropy(self, q):
        d = q.mean.shape[-1]
        return 0.5 * d * (1.0 + _LOG_2PI) - 0.5 * jnp.sum(jnp.log(q.precision))

    def kl(self, q, p):
        ratio = p.precision / q.precision
        return 0.5 * jnp.sum(ratio + p.precision * (p.mean - q.mean) ** 2 - 1.0 - jnp.log(ratio))

    def draws(self, q, noise):
        return q.mean + noise / jnp.sqrt(q.precision)

    def site_natural(self, grad, curvature, ref_mean):
        return GaussianNatural(curvature * ref_mean - grad, curvature)

    def dense_precision(self, q):
        return jnp.diag(q.precision)

    def dense_covariance(self, q):
        return jnp.diag(1.0 / q.precision)

    def project_curvature(self, dense):
        return jnp.diagonal(dense, axis1=-2, axis2=-1)

    def is_positive_definite(self, precision):
        return jnp.all(jnp.isfinite(precision)) & jnp.all(precision > 0)

    curvature_detail = 1
    default_storage = "diag"

    def relative_eigenvalues(self, q, curvature):
        return curvature / q.precision

    def curvature_sum(self, store, weights):
        return store.weighted_diagonal(weights)

    def site_curvatures(self, store):
        return store.diagonals()

    def prior_natural(self, prior, tau=None):
        off = prior.precision - jnp.diag(jnp.diag(prior.precision))
        if bool(jnp.any(off != 0)):
            raise UnsupportedModelError("the diagonal family needs a prior with independent coordinates "
                                        "(a diagonal prior precision in unconstrained space)")
        return super().prior_natural(prior)

    def precision_shape(self, dim):
        return (dim,)

    def noisy_precision(self, precision, key, scale):
        return jnp.maximum(precision + scale * jax.random.normal(key, precision.shape, precision.dtype), 0.0)


@dataclass(frozen=True, repr=False)
class IsotropicGaussian(ExponentialFamily):
    """Gaussian ``N(m, τ⁻¹ I)`` with a fixed precision ``τ`` (the ERM / MAP case).

    Only the mean is learned, ``T(z) = z``, and the base measure ``exp(−τ‖z‖²/2)`` is
    carried by the prior site (paper appendix "non-constant base measures"): a site has
    no curvature and ``λ = τ m = −Σ_{i≥0} ĝ_i + τ m`` reduces to ``Σ_{i≥0} ĝ_i = 0``.
    """

    name: str = "isotropic"
    fixed_precision = True

    def natural(self, q):
        return GaussianNatural(q.precision * q.mean, q.precision)

    def from_natural(self, natural):
        return Gaussian(natural.linear / natural.precision, natural.precision)

    def expectation(self, q):
        return (q.mean,)

    def from_expectation(self, mu, precision=1.0):
        (mean,) = mu
        return Gaussian(mean, jnp.asarray(precision, mean.dtype))

    def log_prob(self, q, z):
        d = q.mean.shape[-1]
        return -0.5 * q.precision * jnp.sum((z - q.mean) ** 2, -1) + 0.5 * d * (jnp.log(q.precision) - _LOG_2PI)

    def entropy(self, q):
        d = q.mean.shape[-1]
        return 0.5 * d * (1.0 + _LOG_2PI - jnp.log(q.precision))

    def kl(self, q, p):
        d = q.mean.shape[-1]
        ratio = p.precision / q.precision
        return 0.5 * (d * (ratio - 1.0 - jnp.log(ratio)) + p.precision * jnp.sum((p.mean - q.mean) ** 2))

    def draws(self, q, noise):
        return q.mean + noise / jnp.sqrt(q.precision)

    def site_natural(self, grad, curvature, ref_mean):
        return GaussianNatural(-grad, jnp.zeros((), grad.dtype))

    def dense_precision(self, q):
        d = q.mean.shape[-1]
        return q.precision * jnp.eye(d, dtype=q.mean.dtype)

    def dense_covariance(self, q):
        d = q.mean.shape[-1]
        return jnp.eye(d, dtype=q.mean.dtype) / q.precision

    def project_curvature(self, dense):
        return jnp.zeros(jnp.shape(dense)[:-2], jnp.result_type(dense))

    def is_positive_definite(self, precision):
        return jnp.isfinite(precision) & (precision > 0)

    curvature_detail = 0
    default_storage = "none"

    def relative_eigenvalues(self, q, curvature):
        return jnp.zeros((1,), q.mean.dtype)

    def curvature_sum(self, store, weights):
        return jnp.zeros((), weights.dtype)

    def site_curvatures(self, store):
        return jnp.zeros(store.num_examples, jax.tree.leaves(store)[0].dtype)

    def precision_residual(self, precision, target):
        return jnp.zeros((), jnp.result_type(precision))

    def fixed_point(self, q, target, dense):
        return q.precision, dense

    def keep_fixed(self, current, new):
        return current

    def prior_natural(self, prior, tau=None):
        tau = jnp.asarray(1.0 if tau is None else tau, prior.mean.dtype)
        return GaussianNatural(tau * prior.mean, tau)

    def prior_tau(self, prior):
        return jnp.mean(jnp.diag(prior.precision))

    def precision_shape(self, dim):
        return ()

    def noisy_precision(self, precision, key, scale):
        return precision

    def precision_spectrum(self, precision):
        return True, None


def regularised_chol(matrix):
    """Cholesky of ``matrix + μI`` with the smallest ``μ`` in a geometric ladder that works: ``(chol, μ)``."""
    chol = _chol_or_none(matrix)
    if chol is not None:
        return chol, 0.0
    scale = float(jnp.mean(jnp.abs(jnp.diag(matrix)))) or 1.0
    eye = jnp.eye(matrix.shape[0], dtype=matrix.dtype)
    for power in range(-10, 4):
        jitter = scale * 10.0**power
        chol = _chol_or_none(matrix + jitter * eye)
        if chol is not None:
            return chol, jitter
    raise NonFiniteResultError("the expected Hessian could not be regularised to positive definiteness")


def _chol_or_none(matrix):
    chol = jnp.linalg.cholesky(matrix)
    return chol if bool(jnp.all(jnp.isfinite(chol))) else None


_FAMILIES = {"full": FullGaussian(), "diagonal": DiagonalGaussian(), "isotropic": IsotropicGaussian()}
_ALIASES = {"diag": "diagonal", "iso": "isotropic", "dense": "full"}
_FACTORIES = {}


def register_family_factory(prefix: str, build, parse) -> None:
    """Make a parametrised family available as ``prefix`` with options and as ``"prefix-suffix"``.

    ``get_family(prefix, **options)`` returns ``build(**options)`` and ``get_family("prefix-s")``
    returns ``build(**parse("s"))``; the family built must be named ``"prefix-s"`` so that saved
    files name it completely (``LowRankGaussian(rank=5)`` is ``"lowrank-5"``).
    """
    if prefix in _FAMILIES or prefix in _ALIASES:
        raise InvalidOptionError(f"the family name {prefix!r} is taken")
    _FACTORIES[prefix] = (build, parse)


def register_family(family: ExponentialFamily, aliases: Iterable[str] = ()) -> ExponentialFamily:
    """Make ``family`` (an :class:`ExponentialFamily` instance) available by its ``name``.

    After registration ``pc.fit(..., family=name)``, saved files and every operation accept
    it; docs/architecture.md, "Adding a family", lists the methods a family implements.

    :raises InvalidOptionError: ``family`` is not an :class:`ExponentialFamily`, or its
        name or an alias is taken by another family.
    """
    if not isinstance(family, ExponentialFamily):
        raise InvalidOptionError(f"register_family expects an ExponentialFamily instance, found {type(family).__name__}")
    for name in (family.name, *aliases):
        taken = _FAMILIES.get(_ALIASES.get(name, name))
        if taken is not None and taken != family:
            raise InvalidOptionError(f"the family name {name!r} is taken by {taken!r}")
    _FAMILIES[family.name] = family
    _ALIASES.update({alias: family.name for alias in aliases})
    return family


def registered_families():
    """``{name: family}`` of every registered family."""
    return dict(_FAMILIES)


def get_family(family: str | ExponentialFamily, **options) -> ExponentialFamily:
    """Return a family instance from a registered name (``"full"``, ``"diagonal"``, ``"isotropic"``,
    ``"lowrank-5"``, …) or instance; ``options`` parametrise a family registered with
    :func:`register_family_factory` (``get_family("lowrank", rank=5)``).

    :raises InvalidOptionError: an unknown name, or options for a family that takes none.
    """
    options = {k: v for k, v in options.items() if v is not None}
    if isinstance(family, ExponentialFamily):
        if options:
            raise InvalidOptionError(f"options {sorted(options)} apply to a family name, not to {family!r}")
        return family
    key = _ALIASES.get(family, family) if isinstance(family, str) else family
    if isinstance(key, str):
        head, sep, tail = key.partition("-")
        if head in _FACTORIES and (sep or options or key not in _FAMILIES):
            build, parse = _FACTORIES[head]
            made = build(**{**(parse(tail) if sep else {}), **options})
            return _FAMILIES.get(made.name) or register_family(made)
        if options:
            raise InvalidOptionError(f"the {key!r} family takes no options (got {sorted(options)})")
    if not isinstance(key, str) or key not in _FAMILIES:
        raise InvalidOptionError(f"unknown family {family!r}; expected one of {sorted(_FAMILIES) + sorted(_FACTORIES)} "
                                 "or an ExponentialFamily")
    return _FAMILIES[key]
