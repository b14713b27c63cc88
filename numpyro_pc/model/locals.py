r"""Local latent variables: integrated per example by a Laplace approximation (nested Laplace).

A model whose data plate also carries latent sites — one ability per player, one effect
per school — has *local* latents ``u_i`` beside the global ``z``. The example is the unit
of the plate, and its loss is the negative log marginal likelihood of the unit, with the
unit's local latents integrated out under their own Gaussian factor (docs/hierarchical.md,
"Local latent variables"):

.. math::

    \ell_i(z) = -\log \int p(y_i \mid z, u)\, p(u \mid z)\, du
    \approx f_i(z, u^*_i) + \tfrac12 \log\det H_i(z) - \tfrac{m}{2}\log 2\pi,

with ``f_i(z, u) = -\log p(y_i \mid z, u) - \log p(u \mid z)`` in the unconstrained
coordinates of the local sites (log-Jacobian included), ``u^*_i(z) = \arg\min_u f_i(z, u)``
and ``H_i = ∇²_u f_i(z, u^*_i)``: Laplace's approximation of the marginal, exact when
``u ↦ f_i(z, u)`` is quadratic (a Gaussian local effect with a Gaussian likelihood), and
the local factor ``q(u_i | z) = N(u^*_i(z), H_i^{-1})`` is what :func:`conditional_draw`
samples. Every other part of the package — sites, updates, deletions, LOO by unit — sees
``ℓ_i(z)`` as the loss of a model with global latents only, so the dimension of the
posterior does not grow with the number of units.

**Derivatives.** The sites need ``∇ℓ_i`` and ``∇²ℓ_i`` in ``z``. The mode is found by a
damped Newton iteration whose result is treated as a constant (``stop_gradient``); two
plain Newton steps from it are then differentiated. One step from the exact mode gives
``u^*``'s first derivative in ``z`` (the implicit-function theorem's
``-H^{-1} ∂_u∂_z f``), and the second step makes the error vanish to fourth order, so
the first and second derivatives of ``ℓ_i`` are exact (to the mode's rounding) — without
differentiating through the search.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from .latent import LatentSpace

__all__ = ["SEARCH_STEPS", "conditional_mode", "laplace_marginal", "conditional_draw", "stack_rows",
           "mode_tolerance"]

SEARCH_STEPS = 15
"""Damped Newton steps of the search for ``u^*`` (converged in a handful on log-concave units)."""

_STEP_SIZES = (1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125, 0.0078125, 0.0)  # backtracking candidates; 0 keeps the iterate


def mode_tolerance(dtype) -> float:
    """Largest Newton decrement ``½ ∇_u f_iᵀ H_i^{-1} ∇_u f_i`` (what another Newton step would
    still gain, in units of ``f_i``) at which a point counts as the mode."""
    return 1e-10 if jnp.dtype(dtype) == jnp.float64 else 1e-4


def _search_step(f, u) -> jax.Array:
    """One damped Newton step on ``f``: the Hessian's eigenvalues taken in absolute value (so
    that a step from a region of negative curvature still descends); the full step where the
    Newton decrement is below ``1/4`` (the region of quadratic convergence, where comparing
    values would only compare rounding), else the best of a few step sizes along it, ``0``
    included, so that the objective never increases."""
    g = jax.grad(f)(u)
    h = jax.hessian(f)(u)
    vals, vecs = jnp.linalg.eigh(0.5 * (h + h.T))
    floor = 1e-8 * jnp.maximum(1.0, jnp.max(jnp.abs(vals)))
    direction = -vecs @ ((vecs.T @ g) / jnp.maximum(jnp.abs(vals), floor))
    sizes = jnp.asarray(_STEP_SIZES, u.dtype)
    values = jax.vmap(lambda t: f(u + t * direction))(sizes)
    values = jnp.where(jnp.isfinite(values), values, jnp.inf)
    local = -0.5 * jnp.dot(g, direction) < 0.25
    return u + jnp.where(local, 1.0, sizes[jnp.argmin(values)]) * direction


def _newton(f, u) -> jax.Array:
    g = jax.grad(f)(u)
    h = jax.hessian(f)(u)
    return u - jnp.linalg.solve(0.5 * (h + h.T), g)


def _is_mode(f, u, dtype) -> tuple[jax.Array, jax.Array]:
    """``(chol, ok)``: the Cholesky factor of ``∇²f(u)`` and whether ``u`` is a mode (a factor
    exists and the Newton decrement is below :func:`mode_tolerance`; ``False`` for NaN)."""
    value, grad = jax.value_and_grad(f)(u)
    hess = jax.hessian(f)(u)
    chol = jnp.linalg.cholesky(0.5 * (hess + hess.T))
    decrement = 0.5 * jnp.dot(grad, jax.scipy.linalg.cho_solve((chol, True), grad))
    return chol, (decrement <= mode_tolerance(dtype)) & jnp.isfinite(value)


def conditional_mode(f: Callable, num_local: int, dtype) -> tuple[jax.Array, jax.Array]:
    """``(u*, converged)``: the minimiser of ``f`` over ``R^m``, by :data:`SEARCH_STEPS` damped
    Newton steps from ``0`` and one plain step, and whether it is a mode (:func:`_is_mode`)."""
    u = jax.lax.fori_loop(0, SEARCH_STEPS, lambda _, v: _search_step(f, v), jnp.zeros((num_local,), dtype))
    u = _newton(f, u)
    return u, _is_mode(f, u, dtype)[1]


def laplace_marginal(joint: Callable, z: jax.Array, num_local: int) -> jax.Array:
    """``ℓ_i(z)`` of the module docstring for ``joint(z, u) = f_i(z, u)``; NaN where the
    conditional mode is not found or its Hessian is not positive definite (callers refuse
    non-finite losses)."""
    mode, _ = conditional_mode(lambda u: joint(jax.lax.stop_gradient(z), u), num_local, z.dtype)
    mode = jax.lax.stop_gradient(mode)
    f = lambda u: joint(z, u)  # noqa: E731
    u = _newton(f, _newton(f, mode))
    chol, converged = _is_mode(f, u, z.dtype)
    value = f(u) + jnp.sum(jnp.log(jnp.diagonal(chol))) - 0.5 * num_local * math.log(2 * math.pi)
    return jnp.where(jax.lax.stop_gradient(converged), value, jnp.nan)


def conditional_draw(f: Callable, num_local: int, key: jax.Array, dtype) -> jax.Array:
    """One draw of ``u ~ N(u*, H^{-1})``, the local factor given fixed globals (``f(u) = f_i(z, u)``);
    NaN where the mode is not found."""
    mode, _ = conditional_mode(f, num_local, dtype)
    chol, converged = _is_mode(f, mode, dtype)
    eps = jax.random.normal(key, (num_local,), dtype)
    draw = mode + jax.scipy.linalg.solve_triangular(chol.T, eps, lower=False)
    return jnp.where(converged, draw, jnp.nan)


def stack_rows(space: LatentSpace, axes: tuple, rows: jax.Array, shapes: tuple | None = None) -> dict[str, jax.Array]:
    """Per-row values of the local sites ``(N, m)`` (or a dict of ``(N, *shape)`` arrays with
    the plate axis of size one) as each site's value over the whole plate: row ``i`` goes to
    index ``i`` of the site's plate axis ``axes[j]``, as NumPyro lays out a site in a plate."""
    values = space.unravel(rows) if not isinstance(rows, dict) else rows
    shapes = space.unconstrained_shapes if shapes is None else shapes
    out = {}
    for name, shape, axis in zip(space.names, shapes, axes):
        per_row = jnp.reshape(values[name], (-1,) + tuple(shape))
        out[name] = jnp.moveaxis(jnp.squeeze(per_row, axis + 1), 0, axis)
    return out
