r"""The one fixed-point engine: the pieces every dual-form solve in the package is built from.

Every solve in numpyro_pc looks for a fixed point :math:`x = T(x)` of a natural-gradient
(Bayesian learning rule) map — the Gaussian solver on ``(m, S)``
(:mod:`numpyro_pc.solvers.gaussian`), the pure kernels of :mod:`numpyro_pc.kernels.stream_state` and
:mod:`numpyro_pc.kernels.site_table`, the exponential-family solve on the natural parameter
(:func:`numpyro_pc.solvers.expfam.blr_solve`) and the federated clients' local solves
(:mod:`numpyro_pc.federated.ef`). They share these pieces, each a pure function over a
``NamedTuple`` carry so that the same code runs in a host loop and inside
``lax.while_loop``:

* **Anderson acceleration** (type II; Walker & Ni 2011), :class:`AndersonHistory` with
  :func:`anderson_init` / :func:`anderson_push` / :func:`anderson_restart` /
  :func:`anderson_mix`: from the last iterates :math:`x_j` and residuals
  :math:`f_j = T(x_j) - x_j`, with :math:`\gamma = \arg\min_\gamma \|f_k - \Delta F \gamma\|`,

  .. math:: x^{+} = x_k + \beta f_k - (\Delta X + \beta\, \Delta F)\, \gamma .

  With ``β = 1`` and a full history this is GMRES on a linear map, so on an affine
  :math:`T` it reaches the fixed point in at most ``n + 1`` steps.
* **Backtracking**, :func:`backtrack`: the longest of ``ρ, ρ/2, ρ/4, …`` that a test accepts
  (e.g. the iterate stays a proper Gaussian).
* **Non-monotone damping with recovery**, :class:`Damping` with :func:`damping_init` /
  :func:`damping_observe`: a residual above the largest of the last three halves the step
  (when the step that caused it was a plain one) and clears the secant history; a residual
  below the smallest of the last three doubles it again, up to its initial value. Block
  (Jacobi-type) updates of a product family oscillate on their way to the fixed point, so a
  monotone test would reject them.
* **The natural-parameter iteration** on a convex domain, :class:`NaturalState` with
  :func:`natural_init` / :func:`natural_propose` / :func:`natural_observe` and the traced
  driver :func:`natural_solve`: the Anderson candidate when it is inside the domain, else
  the plain step :math:`(1-\rho)\lambda + \rho\tau` halved until it is.
* **Stagnation detection**, :func:`stagnation`, and **one default tolerance rule per
  dtype**, :func:`default_tol`.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tqdm.auto import tqdm
    from typing import Any

__all__ = ["AndersonHistory", "anderson_init", "anderson_push", "anderson_restart", "anderson_mix",
           "backtrack", "Damping", "damping_init", "damping_observe", "NaturalState", "natural_init", "natural_propose",
           "natural_observe", "natural_propose_host", "natural_solve", "relative_residual", "default_tol", "stagnation",
           "iteration_budget", "progress_bar", "largest_inside_fraction", "BASE_ITERATIONS", "MAX_ITERATIONS", "PATIENCE", "TINY_STEP", "TINY_RUN",
           "OBJECTIVE_PROGRESS"]

PATIENCE = 25  # iterations without halving the best residual before a run is declared stagnant
TINY_STEP = 1e-3  # accepted damped steps this small, TINY_RUN times in a row, also mean stagnation
TINY_RUN = 8
OBJECTIVE_PROGRESS = 0.01  # nats per iteration: an objective falling faster than this is progress
_RECENT = 3  # residuals remembered by the non-monotone damping rule
_MIN_DAMPING = 1e-3  # the damping rule never halves the step below this
_HALVINGS = 60  # plain-step halvings tried before a natural-parameter step is declared out of the domain


def default_tol(dtype) -> float:
    """The default residual tolerance of every solve: ``1e-8`` in float64, ``1e-5`` in float32.

    The residuals are relative (a gradient norm over the norms of its terms; a natural-parameter
    gap over ``1 + ‖τ‖``), so the rule is one per dtype: about ``1e-8`` is where float64 sums
    over thousands of sites stop being exact, ``1e-5`` the same for float32's ``1.2e-7``
    machine epsilon.
    """
    return 1e-8 if jnp.dtype(dtype) == jnp.float64 else 1e-5


def relative_residual(lam, target) -> jax.Array:
    r""":math:`\|\lambda - \tau\| / (1 + \|\tau\|)`, the natural-parameter residual (traceable)."""
    return jnp.linalg.norm(lam - target) / (1.0 + jnp.linalg.norm(target))


class AndersonHistory(NamedTuple):
    """Ring buffers of the last ``memory + 1`` iterates and residuals (newest last).

    :ivar xs: iterates, shape ``(memory + 1, n)``.
    :ivar fs: residuals ``T(x) − x`` at those iterates, same shape.
    :ivar count: how many of the newest rows are filled (int scalar).
    """

    xs: jax.Array
    fs: jax.Array
    count: jax.Array  # type: ignore[assignment]  # shadows tuple.count, as the field always has


def anderson_init(x, memory: int) -> AndersonHistory:
    """An empty history for iterates shaped like the flat vector ``x`` (``memory ≥ 0``)."""
    zeros = jnp.zeros((int(memory) + 1, x.shape[0]), x.dtype)
    return AndersonHistory(zeros, zeros, jnp.asarray(0))


@jax.jit
def anderson_push(history: AndersonHistory, x, f) -> AndersonHistory:
    """The history with ``(x, f = T(x) − x)`` appended (the oldest pair drops out)."""
    xs = jnp.concatenate([history.xs[1:], x[None]])
    fs = jnp.concatenate([history.fs[1:], f[None]])
    return AndersonHistory(xs, fs, jnp.minimum(history.count + 1, xs.shape[0]))


def anderson_restart(history: AndersonHistory, keep=0) -> AndersonHistory:
    """The history with only its newest ``keep`` (0 or 1) pairs: a restart after a stale secant."""
    return history._replace(count=jnp.minimum(history.count, keep))


@jax.jit
def anderson_mix(history: AndersonHistory, beta=1.0) -> jax.Array:
    r"""The Anderson (type II) candidate :math:`x_k + \beta f_k - (\Delta X + \beta \Delta F)\gamma`.

    Differences whose ends are not both filled carry zero weight, so with fewer than two
    pairs this is the plain step :math:`x_k + \beta f_k` (the least-squares solution of a zero
    system is zero).
    """
    xs, fs = history.xs, history.fs
    rows = xs.shape[0]
    filled = (jnp.arange(rows - 1) >= rows - history.count)[:, None]
    dx = jnp.where(filled, xs[1:] - xs[:-1], 0.0)
    df = jnp.where(filled, fs[1:] - fs[:-1], 0.0)
    gamma = jnp.linalg.lstsq(df.T, fs[-1])[0]
    return xs[-1] + beta * fs[-1] - (dx + beta * df).T @ gamma


def backtrack(accept: Callable, rho, min_rho) -> jax.Array:
    """The longest step ``ρ·2⁻ᵏ ≥ min_rho`` that ``accept`` takes (traceable): ``accept(ρ)`` is tried,
    then its halves; a result below ``min_rho`` means none was accepted.

    The Gaussian kernels halve a step until the iterate is a proper Gaussian
    (:func:`numpyro_pc.kernels.stream_state.iterate`, :func:`numpyro_pc.federated.core.local_update`);
    :func:`natural_propose` tries the same halvings at once, vectorised over the domain test.
    """
    rho = jnp.asarray(rho)
    return jax.lax.while_loop(lambda r: (r >= min_rho) & ~accept(r), lambda r: 0.5 * r, rho)


class Damping(NamedTuple):
    """The non-monotone damping rule's state.

    :ivar step: the current step ``ρ``.
    :ivar recent: the last residuals (newest last).
    :ivar seen: how many of ``recent`` are filled.
    """

    step: jax.Array
    recent: jax.Array
    seen: jax.Array


def damping_init(rho, dtype) -> Damping:
    """The rule's state before the first residual, with step ``rho``."""
    return Damping(jnp.asarray(rho, dtype), jnp.zeros(_RECENT, dtype), jnp.asarray(0))


