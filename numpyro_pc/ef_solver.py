r"""The Bayesian learning rule in natural parameters for Beta/Gamma/Dirichlet products.

The BLR (paper §2; Khan & Rue, 2023) with step :math:`\rho` iterates

.. math::

    \lambda \leftarrow (1-\rho)\,\lambda + \rho\,\tau(\lambda), \qquad
    \tau(\lambda) = c - \sum_{i \in A} g_i(\lambda),

where :math:`g_i = \nabla_\mu E_q[\ell_i]` are the sites of the *active* terms (recomputed
at every iterate), and :math:`c` collects what is held fixed: :math:`\lambda_0` of a
conjugate-form prior and the frozen sites of terms that are not corrected (the VCL update
freezes the past; site removal subtracts sites). A non-conjugate prior is one more active
term. At the fixed point :math:`\lambda = \tau(\lambda)`, which is the dual form
(eq. ``qdualform``) and the stationarity condition of the ELBO in the family.

The plain iteration converges linearly; Anderson mixing over the last few iterates
(:func:`blr_solve`, ``memory``) accelerates it. Safeguards: the step is halved until every shape parameter of the new iterate is
positive (the domain is convex, so this terminates when :math:`\lambda` is inside); the
step is halved for the following iterations when the residual grows; the residual
:math:`\|\lambda - \tau(\lambda)\| / (1 + \|\tau(\lambda)\|)` must be finite to count as
converged. Conjugate models converge in one full step (:math:`\tau` is constant).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from .errors import ConvergenceError, NonFiniteResultError, OutOfDomainError

__all__ = ["SolveInfo", "blr_solve", "relative_residual"]


class SolveInfo(NamedTuple):
    """What the solver did: ``iterations``, final ``residual``, ``converged``, last step ``rho``."""

    iterations: int
    residual: float
    converged: bool
    rho: float


def relative_residual(lam, target):
    """:math:`\\|\\lambda - \\tau\\| / (1 + \\|\\tau\\|)`."""
    return float(jnp.linalg.norm(lam - target) / (1.0 + jnp.linalg.norm(target)))


def blr_solve(target_fn, in_domain, lam, tol=1e-10, max_iters=200, rho=1.0, raise_on_failure=True, memory=5):
    r"""Run the BLR to the fixed point of ``target_fn``.

    With ``memory > 0`` the plain step is accelerated by Anderson mixing over the last
    ``memory`` iterates (type II; Walker & Ni, 2011): with :math:`f_k = \tau(\lambda_k) - \lambda_k`
    and :math:`\gamma = \arg\min \|f_k - \Delta F\,\gamma\|`, the candidate is
    :math:`\lambda_k + \rho f_k - (\Delta\Lambda + \rho\,\Delta F)\gamma`. It is used only when it
    lies inside the domain; otherwise, and whenever the residual grows (the history is then
    cleared), the safeguarded plain step is taken. A conjugate model still converges in one
    step (there is no history at the first step).

    :param target_fn: ``λ -> (τ(λ), aux)``: the fixed-point target and what was computed
        with it (the sites at ``λ``); jit it.
    :param in_domain: ``λ -> bool``.
    :param lam: the start (inside the domain).
    :return: ``(λ, aux, SolveInfo)`` where ``aux`` belongs to the returned ``λ``.
    :raises OutOfDomainError: if the start is outside the domain, or no step keeps
        the iterate inside.
    :raises NonFiniteResultError: if the sites are not finite.
    :raises ConvergenceError: if ``tol`` is not met in ``max_iters`` (with ``raise_on_failure``).
    """
    if not bool(in_domain(lam)):
        raise OutOfDomainError("the start of the natural-parameter iteration has a non-positive shape "
                               f"parameter: {np.asarray(lam).tolist()}")
    previous = np.inf
    step = float(rho)
    lams, fs = [], []
    for it in range(max_iters + 1):
        target, aux = target_fn(lam)
        if not bool(jnp.all(jnp.isfinite(target))):
            raise NonFiniteResultError(f"the sites at iteration {it} are not finite (natural parameter "
                                       f"{np.asarray(lam).tolist()})")
        res = relative_residual(lam, target)
        if res < tol:
            return lam, aux, SolveInfo(it, res, True, step)
        if it == max_iters:
            break
        if res > previous:
            step = max(step * 0.5, 1e-3)
            lams, fs = [], []
        previous = res
        lams.append(lam)
        fs.append(target - lam)
        lams, fs = lams[-(memory + 1):], fs[-(memory + 1):]
        cand = _anderson(lams, fs, step) if memory and len(fs) > 1 else None
        if cand is None or not bool(in_domain(cand)):
            cand = _plain_step(lam, target, step, in_domain)
        lam = cand
    info = SolveInfo(max_iters, res, False, step)
    if raise_on_failure:
        raise ConvergenceError(f"the natural-parameter iteration did not reach tol={tol:g} in {max_iters} "
                               f"iterations (relative residual {res:.3g})")
    return lam, aux, info


def _plain_step(lam, target, step, in_domain):
    r""":math:`(1-\rho)\lambda + \rho\tau`, halving :math:`\rho` until inside the domain."""
    trial = step
    for _ in range(60):
        cand = (1.0 - trial) * lam + trial * target
        if bool(in_domain(cand)):
            return cand
        trial *= 0.5
    raise OutOfDomainError("no step of the natural-parameter iteration keeps every shape parameter "
                           f"positive (target {np.asarray(target).tolist()})")


def _anderson(lams, fs, step):
    d_lam = jnp.stack([b - a for a, b in zip(lams[:-1], lams[1:])], 1)
    d_f = jnp.stack([b - a for a, b in zip(fs[:-1], fs[1:])], 1)
    gamma = jnp.linalg.lstsq(d_f, fs[-1])[0]
    cand = lams[-1] + step * fs[-1] - (d_lam + step * d_f) @ gamma
    return cand if bool(jnp.all(jnp.isfinite(cand))) else None
