"""Optimisers for the per-batch objective: L-BFGS (default) and Adam, both fully traced.

Both work on any pytree of unconstrained float arrays and are meant to be called inside
a jitted function, so one compilation serves every batch of the same (bucketed) shape.
The default L-BFGS (:func:`_lbfgs`) runs in a ``lax.while_loop`` whose body evaluates the
objective and its gradient **once**, at a trial point (Armijo backtracking, two-loop
recursion): the objective appears at one place in the compiled program, which is what
compile time scales with (optax's L-BFGS with a zoom line search, ``"optax_lbfgs"``, as in
``gpx.fit_lbfgs``, inlines it in the step and again in the line search). L-BFGS stops at
``max_iters``, when the gradient norm falls below ``gtol``, or when the last ten accepted
iterations lowered the objective by less than ``ftol · max(1, |f|)`` each on average (the
relative-reduction test of L-BFGS-B, averaged because one short Armijo step is not
convergence); Adam runs a ``lax.scan`` of
``max_iters`` steps. Non-finite objective values never leak out: the last finite
iterate is returned and the caller checks the final value.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree

from ..errors import InvalidOptionError
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["OptimResult", "minimize"]


class OptimResult(NamedTuple):
    """Result of :func:`minimize`: final parameters, objective value, iterations run, objective
    evaluations (line-search trials included; L-BFGS only) and the auxiliary output of ``fun`` at the
    final parameters (``has_aux``; L-BFGS only, else ``None``)."""

    params: Any
    value: jnp.ndarray
    iterations: jnp.ndarray
    evaluations: jnp.ndarray | None = None
    aux: Any = None


def _finite_tree(tree) -> jax.Array:
    leaves = jax.tree.leaves(tree)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.array(True)


def minimize(fun, params, method="lbfgs", max_iters=200, learning_rate=0.01, gtol=1e-6, ftol=0.0, has_aux=False) -> OptimResult:
    """Minimise ``fun(params)`` (traced; no Python loop over iterations).

    :param callable fun: scalar objective of a pytree of float arrays.
    :param params: initial pytree (the warm start).
    :param str method: ``"lbfgs"`` (:func:`_lbfgs`: one evaluation site, the fastest to compile),
        ``"optax_lbfgs"`` (optax's L-BFGS with a zoom line search, as ``gpx.fit_lbfgs``) or ``"adam"``.
    :param int max_iters: iteration cap (L-BFGS) or number of steps (Adam).
    :param float learning_rate: Adam step size (ignored by L-BFGS).
    :param float gtol: L-BFGS stops when the gradient's L2 norm is below this.
    :param float ftol: L-BFGS stops when an iteration's relative reduction of ``fun`` is below this (0: off).
    :param bool has_aux: ``fun`` returns ``(value, aux)``; ``"lbfgs"`` returns the ``aux`` of the final
        iterate (no extra evaluation), the other methods drop it (``aux=None``: the caller recomputes it).
    :return: :class:`OptimResult`.
    """
    if method == "lbfgs":
        return _lbfgs(fun, params, max_iters, gtol, ftol, has_aux=has_aux)
    if has_aux:
        fun = (lambda f: lambda p: f(p)[0])(fun)
    if method == "optax_lbfgs":
        return _lbfgs_optax(fun, params, max_iters, gtol, ftol)
    if method == "adam":
        return _adam(fun, params, max_iters, learning_rate)
    raise InvalidOptionError(f"method must be 'lbfgs', 'optax_lbfgs' or 'adam', got {method!r}")


class _LBFGSCarry(NamedTuple):
    x: jnp.ndarray        # current iterate (flat)
    f: jnp.ndarray        # objective at x
    g: jnp.ndarray        # gradient at x
    d: jnp.ndarray        # search direction from x
    t: jnp.ndarray        # step of the trial point x + t d
    S: jnp.ndarray        # (m, n) steps s_k (circular buffer)
    Y: jnp.ndarray        # (m, n) gradient differences y_k
    head: jnp.ndarray     # slot of the next pair
    pairs: jnp.ndarray    # pairs stored (≤ m)
    it: jnp.ndarray       # accepted iterations
    evals: jnp.ndarray    # objective evaluations
    ls: jnp.ndarray       # consecutive rejected trial points
    recent: jnp.ndarray   # (window,) objective before each of the last accepted iterations (circular)
    aux: object           # auxiliary output of fun at x


def _two_loop(g, S, Y, head, pairs) -> jax.Array:
    """``−H g`` by the L-BFGS two-loop recursion over the stored pairs (newest first), ``H₀ = (sᵀy / yᵀy) I``."""
    m = S.shape[0]
    idx = (head - 1 - jnp.arange(m)) % m                       # newest → oldest
    valid = jnp.arange(m) < pairs
    sy = jnp.sum(S * Y, 1)
    rho = 1.0 / jnp.where(sy > 0, sy, 1.0)

    def first(i, carry) -> tuple[Any, jax.Array]:
        q, alpha = carry
        j = idx[i]
        a = jnp.where(valid[i], rho[j] * jnp.dot(S[j], q), 0.0)
        return q - a * Y[j], alpha.at[i].set(a)

    q, alpha = jax.lax.fori_loop(0, m, first, (g, jnp.zeros(m, g.dtype)))
    newest = idx[0]
    gamma = jnp.where(pairs > 0, sy[newest] / jnp.maximum(jnp.dot(Y[newest], Y[newest]), 1e-300), 1.0)
    r = gamma * q

    def second(k, r) -> jax.Array:
        i = m - 1 - k                                            # oldest → newest
        j = idx[i]
        b = rho[j] * jnp.dot(Y[j], r)
        return jnp.where(valid[i], r + (alpha[i] - b) * S[j], r)

    return -jax.lax.fori_loop(0, m, second, r)


def _lbfgs(fun, params, max_iters, gtol, ftol=0.0, history=10, max_linesearch=25, c1=1e-4, has_aux=False,
           window=10) -> OptimResult:
    """L-BFGS with an Armijo backtracking line search, written so that ``fun`` is evaluated at **one**
    place in the compiled program.

    Every pass of the ``lax.while_loop`` evaluates ``value_and_grad(fun)`` once, at a trial point
    ``x + t d``: the first pass at the start (accepted unconditionally), then a trial is accepted when
    it is finite and satisfies ``f(x + t d) ≤ f(x) + c₁ t ∇f(x)ᵀd``, otherwise ``t`` shrinks by safeguarded
    quadratic interpolation (within ``[0.1 t, 0.5 t]``). An accepted step stores ``(s, y)`` when
    ``sᵀy > 0`` and computes the next direction by the two-loop recursion. Optax's L-BFGS with a zoom
    line search inlines ``fun`` in the step and again in the line search; XLA then compiles the
    objective and its gradient several times (1.3–2× the compile time for the GP bounds).

    Stops at ``max_iters`` accepted iterations, when ``‖∇f‖₂ < gtol``, when the last ``window`` accepted
    iterations lowered ``f`` by less than ``ftol · max(1, |f|)`` each on average, or after
    ``max_linesearch`` rejected trial points in a row (no finite decrease along ``d``: numerically
    converged). The decrease is averaged over a window because a backtracking (Armijo-only) search
    can accept a short step: one small decrease is not convergence.
    """
    x0, unravel = ravel_pytree(params)
    n = x0.shape[0]
    dt = x0.dtype
    f_aux = (lambda x: fun(unravel(x))) if has_aux else (lambda x: (fun(unravel(x)), None))
    vg = jax.value_and_grad(f_aux, has_aux=True)
    inf = jnp.asarray(jnp.inf, dt)

    def body(c) -> _LBFGSCarry:
        xt = c.x + c.t * c.d
        (ft, at), gt = vg(xt)
        ft = jnp.where(jnp.isfinite(ft) & jnp.all(jnp.isfinite(gt)), ft, inf)
        first = c.evals == 0
        slope = jnp.dot(c.g, c.d)
        accept = first | (jnp.isfinite(ft) & (ft <= c.f + c1 * c.t * slope))
        # accepted: store the pair, new iterate and direction
        s, y = xt - c.x, gt - c.g
        store = ~first & (jnp.dot(s, y) > 1e-12 * jnp.dot(y, y))
        S = jnp.where(store, c.S.at[c.head].set(s), c.S)
        Y = jnp.where(store, c.Y.at[c.head].set(y), c.Y)
        head = jnp.where(store, (c.head + 1) % history, c.head)
        pairs = jnp.where(store, jnp.minimum(c.pairs + 1, history), c.pairs)
        d_new = _two_loop(gt, S, Y, head, pairs)
        descent = jnp.dot(gt, d_new) < 0
        d_new = jnp.where(descent & (pairs > 0), d_new, -gt)      # restart along −∇f if H lost definiteness
        pairs = jnp.where(descent, pairs, 0)
        t_new = jnp.where(pairs > 0, 1.0, jnp.minimum(1.0, 1.0 / jnp.maximum(jnp.linalg.norm(gt), 1e-300)))
        # rejected: shrink t (quadratic interpolation of f along d, safeguarded)
        curv = ft - c.f - slope * c.t
        t_q = -slope * c.t ** 2 / (2.0 * jnp.where(curv > 0, curv, 1.0))
        t_shrunk = jnp.where(jnp.isfinite(ft) & (curv > 0), jnp.clip(t_q, 0.1 * c.t, 0.5 * c.t), 0.1 * c.t)
        pick = lambda a, b: jnp.where(accept, a, b)  # noqa: E731
        return _LBFGSCarry(x=pick(xt, c.x), f=pick(ft, c.f), g=pick(gt, c.g), d=pick(d_new, c.d),
                           t=pick(t_new, t_shrunk), S=S, Y=Y, head=head, pairs=jnp.where(accept, pairs, c.pairs),
                           it=c.it + jnp.where(accept & ~first, 1, 0), evals=c.evals + 1,
                           ls=jnp.where(accept, 0, c.ls + 1),
                           recent=jnp.where(accept & ~first, c.recent.at[c.it % window].set(c.f), c.recent),
                           aux=jax.tree.map(pick, at, c.aux))

    def cont(c) -> jax.Array:
        # c.recent[it % window] is f after iteration it − window (overwritten by the next accepted one)
        stalled = (c.it >= window) & (c.recent[c.it % window] - c.f <= window * ftol * jnp.maximum(1.0, jnp.abs(c.f)))
        return (c.evals == 0) | ((c.it < max_iters) & (jnp.linalg.norm(c.g) >= gtol) & ~stalled
                                 & (c.ls < max_linesearch) & jnp.isfinite(c.f))

    z = jnp.zeros(n, dt)
    c0 = _LBFGSCarry(x=x0, f=inf, g=z, d=z, t=jnp.asarray(0.0, dt), S=jnp.zeros((history, n), dt),
                     Y=jnp.zeros((history, n), dt), head=jnp.asarray(0), pairs=jnp.asarray(0), it=jnp.asarray(0),
                     evals=jnp.asarray(0), ls=jnp.asarray(0), recent=jnp.full(window, inf),
                     aux=jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(f_aux, x0)[1]))
    c = jax.lax.while_loop(cont, body, c0)
    return OptimResult(unravel(c.x), c.f, c.it, c.evals, c.aux if has_aux else None)


def _lbfgs_optax(fun, params, max_iters, gtol, ftol=0.0) -> OptimResult:
    # optax's L-BFGS with its zoom line search (as in ``gpx.fit_lbfgs``): ``fun`` is inlined in the step
    # and in the line search
    opt = optax.lbfgs(linesearch=optax.scale_by_zoom_linesearch(max_linesearch_steps=30,
                                                                 initial_guess_strategy="one"))
    value_and_grad = optax.value_and_grad_from_state(fun)

    def step(carry) -> tuple[Any, Any, Any, Any, Any, Any]:
        p, _, state, last, _, k = carry
        value, grad = value_and_grad(p, state=state)
        updates, state = opt.update(grad, state, p, value=value, grad=grad, value_fn=fun)
        new = optax.apply_updates(p, updates)
        return new, p, state, value, last, k + 1

    def cont(carry) -> jax.Array:
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


def _adam(fun, params, max_iters, learning_rate) -> OptimResult:
    opt = optax.adam(learning_rate)
    vg = jax.value_and_grad(fun)

    def step(carry, _) -> tuple[tuple[Any, Any, Any, Any], None]:
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