def damping_observe(damping: Damping, residual, accelerated, rho_max, strict=True) -> tuple[Damping, jax.Array]:
    """Update the damping from the residual at the new iterate.

    :param bool strict: ``worse`` needs the residual strictly above the largest of the last three; with
        ``False`` equal counts too, so that an iteration cycling between two iterates with a constant
        residual is damped as well (the federated clients' local solve).
    :return: ``(damping, worse)``; ``worse`` — the residual exceeds the largest of the last
        three — means the secant history is stale.
    """
    filled = jnp.arange(_RECENT) >= _RECENT - damping.seen
    largest = jnp.max(jnp.where(filled, damping.recent, -jnp.inf))
    worse = (damping.seen > 0) & ((residual > largest) if strict else (residual >= largest))
    better = (damping.seen > 0) & (residual < jnp.min(jnp.where(filled, damping.recent, jnp.inf)))
    step = jnp.where(worse & ~accelerated, jnp.maximum(0.5 * damping.step, _MIN_DAMPING),
                     jnp.where(better, jnp.minimum(2.0 * damping.step, rho_max), damping.step))
    recent = jnp.concatenate([damping.recent[1:], jnp.asarray(residual, damping.recent.dtype)[None]])
    return Damping(step, recent, jnp.minimum(damping.seen + 1, _RECENT)), worse


