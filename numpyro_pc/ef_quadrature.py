r"""Gauss quadrature for the Beta and Gamma distributions (Golub–Welsch, jit-able).

The nodes and weights of an ``n``-point Gauss rule are the eigenvalues of the symmetric
tridiagonal Jacobi matrix of the monic orthogonal polynomials of the weight function and
the squared first components of its eigenvectors (Golub & Welsch, 1969). For the two
weights used by the non-Gaussian families the three-term recurrences are closed-form in
the shape parameters, so the rules are computed inside ``jit`` from the current natural
parameters (no host round trip per iteration):

* **Gauss–Jacobi** for :math:`\mathrm{Beta}(a, b)`: weight :math:`(1-t)^{\alpha}(1+t)^{\beta}` on
  :math:`[-1, 1]` with :math:`\alpha = b-1`, :math:`\beta = a-1`, nodes mapped by
  :math:`x = (1+t)/2`;
* **generalised Gauss–Laguerre** for :math:`\mathrm{Gamma}(a, r)`: weight
  :math:`t^{\alpha} e^{-t}` on :math:`(0, \infty)` with :math:`\alpha = a-1`, nodes mapped by
  :math:`x = t / r`.

The weights returned are normalised to sum to one, so a rule is a discrete probability
measure whose first ``2n-1`` moments in ``t`` equal those of the distribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["golub_welsch", "beta_rule", "gamma_rule"]


def golub_welsch(diagonal, off_diagonal):
    """Nodes and probability weights of the Gauss rule of a Jacobi matrix.

    :param diagonal: ``(n,)`` recurrence coefficients ``a_0..a_{n-1}``.
    :param off_diagonal: ``(n-1,)`` values ``sqrt(b_1)..sqrt(b_{n-1})``.
    :return: ``(nodes, weights)``, each ``(n,)``, weights summing to one.
    """
    jac = jnp.diag(diagonal) + jnp.diag(off_diagonal, 1) + jnp.diag(off_diagonal, -1)
    nodes, vectors = jnp.linalg.eigh(jac)
    weights = vectors[0] ** 2
    return nodes, weights / jnp.sum(weights)


def beta_rule(a, b, num_nodes):
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


def gamma_rule(a, rate, num_nodes):
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
