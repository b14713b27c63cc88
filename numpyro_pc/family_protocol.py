r"""The family protocol: Gaussian distributions, Gaussian sites and :class:`ExponentialFamily`.

A distribution is the pytree :class:`Gaussian` ``(mean, precision)``; its natural
parameters are :class:`GaussianNatural` ``(linear, precision)`` meaning
:math:`\lambda = (S m, -\tfrac12 S)` — the ``precision`` field stores ``S`` itself
rather than ``-S/2`` so that sums of sites read as sums of precisions.

A Gaussian *site* ``ℓ̂(z) = zᵀĝ + ½ (z − m_t)ᵀ Ĥ (z − m_t)`` (paper Table 1) has natural
parameters ``(Ĥ m_t − ĝ, Ĥ)``: ``exp(−ℓ̂)`` is an unnormalised Gaussian factor. Adding,
removing and scaling sites is arithmetic on these pairs (:func:`add_site`,
:func:`remove_site`, :func:`scale_site`). :class:`ExponentialFamily` lists what every family
implements; the concrete families are in :mod:`numpyro_pc.gaussians` and
:mod:`numpyro_pc.lowrank`, the registry in :mod:`numpyro_pc.families`.
"""

from abc import ABC, abstractmethod
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import cho_solve, solve_triangular

from .errors import NonFiniteResultError, NotPositiveDefiniteError, UnsupportedGuideError

__all__ = ["Gaussian", "GaussianNatural", "ExponentialFamily", "regularised_chol", "add_site", "remove_site",
           "scale_site", "require_site_product"]


class Gaussian(NamedTuple):
    """A Gaussian ``N(mean, precision⁻¹)`` in its family's compact precision format."""

    mean: jax.Array
    precision: jax.Array


class GaussianNatural(NamedTuple):
    """Natural parameters ``λ = (linear, −½ precision)`` with ``linear = S m``."""

    linear: jax.Array
    precision: jax.Array


def require_site_product(family, operation: str) -> None:
    """Refuse ``operation`` unless ``q`` is the product of its sites in ``family`` (``λ = Σ_i λ̂_i``):
    cavities, the information-gain decomposition and corrected models divide sites out of ``q``.

    :raises UnsupportedGuideError: for a family whose precision is a fixed base measure
        (isotropic) or a non-linear projection of the site sum (low-rank).
    """
    if family.fixed_precision:
        why = "a fixed base measure, and its sites carry no curvature"
    elif not family.linear_precision:
        why = "a projection of the site sum, not the sum itself"
    else:
        return
    raise UnsupportedGuideError(
        f"{operation} divides sites out of q, which needs q to be the product of its sites; the {family.name} "
        f"family's precision is {why}. Fit with family='full' or 'diagonal' for it.")


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
    #: the family asks of its sites only sums and matrix-free products: ``storage="auto"`` keeps the
    #: Jacobians by their nonzero columns (``"sparse"``) and a separable prior's curvature as its diagonal
    sparse_sites = False

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

    def project_diagonal(self, diag):
        """Map a diagonal curvature ``(d,)`` to this family's precision format (through the dense matrix
        here; a family with matrix-free sites overrides it)."""
        return self.project_curvature(jnp.diag(diag))

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

    def newton_operator(self, store, weights, prior_curvature=None, base=None):
        """The mean preconditioner handed to :meth:`fixed_point` as ``dense`` where the family needs no
        dense sum (``needs_dense_sum`` false); ``None`` here (the low-rank family: ``T`` as an operator)."""
        return None

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
        """``Σ_i w_i Ĥ_i`` (``+ Ĥ_0`` from ``prior_curvature``, dense or its diagonal, ``+ B`` a
        precision in the family's format) in the family's format: the precision the fixed point asks for."""
        curv = self.curvature_sum(store, weights)
        if prior_curvature is not None:
            curv = curv + (self.project_diagonal(prior_curvature) if prior_curvature.ndim == 1
                           else self.project_curvature(prior_curvature))
        if base is not None:
            curv = curv + base
        return curv

    def precondition(self, pre, grad):
        """``P⁻¹ grad`` for the mean preconditioner ``P`` of :meth:`fixed_point` (a dense
        matrix here: Cholesky, with the smallest jitter in a geometric ladder that works)."""
        chol, _ = regularised_chol(pre)
        return cho_solve((chol, True), grad)

    def inner_preconditioner(self, pre):
        """``v ↦ P⁻¹ v`` for the mean preconditioner ``pre`` of :meth:`fixed_point`, factorised once: what
        an inner iterative solve applies at each of its steps (the Newton–CG steps of
        :mod:`numpyro_pc.newton_polish`)."""
        chol, _ = regularised_chol(pre)
        return lambda v: cho_solve((chol, True), v)

    def traced_precondition(self, pre, grad):
        """``P⁻¹ grad`` inside a trace (the pure kernels of :mod:`numpyro_pc.stream_state`): no
        jitter ladder, so a preconditioner that is not positive definite gives non-finite values,
        which the kernels treat as a step to halve."""
        return cho_solve((jnp.linalg.cholesky(pre), True), grad)

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

