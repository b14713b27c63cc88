r"""Deterministic point sets standing for one factor of a mean-field posterior.

**Gauss rules.** The nodes and weights of an ``n``-point Gauss rule are the eigenvalues of
the symmetric tridiagonal Jacobi matrix of the monic orthogonal polynomials of the weight
and the squared first components of its eigenvectors (Golub & Welsch, 1969). The
recurrences are closed-form in the shape parameters, so the rules are computed inside
``jit`` from the current natural parameters:

* Gauss–Jacobi for :math:`\mathrm{Beta}(a, b)` (weight :math:`(1-t)^{b-1}(1+t)^{a-1}` on
  :math:`[-1, 1]`, :math:`x = (1+t)/2`);
* generalised Gauss–Laguerre for :math:`\mathrm{Gamma}(a, r)` (weight :math:`t^{a-1}e^{-t}`,
  :math:`x = t/r`);
* Gauss–Hermite (probabilists') for :math:`\mathcal N(m, s^2)` (weight :math:`e^{-t^2/2}`,
  :math:`x = m + s t`).

The weights sum to one: a rule is a discrete probability measure whose first ``2n-1``
moments equal the distribution's.

**Moment-matched draws.** For a Gaussian vector the points are fixed standard-normal
draws whitened so that their sample mean is exactly zero and their sample second moment
exactly the identity; mapped through :math:`m + L\epsilon` they reproduce the mean and
covariance of :math:`q` exactly, so every expectation of a quadratic function — the
conjugate Gaussian case — is exact whatever the number of draws.

**Symmetric cubature.** For Gaussian blocks of total dimension :math:`D` the centre with
weight :math:`1 - 1/c` and the :math:`2D` points :math:`\pm\sqrt{cD}\,Q e_j` with weights
:math:`1/(2Dc)` (the degree-3 spherical rule; Stroud, 1971; :math:`c = 1` is the cubature
Kalman filter's rule), :math:`Q` an orthogonal matrix and :math:`c \in [1.5, 2.5]`, both
drawn with the seed: every odd moment vanishes and the second moment is :math:`QQ^\top = I`,
so the rule integrates every polynomial of degree at most 3 exactly. A site of a Gaussian
block needs :math:`E[\nabla\ell]` (exact for losses of degree at most 4) and
:math:`E[\nabla^2\ell]` (exact up to degree 5 from Hessians, up to degree 3 from Stein's
identity), with :math:`2D + 1` points instead of the dozens of draws a regression needs.
Another seed is another rule of the same degree, at another radius and rotation: their
disagreement at the fixed point estimates the rule's error on a loss of higher degree
(a fixed radius would hide an error that depends on the radius alone).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["golub_welsch", "beta_rule", "gamma_rule", "hermite_rule", "whitened_normal", "symmetric_cubature"]


def golub_welsch(diagonal, off_diagonal) -> tuple[Any, Any]:
    """Nodes and probability weights of the Gauss rule of a Jacobi matrix.

    :param diagonal: ``(n,)`` recurrence coefficients ``a_0..a_{n-1}``.
    :param off_diagonal: ``(n-1,)`` values ``sqrt(b_1)..sqrt(b_{n-1})``.
    :return: ``(nodes, weights)``, each ``(n,)``, weights summing to one.
    """
    jac = jnp.diag(diagonal) + jnp.diag(off_diagonal, 1) + jnp.diag(off_diagonal, -1)
    nodes, vectors = jnp.linalg.eigh(jac)
    weights = vectors[0] ** 2
    return nodes, weights / jnp.sum(weights)


def beta_rule(a, b, num_nodes) -> tuple[Any, Any]:
    r"""``num_nodes``-point Gauss–Jacobi rule of :math:`\mathrm{Beta}(a, b)` on :math:`(0, 1)`.

    Recurrence of the monic Jacobi polynomials (:math:`s = 2k + \alpha + \beta`):
    :math:`a_k = (\beta^2-\alpha^2)/(s(s+2))` (:math:`a_0 = (\beta-\alpha)/(\alpha+\beta+2)`),
    :math:`b_k = 4k(k+\alpha)(k+\beta)(k+\alpha+\beta)/(s^2(s+1)(s-1))`
    (:math:`b_1 = 4(1+\alpha)(1+\beta)/((2+\alpha+\beta)^2(3+\alpha+\beta))`).

    :return: ``(x, weights)``.
    """
    a, b = jax.lax.stop_gradient(a), jax.lax.stop_gradient(b)
    alpha, beta = b - 1.0, a - 1.0
    k = jnp.arange(num_nodes, dtype=jnp.result_type(a, float))
    s = 2.0 * k + alpha + beta
    safe = jnp.where(k == 0, 1.0, s * (s + 2.0))
    diag = jnp.where(k == 0, (beta - alpha) / (alpha + beta + 2.0), (beta**2 - alpha**2) / safe)
    kk = k[1:]
    ss = s[1:]
    general = 4.0 * kk * (kk + alpha) * (kk + beta) * (kk + alpha + beta) / (
        ss**2 * (ss + 1.0) * jnp.where(kk == 1, 1.0, ss - 1.0))
    first = 4.0 * (1.0 + alpha) * (1.0 + beta) / ((2.0 + alpha + beta) ** 2 * (3.0 + alpha + beta))
    off = jnp.sqrt(jnp.where(kk == 1, first, general))
    t, w = golub_welsch(diag, off)
    t = jnp.clip(t, -1.0, 1.0)
    return 0.5 * (1.0 + t), w


def gamma_rule(a, rate, num_nodes) -> tuple[Any, Any]:
    r"""``num_nodes``-point generalised Gauss–Laguerre rule of :math:`\mathrm{Gamma}(a, r)`.

    Recurrence: :math:`a_k = 2k + \alpha + 1`, :math:`b_k = k(k + \alpha)`, :math:`\alpha = a - 1`.

    :return: ``(x, weights)``.
    """
    a, rate = jax.lax.stop_gradient(a), jax.lax.stop_gradient(rate)
    alpha = a - 1.0
    k = jnp.arange(num_nodes, dtype=jnp.result_type(a, float))
    diag = 2.0 * k + alpha + 1.0
    off = jnp.sqrt(k[1:] * (k[1:] + alpha))
    t, w = golub_welsch(diag, off)
    return jnp.maximum(t, jnp.finfo(t.dtype).tiny) / rate, w


def hermite_rule(loc, scale, num_nodes) -> tuple[Any, Any]:
    r"""``num_nodes``-point Gauss–Hermite rule of :math:`\mathcal N(m, s^2)`.

    Recurrence of the monic probabilists' Hermite polynomials: :math:`a_k = 0`, :math:`b_k = k`.

    :return: ``(x, weights)``.
    """
    loc, scale = jax.lax.stop_gradient(loc), jax.lax.stop_gradient(scale)
    k = jnp.arange(num_nodes, dtype=jnp.result_type(loc, float))
    t, w = golub_welsch(jnp.zeros_like(k), jnp.sqrt(k[1:]))
    return loc + scale * t, w


def whitened_normal(key, num, dim, dtype) -> jax.Array:
    r"""``(num, dim)`` standard-normal draws with sample mean exactly 0 and sample second
    moment :math:`\frac1S\sum_s \epsilon_s\epsilon_s^\top` exactly the identity.

    :raises ValueError: if ``num <= dim`` (the whitening needs a full-rank sample).
    """
    if num <= dim:
        raise ValueError(f"moment-matched draws need more draws ({num}) than dimensions ({dim})")
    eps = jax.random.normal(key, (num, dim), dtype)
    eps = eps - jnp.mean(eps, 0)
    chol = jnp.linalg.cholesky(eps.T @ eps / num)
    return jax.scipy.linalg.solve_triangular(chol, eps.T, lower=True).T


def symmetric_cubature(key, dim, dtype) -> tuple[jax.Array, jax.Array]:
    r"""The degree-3 symmetric rule for :math:`N(0, I_D)`: ``(points (2 dim + 1, dim), weights (2 dim + 1,))``,
    the centre and :math:`\pm\sqrt{cD}\,Q e_j`, with :math:`Q` the orthogonal factor of the QR
    factorisation of a standard-normal matrix (signs fixed so that it is unique) and
    :math:`c = 1.5 + U(0, 1)`, both drawn with ``key``.
    """
    k_rotation, k_radius = jax.random.split(key)
    q, r = jnp.linalg.qr(jax.random.normal(k_rotation, (dim, dim), dtype))
    q = q * jnp.where(jnp.diagonal(r) < 0, -1.0, 1.0).astype(dtype)
    spread = 1.5 + jax.random.uniform(k_radius, (), dtype)
    cols = jnp.sqrt(spread * dim) * q.T
    points = jnp.concatenate([jnp.zeros((1, dim), dtype), cols, -cols], 0)
    weights = jnp.concatenate([jnp.reshape(1.0 - 1.0 / spread, (1,)),
                               jnp.full((2 * dim,), 0.5 / (dim * spread), dtype)])
    return points, weights
