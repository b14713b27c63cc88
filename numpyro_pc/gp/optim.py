"""Optimisers for the per-batch objective: L-BFGS (default) and Adam, both fully traced.

Both work on any pytree of unconstrained float arrays and are meant to be called inside
a jitted function, so one compilation serves every batch of the same (bucketed) shape.
L-BFGS runs in a ``lax.while_loop`` (optax ``lbfgs`` with a zoom line search) and stops at
``max_iters``, when the gradient norm falls below ``gtol``, or when one iteration lowers
the objective by less than ``ftol · max(1, |f|)`` (the relative-reduction test of
L-BFGS-B, whose default ``factr = 1e7`` is ``ftol ≈ 2.2e-9``); Adam runs a ``lax.scan`` of
``max_iters`` steps. Non-finite objective values never leak out: the last finite
iterate is returned and the caller checks the final value.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from ..errors import InvalidOptionError

__all__ = ["OptimResult", "minimize"]


class OptimResult(NamedTuple):
    """Result of :func:`minimize`: final parameters, objective value and iterations run."""

    params: object
    value: jnp.ndarray
    iterations: jnp.ndarray


def _finite_tree(tree):
    leaves = jax.tree.leaves(tree)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.array(True)


def minimize(fun, params, method="lbfgs", max_iters=200, learning_rate=0.01, gtol=1e-6, ftol=0.0):
    """Minimise ``fun(params)`` (traced; no Python loop over iterations).

    :param callable fun: scalar objective of a pytree of float arrays.
    :param params: initial pytree (the warm start).
    :param str method: ``"lbfgs"`` or ``"adam"``.
    :param int max_iters: iteration cap (L-BFGS) or number of steps (Adam).
    :param float learning_rate: Adam step size (ignored by L-BFGS).
    :param float gtol: L-BFGS stops when the gradient's L2 norm is below this.
    :param float ftol: L-BFGS stops when an iteration's relative reduction of ``fun`` is below this (0: off).
    :return: :class:`OptimResult`.
    """
    if method == "lbfgs":
        return _lbfgs(fun, params, max_iters, gtol, ftol)
    if method == "adam":
        return _adam(fun, params, max_iters, learning_rate)
    raise InvalidOptionError(f"method must be 'lbfgs' or 'adam', got {method!r}")


def _lbfgs(fun, params, max_iters, gtol, ftol=0.0):
    # ``fun`` is traced only by optax (value-and-grad and the line search): no extra forward
    # passes, which keeps the compiled program (and its compile time) small
    opt = optax.lbfgs(linesearch=optax.scale_by_zoom_linesearch(max_linesearch_steps=30,
                                                                 initial_guess_strategy="one"))
    value_and_grad = optax.value_and_grad_from_state(fun)

    def step(carry):
        p, _, state, last, _, k = carry
        value, grad = value_and_grad(p, state=state)
        updates, state = opt.update(grad, state, p, value=value, grad=grad, value_fn=fun)
        new = optax.apply_updates(p, updates)
        return new, p, state, value, last, k + 1

    def cont(carry):
        p, _, state, value, last, k = carry
        g = optax.tree_utils.tree_get(state, "grad")
        gnorm = optax.tree_utils.tree_norm(g)
        ok = jnp.isfinite(value) & _finite_tree(p)
        stalled = (k >= 3) & (last - value <= ftol * jnp.maximum(1.0, jnp.abs(value)))
        return (k == 0) | ((k < max_iters) & (gnorm >= gtol) & ok & ~stalled)

    state0 = opt.init(params)
    inf = jnp.asarray(jnp.inf, optax.tree_utils.tree_get(state0, "value").dtype)
    p, prev, state, value, _, k = jax.lax.while_loop(cont, step, (params, params, state0, inf, inf, jnp.asarray(0)))
    final = optax.tree_utils.tree_get(state, "value")       # the line search's value at ``p``
    good = jnp.isfinite(final) & _finite_tree(p)
    p = jax.tree.map(lambda a, b: jnp.where(good, a, b), p, prev)
    return OptimResult(p, jnp.where(good, final, value), k)


def _adam(fun, params, max_iters, learning_rate):
    opt = optax.adam(learning_rate)
    vg = jax.value_and_grad(fun)

    def step(carry, _):
        p, state, best, best_value = carry
        value, grad = vg(p)
        better = jnp.isfinite(value) & (value < best_value)
        best = jax.tree.map(lambda a, b: jnp.where(better, a, b), p, best)
        best_value = jnp.where(better, value, best_value)
        grad = jax.tree.map(lambda g: jnp.where(jnp.isfinite(g), g, 0.0), grad)
        updates, state = opt.update(grad, state, p)
        return (optax.apply_updates(p, updates), state, best, best_value), None

    init = (params, opt.init(params), params, jnp.asarray(jnp.inf, jnp.result_type(float)))
    (p, _, best, best_value), _ = jax.lax.scan(step, init, None, length=max_iters)
    final = fun(p)
    use_last = jnp.isfinite(final) & (final <= best_value)
    p = jax.tree.map(lambda a, b: jnp.where(use_last, a, b), p, best)
    return OptimResult(p, jnp.where(use_last, final, best_value), jnp.asarray(max_iters))
