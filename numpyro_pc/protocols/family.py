r"""The family protocol: the core every family implements (:class:`Family`), Gaussian distributions and sites, and :class:`GaussianFamily`.

A distribution is the pytree :class:`Gaussian` ``(mean, precision)``; its natural
parameters are :class:`GaussianNatural` ``(linear, precision)`` meaning
:math:`\lambda = (S m, -\tfrac12 S)` — the ``precision`` field stores ``S`` itself
rather than ``-S/2`` so that sums of sites read as sums of precisions.

A Gaussian *site* ``ℓ̂(z) = zᵀĝ + ½ (z − m_t)ᵀ Ĥ (z − m_t)`` (paper Table 1) has natural
parameters ``(Ĥ m_t − ĝ, Ĥ)``: ``exp(−ℓ̂)`` is an unnormalised Gaussian factor. Adding,
removing and scaling sites is arithmetic on these pairs (:func:`add_site`,
:func:`remove_site`, :func:`scale_site`). :class:`Family` is the core every family implements,
Gaussian or a product of exponential families (:class:`~numpyro_pc.families.product.ProductFamily`);
:class:`GaussianFamily` adds what the Gaussian site solver needs. The concrete Gaussian families
are in :mod:`numpyro_pc.families.gaussians` and :mod:`numpyro_pc.families.lowrank`, the registry
in :mod:`numpyro_pc.families.registry`. ``ExponentialFamily``, the former name of
:class:`GaussianFamily`, still reads, with a warning.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import cho_solve, solve_triangular

from numpyro_pc.deprecation import warn_renamed
from numpyro_pc.errors import NonFiniteResultError, NotPositiveDefiniteError

from .capabilities import (
    FixedPrecision,
    GaussianSolver,
    SiteCurvature,
    SiteDivision,
    SiteSum,
    capabilities_from_flags,
    declares_flags,
    flag_values,
    refuse_unbridgeable_flags,
    require,
)
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

__all__ = ["Gaussian", "GaussianNatural", "Family", "GaussianFamily", "regularised_chol", "add_site", "remove_site",
           "scale_site", "require_site_product"]

_T = TypeVar("_T")


class Gaussian(NamedTuple):
    """A Gaussian ``N(mean, precision⁻¹)`` in its family's compact precision format."""

    mean: jax.Array
    precision: jax.Array


class GaussianNatural(NamedTuple):
    """Natural parameters ``λ = (linear, −½ precision)`` with ``linear = S m``."""

    linear: jax.Array
    precision: jax.Array


def require_site_product(family, operation: str) -> None:
    """Deprecated: ``require(family, SiteDivision, operation)`` (:mod:`numpyro_pc.protocols.capabilities`).

    :raises UnsupportedGuideError: the family's ``q`` is not the product of its sites.
    """
    warnings.warn("require_site_product is deprecated: use numpyro_pc.protocols.capabilities.require(family, SiteDivision, "
                  "operation)", DeprecationWarning, stacklevel=2)
    require(family, SiteDivision, operation)


def add_site(natural: _T, site: _T, alpha=1.0) -> _T:
    """Multiply a distribution by ``exp(−α ℓ̂)``: ``λ + α λ_site``."""
    return jax.tree.map(lambda a, b: a + alpha * b, natural, site)


def remove_site(natural: _T, site: _T, alpha=1.0) -> _T:
    """Divide a distribution by ``exp(−α ℓ̂)``: ``λ − α λ_site``."""
    return jax.tree.map(lambda a, b: a - alpha * b, natural, site)


def scale_site(site: _T, alpha) -> _T:
    """Raise a site to the power ``α`` (tempering): ``α λ_site``."""
    return jax.tree.map(lambda a: alpha * a, site)


def _deprecated_flag(name: str, meaning: str) -> property:
    """A read-only property answering the old family flag ``name`` from the capabilities, with a warning."""
    def read(self) -> bool:
        warnings.warn(f"GaussianFamily.{name} is deprecated: use {meaning} (numpyro_pc.protocols.capabilities)",
                      DeprecationWarning, stacklevel=2)
        return flag_values(self.capabilities)[name]
    return property(read, doc=f"Deprecated: {meaning}.")