class NaturalState(NamedTuple):
    """The carry of the natural-parameter iteration :math:`\\lambda \\to \\tau(\\lambda)`.

    :ivar lam: the current natural parameter.
    :ivar target: :math:`\\tau(\\lambda)`, the fixed-point map at ``lam``.
    :ivar residual: :func:`relative_residual` of ``lam`` and ``target``.
    :ivar iteration: steps taken.
    :ivar history: the :class:`AndersonHistory`.
    :ivar damping: the :class:`Damping` state.
    :ivar accelerated: whether the step to ``lam`` was the Anderson candidate.
    :ivar inside: whether the last proposal found a point inside the domain.
    """

    lam: jax.Array
    target: jax.Array
    residual: jax.Array
    iteration: jax.Array
    history: AndersonHistory
    damping: Damping
    accelerated: jax.Array
    inside: jax.Array


def natural_init(lam, target, rho=1.0, memory=5) -> NaturalState:
    """The state at the start ``lam`` with its map value ``target``."""
    false = jnp.asarray(False)
    return NaturalState(lam, target, relative_residual(lam, target), jnp.asarray(0), anderson_init(lam, memory),
                        damping_init(rho, lam.dtype), false, jnp.asarray(True))


def natural_propose(state: NaturalState, in_domain: Callable, rho_max=1.0) -> tuple[jax.Array, Any]:
    """The next iterate: the damping rule observes the current residual, then the Anderson candidate
    is taken when it is finite and inside the domain, else the plain step halved until inside.

    :return: ``(lam, state)``; ``state.accelerated`` and ``state.inside`` describe the proposal
        (``inside`` false: no halving of the plain step is inside the domain, and ``lam`` is the
        current iterate unchanged).
    """
    lam, f = state.lam, state.target - state.lam
    damping, worse = damping_observe(state.damping, state.residual, state.accelerated, rho_max)
    pushed = anderson_push(state.history, lam, f)
    restarted = anderson_push(anderson_restart(state.history), lam, f)
    history = jax.tree.map(lambda kept, cleared: jnp.where(worse, cleared, kept), pushed, restarted)
    step = damping.step
    anderson = anderson_mix(history, step)
    use = (history.count > 1) & jnp.all(jnp.isfinite(anderson)) & in_domain(anderson)
    trials = lam[None] + (step * 0.5 ** jnp.arange(_HALVINGS, dtype=lam.dtype))[:, None] * f[None]
    inside = jax.vmap(in_domain)(trials)
    new = jnp.where(use, anderson, jnp.where(jnp.any(inside), trials[jnp.argmax(inside)], lam))
    return new, state._replace(history=history, damping=damping, accelerated=use, inside=use | jnp.any(inside))


