r"""Natural-gradient (variational online Newton) solver for the dual-form fixed point.

For a Gaussian ``q = N(m, S⁻¹)`` the BLR step with rate ``ρ`` is (paper App. A.3,
Khan & Rue 2023 §3.1.2)

.. math::

    S \leftarrow (1-\rho) S + \rho \textstyle\sum_{i=0}^N \hat H_i, \qquad
    m \leftarrow m - \rho\, P^{-1} \textstyle\sum_{i=0}^N \hat g_i ,

with ``P = S`` for the full family. For the diagonal and isotropic families the mean is
preconditioned with the full expected Hessian ``Σ_i E_q[∇²ℓ_i]`` (a Newton step on
``E_q[Σℓ_i]``, by Price's theorem), which reaches the same fixed point — ``S = Σ Ĥ_i``
and ``Σ ĝ_i = 0`` — far faster than a diagonally preconditioned step; the low-rank family
does the same matrix-free (conjugate gradients with ``Σ Ĥ_i`` as an operator).

The undamped map converges linearly; Anderson acceleration over the last few steps
(Walker & Ni 2011) is tried first, and each fallback step is damped by backtracking: ``ρ`` is halved until the new precision is
positive definite and the step makes progress: the variational objective decreases, or
— once the residual is below 1e-2 — the dual-form residual falls below the largest of
the last three residuals (a non-monotone rule: full steps alternate between reducing the
mean and the precision identity, which a monotone test would reject). A family judged by the
residual alone (:class:`~numpyro_pc.protocols.capabilities.GaussianSolver` ``minimises_objective``
false) then tries a watchdog: up to three undamped steps, accepted if one ends below the current residual. Site computations at a rejected trial are
discarded; accepted trials are reused as the next iteration's sites.

Under the delta rule the sites depend on the mean alone: every evaluated point takes the
precision ``T(m)`` its own sites ask for, the objective is the MAP loss at the mean, and
a Laplace–Gauss–Newton fit tries a Newton–CG step on the MAP condition first
(:mod:`numpyro_pc.solvers.newton_polish`), backtracked along its direction, so the iteration is a
globalised Newton method on the mean; a start far from its fixed point (residual above 1e-2) is first
moved by L-BFGS on the MAP loss, one gradient per iteration instead of a site pass and a CG solve.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import cho_solve

from numpyro_pc.curvature.stores import NONE
from numpyro_pc.errors import ConvergenceError, NonFiniteResultError, PrecisionLossError, StagnationError
from numpyro_pc.families.registry import Gaussian
from numpyro_pc.protocols.capabilities import gaussian_solver, needs_dense_sum
from numpyro_pc.protocols.records import IterationInfo
from numpyro_pc.sites.prior import prior_diagonal

from . import newton_polish
from .fixed_point import (
    BASE_ITERATIONS,
    AndersonHistory,
    anderson_init,
    anderson_mix,
    anderson_push,
    anderson_restart,
    default_tol,
    iteration_budget,
    progress_bar,
    stagnation,
)
from .site_problem import Point, check_finite_sites, evaluate, fixed_point_map

__all__ = ["SolveState", "SolveOptions", "solve", "solve_init", "solve_step", "solve_converged", "default_tol"]

_WATCH = 3  # residuals remembered by the non-monotone acceptance rule
_LINEAR = 1e-2  # accelerate only while the residual shrinks by less than 100× per step
_LOCAL = 1e-2  # below this residual, progress may also be judged by the residual itself
_NEWTON_MIN_STEP = 2.0**-6  # shortest step along a Newton–CG direction before the plain damped step is tried


def _pack(q) -> jax.Array:
    return jnp.concatenate([q.mean, jnp.ravel(q.precision)])


def _unpack(x, like) -> Gaussian:
    d = like.mean.shape[0]
    return Gaussian(x[:d], jnp.reshape(x[d:], like.precision.shape))


class SolveState(NamedTuple):
    """The carry of the Gaussian solve: :func:`solve_init` makes it, :func:`solve_step` advances it.

    :ivar point: the current iterate, evaluated (sites, totals, residual, objective).
    :ivar anderson: the :class:`~numpyro_pc.solvers.fixed_point.AndersonHistory` of undamped steps.
    :ivar history: one :class:`~numpyro_pc.protocols.records.IterationInfo` per accepted iterate, the start first (a tuple: the carry is never mutated).
    :ivar iteration: accepted steps so far (a watchdog path counts each of its steps).
    :ivar stagnant: why the run is stagnant (:func:`~numpyro_pc.solvers.fixed_point.stagnation`), or ``None``.
    :ivar stalled: no proposal made progress at the last step: the iteration cannot go on.
    :ivar started: ``time.perf_counter()`` at the start (the history's clock).
    """

    point: Point
    anderson: AndersonHistory
    history: tuple
    iteration: int
    stagnant: str | None
    stalled: bool
    started: float


class SolveOptions(NamedTuple):
    """The static policies of a solve: initial damped step, its floor, and the Anderson memory."""

    step_size: float = 1.0
    min_step: float = 2.0**-30
    memory: int = 3


def solve_init(problem, q, sites=None, sums=None, memory=3) -> SolveState:
    """The carry at the start ``q`` (its sites are computed unless ``sites`` and ``sums`` are given).

    :raises NonFiniteResultError: the site gradients, residual or objective are not finite at ``q``.
    """
    started = time.perf_counter()
    if sites is None or sums is None:
        sites, sums = problem.sites(q, need_hessian_sum=needs_dense_sum(problem.family, q.mean.shape[0]))
    check_finite_sites(sites)
    point = evaluate(problem, q, sites, sums)
    if not np.isfinite(point.residual) or not np.isfinite(point.objective):
        raise NonFiniteResultError(
            f"the dual-form residual ({point.residual}) or objective ({point.objective}) is not finite at the "
            "starting posterior; the expected log density overflows there (check priors, constraints, data "
            "scaling, or pc.fit's default start if this run started elsewhere)."
        )
    return SolveState(point, anderson_init(_pack(q), memory), (_history_entry(0, point, 0.0, False, started),),
                      0, None, False, started)


def solve_converged(state: SolveState, tol: float) -> bool:
    """Whether the current residual is at most ``tol`` (a NaN residual is not converged)."""
    return bool(state.point.residual <= tol)


def solve_step(problem, state: SolveState, options: SolveOptions = SolveOptions()) -> SolveState:
    """One accepted step of the Gaussian solve, built from the engine's proposals in order.

    0. :func:`_map_proposal` — at the first step of a Laplace–Gauss–Newton solve that starts far
       from its fixed point, L-BFGS on the MAP loss;
    1. :func:`_newton_proposal` — for a Laplace–Gauss–Newton fit, the Newton–CG step on the MAP
       condition, backtracked along its direction;
    2. :func:`_anderson_proposal` — while convergence is linear, the Anderson candidate of the
       last undamped steps;
    3. :func:`_damped_proposal` — the damped step, halved from ``options.step_size`` down to
       ``options.min_step`` (the Anderson history restarts from the current point);
    4. :func:`_watchdog` — for a family judged by the residual alone, up to three undamped steps.

    Each trial is judged by :func:`_accept`. Returns the new carry; ``stalled`` is set when no
    proposal made progress.
    """
    point, family = state.point, problem.family
    direction, target = fixed_point_map(problem, point)
    x = _pack(point.q)
    anderson = anderson_push(state.anderson, x, _pack(Gaussian(point.q.mean + direction, target)) - x)
    iteration, history = state.iteration + 1, state.history
    outcome, rho, accelerated = _map_proposal(problem, point, history, state.iteration)
    if outcome is None:
        outcome, rho, accelerated = _newton_proposal(problem, point, history, target)
    if outcome is None and _linear(history):
        outcome, rho, accelerated = _anderson_proposal(problem, point, history, anderson, options.memory)
    if outcome is None:
        anderson = anderson_restart(anderson, keep=1)  # restart the acceleration from the current point
        outcome, rho, accelerated = _damped_proposal(problem, point, history, direction, target, options)
    judged_by_objective = gaussian_solver(family).minimises_objective
    if outcome is None and not judged_by_objective:
        path = _watchdog(problem, point)
        if path is not None:  # the intermediate full steps are iterations too
            passed = tuple(_history_entry(iteration + k, p, 1.0, False, state.started) for k, p in enumerate(path[:-1]))
            history, iteration = history + passed, iteration + len(passed)
            outcome, rho, accelerated = path[-1], 1.0, False
            anderson = anderson_restart(anderson)
    if outcome is None:
        return state._replace(iteration=iteration, stalled=True)
    history = history + (_history_entry(iteration, outcome, rho, accelerated, state.started),)
    return SolveState(outcome, anderson, history, iteration, _stagnation(history, judged_by_objective),
                      False, state.started)


def _linear(history) -> bool:
    """Convergence is linear: the residual shrank by less than 100× at the last step."""
    return len(history) > 1 and history[-1]["residual"] > _LINEAR * history[-2]["residual"]


def _evaluate_trial(problem, trial) -> Point | None:
    """``trial`` evaluated, or ``None`` when it is not a proper Gaussian (checked before its sites are
    computed) or its site gradients or loss are not finite."""
    family = problem.family
    if not bool(jnp.all(jnp.isfinite(trial.mean))) or not bool(family.is_positive_definite(trial.precision)):
        return None
    t_sites, t_sums = problem.sites(trial, need_hessian_sum=needs_dense_sum(family, trial.mean.shape[0]))
    if not (bool(jnp.all(jnp.isfinite(t_sites.grad))) and bool(jnp.isfinite(t_sums.loss))):
        return None
    return evaluate(problem, trial, t_sites, t_sums)


def _accept(problem, point, history, trial, permissive=False) -> Point | None:
    """The evaluated ``trial`` if it makes progress from ``point``, else ``None``.

    Progress is a lower variational objective (for a family whose iteration minimises it) or —
    close to the fixed point (residual below 1e-2), as a last resort, or for a family judged by
    the residual alone — a residual below the largest of the last three (non-monotone: full
    steps alternate between reducing the mean and the precision identity). Far from the fixed
    point only the objective counts: a falling residual there can come from running away
    (non-log-concave models). A trial that is not a proper Gaussian, or whose sites or loss are
    not finite, is refused before or after its sites are computed.
    """
    candidate = _evaluate_trial(problem, trial)
    if candidate is None:
        return None
    reference = max(h["residual"] for h in history[-_WATCH:])
    slack = 1e-12 * (1.0 + abs(point.objective))
    judged_by_objective = gaussian_solver(problem.family).minimises_objective
    local = candidate.residual < _LOCAL or permissive or not judged_by_objective
    descent = judged_by_objective and candidate.objective <= point.objective + slack
    if np.isfinite(candidate.residual) and ((local and candidate.residual < reference) or descent):
        return candidate
    return None


def _map_proposal(problem, point, history, iteration) -> tuple[Point | None, float, bool]:
    """Laplace–GGN, first step, residual above 1e-2: the point L-BFGS reaches on the MAP loss
    (:func:`~numpyro_pc.solvers.newton_polish.map_descent`), if it makes progress. A start far from a
    minimum of a non-convex loss (an update whose new batch the old mean does not fit) otherwise takes
    tens of backtracked Newton–CG steps, each a site pass and up to 50 Hessian–vector products.

    :return: ``(point or None, step, accelerated)``.
    """
    if iteration != 0 or not point.residual > _LOCAL or not newton_polish.applies(problem):
        return None, 0.0, False
    mean, _ = newton_polish.map_descent(problem, point.q.mean)
    if mean is point.q.mean:
        return None, 0.0, False
    outcome = _accept(problem, point, history, Gaussian(mean, point.q.precision))
    return outcome, 1.0, outcome is not None


def _newton_proposal(problem, point, history, target) -> tuple[Point | None, float, bool]:
    """Laplace–GGN: the mean equation is a MAP condition; a Newton step on it (CG with the
    Gauss–Newton precision as preconditioner, truncated at negative curvature) removes the linear
    rate of the plain step. Far from a minimum of a non-convex loss the full step overshoots while
    a shorter one still descends, so it is backtracked along its direction down to 1/64.

    :return: ``(point or None, step, accelerated)``.
    """
    if not newton_polish.applies(problem):
        return None, 0.0, False
    family, q = problem.family, point.q
    _, pre = family.fixed_point(q, point.totals[2], point.totals[3])
    step = newton_polish.newton_direction(problem, q, point.totals[0], pre)
    rho = 1.0
    while step is not None and rho >= _NEWTON_MIN_STEP:
        outcome = _accept(problem, point, history, Gaussian(q.mean + rho * step, target))
        if outcome is not None:
            return outcome, rho, True
        rho *= 0.5
    return None, rho, False


def _anderson_proposal(problem, point, history, anderson, memory) -> tuple[Point | None, float, bool]:
    """The Anderson (type II) candidate of the last ``memory`` undamped steps, if it makes progress."""
    if memory <= 0 or int(anderson.count) <= 1:
        return None, 0.0, False
    outcome = _accept(problem, point, history, _unpack(anderson_mix(anderson), point.q))
    return outcome, 1.0, outcome is not None


def _damped_proposal(problem, point, history, direction, target, options) -> tuple[Point | None, float, bool]:
    """The damped step of rate ``ρ`` (:func:`_damped_trial`), halved from ``options.step_size`` until
    it makes progress; a falling residual far from the fixed point is accepted only on a second,
    permissive pass."""
    target_pd = problem.family.accepts_target(target)
    for permissive in (False, True):
        rho = float(options.step_size)
        while rho >= options.min_step:
            trial = _damped_trial(point.q, direction, target, point.totals[0], rho, target_pd, problem.family)
            outcome = _accept(problem, point, history, trial, permissive)
            if outcome is not None:
                return outcome, rho, False
            rho *= 0.5
    return None, 0.0, False


def solve(problem, q, tol=None, max_iters=None, step_size=1.0, min_step=2.0**-30, raise_on_failure=True,
          progress=False, sites=None, sums=None, memory=3) -> tuple[Any, Any, Any]:
    """Iterate natural-gradient steps from ``q`` until the dual-form residual is below ``tol``.

    The host driver of :func:`solve_init` / :func:`solve_step`. While convergence is linear
    (the residual shrinks by less than 100× per step), an iteration first tries an
    Anderson-accelerated step built from the last ``memory`` undamped steps, which removes the
    slow modes; when that trial is not positive definite or makes no progress, it falls back to
    the damped step with backtracking.

    :param SiteProblem problem: model, data and site options.
    :param Gaussian q: starting point.
    :param float tol: residual tolerance (default :func:`default_tol` of the dtype).
    :param int max_iters: maximum number of accepted steps; ``None`` (default): 100, extended
        while the run converges linearly by what its rate predicts
        (:func:`~numpyro_pc.solvers.fixed_point.iteration_budget`, at most 1000).
    :param float step_size: initial ``ρ`` of a damped step (``1`` is a full Newton-like step).
    :param float min_step: smallest ``ρ`` tried before giving up.
    :param bool raise_on_failure: raise :class:`ConvergenceError` if the tolerance is not
        reached (the error carries the last iterate); otherwise warn.
    :param bool progress: show a progress bar.
    :param int memory: Anderson history length (``0`` disables acceleration).
    :return: ``(q, sites, history)`` where history is a list of :class:`~numpyro_pc.protocols.records.IterationInfo`.
    """
    tol = default_tol(q.mean.dtype) if tol is None else float(tol)
    options = SolveOptions(float(step_size), float(min_step), int(memory))
    state = solve_init(problem, q, sites, sums, memory)
    auto = max_iters is None
    max_iters = BASE_ITERATIONS if auto else int(max_iters)
    bar = progress_bar(progress, max_iters)
    while not solve_converged(state, tol):
        if state.iteration >= max_iters:
            more = iteration_budget([h["residual"] for h in state.history], tol, state.iteration) if auto else 0
            if more == 0:
                break
            max_iters += more
            if bar is not None:
                bar.total = max_iters
        state = solve_step(problem, state, options)
        if state.stalled:
            break
        if bar is not None:
            bar.update(1)
            bar.set_postfix(residual=f"{state.point.residual:.2e}")
        if state.stagnant is not None and not solve_converged(state, tol):
            break
    if bar is not None:
        bar.close()
    point, history, it = state.point, list(state.history), state.iteration
    if not solve_converged(state, tol):
        stagnant = state.stagnant
        why = (stagnant if stagnant is not None else "no step size made progress" if it < max_iters
               else f"max_iters={max_iters} reached")
        message = (f"refinement stopped at residual {point.residual:.3e} > tol {tol:.1e} after {it} iteration(s) "
                   f"({why}); mean part {point.parts['mean']:.2e}, precision part {point.parts['precision']:.2e}. "
                   + _advice(point, history))
        if raise_on_failure:
            error = StagnationError if stagnant is not None or it < max_iters else ConvergenceError
            raise error(message, posterior=(point.q, point.sites), history=history)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    _check_representable(problem, point)
    return point.q, point.sites, history


def _watchdog(problem, point) -> list[Point] | None:
    """Up to ``_WATCH`` undamped steps from ``point``: the path to the first one whose residual is
    below ``point``'s, or ``None`` (a watchdog, Chamberlain et al. 1982).

    For a family judged by the residual alone the undamped map can converge while its first
    step raises the residual (the low-rank family from a MAP start on a7a: 9.0e-3, 2.0e-2,
    5.4e-4, then to 1e-16), which no damped step satisfies.
    """
    path, reference = [], point.residual
    for _ in range(_WATCH):
        direction, target = fixed_point_map(problem, point)
        point = _evaluate_trial(problem, Gaussian(point.q.mean + direction, target))
        if point is None or not np.isfinite(point.residual):
            return None
        path.append(point)
        if point.residual < reference:
            return path
    return None


def _damped_trial(q, direction, target, grad, rho, target_pd, family=None) -> Gaussian:
    r"""The step of rate ``ρ`` towards the fixed-point map's ``(m + direction, target)``.

    While the target precision ``T = Σ_i Ĥ_i`` is positive definite this is the plain
    damped step. Where it is not (far from the optimum of a non-log-concave model, e.g. a
    neural network under Monte Carlo expectations) the full family takes the
    positive-definite Bayesian learning rule of Lin, Schmidt & Khan (2020, eq. 8),

    .. math::

        S_ρ = S + ρ G + \tfrac{ρ^2}{2} G S^{-1} G, \quad G = T − S, \qquad
        m_ρ = m − ρ S_ρ^{-1} \textstyle\sum_i \hat g_i,

    which is positive definite for every ``ρ`` and has the same fixed points.
    """
    if target_pd:
        precision = (1.0 - rho) * q.precision + rho * target if family is None else family.blend(q.precision, target,
                                                                                                    rho)
        return Gaussian(q.mean + rho * direction, precision)
    gap = target - q.precision
    chol = jnp.linalg.cholesky(q.precision)
    precision = q.precision + rho * gap + 0.5 * rho**2 * (gap @ cho_solve((chol, True), gap))
    precision = 0.5 * (precision + precision.T)
    return Gaussian(q.mean - rho * cho_solve((jnp.linalg.cholesky(precision), True), grad), precision)


def _check_representable(problem, point) -> None:
    """Refuse a float32 posterior whose covariance float32 cannot get right.

    The precision ``S = Σ_i Ĥ_i`` is re-accumulated in float64 on the host from the same
    sites; where the float32 covariance's standard deviations differ from the float64
    ones by more than 25 % (a collinear design: the small eigenvalues of ``S`` are below the
    rounding of the float32 sum), or the float64 precision has ``cond(S)·eps₃₂ ≥ 1``, the
    result is refused — however small its residual.
    """
    family, q, sites = problem.family, point.q, point.sites
    if (q.mean.dtype == jnp.float64 or sites.curv.detail == NONE or not gaussian_solver(family).dense_checks
            or q.precision.ndim == 0):  # a fixed precision: nothing accumulated to check
        return
    w = np.ones(sites.num_examples) if problem.weights is None else np.asarray(problem.weights, np.float64)
    f64 = lambda x: np.asarray(x, dtype=np.float64)  # noqa: E731
    with jax.enable_x64(True):
        store = jax.tree.map(lambda x: jnp.asarray(f64(x) if jnp.issubdtype(x.dtype, jnp.floating) else x),
                             sites.curv)  # a sparse store's column index stays an integer
        weights = jnp.asarray(w)
        eig: Any
        if q.precision.ndim == 1:  # a diagonal family keeps the diagonal of the curvature: O(d), no (d, d)
            eig = f64(store.weighted_diagonal(weights))
            if problem.include_prior:
                eig = eig + f64(prior_diagonal(sites.prior_curvature))
            if problem.base is not None:
                eig = eig + f64(problem.base.precision)
            sd32, sd64 = 1.0 / np.sqrt(np.abs(f64(q.precision))), 1.0 / np.sqrt(np.abs(eig))
            eig = np.sort(eig).astype(np.float64)
        else:
            total = f64(store.weighted_dense(weights))
            if problem.include_prior:
                total = total + f64(sites.prior_curvature_dense())
            if problem.base is not None:
                total = total + f64(family.dense_precision(Gaussian(q.mean, problem.base.precision)))
            eig = np.linalg.eigvalsh(0.5 * (total + total.T))
            sd32 = np.sqrt(np.abs(np.diag(np.linalg.inv(f64(family.dense_precision(q))))))
            sd64 = np.sqrt(np.abs(np.diag(np.linalg.pinv(total))))
    eps = float(jnp.finfo(q.mean.dtype).eps)
    cond = float(eig[-1] / eig[0]) if eig[0] > 0 else float("inf")
    worst = float(np.max(np.abs(np.log(sd32 / sd64)))) if np.all(sd64 > 0) else float("inf")
    if not (cond * eps < 1.0 and worst < np.log(1.25)):
        raise PrecisionLossError(
            f"the posterior is beyond what {jnp.dtype(q.mean.dtype).name} can represent: re-accumulated in float64, "
            f"its precision has condition number {cond:.2e} (eps {eps:.1e}) and its standard deviations differ from "
            f"the {jnp.dtype(q.mean.dtype).name} ones by up to a factor {np.exp(worst):.3g}. Enable float64 "
            "(jax.config.update('jax_enable_x64', True) or `with jax.enable_x64():`), or reparameterise the model "
            "(collinear covariates, unscaled data).")


def _stagnation(history, minimises_objective=False) -> str | None:
    """:func:`numpyro_pc.solvers.fixed_point.stagnation` of a solve's history (a phrase, or ``None``); the objective
    counts as progress for a family whose iteration minimises it."""
    objectives = [h["objective"] for h in history] if minimises_objective else None
    return stagnation([h["residual"] for h in history], [h["step"] for h in history[1:]], objectives)


def _advice(point, history) -> str:
    """What to try, from which identity is off, the dtype and how the run went."""
    dtype = jnp.dtype(point.q.mean.dtype)
    eps = float(jnp.finfo(dtype).eps)
    if dtype != jnp.float64 and point.residual < 1e4 * eps:  # a stall within 10⁴ ε: the sums' rounding
        return (f"The most likely cause is the dtype: in {dtype.name} (machine epsilon {eps:.1e}) the sums over "
                "the sites carry rounding errors that grow with the number of examples and the data's scale, and "
                "the residual stalls at their level. Rerun in float64 (jax.config.update('jax_enable_x64', True), "
                "or `with jax.enable_x64():` around the fit and its data) before changing the model; if float64 "
                "stalls as well, standardise covariates or try family='diagonal'.")
    if point.parts["precision"] > 10 * point.parts["mean"]:
        cause = ("The precision identity is the one off: the expected curvature E_q[∇²ℓ] changes fast with q, "
                 "typical of scale parameters (σ, τ) whose posterior is far from Gaussian in unconstrained "
                 "space, or of a start far from the posterior.")
    else:
        cause = ("The mean identity is the one off: the expected gradients do not balance, typical of a "
                 "non-log-concave or multimodal posterior, or of a start far from the posterior.")
    return (cause + " Try: pc.fit's default start (MAP/Laplace, or the mean-field ELBO where the MAP search "
            "fails) if this run started elsewhere (an SVI guide, init='prior'), standardising "
            "covariates, family='diagonal', expectation='delta' for a Laplace-like answer, or a larger max_iters.")


def _history_entry(iteration, point, step, accelerated, start) -> IterationInfo:
    return IterationInfo(iteration=iteration, residual=point.residual, residual_mean=point.parts["mean"],
                         residual_precision=point.parts["precision"], objective=point.objective, step=step,
                         accelerated=accelerated, seconds=time.perf_counter() - start)


