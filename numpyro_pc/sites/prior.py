r"""The prior site ``(ĝ_0, Ĥ_0)`` and the reparameterisation estimator of a site's precision.

The prior's curvature ``Ĥ_0 = E_q[∇²ℓ_0]`` is held in one of two forms (``Sites.prior_curvature``):

* a dense ``(d, d)`` matrix — the general case;
* its diagonal ``(d,)`` — when the family keeps its sites matrix-free
  (:class:`~numpyro_pc.protocols.capabilities.SiteCurvature` ``matrix_free``, the low-rank family) and the
  prior is separable (:func:`~numpyro_pc.sites.expectations.prior_is_separable`, a matrix-free
  probe). Then ``diag Ĥ_0`` is one Hessian-vector product with ``1`` per point
  (``H 1 = diag H`` for a diagonal ``H``), and no ``d × d`` array is formed: at
  ``d = 100,000`` the dense form alone is 40 GB in float32.

Consumers go through :func:`prior_matvec`, :func:`prior_diagonal` and :func:`prior_dense`
(the last materialises the matrix: small ``d`` only), so both forms mean the same site.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.model.likelihood import prior_loss

from .expectations import hermite_nodes
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["prior_terms", "prior_terms_reparam", "reparam_curvature", "prior_matvec", "prior_diagonal",
           "prior_dense", "prior_diagonal_at"]


def prior_matvec(curvature, v) -> jax.Array:
    """``Ĥ_0 v`` for ``v`` of shape ``(d,)`` or ``(d, p)``, whichever form ``Ĥ_0`` is held in."""
    if curvature.ndim == 1:
        return (curvature if v.ndim == 1 else curvature[:, None]) * v
    return curvature @ v


def prior_diagonal(curvature) -> jax.Array:
    """``diag Ĥ_0`` ``(d,)``."""
    return curvature if curvature.ndim == 1 else jnp.diagonal(curvature)


def prior_dense(curvature) -> jax.Array:
    """``Ĥ_0`` as a dense ``(d, d)`` matrix (materialised from the diagonal form: small ``d`` only)."""
    return jnp.diag(curvature) if curvature.ndim == 1 else curvature


def _hvp_ones(f, z) -> jax.Array:
    """``∇²f(z) 1``: the Hessian's diagonal when ``f`` is separable (one forward-over-reverse product)."""
    return jax.jvp(jax.grad(f), (z,), (jnp.ones_like(z),))[1]


def prior_diagonal_at(spec, data, z) -> jax.Array:
    """``diag ∇²ℓ_0(z)`` of a separable prior, matrix-free (the start of a family with matrix-free sites)."""
    return _hvp_ones(lambda zz: prior_loss(spec, zz, data), z)


def reparam_curvature(chol, cross) -> jax.Array:
    r"""Site precision ``Ĥ = 2 ∂E_K[ℓ]/∂Σ`` from ``G = (1/K) Σ_s ∇ℓ(z_s) ε_sᵀ``.

    With ``z_s = m + Cε_s``, ``C = L⁻ᵀ`` and ``S = LLᵀ``, the chain rule through the
    Cholesky factor gives

    .. math::

        \hat H = L \, \mathrm{sym}_\downarrow(Gᵀ L^{-ᵀ}) \, Lᵀ,

    where ``sym↓(M)`` keeps the strict lower triangle of ``M``, mirrors it above the
    diagonal, and keeps the diagonal. For a quadratic ``ℓ = ½zᵀAz`` and ``E[G] = AC`` this
    is ``A``: the estimator is unbiased for ``E_q[∇²ℓ]`` and is the exact derivative of the
    fixed-draw expectation, so ``S = Σ_i Ĥ_i`` holds exactly at a stationary point of the
    fixed-draw variational objective.
    """
    m = jax.scipy.linalg.solve_triangular(chol, cross, lower=True).T  # Gᵀ L⁻ᵀ
    low = jnp.tril(m, -1)
    sym = low + low.T + jnp.diag(jnp.diagonal(m))
    return chol @ sym @ chol.T


def prior_terms_reparam(spec, chol, data, draws, eps) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The prior site under the reparameterisation estimator, with the examples' draws."""
    losses, grads = jax.lax.map(jax.value_and_grad(lambda zz: prior_loss(spec, zz, data)), draws, batch_size=8)
    cross = grads.T @ eps / eps.shape[0]  # (1/K) Σ_s ∇ℓ_0(z_s) ε_sᵀ without a (K, d, d) stack
    return jnp.mean(losses), jnp.mean(grads, 0), reparam_curvature(chol, cross)


def prior_terms(spec, rule, family, q, data, extra, diagonal=False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(E_q[ℓ_0], ĝ_0, Ĥ_0)`` of the prior under ``rule``; ``Ĥ_0`` is its diagonal ``(d,)`` when
    ``diagonal`` (allowed only for a separable prior), else a dense ``(d, d)`` matrix."""
    f = lambda z: prior_loss(spec, z, data)  # noqa: E731
    curv = (lambda z: _hvp_ones(f, z)) if diagonal else jax.hessian(f)
    vgh = lambda z: (*jax.value_and_grad(f)(z), curv(z))  # noqa: E731
    if rule.kind == "delta":
        return vgh(q.mean)
    if rule.kind == "mc":
        vals = jax.lax.map(vgh, extra, batch_size=8)
        return jax.tree.map(lambda x: jnp.mean(x, 0), vals)
    if rule.prior_mode == "quadratic":
        loss, grad, hess = vgh(q.mean)
        return loss + 0.5 * family.trace_dense_with_covariance(q, prior_dense(hess)), grad, hess
    if rule.prior_mode == "qmc":
        # the reparameterisation estimator on the fixed points: Ĥ_0 is the exact derivative of the
        # fixed-point expectation, so the fixed point is a stationary point of the objective the
        # solver's descent test measures (Price's average Hessian is not, and on a funnel prior the
        # two disagree: eight schools stalled at residual 2e-2 with every step raising the objective)
        chol = jnp.linalg.cholesky(family.dense_precision(q))
        eps = _sobol_normals(rule.num_prior_points, q.mean.shape[0], rule.seed, q.mean.dtype)
        points = q.mean[None, :] + jax.scipy.linalg.solve_triangular(chol.T, eps.T, lower=False).T
        return prior_terms_reparam(spec, chol, data, points, eps)
    nodes, node_w = extra[:2] if rule.subspace_dim == 0 else hermite_nodes(rule.num_nodes, q.mean.dtype)
    std = jnp.sqrt(family.marginal_variance(q))

    def vgd(z) -> tuple[Any, Any, Any]:  # separable prior: its Hessian is diagonal, so diag H = H·1 (one product, no d × d per node)
        value, grad = jax.value_and_grad(f)(z)
        return value, grad, _hvp_ones(f, z)

    vals = jax.lax.map(lambda xi: vgd(q.mean + std * xi), nodes, batch_size=8)
    loss = jnp.dot(node_w, vals[0])
    grad = node_w @ vals[1]
    diag = node_w @ vals[2]
    return loss, grad, diag if diagonal else jnp.diag(diag)


def _sobol_normals(num, dim, seed, dtype) -> jax.Array:
    """``num`` scrambled Sobol points mapped to standard normals (a constant of the compiled program)."""
    from scipy.special import ndtri
    from scipy.stats import qmc

    power = int(np.ceil(np.log2(max(num, 2))))
    unit = qmc.Sobol(dim, scramble=True, seed=seed).random_base2(power)[:num]
    return jnp.asarray(ndtri(np.clip(unit, 1e-12, 1 - 1e-12)), dtype)
