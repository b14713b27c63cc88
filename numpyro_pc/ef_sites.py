r"""Sites of a non-Gaussian exponential-family posterior (paper eq. ``qdualform``, Table 1).

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
  generalised Gauss–Laguerre for Gamma; :mod:`numpyro_pc.ef_quadrature`), deterministic;
  available when every latent site is a scalar Beta or Gamma;
* ``"mc"``: ``num_samples`` draws of :math:`q` with a fixed seed (Dirichlet and vector
  sites), so the fixed point is deterministic.

The regression residual says how far :math:`\ell_i` is from linear in :math:`T` over the
points; a prior with (relative) residual below ``1e-9`` (float64) is conjugate-form and its site is
kept as the constant :math:`\lambda_0`.

Losses are evaluated with the model binding of :mod:`numpyro_pc.likelihood` at the
unconstrained image of each point; the prior term drops the Jacobian
(:math:`\ell_0^{x}(x) = \ell_0(z) + \log|\det J_T(z)|`), since these families live on the
constrained values.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .ef_families import ProductFamily
from .errors import InvalidOptionError
from .likelihood import ModelSpec, example_loss, prior_loss

__all__ = ["EFConfig", "EFSites", "design", "point_losses", "regress", "compute_sites", "conjugate_rtol"]


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