def natural_observe(state: NaturalState, lam, target) -> NaturalState:
    """The state at the proposed ``lam`` once its map value ``target`` is known."""
    return state._replace(lam=lam, target=target, residual=relative_residual(lam, target),
                          iteration=state.iteration + 1)


@partial(jax.jit, static_argnames=("owner", "name"))
def _propose_method(state, owner, name, rho_max) -> tuple[jax.Array, Any]:
    return natural_propose(state, getattr(owner, name), rho_max)


@partial(jax.jit, static_argnames=("owner", "name"))
def _inside_method(lam, owner, name) -> jax.Array:
    return getattr(owner, name)(lam)


def _cacheable_method(fn: Callable) -> tuple[object, str] | None:
    """``(owner, name)`` when ``fn`` is a method of a hashable object (a compiled program's static key), else ``None``."""
    owner, name = getattr(fn, "__self__", None), getattr(fn, "__name__", None)
    try:
        hash(owner)
    except TypeError:
        return None
    return None if owner is None or name is None else (owner, name)


def in_domain_host(in_domain: Callable, lam) -> bool:
    """``in_domain(lam)`` as a Python bool, compiled once per family and shape when ``in_domain`` is a
    method of an object that hashes by value (as :func:`natural_propose_host`; op by op otherwise:
    a Gaussian block's check is a Cholesky factorisation, 6 ms op by op on bench_ef_guides)."""
    method = _cacheable_method(in_domain)
    return bool(in_domain(lam) if method is None else _inside_method(lam, *method))


def natural_propose_host(state: NaturalState, in_domain: Callable, rho_max=1.0) -> tuple[jax.Array, NaturalState]:
    """:func:`natural_propose` for a host loop (:func:`numpyro_pc.solvers.expfam.blr_solve`).

    When ``in_domain`` is a method of an object that hashes by value (a family: a frozen
    dataclass) the proposal is compiled once per family and shape, so a new fit with an equal
    family reuses it; otherwise it runs op by op (compiling the whole proposal for every new
    ``in_domain`` cost 0.2 s per warm fit on bench_ef_guides, op by op 3 ms per iteration).
    """
    rho_max = jnp.asarray(rho_max, state.lam.dtype)
    method = _cacheable_method(in_domain)
    if method is None:
        return natural_propose(state, in_domain, rho_max)
    return _propose_method(state, *method, rho_max)


def natural_solve(target: Callable, in_domain: Callable, lam, tol, max_iters, rho=1.0, memory=5) -> tuple[Any, Any, Any, Any, Any]:
    """The natural-parameter iteration as one ``lax.while_loop`` (traceable; e.g. ``vmap`` over clients).

    :param target: ``λ -> (τ(λ), aux)``, traceable.
    :param in_domain: ``λ -> bool``, traceable.
    :return: ``(λ, aux, iterations, residual, ok)``; ``ok`` is false when a proposal left the
        domain or the residual is not finite.
    """
    tau, aux = target(lam)
    start = (natural_init(lam, tau, rho, memory), aux)

    def cond(carry) -> jax.Array:
        state = carry[0]
        return ((state.iteration < max_iters) & (state.residual > tol) & jnp.isfinite(state.residual)
                & state.inside)

    def body(carry) -> tuple[NaturalState, Any]:
        new, state = natural_propose(carry[0], in_domain, rho)
        tau, aux = target(new)
        return natural_observe(state, new, tau), aux

    state, aux = jax.lax.while_loop(cond, body, start)
    ok = state.inside & in_domain(state.lam) & jnp.isfinite(state.residual)
    return state.lam, aux, state.iteration, state.residual, ok


BASE_ITERATIONS = 100  # the automatic budget before it is extended
MAX_ITERATIONS = 1000  # the automatic budget never grows beyond this
_RATE_WINDOW = 10  # iterations over which the linear rate is measured


