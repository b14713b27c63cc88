r"""Natural-gradient (variational online Newton) solver for the dual-form fixed point.

For a Gaussian ``q = N(m, S⁻¹)`` the BLR step with rate ``ρ`` is (paper App. A.3,
Khan & Rue 2023 §3.1.2)

.. math::

    S \leftarrow (1-\rho) S + \rho \textstyle\sum_{i=0}^N \hat H_i, \qquad
    m \leftarrow m - \rho\, P^{-1} \textstyle\sum_{i=0}^N \hat g_i ,

with ``P = S`` for the full family. For the diagonal and isotropic families the mean is
preconditioned with the full expected Hessian ``Σ_i E_q[∇²ℓ_i]`` (a Newton step on
``E_q[Σℓ_i]``, by Price's theorem), which reaches the same fixed point — ``S = Σ Ĥ_i``
and ``Σ ĝ_i = 0`` — far faster than a diagonally preconditioned step.

Each step is damped by backtracking: ``ρ`` is halved until the new precision is
positive definite and the step makes progress: the variational objective decreases, or
the dual-form residual falls below the largest of the last three residuals (a
non-monotone rule: full steps alternate between reducing the mean and the precision
identity, which a monotone test would reject). Site computations at a rejected trial are
discarded; accepted trials are reused as the next iteration's sites.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import cho_solve

from .errors import ConvergenceError, NonFiniteResultError
from .families import FullGaussian, Gaussian, IsotropicGaussian
from .sites import compute_sites

__all__ = ["SiteProblem", "dual_residual", "solve", "default_tol"]

_WATCH = 3  # residuals remembered by the non-monotone acceptance rule


class SiteProblem(NamedTuple):
    """Everything needed to recompute sites at a new ``q`` (model, data and options)."""

    spec: object
    data: object
    family: object
    rule: object
    curvature: str
    storage: str
    chunk_size: int | None
    ids: object

    def sites(self, q, need_hessian_sum=False):
        return compute_sites(self.spec, self.data, self.family, q, self.rule, curvature=self.curvature,
                             storage=self.storage, chunk_size=self.chunk_size, ids=self.ids,
                             need_hessian_sum=need_hessian_sum)


def default_tol(dtype):
    """Default residual tolerance: ``1e-8`` in float64, ``1e-5`` in float32."""
    return 1e-8 if jnp.dtype(dtype) == jnp.float64 else 1e-5


@jax.jit
def _residual_parts_full(precision, grad_sum, grad_norms, curv_sum):
    r_mean = jnp.linalg.norm(grad_sum) / jnp.maximum(grad_norms, jnp.finfo(grad_sum.dtype).tiny)
    r_prec = jnp.linalg.norm(precision - curv_sum) / jnp.linalg.norm(precision)
    return r_mean, r_prec


def dual_residual(family, q, sites):
    """Relative residuals of the two dual-form identities (DESIGN §2).

    ``mean = ‖Σ_{i=0..N} ĝ_i‖ / Σ_{i=0..N} ‖ĝ_i‖`` (cancellation of the expected
    gradients) and ``precision = ‖S − Σ_{i=0..N} Ĥ_i‖_F / ‖S‖_F`` (zero by construction
    for the isotropic family, whose precision is fixed).

    :return: ``(residual, {"mean": ..., "precision": ...})`` with ``residual`` the larger.
    """
    grad_norms = jnp.linalg.norm(sites.prior_grad) + jnp.sum(jnp.linalg.norm(sites.grad, axis=1))
    if isinstance(family, IsotropicGaussian):
        curv = q.precision
    else:
        curv = sites.curvature_sum(family)
    r_mean, r_prec = _residual_parts_full(q.precision, sites.grad_sum(), grad_norms, curv)
    r_mean, r_prec = float(r_mean), float(r_prec)
    if isinstance(family, IsotropicGaussian):
        r_prec = 0.0
    return max(r_mean, r_prec), {"mean": r_mean, "precision": r_prec}


def _objective(problem, q, sites, sums):
    """Variational objective ``Σ_{i≥0} E_q[ℓ_i] − H(q)`` (the MAP loss for the delta rule)."""
    value = sums.loss + sites.prior_loss
    if problem.rule.kind != "delta":
        value = value - problem.family.entropy(q)
    return float(value)


def _chol_or_none(matrix):
    chol = jnp.linalg.cholesky(matrix)
    return chol if bool(jnp.all(jnp.isfinite(chol))) else None


def _regularised_chol(matrix):
    """Cholesky of ``matrix + μI`` with the smallest ``μ`` in a geometric ladder that works."""
    chol = _chol_or_none(matrix)
    if chol is not None:
        return chol, 0.0
    scale = float(jnp.mean(jnp.abs(jnp.diag(matrix)))) or 1.0
    eye = jnp.eye(matrix.shape[0], dtype=matrix.dtype)
    for power in range(-10, 4):
        jitter = scale * 10.0**power
        chol = _chol_or_none(matrix + jitter * eye)
        if chol is not None:
            return chol, jitter
    raise NonFiniteResultError("the expected Hessian could not be regularised to positive definiteness")


def _check_finite(sites):
    if not (bool(jnp.all(jnp.isfinite(sites.grad))) and bool(jnp.all(jnp.isfinite(sites.prior_grad)))):
        raise NonFiniteResultError(
            "site gradients are not finite at the current posterior; the model's log density is NaN/inf "
            "somewhere the posterior puts mass (check priors, constraints and the data)."
        )


def solve(problem, q, tol=None, max_iters=100, step_size=1.0, min_step=2.0**-30, raise_on_failure=True,
          progress=False, sites=None, sums=None):
    """Iterate natural-gradient steps from ``q`` until the dual-form residual is below ``tol``.

    :param SiteProblem problem: model, data and site options.
    :param Gaussian q: starting point.
    :param float tol: residual tolerance (default :func:`default_tol` of the dtype).
    :param int max_iters: maximum number of accepted steps.
    :param float step_size: initial ``ρ`` of each step (``1`` is a full Newton-like step).
    :param float min_step: smallest ``ρ`` tried before giving up.
    :param bool raise_on_failure: raise :class:`ConvergenceError` if the tolerance is not
        reached (the error carries the last iterate); otherwise warn.
    :param bool progress: show a progress bar.
    :return: ``(q, sites, history)`` where history is a list of per-iteration dicts.
    """
    family = problem.family
    tol = default_tol(q.mean.dtype) if tol is None else float(tol)
    need_sum = not isinstance(family, FullGaussian)
    start = time.perf_counter()
    if sites is None or (need_sum and sums is None) or sums is None:
        sites, sums = problem.sites(q, need_hessian_sum=need_sum)
    _check_finite(sites)
    res, parts = dual_residual(family, q, sites)
    obj = _objective(problem, q, sites, sums)
    history = [dict(iteration=0, residual=res, residual_mean=parts["mean"], residual_precision=parts["precision"],
                    objective=obj, step=0.0, seconds=time.perf_counter() - start)]
    bar = _progress(progress, max_iters)
    it = 0
    while res > tol and it < max_iters:
        it += 1
        grad = sites.grad_sum()
        target = sites.curvature_sum(family) if not isinstance(family, IsotropicGaussian) else q.precision
        if not isinstance(family, FullGaussian):
            hess = sums.hessian + sites.prior_curvature
            pre_chol, _ = _regularised_chol(hess)
            direction = -cho_solve((pre_chol, True), grad)
        rho = float(step_size)
        accepted = False
        while rho >= min_step:
            precision = (1.0 - rho) * q.precision + rho * target
            if not bool(family.is_positive_definite(precision)):
                rho *= 0.5
                continue
            if isinstance(family, FullGaussian):
                chol = jnp.linalg.cholesky(precision)
                mean = q.mean - rho * cho_solve((chol, True), grad)
            else:
                mean = q.mean + rho * direction
            trial = Gaussian(mean, precision)
            t_sites, t_sums = problem.sites(trial, need_hessian_sum=need_sum)
            finite = bool(jnp.all(jnp.isfinite(t_sites.grad))) and bool(jnp.isfinite(t_sums.loss))
            if finite:
                t_res, t_parts = dual_residual(family, trial, t_sites)
                t_obj = _objective(problem, trial, t_sites, t_sums)
                slack = 1e-12 * (1.0 + abs(obj))
                reference = max(h["residual"] for h in history[-_WATCH:])
                if np.isfinite(t_res) and (t_res < reference or t_obj <= obj + slack):
                    accepted = True
                    break
            rho *= 0.5
        if not accepted:
            break
        q, sites, sums, res, parts, obj = trial, t_sites, t_sums, t_res, t_parts, t_obj
        history.append(dict(iteration=it, residual=res, residual_mean=parts["mean"],
                            residual_precision=parts["precision"], objective=obj, step=rho,
                            seconds=time.perf_counter() - start))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(residual=f"{res:.2e}")
    if bar is not None:
        bar.close()
    if res > tol:
        why = "no step size made progress" if it < max_iters else f"max_iters={max_iters} reached"
        message = (f"refinement stopped at residual {res:.3e} > tol {tol:.1e} after {it} iteration(s) ({why}); "
                   f"mean part {parts['mean']:.2e}, precision part {parts['precision']:.2e}.")
        if raise_on_failure:
            raise ConvergenceError(message, posterior=(q, sites), history=history)
        import warnings
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    return q, sites, history


def _progress(enabled, total):
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="refine", leave=False)