class Family(ABC):
    r"""The core every variational family implements, whatever its kind: a minimal exponential
    family :math:`q(x) \propto h(x) \exp(\langle\lambda, T(x)\rangle - A(\lambda))` (paper sec. 2,
    Table 1), with its natural and expectation parameters, density, entropy, KL and draws.

    ``q`` is the member in the form the family's functions take: a Gaussian family's
    :class:`Gaussian` ``(mean, precision)`` (:class:`GaussianFamily`), a product's natural-parameter
    vector :math:`\lambda` (:class:`~numpyro_pc.families.product.ProductFamily`); a posterior's
    :attr:`~numpyro_pc.protocols.posterior.Posterior.q` is one. What a family can do beyond this core
    is declared, not flagged: ``capabilities`` holds instances of the classes of
    :mod:`numpyro_pc.protocols.capabilities`, and ``lacks`` says, for a capability the family does not
    have, why; operations look them up with :func:`~numpyro_pc.protocols.capabilities.capability` and
    :func:`~numpyro_pc.protocols.capabilities.require`, never by the family's class. Every method is a
    pure function of pytrees, usable under ``jit``/``vmap``; the core's arguments are positional (the
    kinds name them after their coordinates: a Gaussian's ``z``, a product's ``lam``).
    """

    name: str
    capabilities: ClassVar[tuple] = ()
    lacks: ClassVar[Mapping] = MappingProxyType({})

    @abstractmethod
    def natural(self, q, /) -> Any:
        r"""Natural parameters :math:`\lambda` of ``q``."""

    @abstractmethod
    def expectation(self, q, /) -> Any:
        r"""Expectation parameters :math:`\mu = E_q[T(x)]`."""

    @abstractmethod
    def log_prob(self, q, point, /) -> jax.Array:
        """Log-density of ``point`` (the family's coordinates; leading batch axes allowed) under ``q``."""

    @abstractmethod
    def entropy(self, q, /) -> jax.Array:
        """Entropy of ``q`` (in the family's coordinates)."""

    @abstractmethod
    def kl(self, q, p, /) -> jax.Array:
        """``KL(q ‖ p)`` for two members of this family."""

    @abstractmethod
    def sample(self, q, key, num_samples, /) -> Any:
        """``num_samples`` draws of ``q`` with the PRNG ``key``, in the family's coordinates (leading axis
        ``num_samples``)."""


