r"""The low-rank-plus-diagonal Gaussian family (precision form).

A member is ``q = N(m, S⁻¹)`` with

.. math::

    S = \operatorname{diag}(D) + U U^\top, \qquad D \in \mathbb{R}^d_{>0},\; U \in \mathbb{R}^{d\times r},

stored as one ``(d, r + 1)`` array ``[D | U]`` (column 0 the diagonal, columns ``1..r`` the
factor), so that files, messages and the solver's packing see one array as for the other
families. Every operation costs ``O(d r²)`` and forms no ``d × d`` array: solves
(Woodbury), ``log|S| = Σ log D_j + log|I + UᵀD⁻¹U|`` (matrix determinant lemma), the
covariance ``Σ = diag(1/D) − W Wᵀ`` with ``W = D⁻¹ U L⁻ᵀ``, ``L Lᵀ = I + UᵀD⁻¹U``, and
draws ``z = m + D^{-1/2}(I + ÛÛᵀ)^{-1/2} ε`` with ``Û = D^{-1/2}U`` (the symmetric square
root through a thin SVD of ``Û``).

**Why the precision form.** Sites add to the precision: the dual form is
``S = Σ_{i≥0} Ĥ_i`` (paper Table 1). In precision form the target ``T = Ĥ_0 + Σ_i w_i Ĥ_i``
(plus a fixed Gaussian factor when there is one) is a positive semi-definite operator whose
products ``T V`` the curvature store gives matrix-free
(:meth:`~numpyro_pc.curvature.stores.CurvatureStore.weighted_matmat`); its projection onto the
family needs only ``T V`` for ``r + 10`` vectors and ``diag T``. The covariance form of
``AutoLowRankMultivariateNormal`` (``Σ = diag + WWᵀ``) would need the *smallest*
eigen-directions of ``T`` (solves with ``T``) at every step. The two forms convert into one
another in ``O(d r²)`` by Woodbury, which is how the guide adapter reads and writes that
guide (:mod:`numpyro_pc.guides.gaussian`); since the two sets differ (the inverse of ``diag + WWᵀ``
is ``diag − VVᵀ``) the conversion is a projection, exact when ``r ≥ d − 1``.

**The projection** ``Π_r(T)``, which defines the family's fixed point ``S = Π_r(T)``:

* ``r < d − 1``: ``U Uᵀ`` is the best rank-``r`` part of the Nyström approximation
  ``T_Ω = Y (Ωᵀ Y)⁻¹ Yᵀ``, ``Y = T Ω``, of ``T`` on a subspace ``Ω`` found by randomized
  subspace iteration (fixed seed: ``Π_r`` is a deterministic function of ``T``), and
  ``D = diag T − diag(U Uᵀ)``. Since ``U Uᵀ ⪯ T_Ω ⪯ T``, ``D ≥ diag(T − T_Ω) ≥ 0``:
  the projection keeps the diagonal of ``T`` exactly (the marginal precisions of the
  diagonal family; ``r = 0`` would be that family) and ``U Uᵀ`` holds the leading ``r``
  eigenpairs of ``T`` as far as the subspace iteration resolves them. Cost ``O((r + 10)·cost(T V))``, no ``d × d`` array.
* ``r ≥ d − 1``: every positive definite ``T`` is ``λ_min I + Σ_{j<d}(λ_j − λ_min) v_j v_jᵀ``,
  so ``Π_r(T) = T`` exactly. This is computed from a dense eigendecomposition of ``T``,
  which is only reached when the family's own array already holds ``d²`` numbers (small
  ``d``, the regime of the "equals the full family" check).

**The mean step** is a Newton step on ``E_q[Σ ℓ_i]``, ``m ← m − T⁻¹ Σ ĝ_i`` with the
unprojected ``T`` (conjugate gradients on products ``T v``, preconditioned by ``S⁻¹``), as
for the diagonal family; the fixed point (``Σ ĝ_i = 0``, ``S = Π_r(T)``) does not depend on
it. Preconditioning with ``S`` itself stalled the solver ("no step size made progress"):
``S`` keeps only ``T``'s diagonal and top ``r``, and at the measured stalls (a7a, breast
cancer) ``S⁻¹T`` had eigenvalues from 0.1 to 7, a step that overshoots some directions
sevenfold, moves ``T`` away from ``S``, and crawls along others.

Because ``Π_r`` is not linear, the precision of a member is not a sum of site precisions:
an operation that divides *some* sites out of a posterior (a partial correction, site
removal) has no meaning in this family, and the family says so
(it lacks the :class:`~numpyro_pc.protocols.capabilities.SiteSum` capability; those
operations raise :class:`~numpyro_pc.errors.UnsupportedModelError`). Operations that
recompute every site — the exact update, corrected deletion with the data kept,
retraining, merging followed by refinement — are exact; the uncorrected update
(``correction="none"``) divides nothing out and is VCL: ``S_new = Π_r(S_old + Σ_new Ĥ_i)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.errors import InvalidOptionError, UnsupportedModelError
from numpyro_pc.protocols.capabilities import (
    FULL_CURVATURE,
    FixedPrecision,
    GaussianSolver,
    SiteCurvature,
    SiteDivision,
    SiteSum,
)

from .lowrank_algebra import TargetOperator as _TargetOperator
from .lowrank_algebra import apply_precision as _apply
from .lowrank_algebra import compress_precision as _compress
from .lowrank_algebra import cov_factor as _cov_factor
from .lowrank_algebra import diff_fro2 as _diff_fro2
from .lowrank_algebra import fro_inner as _fro_inner
from .lowrank_algebra import join_precision as _join
from .lowrank_algebra import logdet_precision as _logdet
from .lowrank_algebra import lowrank_from_covariance, project_operator
from .lowrank_algebra import newton_solve as _newton_solve
from .lowrank_algebra import solve_precision as _solve
from .lowrank_algebra import split_precision as _split
from .lowrank_algebra import target_diagonal as _target_diagonal
from .lowrank_algebra import target_matmat as _target_matmat
from .registry import GaussianFamily, Gaussian, GaussianNatural, register_family_factory
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

__all__ = ["LowRankGaussian", "project_operator", "lowrank_from_covariance"]  # the last two: from lowrank_algebra

_LOG_2PI = math.log(2.0 * math.pi)

@dataclass(frozen=True, repr=False)
class LowRankGaussian(GaussianFamily):
    r"""Gaussian with precision ``diag(D) + U Uᵀ``, ``U`` of ``rank`` columns (see the module docstring).

    Obtain it as ``get_family("lowrank", rank=r)``, the name ``"lowrank-r"``, or
    ``pc.fit(..., family="lowrank", rank=r)``.

    :param int rank: number of columns ``r ≥ 1`` of ``U``.
    """

    rank: int = 1
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, (int, np.integer)) or self.rank < 1:
            raise InvalidOptionError(f"the lowrank family needs an integer rank >= 1, got {self.rank!r}")
        object.__setattr__(self, "rank", int(self.rank))
        object.__setattr__(self, "name", f"lowrank-{self.rank}")

    def __hash__(self) -> int:
        return hash((type(self), self.rank))

    def __repr__(self) -> str:
        return f"LowRankGaussian(rank={self.rank})"

    capabilities = (SiteCurvature(FULL_CURVATURE, None, matrix_free=True),
                    GaussianSolver(dense_sum=False, minimises_objective=False, dense_checks=False))
    lacks = MappingProxyType(dict.fromkeys(
        (SiteSum, SiteDivision), "the precision is a projection of the site sum onto rank-r plus diagonal, not the sum itself")
        | {FixedPrecision: "the precision is learned, not fixed by the prior"})

    # --- parameters and densities ---------------------------------------------------------
    def natural(self, q) -> GaussianNatural:
        return GaussianNatural(_apply(q.precision, q.mean), q.precision)

    def from_natural(self, natural) -> Gaussian:
        return Gaussian(_solve(natural.precision, natural.linear), natural.precision)

    def expectation(self, q) -> tuple[Any, Any]:
        """``(m, m mᵀ + Σ)``: the second moment is a dense ``(d, d)`` matrix (not used by any operation)."""
        return q.mean, jnp.outer(q.mean, q.mean) + self.dense_covariance(q)

    def from_expectation(self, mu) -> Gaussian:
        """The member from ``(m, E[z zᵀ])`` (dense input): the projection of ``(E[zzᵀ] − mmᵀ)⁻¹``."""
        mean, second = mu
        return Gaussian(mean, self.project_curvature(jnp.linalg.inv(second - jnp.outer(mean, mean))))

    def log_prob(self, q, z) -> jax.Array:
        diag, factor = _split(q.precision)
        diff = z - q.mean
        quad = jnp.sum(diag * diff**2, -1) + jnp.sum((diff @ factor) ** 2, -1)
        return -0.5 * quad + 0.5 * _logdet(q.precision) - 0.5 * q.mean.shape[-1] * _LOG_2PI

    def entropy(self, q) -> jax.Array:
        return 0.5 * q.mean.shape[-1] * (1.0 + _LOG_2PI) - 0.5 * _logdet(q.precision)

    def kl(self, q, p) -> jax.Array:
        r"""``½[tr(S_p Σ_q) + Δᵀ S_p Δ − d + log|S_q| − log|S_p|]`` in ``O(d r²)``."""
        dq, _ = _split(q.precision)
        dp, up = _split(p.precision)
        wq = _cov_factor(q.precision)
        trace = (jnp.sum(dp / dq) - jnp.sum(dp * jnp.sum(wq**2, 1)) + jnp.sum(up**2 / dq[:, None])
                 - jnp.sum((wq.T @ up) ** 2))
        diff = p.mean - q.mean
        maha = diff @ _apply(p.precision, diff)
        return 0.5 * (trace + maha - q.mean.shape[-1] + _logdet(q.precision) - _logdet(p.precision))

    def draws(self, q, noise) -> jax.Array:
        diag, factor = _split(q.precision)
        root = jnp.sqrt(diag)
        basis, tri = jnp.linalg.qr(factor / root[:, None])
        left, sing, _ = jnp.linalg.svd(tri)
        vecs = basis @ left  # Û = vecs diag(sing) (...)ᵀ
        shrink = 1.0 / jnp.sqrt(1.0 + sing**2) - 1.0
        white = noise + ((noise @ vecs) * shrink) @ vecs.T  # (I + ÛÛᵀ)^{-1/2} ε, row-wise
        return q.mean + white / root

    def marginal_variance(self, q) -> jax.Array:
        diag, _ = _split(q.precision)
        return 1.0 / diag - jnp.sum(_cov_factor(q.precision) ** 2, 1)

    # --- site algebra ------------------------------------------------------------------------
    def site_natural(self, grad, curvature, ref_mean) -> GaussianNatural:
        return GaussianNatural(_apply(curvature, ref_mean) - grad, curvature)

    def dense_precision(self, q) -> jax.Array:
        """``diag(D) + UUᵀ`` as a dense ``(d, d)`` matrix (for small ``d``: inspection and files of other families)."""
        diag, factor = _split(q.precision)
        return jnp.diag(diag) + factor @ factor.T

    def dense_covariance(self, q) -> jax.Array:
        """``Σ`` as a dense ``(d, d)`` matrix (for small ``d``)."""
        diag, _ = _split(q.precision)
        w = _cov_factor(q.precision)
        return jnp.diag(1.0 / diag) - w @ w.T

    def project_curvature(self, dense) -> Any:
        if dense.ndim > 2:
            return jax.vmap(self.project_curvature)(dense)
        dim = dense.shape[-1]
        return project_operator(lambda v: dense @ v, jnp.diagonal(dense), self.rank, dim, dense.dtype)

    def project_diagonal(self, diag) -> jax.Array:
        """``[diag | 0]``: a diagonal is already in the format (``Π_r`` keeps a diagonal exactly)."""
        return _join(diag, jnp.zeros((diag.shape[0], self.rank), diag.dtype))

    def is_positive_definite(self, precision) -> jax.Array:
        diag, _ = _split(precision)
        return jnp.all(jnp.isfinite(precision)) & jnp.all(diag > 0)

    def check_dimension(self, dim) -> None:
        if self.rank > dim:
            raise InvalidOptionError(f"the lowrank family's rank ({self.rank}) exceeds the latent dimension ({dim}); "
                                     f"use rank <= {dim} (rank >= {dim - 1} already represents every precision)")

    # --- what the solver, sites and operations ask ----------------------------------------
    def curvature_sum(self, store, weights) -> jax.Array:
        return self.target_precision(store, weights)

    def target_precision(self, store, weights, prior_curvature=None, base=None) -> jax.Array:
        r"""``Π_r(Σ w_i Ĥ_i + Ĥ_0 + B)`` from products with the store, the prior curvature (dense, or
        its diagonal for a separable prior: then no ``d × d`` array) and ``B``."""
        op = _TargetOperator(store, weights, prior_curvature, base)
        diag = _target_diagonal(op)
        return project_operator(partial(_target_matmat, op), diag, self.rank, diag.shape[0], diag.dtype)

    def newton_operator(self, store, weights, prior_curvature=None, base=None) -> Any:
        """The unprojected target ``T`` as an operator (the mean's Newton preconditioner, see :meth:`fixed_point`)."""
        return _TargetOperator(store, weights, prior_curvature, base)

    def site_curvatures(self, store) -> Any:
        """Per-example site precisions, each projected (materialises each ``Ĥ_i``: small ``d`` only)."""
        return self.project_curvature(store.dense())

    def precision_residual(self, precision, target) -> jax.Array:
        """``‖S − T‖_F / ‖S‖_F`` in ``O(d r²)``, accurate to rounding (see :func:`_diff_fro2`)."""
        return jnp.sqrt(_diff_fro2(precision, target) / _fro_inner(precision, precision))

    def fixed_point(self, q, target, dense) -> tuple[Any, tuple[Any, Any]]:
        r"""``(Π_r(T), (Π_r(T), T))``: the mean takes the Newton step ``T⁻¹ Σ ĝ_i`` on ``E_q[Σ ℓ_i]``.

        ``dense`` is the unprojected ``T`` as an operator (:meth:`newton_operator`); without it
        (``None``) the mean is preconditioned with ``S = Π_r(T)``, which stalls the solver where
        ``S⁻¹T`` is far from the identity (see the module docstring). The Newton step is what the
        diagonal family takes; the fixed point (``Σ ĝ_i = 0``, ``S = Π_r(T)``) is the same.
        """
        return target, (target, dense if isinstance(dense, _TargetOperator) else None)

    def precondition(self, pre, grad) -> jax.Array:
        r"""``T⁻¹ grad`` by conjugate gradients preconditioned with ``S⁻¹`` (Woodbury), ``S = Π_r(T)``.

        ``pre`` is ``(S, T)`` from :meth:`fixed_point` (``T`` as an operator), or ``S`` alone
        (then ``S⁻¹ grad``). CG stops at relative residual ``√eps``; where ``T`` is not positive
        definite (a non-log-concave model far from its mode) it falls back to ``S⁻¹ grad``.
        """
        if isinstance(pre, tuple):
            precision, operator = pre
            return _solve(precision, grad) if operator is None else _newton_solve(precision, operator, grad)
        return _solve(pre, grad)

    def inner_preconditioner(self, pre) -> Callable[[jax.Array], jax.Array]:
        """``v ↦ S⁻¹ v`` by Woodbury (``O(d r)``), ``S = Π_r(T)``. Not :meth:`precondition`'s ``T⁻¹``:
        inside an iterative solve that would be a CG solve at every step (nested CG; the digits
        network's low-rank fit spent over 20 minutes in it)."""
        precision = pre[0] if isinstance(pre, tuple) else pre
        return lambda v: _solve(precision, v)

    def traced_precondition(self, pre, grad) -> jax.Array:
        return self.precondition(pre, grad)  # CG and Woodbury solves: traceable as they are

    def blend(self, current, target, rho) -> Any:
        if not isinstance(rho, jax.core.Tracer) and rho == 1.0:
            return target
        dc, uc = _split(current)
        dt, ut = _split(target)
        stacked = jnp.concatenate([jnp.sqrt(1.0 - rho) * uc, jnp.sqrt(rho) * ut], 1)
        return _compress((1.0 - rho) * dc + rho * dt, stacked, self.rank)

    def arithmetic(self, base, naturals, alphas) -> GaussianNatural:
        r"""``λ_base + Σ_k α_k (λ_k − λ_base)`` in the family.

        The combination ``Σ_k c_k S_k = diag(Σ c_k D_k) + V diag(±1) Vᵀ`` (``V`` the stacked
        ``√|c_k| U_k``) is formed exactly; its mean ``(Σ c_k S_k)⁻¹ Σ c_k S_k m_k`` is solved by
        Woodbury with the signed core, and its precision is ``Π_r`` of the combination.
        """
        coefficients = [1.0 - sum(alphas)] + list(alphas)
        terms = [(c, n) for c, n in zip(coefficients, [base] + list(naturals)) if c != 0.0]
        linear = sum(c * n.linear for c, n in terms)
        diag = sum(c * _split(n.precision)[0] for c, n in terms)
        stacked = jnp.concatenate([math.sqrt(abs(c)) * _split(n.precision)[1] for c, n in terms], 1)
        signs = jnp.concatenate([jnp.full(self.rank, 1.0 if c > 0 else -1.0, linear.dtype) for c, _ in terms])
        scaled = stacked / diag[:, None]
        core = jnp.diag(signs) + stacked.T @ scaled  # C⁻¹ + Vᵀ D⁻¹ V with C = diag(signs)
        mean = linear / diag - scaled @ jnp.linalg.solve(core, scaled.T @ linear)
        matmat = lambda v: diag[:, None] * v + stacked @ (signs[:, None] * (stacked.T @ v))  # noqa: E731
        total_diag = diag + jnp.sum(signs * stacked**2, 1)
        precision = project_operator(matmat, total_diag, self.rank, linear.shape[0], linear.dtype)
        return GaussianNatural(_apply(precision, mean), precision)

    def trace_with_covariance(self, q, precision) -> jax.Array:
        r"""``tr(B Σ_q)`` for ``B`` in the family's format, ``O(d r²)``."""
        db, ub = _split(precision)
        dq, _ = _split(q.precision)
        wq = _cov_factor(q.precision)
        return (jnp.sum(db / dq) - jnp.sum(db * jnp.sum(wq**2, 1)) + jnp.sum(ub**2 / dq[:, None])
                - jnp.sum((wq.T @ ub) ** 2))

    def trace_dense_with_covariance(self, q, dense) -> jax.Array:
        wq = _cov_factor(q.precision)
        dq, _ = _split(q.precision)
        return jnp.sum(jnp.diagonal(dense) / dq) - jnp.sum(wq * (dense @ wq))

    def relative_eigenvalues(self, q, curvature) -> jax.Array:
        raise UnsupportedModelError("the lowrank family's precision is not a sum of site precisions; "
                                    "removing sites from it is not defined (use method='corrected' or 'retrain')")

    def covariance_operand(self, q) -> jax.Array:
        return _cov_factor(q.precision)

    def quad_form_cov(self, q, cov, a) -> jax.Array:
        diag, _ = _split(q.precision)
        return jnp.sum(a**2 / diag) - jnp.sum((a @ cov) ** 2)

    def cov_times(self, q, cov, mat) -> jax.Array:
        diag, _ = _split(q.precision)
        return mat / diag[:, None] - cov @ (cov.T @ mat)

    def precision_shape(self, dim) -> tuple[Any, Any]:
        return (dim, self.rank + 1)

    def noisy_precision(self, precision, key, scale) -> jax.Array:
        """Noise of sd ``scale`` on ``D`` (kept ``≥ 0``) and on every entry of ``U`` (``UUᵀ`` stays PSD)."""
        noise = scale * jax.random.normal(key, precision.shape, precision.dtype)
        diag, factor = _split(precision + noise)
        return _join(jnp.maximum(diag, 0.0), factor)

    def saved_precision_problem(self, precision) -> str | None:
        """``None`` when every ``D_j > 0`` and every entry is finite (then ``S`` is positive definite)."""
        p = np.asarray(precision, np.float64)
        return None if np.all(np.isfinite(p)) and np.all(p[:, 0] > 0) else "indefinite"

    def precision_spectrum(self, precision) -> tuple[bool, np.ndarray]:
        """``(True, sorted D)``: ``λ_min(S) ≥ min D``, so positive ``D`` certifies a positive definite ``S``."""
        return True, np.sort(np.asarray(precision)[:, 0])


def _build(rank=None) -> LowRankGaussian:
    if rank is None:
        raise InvalidOptionError("the lowrank family needs a rank: family='lowrank', rank=r (or the name 'lowrank-r')")
    return LowRankGaussian(rank=rank)


def _parse(suffix) -> dict[str, int]:
    if not suffix.isdigit():
        raise InvalidOptionError(f"a lowrank family's name is 'lowrank-r' with an integer r, got 'lowrank-{suffix}'")
    return {"rank": int(suffix)}


register_family_factory("lowrank", _build, _parse)