def iteration_budget(residuals, tol, used, cap=MAX_ITERATIONS) -> int:
    """Further iterations a run that reached its budget has earned (host; ``0``: none).

    A run still converging linearly is given the iterations its own rate predicts, plus half
    again: with ``ρ`` the geometric mean of the residual's ratio over the last
    :data:`_RATE_WINDOW` iterations, ``n = log(tol / r) / log ρ``. None when ``ρ ≥ 0.999``
    (no measurable progress), when a residual is not finite, or when ``used + 1.5 n`` passes
    ``cap``: the budget follows the problem's rate, not a constant, but never without limit.

    :param residuals: the residual at every iterate, the start first.
    :param float tol: the tolerance the run must reach.
    :param int used: iterations already taken.
    :param int cap: the largest total budget.
    """
    if len(residuals) <= _RATE_WINDOW:
        return 0
    last, earlier = float(residuals[-1]), float(residuals[-1 - _RATE_WINDOW])
    if not (np.isfinite(last) and np.isfinite(earlier) and 0.0 < last < earlier):
        return 0
    rate = (last / earlier) ** (1.0 / _RATE_WINDOW)
    if rate >= 0.999:
        return 0
    needed = int(np.ceil(1.5 * np.log(tol / last) / np.log(rate))) + 5 if last > tol else 0
    return needed if 0 < needed and used + needed <= cap else 0


def stagnation(residuals, steps, objectives=None) -> str | None:
    """Why a run is stagnant (a short phrase), or ``None`` while it still makes progress (host).

    Stagnant: the best residual of the last :data:`PATIENCE` iterations is not below half the
    best before them — unless ``objectives`` are given and the best objective of those
    iterations is more than :data:`OBJECTIVE_PROGRESS` nats per iteration below the best before
    them (a run climbing out of a funnel: posteriordb's rats model takes 97 iterations, its
    residual between 1e-2 and 9e-2 for 70 of them while the objective falls from 587.1 to
    581.1, then converges) — or the last :data:`TINY_RUN` accepted steps were all damped below
    :data:`TINY_STEP`.

    :param residuals: the residual at every iterate, the start first.
    :param steps: the step size of every accepted step (``0`` for an undamped special step).
    :param objectives: the variational objective at every iterate, for an iteration that
        minimises it (``None``: judged by the residual alone).
    """
    if len(residuals) > PATIENCE + 1:
        before, recent = min(residuals[:-PATIENCE]), min(residuals[-PATIENCE:])
        falling = objectives is not None and (
            min(objectives[-PATIENCE:]) < min(objectives[:-PATIENCE]) - OBJECTIVE_PROGRESS * PATIENCE)
        if not recent < 0.5 * before and not falling:
            return f"stagnant: the best residual did not halve in the last {PATIENCE} iterations"
    if len(steps) >= TINY_RUN and all(0.0 < s <= TINY_STEP for s in steps[-TINY_RUN:]):
        return f"stagnant: the last {TINY_RUN} accepted steps were damped below {TINY_STEP:g}"
    return None


def progress_bar(enabled: bool, total: int, desc: str = "refine") -> tqdm | None:
    """A ``tqdm`` bar of ``total`` steps that a host loop advances, or ``None`` when not ``enabled``."""
    if not enabled:
        return None
    from tqdm.auto import tqdm  # imported only when a bar is asked for
    return tqdm(total=total, desc=desc, leave=False, disable=False, mininterval=0.5)


def largest_inside_fraction(inside: Callable[[float], bool], steps: int = 40, margin: float = 0.99) -> float:
    """The largest ``α ∈ [0, 1]`` with ``inside(α)``, by bisection, times ``margin`` (off the boundary).

    For a convex region that holds the point at ``α = 0`` — a positive definite precision, an
    exponential family's natural domain — the answer is a step that stays inside; ``0`` when none
    of the bisection's points is inside.
    """
    lo, hi = 0.0, 1.0
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        if inside(mid):
            lo = mid
        else:
            hi = mid
    return margin * lo
