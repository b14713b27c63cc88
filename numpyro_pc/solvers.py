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
residual alone (``minimises_objective`` false) then tries a watchdog: up to three undamped
steps, accepted if one ends below the current residual. Site computations at a rejected trial are
discarded; accepted trials are reused as the next iteration's sites.

Under the delta rule the sites depend on the mean alone: every evaluated point takes the
precision ``T(m)`` its own sites ask for, the objective is the MAP loss at the mean, and
a Laplace–Gauss–Newton fit tries a Newton–CG step on the MAP condition first
(:mod:`numpyro_pc.newton_polish`), backtracked along its direction, so the iteration is a
globalised Newton method on the mean.
"""

from __future__ import annotations

import time
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import cho_solve

from .errors import ConvergenceError, NonFiniteResultError, PrecisionLossError, StagnationError
from .curvature import FULL, NONE
from . import newton_polish
from .fixed_point import anderson_init, anderson_mix, anderson_push, anderson_restart, default_tol, stagnation
from .families import Gaussian
from .rowops import all_finite
from .sites import compute_sites

__all__ = ["SiteProblem", "dual_residual", "solve", "default_tol", "live_totals"]

_WATCH = 3  # residuals remembered by the non-monotone acceptance rule
_LINEAR = 1e-2  # accelerate only while the residual shrinks by less than 100× per step
_LOCAL = 1e-2  # below this residual, progress may also be judged by the residual itself
_NEWTON_MIN_STEP = 2.0**-6  # shortest step along a Newton–CG direction before the plain damped step is tried


class SiteProblem(NamedTuple):
    """A dual-form fixed-point problem: which terms are live and how their sites are computed.

    The target is ``q ∝ base(z) · exp(−ℓ_0(z))^{[include_prior]} · Π_i exp(−ℓ_i(z))`` over the
    examples in ``data``, where ``base`` is a fixed (possibly improper) Gaussian factor in
    natural parameters — e.g. the old posterior with the sites of corrected examples
    divided out (docs/adapting.md, "Adding data" and "Deleting data").
    """

    spec: object
    data: object
    family: object
    rule: object
    curvature: str
    storage: str
    chunk_size: int | None
    ids: object
    base: object = None
    include_prior: bool = True
    weights: object = None

    def sites(self, q, need_hessian_sum=False):
        return compute_sites(self.spec, self.data, self.family, q, self.rule, curvature=self.curvature,
                             storage=self.storage, chunk_size=self.chunk_size, ids=self.ids,
                             need_hessian_sum=need_hessian_sum, weights=self.weights)


def _base_terms(family, q, base, point_loss=False):
    """Gradient, family-format and dense curvature, and loss of a Gaussian factor.

    The factor ``exp(bᵀz − ½ zᵀBz)`` contributes the loss ``½ zᵀBz − bᵀz``: its expectation
    under ``q`` (``+ ½ tr(BΣ)``), or its value at the mean when ``point_loss``.
    """
    b_mean = family.natural(Gaussian(q.mean, base.precision)).linear  # B m
    grad = b_mean - base.linear
    dense_b = family.dense_precision(Gaussian(q.mean, base.precision)) if family.needs_dense_sum else None
    loss = 0.5 * q.mean @ b_mean - base.linear @ q.mean
    if not point_loss:
        loss = loss + 0.5 * family.trace_with_covariance(q, base.precision)
    return grad, base.precision, dense_b, loss


def _point_rule(problem):
    """Whether the problem's sites are evaluated at the mean alone (the delta rule): then they do not
    depend on the precision, and neither does the objective (the MAP loss)."""
    return problem.rule is not None and problem.rule.kind == "delta"


def _totals(problem, q, sites, sums=None):
    """Sums over the live terms: gradient, Σ‖gradients‖, curvature (family format), dense curvature, loss."""
    return live_totals(problem.family, bool(problem.include_prior), q, sites, sums, problem.base, problem.weights,
                       point_loss=_point_rule(problem))


@partial(jax.jit, static_argnums=(0, 1), static_argnames=("point_loss",))
def live_totals(family, include_prior, q, sites, sums, base, weights, point_loss=False):
    """Sums over a problem's live terms at ``q`` (pure; the solver's and :mod:`numpyro_pc.site_table`'s).

    :param family: the :class:`~numpyro_pc.families.ExponentialFamily` (static).
    :param bool include_prior: whether the prior site is a live term (static).
    :param q: the current member.
    :param sites: the live examples' :class:`~numpyro_pc.sites.Sites` (their prior site is used
        when ``include_prior``).
    :param sums: their :class:`~numpyro_pc.sites.SiteSums`, or ``None`` (no dense curvature and loss).
    :param base: a fixed Gaussian factor in natural parameters, or ``None``.
    :param weights: per-example weights of the live examples, or ``None`` (all 1).
    :param bool point_loss: the base factor's loss at the mean rather than its expectation (static;
        the delta rule, whose example and prior losses are values at the mean).
    :return: ``(gradient, Σ‖gradients‖, target precision in the family's format, dense
        curvature or None, expected loss or None)``.
    """
    grad, norms = sites.grad_totals(q.mean, weights)
    w = jnp.ones(sites.num_examples, grad.dtype) if weights is None else weights
    dense = None if sums is None or not family.needs_dense_sum else sums.hessian
    loss = None if sums is None else sums.loss
    prior_curvature = b_curv = None
    if include_prior:
        p_grad = sites.prior_grad_at(q.mean)
        grad, norms = grad + p_grad, norms + jnp.linalg.norm(p_grad)
        prior_curvature = sites.prior_curvature
        dense = None if dense is None else dense + sites.prior_curvature_dense()
        loss = None if loss is None else loss + sites.prior_loss
    if base is not None:
        b_grad, b_curv, b_dense, b_loss = _base_terms(family, q, base, point_loss)
        grad, norms = grad + b_grad, norms + jnp.linalg.norm(b_grad)
        dense = None if dense is None else dense + b_dense
        loss = None if loss is None else loss + b_loss
    # the family forms the target from all its parts at once (a non-linear projection sees their sum)
    curv = family.target_precision(sites.curv, w, prior_curvature, b_curv)
    if not family.needs_dense_sum:  # a matrix-free family may still precondition the mean with Σ Ĥ_i
        dense = family.newton_operator(sites.curv, w, prior_curvature, b_curv)
    return grad, norms, curv, dense, loss


def dual_residual(family, q, sites, base=None, include_prior=True, weights=None):
    """Relative residuals of the two dual-form identities (docs/notation.md, "Dual-form residual").

    With ``∇ℓ̂_i(m) = ĝ_i + Ĥ_i (m − m_i)`` the gradient of site ``i`` at the mean (equal to
    ``ĝ_i`` for a site computed at ``q`` itself):

    ``mean = ‖Σ_i ∇ℓ̂_i(m)‖ / Σ_i ‖∇ℓ̂_i(m)‖`` (the site gradients cancel at the mean) and
    ``precision = ‖S − Σ_i Ĥ_i‖_F / ‖S‖_F`` (zero by construction for the isotropic family,
    whose precision is fixed); sums run over the prior site, the example sites and an
    optional fixed Gaussian ``base`` factor; example sites may carry ``weights``.

    :return: ``(residual, {"mean": ..., "precision": ...})`` with ``residual`` the larger.
    """
    if sites.num_examples:  # bucket-padded with weight-0 copies: a growing stream reuses a few compilations
        sites, weights = sites.bucketed(weights)
    problem = SiteProblem(None, None, family, None, None, None, None, None, base, include_prior, weights)
    return _residual_from_totals(family, q, _totals(problem, q, sites))


def _residual_from_totals(family, q, totals):
    grad, norms, curv = totals[:3]
    r_mean = float(jnp.linalg.norm(grad) / jnp.maximum(norms, jnp.finfo(grad.dtype).tiny))
    r_prec = float(family.precision_residual(q.precision, curv))
    return max(r_mean, r_prec), {"mean": r_mean, "precision": r_prec}


class _Point(NamedTuple):
    """An evaluated iterate: its sites, their sums over the live terms, residual and objective."""

    q: object
    sites: object
    totals: tuple
    residual: float
    parts: dict
    objective: float


def _evaluate(problem, q, sites, sums):
    """Residual and objective of ``q`` from one pass over its sites' totals.

    Under the delta rule the sites, their totals and the objective depend on the mean alone, so
    the precision the fixed point asks for at that mean, ``S = T(m)``, is known as soon as the
    sites are: the point takes it (when it is positive definite), and the precision identity
    then holds by construction. Without this a trial that moves the mean carries the precision
    of the previous mean, and the solver ends up trading one identity against the other (an
    uncorrected update of the digits network wandered between residuals 0.01 and 0.2 for 35
    iterations). The fixed points are unchanged: ``∇L(m) = 0`` and ``S = T(m)``.
    """
    totals = _totals(problem, q, sites, sums)
    if _point_rule(problem):
        family = problem.family
        own, _ = family.fixed_point(q, totals[2], totals[3])
        if bool(family.is_positive_definite(own)):
            q = Gaussian(q.mean, own)
    res, parts = _residual_from_totals(problem.family, q, totals)
    return _Point(q, sites, totals, res, parts, _objective_from_totals(problem, q, totals))


def _objective_from_totals(problem, q, totals):
    """Variational objective ``Σ E_q[live losses] − H(q)`` (the MAP loss for the delta rule)."""
    value = totals[4]
    if problem.rule.kind != "delta":
        value = value - problem.family.entropy(q)
    return float(value)


def _check_finite(sites):
    if not (all_finite(sites.grad) and all_finite(sites.prior_grad)):
        raise NonFiniteResultError(
            "site gradients are not finite at the current posterior; the model's log density is NaN/inf "
            "somewhere the posterior puts mass (check priors, constraints and the data)."
        )


def _fixed_point_map(problem, point):
    """The undamped step ``T(m, S)`` (``ρ = 1``); its fixed points are the dual-form solutions."""
    grad, _, target, dense, _ = point.totals
    target, pre = problem.family.fixed_point(point.q, target, dense)
    return -problem.family.precondition(pre, grad), target


def _pack(q):
    return jnp.concatenate([q.mean, jnp.ravel(q.precision)])


def _unpack(x, like):
    d = like.mean.shape[0]
    return Gaussian(x[:d], jnp.reshape(x[d:], like.precision.shape))


def solve(problem, q, tol=None, max_iters=100, step_size=1.0, min_step=2.0**-30, raise_on_failure=True,
          progress=False, sites=None, sums=None, memory=3):
    """Iterate natural-gradient steps from ``q`` until the dual-form residual is below ``tol``.

    While convergence is linear (the residual shrinks by less than 100× per step), an
    iteration first tries an Anderson-accelerated step built from the last ``memory``
    undamped steps, which removes the slow modes; when that trial is not positive definite or makes no
    progress, it falls back to the damped step with backtracking.

    :param SiteProblem problem: model, data and site options.
    :param Gaussian q: starting point.
    :param float tol: residual tolerance (default :func:`default_tol` of the dtype).
    :param int max_iters: maximum number of accepted steps.
    :param float step_size: initial ``ρ`` of a damped step (``1`` is a full Newton-like step).
    :param float min_step: smallest ``ρ`` tried before giving up.
    :param bool raise_on_failure: raise :class:`ConvergenceError` if the tolerance is not
        reached (the error carries the last iterate); otherwise warn.
    :param bool progress: show a progress bar.
    :param int memory: Anderson history length (``0`` disables acceleration).
    :return: ``(q, sites, history)`` where history is a list of per-iteration dicts.
    """
    family = problem.family
    tol = default_tol(q.mean.dtype) if tol is None else float(tol)
    need_sum = family.needs_dense_sum
    start = time.perf_counter()
    if sites is None or sums is None:
        sites, sums = problem.sites(q, need_hessian_sum=need_sum)
    _check_finite(sites)
    point = _evaluate(problem, q, sites, sums)
    history = [_history_entry(0, point, 0.0, False, start)]
    bar = _progress(progress, max_iters)
    anderson = anderson_init(_pack(q), memory)
    it = 0

    def attempt(trial, permissive=False):
        if not bool(jnp.all(jnp.isfinite(trial.mean))) or not bool(family.is_positive_definite(trial.precision)):
            return None
        t_sites, t_sums = problem.sites(trial, need_hessian_sum=need_sum)
        if not (bool(jnp.all(jnp.isfinite(t_sites.grad))) and bool(jnp.isfinite(t_sums.loss))):
            return None
        candidate = _evaluate(problem, trial, t_sites, t_sums)
        reference = max(h["residual"] for h in history[-_WATCH:])
        slack = 1e-12 * (1.0 + abs(point.objective))
        # far from the fixed point only a lower objective counts: a falling residual ratio
        # there can come from running away (non-log-concave models)
        local = candidate.residual < _LOCAL or permissive or not family.minimises_objective
        descent = family.minimises_objective and candidate.objective <= point.objective + slack
        if np.isfinite(candidate.residual) and ((local and candidate.residual < reference) or descent):
            return candidate
        return None

    if not np.isfinite(point.residual) or not np.isfinite(point.objective):
        raise NonFiniteResultError(
            f"the dual-form residual ({point.residual}) or objective ({point.objective}) is not finite at the "
            "starting posterior; the expected log density overflows there (check priors, constraints, data "
            "scaling, or start from init='map')."
        )
    stagnant = None
    while not point.residual <= tol and it < max_iters:
        it += 1
        q = point.q
        direction, target = _fixed_point_map(problem, point)
        x = _pack(q)
        anderson = anderson_push(anderson, x, _pack(Gaussian(q.mean + direction, target)) - x)
        outcome, rho, accelerated = None, 0.0, False
        linear = len(history) > 1 and history[-1]["residual"] > _LINEAR * history[-2]["residual"]
        if newton_polish.applies(problem):
            # Laplace–GGN: the mean equation is a MAP condition; a Newton step on it (CG with the
            # Gauss–Newton precision as preconditioner, truncated at negative curvature) removes
            # the linear rate of the plain step, and far from the optimum it is judged by the
            # same objective test as any other trial
            _, pre = family.fixed_point(q, point.totals[2], point.totals[3])
            step = newton_polish.newton_direction(problem, q, point.totals[0], pre)
            rho = 1.0
            while step is not None and outcome is None and rho >= _NEWTON_MIN_STEP:
                # backtracking along the Newton direction: far from a minimum of a non-convex
                # loss the full step overshoots, while a shorter one still descends
                outcome = attempt(Gaussian(q.mean + rho * step, target))
                rho = rho if outcome is not None else 0.5 * rho
            accelerated = outcome is not None
        if outcome is None and memory > 0 and int(anderson.count) > 1 and linear:
            outcome = attempt(_unpack(anderson_mix(anderson), q))
            rho, accelerated = 1.0, outcome is not None
        if outcome is None:
            anderson = anderson_restart(anderson, keep=1)  # restart the acceleration from the current point
            target_pd = family.accepts_target(target)
            for permissive in (False, True):  # a falling residual far away counts only as a last resort
                rho = float(step_size)
                while rho >= min_step and outcome is None:
                    trial = _damped_trial(q, direction, target, point.totals[0], rho, target_pd, family)
                    outcome = attempt(trial, permissive)
                    if outcome is None:
                        rho *= 0.5
                if outcome is not None:
                    break
        if outcome is None and not family.minimises_objective:
            path = _watchdog(problem, point, need_sum)
            if path is not None:  # the intermediate full steps are iterations too
                for passed in path[:-1]:
                    history.append(_history_entry(it, passed, 1.0, False, start))
                    it += 1
                outcome, rho, accelerated = path[-1], 1.0, False
                anderson = anderson_restart(anderson)
        if outcome is None:
            break
        point = outcome
        history.append(_history_entry(it, point, rho, accelerated, start))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(residual=f"{point.residual:.2e}")
        stagnant = _stagnation(history, family.minimises_objective)
        if stagnant is not None and not point.residual <= tol:
            break
    if bar is not None:
        bar.close()
    if not point.residual <= tol:
        why = (stagnant if stagnant is not None else "no step size made progress" if it < max_iters
               else f"max_iters={max_iters} reached")
        message = (f"refinement stopped at residual {point.residual:.3e} > tol {tol:.1e} after {it} iteration(s) "
                   f"({why}); mean part {point.parts['mean']:.2e}, precision part {point.parts['precision']:.2e}. "
                   + _advice(point, history))
        if raise_on_failure:
            error = StagnationError if stagnant is not None or it < max_iters else ConvergenceError
            raise error(message, posterior=(point.q, point.sites), history=history)
        import warnings
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    _check_representable(problem, point)
    return point.q, point.sites, history


def _watchdog(problem, point, need_sum):
    """Up to ``_WATCH`` undamped steps from ``point``: the path to the first one whose residual is
    below ``point``'s, or ``None`` (a watchdog, Chamberlain et al. 1982).

    For a family judged by the residual alone the undamped map can converge while its first
    step raises the residual (the low-rank family from a MAP start on a7a: 9.0e-3, 2.0e-2,
    5.4e-4, then to 1e-16), which no damped step satisfies.
    """
    family, path, reference = problem.family, [], point.residual
    for _ in range(_WATCH):
        direction, target = _fixed_point_map(problem, point)
        trial = Gaussian(point.q.mean + direction, target)
        if not bool(jnp.all(jnp.isfinite(trial.mean))) or not bool(family.is_positive_definite(trial.precision)):
            return None
        t_sites, t_sums = problem.sites(trial, need_hessian_sum=need_sum)
        if not (bool(jnp.all(jnp.isfinite(t_sites.grad))) and bool(jnp.isfinite(t_sums.loss))):
            return None
        point = _evaluate(problem, trial, t_sites, t_sums)
        if not np.isfinite(point.residual):
            return None
        path.append(point)
        if point.residual < reference:
            return path
    return None


def _damped_trial(q, direction, target, grad, rho, target_pd, family=None):
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


def _check_representable(problem, point):
    """Refuse a float32 posterior whose covariance float32 cannot get right.

    The precision ``S = Σ_i Ĥ_i`` is re-accumulated in float64 on the host from the same
    sites; where the float32 covariance's standard deviations differ from the float64
    ones by more than 25 % (a collinear design: the small eigenvalues of ``S`` are below the
    rounding of the float32 sum), or the float64 precision has ``cond(S)·eps₃₂ ≥ 1``, the
    result is refused — however small its residual.
    """
    family, q, sites = problem.family, point.q, point.sites
    if q.mean.dtype == jnp.float64 or sites.curv.detail == NONE or not family.dense_checks:
        return
    w = np.ones(sites.num_examples) if problem.weights is None else np.asarray(problem.weights, np.float64)
    f64 = lambda x: np.asarray(x, dtype=np.float64)  # noqa: E731
    with jax.enable_x64(True):
        store = jax.tree.map(lambda x: jnp.asarray(f64(x)), sites.curv)
        weights = jnp.asarray(w)
        total = f64(store.weighted_dense(weights) if store.detail == FULL else jnp.diag(store.weighted_diagonal(weights)))
    if problem.include_prior:
        total = total + f64(sites.prior_curvature_dense())
    if problem.base is not None:
        total = total + f64(family.dense_precision(Gaussian(q.mean, problem.base.precision)))
    if q.precision.ndim == 1:  # a diagonal family keeps the diagonal of the curvature
        total = np.diag(np.diag(total))
    eps = float(jnp.finfo(q.mean.dtype).eps)
    eig = np.linalg.eigvalsh(0.5 * (total + total.T))
    cond = float(eig[-1] / eig[0]) if eig[0] > 0 else float("inf")
    sd32 = np.sqrt(np.abs(np.diag(np.linalg.inv(f64(family.dense_precision(q))))))
    sd64 = np.sqrt(np.abs(np.diag(np.linalg.pinv(total))))
    worst = float(np.max(np.abs(np.log(sd32 / sd64)))) if np.all(sd64 > 0) else float("inf")
    if not (cond * eps < 1.0 and worst < np.log(1.25)):
        raise PrecisionLossError(
            f"the posterior is beyond what {jnp.dtype(q.mean.dtype).name} can represent: re-accumulated in float64, "
            f"its precision has condition number {cond:.2e} (eps {eps:.1e}) and its standard deviations differ from "
            f"the {jnp.dtype(q.mean.dtype).name} ones by up to a factor {np.exp(worst):.3g}. Enable float64 "
            "(jax.config.update('jax_enable_x64', True) or `with jax.enable_x64():`), or reparameterise the model "
            "(collinear covariates, unscaled data).")


def _stagnation(history, minimises_objective=False):
    """:func:`numpyro_pc.fixed_point.stagnation` of a solve's history (a phrase, or ``None``); the objective
    counts as progress for a family whose iteration minimises it."""
    objectives = [h["objective"] for h in history] if minimises_objective else None
    return stagnation([h["residual"] for h in history], [h["step"] for h in history[1:]], objectives)


def _advice(point, history):
    """What to try, from which identity is off and how the run went."""
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


def _history_entry(iteration, point, step, accelerated, start):
    return dict(iteration=iteration, residual=point.residual, residual_mean=point.parts["mean"],
                residual_precision=point.parts["precision"], objective=point.objective, step=step,
                accelerated=accelerated, seconds=time.perf_counter() - start)


def _progress(enabled, total):
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="refine", leave=False, disable=False, mininterval=0.5)
