r"""Sites of a Beta/Gamma/Dirichlet posterior and the BLR fixed point over them (paper §2).

In a minimal exponential family the site of loss :math:`\ell_i` at :math:`q` is linear in
the sufficient statistics,

.. math::

    \hat\ell_i(x) = \langle T(x), g_i \rangle, \qquad g_i = \nabla_\mu E_q[\ell_i]
    = F(\lambda)^{-1} \nabla_\lambda E_q[\ell_i] = F^{-1}\,\mathrm{Cov}_q(T(x), \ell_i(x)),

and the posterior is :math:`\lambda = -\sum_{i=0}^N g_i` (:math:`i = 0` the prior term
:math:`\ell_0 = -\log p_0`, so a prior of the family itself gives :math:`\lambda_0 = -g_0`).

**Estimator.** :math:`g_i` is computed as the weighted least-squares regression of
:math:`\ell_i` on :math:`(1, T(x))` over one set of points :math:`x_s` with probability
weights :math:`w_s` that stands for :math:`q` (Salimans & Knowles, 2013, "fixed-form VB by
linear regression"): :math:`g_i = \hat F^{-1} \widehat{\mathrm{Cov}}(T, \ell_i)` with *both*
moments taken under the same discrete measure. When :math:`\ell_i` is linear in
:math:`T` — every conjugate pair — the regression is exact whatever the points, so the
conjugate sites are exact to rounding; otherwise it converges to the true natural
gradient as the rule is refined. The points are

* ``"quadrature"``: the tensor product of the factors' Gauss rules (Gauss–Jacobi for Beta,
  generalised Gauss–Laguerre for Gamma; :func:`numpyro_pc.ef_families.beta_rule`, :func:`~numpyro_pc.ef_families.gamma_rule`), deterministic;
  available when every latent site is a scalar Beta or Gamma;
* ``"mc"``: ``num_samples`` draws of :math:`q` with a fixed seed (Dirichlet and vector
  sites), so the fixed point is deterministic.

The regression residual says how far :math:`\ell_i` is from linear in :math:`T` over the
points; a prior with (relative) residual below ``1e-9`` (float64) is conjugate-form and its
site is kept as the constant :math:`\lambda_0`.

Losses are evaluated with the model binding of :mod:`numpyro_pc.likelihood` at the
unconstrained image of each point; the prior term drops the Jacobian
(:math:`\ell_0^{x}(x) = \ell_0(z) + \log|\det J_T(z)|`), since these families live on the
constrained values.

**The fixed point.** The BLR (paper §2; Khan & Rue, 2023) with step :math:`\rho` iterates

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
(:func:`blr_solve`, ``memory``) accelerates it. Safeguards: the step is halved until
every shape parameter of the new iterate is positive (the domain is convex, so this terminates when :math:`\lambda` is inside); the
step is halved for the following iterations when the residual grows; the residual
:math:`\|\lambda - \tau(\lambda)\| / (1 + \|\tau(\lambda)\|)` must be finite to count as
converged. Conjugate models converge in one full step (:math:`\tau` is constant).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .ef_families import ProductFamily
from .errors import ConvergenceError, InvalidOptionError, NonFiniteResultError, OutOfDomainError
from .likelihood import ModelSpec, example_loss, prior_loss

__all__ = ["EFConfig", "EFSites", "design", "point_losses", "regress", "compute_sites", "conjugate_rtol",
           "SolveInfo", "blr_solve", "relative_residual"]


def conjugate_rtol(dtype):
    """Regression residual below which a loss counts as linear in ``T``: 1e-9 (float64), 1e-4 (float32)."""
    return 1e-9 if jnp.finfo(dtype).bits == 64 else 1e-4


@dataclass(frozen=True)
class EFConfig:
    """Static configuration of the site computation.

    :ivar spec: the :class:`~numpyro_pc.likelihood.ModelSpec`.
    :ivar family: the :class:`~numpyro_pc.ef_families.ProductFamily` (trace order).
    :ivar rule: ``"quadrature"`` or ``"mc"``.
    :ivar num_nodes: Gauss nodes per site (``"quadrature"``).
    :ivar num_samples: draws (``"mc"``).
    :ivar seed: seed of the fixed draws.
    """

    spec: ModelSpec
    family: ProductFamily
    rule: str = "quadrature"
    num_nodes: int = 32
    num_samples: int = 2048
    seed: int = 0

    @classmethod
    def make(cls, spec, family, expectation="auto", num_nodes=32, num_samples=2048, seed=0, max_points=4096):
        """Choose the rule: ``"auto"`` is quadrature when every site has a Gauss rule and the
        tensor grid has at most ``max_points`` points (nodes per site reduced to fit), else MC."""
        if expectation not in ("auto", "quadrature", "mc"):
            raise InvalidOptionError(f"expectation for Beta/Gamma/Dirichlet guides must be 'auto', 'quadrature' or "
                                     f"'mc'; got {expectation!r}")
        k = len(family.factors)
        fits = family.has_rule()
        if expectation == "quadrature" and not fits:
            raise InvalidOptionError("quadrature needs every latent site to be a scalar Beta or Gamma; use 'mc'")
        if expectation != "mc" and fits:
            nodes = int(num_nodes)
            while nodes ** k > max_points and nodes > 4:
                nodes -= 1
            if nodes ** k <= max_points:
                return cls(spec, family, "quadrature", nodes, num_samples, seed)
            if expectation == "quadrature":
                raise InvalidOptionError(f"a tensor Gauss rule over {k} sites exceeds {max_points} points; use 'mc'")
        return cls(spec, family, "mc", num_nodes, int(num_samples), int(seed))


class EFSites(NamedTuple):
    """Sites at one ``λ``: ``grads[i] = ∇_μ E_q[ℓ_i]`` ``(N, P)``, the prior term's ``prior (P,)``,
    and the regression residuals (relative RMS) of the examples ``(N,)`` and of the prior."""

    grads: jax.Array
    prior: jax.Array
    residual: jax.Array
    prior_residual: jax.Array


def design(config, lam):
    """Points standing for ``q``: ``(values dict (S, ...), weights (S,))``."""
    fam = config.family
    if config.rule == "quadrature":
        return fam.tensor_rule(lam, config.num_nodes)
    values = fam.sample(jax.random.PRNGKey(config.seed), lam, config.num_samples)
    return values, jnp.full((config.num_samples,), 1.0 / config.num_samples, lam.dtype)


def _unconstrain(spec, values):
    latent = spec.latent
    parts, log_det = [], 0.0
    for name, transform in zip(latent.names, latent.transforms):
        x = values[name]
        u = transform.inv(x)
        parts.append(jnp.reshape(u, (-1,)))
        log_det = log_det + jnp.sum(transform.log_abs_det_jacobian(u, x))
    return jnp.concatenate(parts), log_det


def point_losses(spec, values, data):
    """``(ℓ_i(x_s))`` ``(N, S)`` and the prior term ``-log p_0(x_s)`` ``(S,)`` at the points."""

    def at(point):
        z, log_det = _unconstrain(spec, point)
        per = jax.vmap(lambda ex: example_loss(spec, z, ex, data.shared))(data.per_example)
        return per, prior_loss(spec, z, data) + log_det

    per, prior = jax.vmap(at)(values)
    return per.T, prior


def regress(stats, weights, targets):
    r"""Weighted least squares of each row of ``targets`` ``(M, S)`` on ``(1, T)``.

    Solved through the SVD of the weighted, centred and column-scaled design rather than the
    normal equations, whose condition number is the square of the design's: a concentrated
    posterior makes the statistics nearly collinear over the points (e.g. :math:`\log x` and
    :math:`x` for a Gamma with a large shape), so this matters at large ``N``.

    :return: ``(coefficients (M, P), relative RMS residual (M,))``; the coefficients are
        :math:`\hat F^{-1}\widehat{\mathrm{Cov}}(T, \ell)` under the weights.
    """
    tiny = jnp.finfo(stats.dtype).tiny
    mu = weights @ stats
    centred = stats - mu
    scale = jnp.sqrt(jnp.maximum(weights @ centred**2, tiny))
    root = jnp.sqrt(weights)[:, None]
    design = root * centred / scale
    mean = targets @ weights
    rhs = root * (targets.T - mean)
    u, sv, vt = jnp.linalg.svd(design, full_matrices=False)
    coef = (vt.T @ ((u.T @ rhs) / sv[:, None])).T / scale
    fitted = mean[:, None] + coef @ centred.T
    resid = jnp.sqrt(((targets - fitted) ** 2) @ weights)
    spread = jnp.sqrt(((targets - mean[:, None]) ** 2) @ weights) + jnp.abs(mean)
    return coef, resid / jnp.maximum(spread, tiny)


@partial(jax.jit, static_argnums=0)
def compute_sites(config, lam, data):
    """:class:`EFSites` of every example and of the prior term at ``lam``."""
    values, weights = design(config, lam)
    stats = config.family.stats(values)
    per, prior = point_losses(config.spec, values, data)
    coef, resid = regress(stats, weights, jnp.concatenate([per, prior[None]], 0))
    return EFSites(coef[:-1], coef[-1], resid[:-1], resid[-1])


# --------------------------------------------------------------------------- the BLR fixed point

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
