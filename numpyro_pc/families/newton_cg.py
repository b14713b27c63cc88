r"""The Newton step of the diagonal and isotropic families without a ``(d, d)`` matrix.

Below :data:`~numpyro_pc.protocols.capabilities.MATRIX_FREE_DIM` latents these families precondition the
mean's step with the dense curvature sum ``T = Σ_i w_i Ĥ_i + Ĥ_0 (+ B)`` (a Newton step on
``E_q[Σ ℓ_i]``, paper App. A.3) by Cholesky. Above it their sites are matrix-free
(:func:`~numpyro_pc.protocols.capabilities.matrix_free_sites`: Jacobian factors, a diagonal prior site), and
the same step ``T⁻¹ g`` is solved by conjugate gradients on the store's products ``T v``
(:meth:`~numpyro_pc.curvature.stores.CurvatureStore.weighted_matmat`), preconditioned by ``diag T``:
``O(N·k·s)`` per product and no ``(d, d)`` array. The fixed point (``Σ ĝ_i = 0``, ``S = diag T`` or
``S = τ``) does not depend on the preconditioner; the step is the same Newton step to CG's tolerance.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["DiagonalNewton", "newton_matvec", "newton_diagonal", "newton_cg"]


class DiagonalNewton(NamedTuple):
    """``T = Σ_i w_i Ĥ_i + Ĥ_0 + B`` as an operator: the store, weights, the prior curvature (dense
    ``(d, d)`` or its diagonal ``(d,)``) and ``B`` (a diagonal ``(d,)`` or a scalar times ``I``), or ``None``."""

    store: object
    weights: object
    prior_curvature: object = None
    base: object = None


def newton_matvec(op, v) -> jax.Array:
    """``T v`` for ``v`` of shape ``(d,)``."""
    out = op.store.weighted_matmat(op.weights, v[:, None])[:, 0]
    if op.prior_curvature is not None:
        prior = op.prior_curvature
        out = out + (prior * v if prior.ndim == 1 else prior @ v)
    if op.base is not None:
        out = out + op.base * v
    return out


def newton_diagonal(op) -> jax.Array:
    """``diag T``, ``(d,)``."""
    diag = op.store.weighted_diagonal(op.weights)
    if op.prior_curvature is not None:
        prior = op.prior_curvature
        diag = diag + (prior if prior.ndim == 1 else jnp.diagonal(prior))
    if op.base is not None:
        diag = diag + op.base
    return diag


@jax.jit
def newton_cg(op, b) -> jax.Array:
    r"""``T⁻¹ b`` by conjugate gradients preconditioned with ``diag T``.

    Stops at ``‖T x − b‖ ≤ √eps ‖b‖`` or after ``d`` iterations. Where a curvature ``pᵀ T p ≤ 0``
    shows ``T`` is not positive definite (a non-log-concave model far from its mode), or the
    result is not finite, it returns the diagonally preconditioned ``b / diag T``.
    """
    diag = newton_diagonal(op)
    inv = jnp.where(diag > 0, 1.0 / jnp.where(diag > 0, diag, 1.0), 0.0)
    fallback = inv * b
    goal = jnp.sqrt(jnp.finfo(b.dtype).eps) * jnp.linalg.norm(b)

    def cond(state) -> Any:
        _, resid, _, _, _, k, ok = state
        return ok & (k < b.shape[0]) & (jnp.linalg.norm(resid) > goal)

    def body(state) -> tuple[Any, ...]:
        x, resid, _, p, rz, k, ok = state
        tp = newton_matvec(op, p)
        curv = p @ tp
        ok = ok & (curv > 0)
        alpha = jnp.where(ok, rz / jnp.where(ok, curv, 1.0), 0.0)
        x, resid = x + alpha * p, resid - alpha * tp
        z_new = inv * resid
        rz_new = resid @ z_new
        p = z_new + (rz_new / jnp.where(rz == 0, 1.0, rz)) * p
        return x, resid, z_new, p, rz_new, k + 1, ok

    resid0 = b - newton_matvec(op, fallback)
    z0 = inv * resid0
    x, _, _, _, _, _, ok = jax.lax.while_loop(
        cond, body, (fallback, resid0, z0, z0, resid0 @ z0, jnp.asarray(0), jnp.all(diag > 0)))
    return jnp.where(ok & jnp.all(jnp.isfinite(x)), x, fallback)