class GaussianFamily(Family):
    """A Gaussian family over the flat unconstrained latent vector ``z`` (full, diagonal, isotropic,
    low-rank): the :class:`Family` core plus the Gaussian algebra the site solver, the sites and the
    operations ask of it — the precision format, site natural parameters, curvature sums and
    projections, the solver's target and preconditioner, Bayesian arithmetic, checks of a precision
    read or received (docs/architecture.md, "Who decides what").

    All methods are pure functions of pytrees and may be used under ``jit``/``vmap``.

    What a family can do beyond this core is declared, not flagged: ``capabilities`` holds
    instances of the classes of :mod:`numpyro_pc.protocols.capabilities` (the defaults: ``SiteSum``,
    ``SiteDivision``, full ``SiteCurvature`` and a ``GaussianSolver`` that preconditions the mean
    with the dense sum ``Σ Ĥ_i``), and ``lacks`` says, for
    a capability the family does not have, why — operations look them up with
    :func:`~numpyro_pc.protocols.capabilities.capability` and :func:`~numpyro_pc.protocols.capabilities.require`.
    """

    name: str
    capabilities: ClassVar[tuple] = (SiteSum(), SiteDivision(), SiteCurvature(), GaussianSolver())
    lacks: ClassVar[Mapping] = MappingProxyType({FixedPrecision: "the precision is learned, not fixed by the prior"})

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        refuse_unbridgeable_flags(cls)
        if declares_flags(cls) and "capabilities" not in vars(cls):
            cls.capabilities = capabilities_from_flags(cls, cls.capabilities)

    fixed_precision = _deprecated_flag("fixed_precision", "capability(family, FixedPrecision) is not None")
    linear_precision = _deprecated_flag("linear_precision", "capability(family, SiteSum) is not None")
    curvature_detail = _deprecated_flag("curvature_detail", "capability(family, SiteCurvature).detail")
    default_storage = _deprecated_flag("default_storage", "capability(family, SiteCurvature).default_storage")
    sparse_sites = _deprecated_flag("sparse_sites", "capability(family, SiteCurvature).matrix_free")
    needs_dense_sum = _deprecated_flag("needs_dense_sum", "capability(family, GaussianSolver).dense_sum")
    minimises_objective = _deprecated_flag("minimises_objective",
                                           "capability(family, GaussianSolver).minimises_objective")
    dense_checks = _deprecated_flag("dense_checks", "capability(family, GaussianSolver).dense_checks")

    @abstractmethod
    def natural(self, q) -> GaussianNatural:
        """Natural parameters of ``q`` (:class:`GaussianNatural`)."""

    @abstractmethod
    def from_natural(self, natural) -> Gaussian:
        """Distribution with the given natural parameters (no positivity check)."""

    @abstractmethod
    def expectation(self, q) -> tuple[Any, ...]:
        """Expectation parameters ``μ = E_q[T(z)]``."""

    @abstractmethod
    def from_expectation(self, mu) -> Gaussian:
        """Distribution with the given expectation parameters."""

    @abstractmethod
    def log_prob(self, q, point) -> jax.Array:
        """Log-density of ``point``, flat unconstrained values ``z`` (trailing axis ``d``), under ``q``."""

    @abstractmethod
    def entropy(self, q) -> jax.Array:
        """Differential entropy of ``q``."""

    @abstractmethod
    def kl(self, q, p) -> jax.Array:
        """``KL(q ‖ p)`` for two members of this family."""

    def sample(self, q, key, num_samples) -> jax.Array:
        """``num_samples`` draws, shape ``(num_samples, d)``."""
        return self.draws(q, jax.random.normal(key, (num_samples,) + q.mean.shape, q.mean.dtype))

    @abstractmethod
    def draws(self, q, noise) -> jax.Array:
        """Draws ``z = m + Cε`` of ``q`` from standard-normal ``noise`` ``ε`` (shape ``(K, d)``), ``CCᵀ = S⁻¹``."""

    @abstractmethod
    def site_natural(self, grad, curvature, ref_mean) -> GaussianNatural:
        """Natural parameters of the site ``zᵀĝ + ½(z−m)ᵀĤ(z−m)`` (``Ĥ`` in family format)."""

    @abstractmethod
    def dense_precision(self, q) -> jax.Array:
        """Precision as a dense ``(d, d)`` matrix."""

    @abstractmethod
    def dense_covariance(self, q) -> jax.Array:
        """Covariance as a dense ``(d, d)`` matrix."""

    @abstractmethod
    def project_curvature(self, dense) -> Any:
        """Map a dense ``(..., d, d)`` curvature to this family's precision format."""

    def project_diagonal(self, diag) -> Any:
        """Map a diagonal curvature ``(d,)`` to this family's precision format (through the dense matrix
        here; a family with matrix-free sites overrides it)."""
        return self.project_curvature(jnp.diag(diag))

    @abstractmethod
    def is_positive_definite(self, precision) -> jax.Array:
        """Boolean (traceable) test of the precision format."""

    # --- what the solver, sites and operations ask of a family (docs/notation.md) ---------

    @abstractmethod
    def curvature_sum(self, store, weights) -> Any:
        """``Σ_i w_i Ĥ_i`` of a :class:`~numpyro_pc.curvature.stores.CurvatureStore` in this family's precision format."""

    @abstractmethod
    def site_curvatures(self, store) -> Any:
        """Per-example site precisions ``Ĥ_i`` in this family's format (leading axis ``N``)."""

    def precision_residual(self, precision, target) -> jax.Array:
        """Relative residual ``‖S − Σ Ĥ_i‖ / ‖S‖`` of the precision identity."""
        return jnp.linalg.norm(precision - target) / jnp.linalg.norm(precision)

    def fixed_point(self, q, target, dense) -> tuple[Any, Any]:
        """``(precision, mean preconditioner)`` of the undamped step to the target ``Σ Ĥ_i``.

        ``dense`` is the dense sum ``Σ E_q[∇²ℓ_i]``: a Newton step on ``E_q[Σ ℓ_i]`` (paper
        App. A.3), which reaches the fixed point far faster than a step preconditioned by a
        diagonal or fixed precision.
        """
        return target, dense

    def newton_operator(self, store, weights, prior_curvature=None, base=None) -> Any:
        """The mean preconditioner handed to :meth:`fixed_point` as ``dense`` where the family needs no
        dense sum (:class:`~numpyro_pc.protocols.capabilities.GaussianSolver` ``dense_sum`` false); ``None`` here (the low-rank family: ``T`` as an operator)."""
        return None

    def accepts_target(self, target) -> bool:
        """Whether a full step to the precision ``target`` stays in the family (host-side)."""
        return True

    def check_dimension(self, dim) -> None:
        """Raise :class:`~numpyro_pc.errors.InvalidOptionError` if the family cannot describe ``dim`` latents."""

    def target_precision(self, store, weights, prior_curvature=None, base=None) -> Any:
        """``Σ_i w_i Ĥ_i`` (``+ Ĥ_0`` from ``prior_curvature``, dense or its diagonal, ``+ B`` a
        precision in the family's format) in the family's format: the precision the fixed point asks for."""
        curv = self.curvature_sum(store, weights)
        if prior_curvature is not None:
            curv = curv + (self.project_diagonal(prior_curvature) if prior_curvature.ndim == 1
                           else self.project_curvature(prior_curvature))
        if base is not None:
            curv = curv + base
        return curv

    def precondition(self, pre, grad) -> jax.Array:
        """``P⁻¹ grad`` for the mean preconditioner ``P`` of :meth:`fixed_point` (a dense
        matrix here: Cholesky, with the smallest jitter in a geometric ladder that works)."""
        chol, _ = regularised_chol(pre)
        return cho_solve((chol, True), grad)

    def inner_preconditioner(self, pre) -> Callable[[jax.Array], jax.Array]:
        """``v ↦ P⁻¹ v`` for the mean preconditioner ``pre`` of :meth:`fixed_point`, factorised once: what
        an inner iterative solve applies at each of its steps (the Newton–CG steps of
        :mod:`numpyro_pc.solvers.newton_polish`)."""
        chol, _ = regularised_chol(pre)
        return lambda v: cho_solve((chol, True), v)

    def traced_precondition(self, pre, grad) -> jax.Array:
        """``P⁻¹ grad`` inside a trace (the pure kernels of :mod:`numpyro_pc.kernels.stream_state`): no
        jitter ladder, so a preconditioner that is not positive definite gives non-finite values,
        which the kernels treat as a step to halve."""
        return cho_solve((jnp.linalg.cholesky(pre), True), grad)

    def blend(self, current, target, rho) -> Any:
        """The precision ``(1 − ρ) S + ρ T`` of a damped step, in the family's format."""
        return (1.0 - rho) * current + rho * target

    def arithmetic(self, base, naturals, alphas) -> GaussianNatural:
        """Bayesian arithmetic ``λ_base + Σ_k α_k (λ_k − λ_base)`` of natural parameters (merging)."""
        total = base
        for a, lam in zip(alphas, naturals):
            total = jax.tree.map(lambda acc, x, b: acc + a * (x - b), total, lam, base)
        return total

    def marginal_variance(self, q) -> jax.Array:
        """The diagonal of the covariance ``Σ``, ``(d,)``."""
        return jnp.diag(self.dense_covariance(q))

    def trace_with_covariance(self, q, precision) -> jax.Array:
        """``tr(B Σ_q)`` for a precision ``B`` in the family's format."""
        return jnp.sum(self.dense_precision(Gaussian(q.mean, precision)) * self.dense_covariance(q))

    def trace_dense_with_covariance(self, q, dense) -> jax.Array:
        """``tr(H Σ_q)`` for a dense ``(d, d)`` matrix ``H``."""
        return jnp.sum(dense * self.dense_covariance(q))

    def relative_eigenvalues(self, q, curvature) -> jax.Array:
        """Eigenvalues of ``Σ^{1/2} H Σ^{1/2}`` for a curvature ``H`` in this family's format
        (``H``'s share of the precision, direction by direction; all below 1 iff ``S − H ≻ 0``)."""
        chol = jnp.linalg.cholesky(self.dense_precision(q))
        dense = self.dense_precision(Gaussian(q.mean, curvature))
        white = solve_triangular(chol, solve_triangular(chol, dense, lower=True).T, lower=True)
        return jnp.linalg.eigvalsh(0.5 * (white + white.T))

    def covariance_operand(self, q) -> Any:
        """What :meth:`quad_form_cov` and :meth:`cov_times` take as ``cov`` (formed once per call)."""
        return None

    def quad_form_cov(self, q, cov, a) -> jax.Array:
        """``aᵀ Σ a`` for a vector ``a``."""
        return jnp.sum(a**2 / q.precision)

    def cov_times(self, q, cov, mat) -> jax.Array:
        """``Σ @ mat`` for a ``(d, r)`` matrix."""
        return mat / (q.precision[:, None] if jnp.ndim(q.precision) else q.precision)

    def keep_fixed(self, current, new) -> Any:
        """The precision after an update to ``new`` (a fixed precision stays ``current``)."""
        return new

    def prior_natural(self, prior, tau=None) -> GaussianNatural:
        """Natural parameters of a dense Gaussian ``prior`` in this family's format."""
        return self.natural(Gaussian(prior.mean, self.project_curvature(prior.precision)))

    def prior_tau(self, prior) -> jax.Array | None:
        """The fixed precision a dense Gaussian prior gives the family (``None``: not fixed)."""
        return None

    @abstractmethod
    def precision_shape(self, dim) -> tuple[int, ...]:
        """Shape of a precision (and of a site's precision) in this family's format."""

    @abstractmethod
    def noisy_precision(self, precision, key, scale) -> Any:
        """``precision`` plus symmetric Gaussian noise of sd ``scale``, projected to positive semi-definite."""

    def precision_spectrum(self, precision) -> tuple[bool, np.ndarray | None]:
        """``(symmetric, eigenvalues)`` of a host-side precision (``eigenvalues`` ``None``: nothing to check)."""
        return True, np.sort(np.asarray(precision))

    def saved_precision_problem(self, precision) -> str | None:
        """Host-side check of a precision read from a file: ``None`` if valid, else ``"asymmetric"``
        or ``"indefinite"`` (here: every entry must be positive)."""
        return None if np.all(np.asarray(precision, np.float64) > 0) else "indefinite"

    def check_positive_definite(self, precision, what="precision") -> None:
        """Raise :class:`NotPositiveDefiniteError` unless the precision is positive definite."""
        if not bool(self.is_positive_definite(precision)):
            raise NotPositiveDefiniteError(
                f"the {what} of the {self.name} Gaussian is not positive definite "
                "(a Cholesky factorisation failed or a variance is not positive)."
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"



def regularised_chol(matrix) -> tuple[jax.Array, float]:
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


def _chol_or_none(matrix) -> jax.Array | None:
    chol = jnp.linalg.cholesky(matrix)
    return chol if bool(jnp.all(jnp.isfinite(chol))) else None



def __getattr__(name: str) -> type:
    if name == "ExponentialFamily":
        warn_renamed("numpyro_pc.protocols.family.ExponentialFamily is now GaussianFamily (every family, Gaussian or "
                     "a product, is a Family); the old name will be removed in the next release")
        return GaussianFamily
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
