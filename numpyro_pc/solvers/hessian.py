r"""The negative log joint's curvature for the starts of :mod:`numpyro_pc.solvers.start`: dense where the
family's own precision is a matrix, matrix-free (Hessian–vector products, one site pass) for every other.

* :func:`lowest_curvature`: the saddle test's ``(λ_min, v_min, max |λ|)``, dense (``eigh``) or by Lanczos
  (ARPACK) on Hessian–vector products;
* :func:`laplace_precision`: the Laplace precision in the family's format from one delta-rule site pass
  (``diag H`` for the diagonal family, ``Π_r(H)`` for the low-rank family), never a ``(d, d)`` array where the
  family's sites are matrix-free;
* :func:`newton_cg_polish`: Newton steps solved by conjugate gradients on Hessian–vector products.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse.linalg

from numpyro_pc.families.registry import Gaussian
from numpyro_pc.model.likelihood import example_loss, prior_loss
from numpyro_pc.sites.expectations import get_rule
from numpyro_pc.sites.gaussian import compute_sites
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

__all__ = ["negative_log_joint", "value_and_grad", "hessian", "hvp", "positive_part", "dense_lowest",
           "lowest_curvature", "laplace_precision", "newton_cg_polish", "DENSE_CURVATURE"]

_HVP_BATCH = 8  # Hessian columns computed together (bounds transient memory to 8 gradient passes)
DENSE_CURVATURE = 2048  # above this dimension even the full family's start tests for a saddle matrix-free
_NEWTON_STEPS = 5  # Newton steps that polish a minimum L-BFGS left short of its gradient tolerance
_CG_ITERS = 200  # Hessian–vector products per Newton–CG polishing step


def negative_log_joint(spec, z, data, weights) -> jax.Array:
    """``ℓ_0(z) + Σ_i w_i ℓ_i(z)`` over the bound (possibly bucket-padded) data."""
    per = jax.vmap(lambda ex: example_loss(spec, z, ex, data.shared))(data.per_example)
    return prior_loss(spec, z, data) + weights @ per


@partial(jax.jit, static_argnames=("spec",))
def value_and_grad(spec, z, data, weights) -> tuple[jax.Array, jax.Array]:
    return jax.value_and_grad(lambda zz: negative_log_joint(spec, zz, data, weights))(z)


@partial(jax.jit, static_argnames=("spec",))
def hessian(spec, z, data, weights) -> jax.Array:
    grad = jax.grad(lambda zz: negative_log_joint(spec, zz, data, weights))
    columns = jax.lax.map(lambda v: jax.jvp(grad, (z,), (v,))[1], jnp.eye(z.shape[0], dtype=z.dtype),
                          batch_size=_HVP_BATCH)
    return 0.5 * (columns + columns.T)


def positive_part(hess, floor_ratio) -> jax.Array:
    """``|H|`` with eigenvalues floored at ``floor_ratio · max |λ|`` (a positive-definite matrix)."""
    vals, vecs = jnp.linalg.eigh(hess)
    mags = jnp.abs(vals)
    floor = floor_ratio * jnp.maximum(jnp.max(mags), jnp.finfo(hess.dtype).tiny)
    return (vecs * jnp.maximum(mags, floor)) @ vecs.T


def dense_lowest(hess) -> tuple[float, Any, float]:
    """``(λ_min, its unit eigenvector, max |λ|)`` of a dense symmetric Hessian."""
    vals, vecs = np.linalg.eigh(np.asarray(hess, dtype=np.float64))
    return float(vals[0]), vecs[:, 0], float(np.max(np.abs(vals)))


@partial(jax.jit, static_argnames=("spec",))
def hvp(spec, z, data, weights, vector) -> jax.Array:
    grad = jax.grad(lambda zz: negative_log_joint(spec, zz, data, weights))
    return jax.jvp(grad, (z,), (vector,))[1]


def host_hvp(spec, z, data, weights) -> Callable[[np.ndarray], np.ndarray]:
    """``v ↦ H(z) v`` in float64 NumPy (one compiled Hessian–vector product)."""
    return lambda v: np.asarray(hvp(spec, z, data, weights, jnp.asarray(np.ravel(v), z.dtype)), np.float64)


def lowest_curvature(spec, z, data, weights, dense=True) -> tuple[float, Any, float] | None:
    """``(λ_min, its unit eigenvector, max |λ|)`` of the Hessian of the negative log joint at ``z``.

    Dense when ``dense`` and up to ``DENSE_CURVATURE`` latents (:func:`_dense_curvature`); else Lanczos
    (ARPACK) on Hessian–vector products: ``max |λ|`` first, then the largest-magnitude eigenvalue of
    ``H − max|λ| I``, which is ``λ_min − max|λ|``. No ``d × d`` array. ``None`` when Lanczos does not converge.
    """
    d = z.shape[0]
    if dense and d <= DENSE_CURVATURE:
        return dense_lowest(hessian(spec, z, data, weights))

    matvec = host_hvp(spec, z, data, weights)
    op = scipy.sparse.linalg.LinearOperator((d, d), matvec=matvec, dtype=np.float64)
    try:
        scale = float(abs(scipy.sparse.linalg.eigsh(op, k=1, which="LM", tol=1e-4, maxiter=500,
                                                    return_eigenvectors=False)[0]))
        shifted = scipy.sparse.linalg.LinearOperator((d, d), matvec=lambda v: matvec(v) - scale * np.ravel(v),
                                                     dtype=np.float64)
        vals, vecs = scipy.sparse.linalg.eigsh(shifted, k=1, which="LM", tol=1e-4, maxiter=500)
    except (scipy.sparse.linalg.ArpackNoConvergence, ValueError):  # ValueError: ARPACK saw a non-finite product
        return None
    if not np.all(np.isfinite(vals)):
        return None
    return float(vals[0]) + scale, vecs[:, 0], scale


def laplace_precision(spec, data, family, z, weights, curvature="hessian") -> Any:
    """``Π(∇²(ℓ_0 + Σ_i w_i ℓ_i)(z))`` in the family's format from one delta-rule site pass (matrix-free where
    the family's sites are), floored like :func:`positive_part`; ``None`` when it is not finite. With
    ``curvature="ggn"`` the examples' Hessians are their Gauss–Newton parts (the fit's own fixed point)."""
    rule = get_rule("delta")
    q = Gaussian(z, family.project_diagonal(jnp.ones_like(z)))
    sites, _ = compute_sites(spec, data, family, q, rule, curvature=curvature or "hessian", weights=weights)
    precision = _target_precision(family, sites.curv, weights, sites.prior_curvature)
    if not bool(jnp.all(jnp.isfinite(precision))):
        return None
    return floored(family, precision, 1e-8 if z.dtype == jnp.float64 else 1e-5)


@partial(jax.jit, static_argnums=0)
def _target_precision(family, store, weights, prior_curvature) -> Any:
    """The family's target precision in one compiled program (op by op, a sparse store's products would
    gather ``(N, s, p)`` rows at once)."""
    return family.target_precision(store, weights, prior_curvature)


def floored(family, precision, ratio) -> Any:
    """The precision with its diagonal part floored at ``ratio · max`` (a flat direction of the Hessian at the
    MAP: :func:`positive_part`'s floor for a family whose precision is a diagonal ``(d,)`` or ``[D | U]``)."""
    if bool(family.is_positive_definite(precision)):
        return precision
    diag = precision if precision.ndim == 1 else precision[:, 0]
    floor = ratio * jnp.maximum(jnp.max(jnp.abs(diag)), jnp.finfo(diag.dtype).tiny)
    floored = jnp.maximum(jnp.abs(diag), floor)
    return floored if precision.ndim == 1 else precision.at[:, 0].set(floored)


def newton_step_improves(value, grad_norm, trial_value, trial_grad_norm) -> bool:
    """Whether a Newton step of a MAP polish is taken: a finite value no higher than ``value`` (up to
    rounding) and a smaller gradient norm (a NaN trial is never taken)."""
    slack = 1e3 * np.finfo(np.float64).eps * (1.0 + abs(value))
    return bool(np.isfinite(trial_value) and trial_grad_norm < grad_norm and trial_value <= value + slack)


def newton_cg_polish(spec, z, value, grad, data, weights, gtol) -> tuple[Any, float, Any, bool, int]:
    """:func:`_newton_polish` without the Hessian: each step solves ``H s = ∇`` by conjugate gradients on
    Hessian–vector products (SciPy's ``cg``, at most ``_CG_ITERS`` products), accepted on the same terms."""
    steps, grad_norm = 0, float(jnp.max(jnp.abs(grad)))
    d = z.shape[0]
    for _ in range(_NEWTON_STEPS):
        op = scipy.sparse.linalg.LinearOperator((d, d), matvec=host_hvp(spec, z, data, weights), dtype=np.float64)
        step, info = scipy.sparse.linalg.cg(op, np.asarray(grad, np.float64), maxiter=_CG_ITERS)
        if info < 0 or not np.all(np.isfinite(step)):
            break
        trial = z - jnp.asarray(step, z.dtype)
        t_value, t_grad = value_and_grad(spec, trial, data, weights)
        t_value, t_norm = float(t_value), float(jnp.max(jnp.abs(t_grad)))
        if not newton_step_improves(value, grad_norm, t_value, t_norm):
            break
        z, value, grad, grad_norm, steps = trial, t_value, t_grad, t_norm, steps + 1
        if grad_norm <= 10 * gtol * (1.0 + abs(value)):
            return z, value, grad, True, steps
    return z, value, grad, False, steps
