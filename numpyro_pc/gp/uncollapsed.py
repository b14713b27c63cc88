r"""Uncollapsed online bound for any likelihood (Bui, Nguyen & Turner 2017, §3.2).

``q(b)`` is explicit and whitened: ``b = L_b v``, ``q(v) = N(μ_w, L_w L_wᵀ)`` with
``L_b = chol(K_bb + εI)``. With ``q(a)`` the marginal of ``q(b)`` at the old inducing
inputs under the current θ,

.. math::

    \mathcal L = \sum_n \mathbb E_{q(f_n)}[\log p(y_n \mid f_n)] − \mathrm{KL}[q(b)\,\|\,p(b)]
        + \mathbb E_{q(a)}\big[\log q_{\rm old}(a) − \log p(a \mid θ_{\rm old})\big],

the last term being ``KL[q(a)‖p(a|θ_old)] − KL[q(a)‖q_old(a)]`` written as one expectation
(both Gaussian; evaluated with the stored Cholesky factors of ``S_a`` and ``K'_aa``).
Expected log-likelihoods come from GPJax (``likelihood.expected_log_likelihood``,
Gauss–Hermite) for Bernoulli (probit), Poisson and any GPJax likelihood; a Gaussian
likelihood is integrated in closed form with the noise of :class:`~numpyro_pc.gp.state.Hyper`;
:class:`BernoulliLogit` adds the logit link.

For a Gaussian likelihood, at the collapsed optimum ``q(b)`` this bound equals the
collapsed bound of :mod:`numpyro_pc.gp.bounds` and is lower anywhere else.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpyro.distributions as npd
from gpjax.likelihoods import AbstractLikelihood, inv_probit
from jax.scipy.linalg import cho_solve, solve_triangular

from ..errors import UnsupportedModelError
from .state import chol, inducing_cross, kernel_diag, kernel_matrix, mean_vector, noise_variance
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["BernoulliLogit", "WhitenedQ", "marginals", "expected_log_lik", "old_marginal", "old_term", "uncollapsed_bound",
           "whiten", "unwhiten", "predict_y"]


class BernoulliLogit(AbstractLikelihood):
    """Bernoulli likelihood with the logit link ``p(y=1|f) = σ(f)`` (GPJax's ``Bernoulli`` is probit)."""

    def link_function(self, f) -> npd.Bernoulli:
        """``Bernoulli(logits=f)``."""
        return npd.Bernoulli(logits=f)

    def predict(self, dist) -> npd.Bernoulli:
        """Predictive ``Bernoulli`` with the probit approximation ``σ(μ / sqrt(1 + π s / 8))``."""
        variance = jnp.diag(dist.covariance_matrix)
        return npd.Bernoulli(logits=dist.mean.ravel() / jnp.sqrt(1.0 + jnp.pi * variance / 8.0))


class WhitenedQ(NamedTuple):
    """Whitened ``q(v) = N(mean, chol cholᵀ)`` with ``b = L_b v``."""

    mean: jnp.ndarray
    chol: jnp.ndarray


def whiten(Lb, mean, cov) -> WhitenedQ:
    """Whitened form of ``q(b) = N(mean, cov)`` given ``L_b``."""
    mw = solve_triangular(Lb, mean, lower=True)
    Sw = solve_triangular(Lb, solve_triangular(Lb, cov, lower=True).T, lower=True)
    return WhitenedQ(mw, chol(Sw))


def unwhiten(Lb, q) -> tuple[Any, Any]:
    """``(mean, cov)`` of ``q(b)`` from its whitened form."""
    R = Lb @ q.chol
    return Lb @ q.mean, R @ R.T


def marginals(hyper, Lb, q, X) -> tuple[Any, jax.Array]:
    """Mean and variance of ``q(f(x_n))`` for every row of ``X``."""
    V = solve_triangular(Lb, kernel_matrix(hyper.kernel, hyper.Z, X), lower=True)
    mu = mean_vector(hyper.mean_function, X) + V.T @ q.mean
    U = q.chol.T @ V
    var = kernel_diag(hyper.kernel, X) - jnp.sum(V * V, 0) + jnp.sum(U * U, 0)
    return mu, jnp.maximum(var, 1e-12)


def expected_log_lik(hyper, y, mu, var) -> jax.Array:
    """``E_q[log p(y_n | f_n)]`` per row: closed form when ``hyper.noise`` is set, else GPJax quadrature."""
    if hyper.noise is not None:
        s2 = noise_variance(hyper)
        return -0.5 * (jnp.log(2 * jnp.pi * s2) + ((y - mu) ** 2 + var) / s2)
    return hyper.likelihood.expected_log_likelihood(y[:, None], mu[:, None], var[:, None])


def predict_y(hyper, mu, var) -> tuple[jax.Array, jax.Array]:
    """Predictive mean of ``y`` (probability of class 1 for Bernoulli, rate for Poisson)."""
    from gpjax.likelihoods import Bernoulli, Poisson

    if hyper.noise is not None:
        return mu, var + noise_variance(hyper)
    lik = hyper.likelihood
    if isinstance(lik, BernoulliLogit):
        p = jax.nn.sigmoid(mu / jnp.sqrt(1.0 + jnp.pi * var / 8.0))
        return p, p * (1 - p)
    if isinstance(lik, Bernoulli):
        p = inv_probit(mu / jnp.sqrt(1.0 + var))
        return p, p * (1 - p)
    if isinstance(lik, Poisson):
        rate = jnp.exp(mu + 0.5 * var)
        return rate, rate + rate ** 2 * (jnp.exp(var) - 1.0)
    raise UnsupportedModelError(f"predict_y supports Gaussian, Bernoulli, BernoulliLogit and Poisson likelihoods, "
                    f"got {type(lik).__name__}")


def old_marginal(hyper, old, Lb, q) -> tuple[jax.Array, jax.Array]:
    """Mean and covariance of ``q(a)``, the marginal of ``q(b)`` at the old inducing inputs ``Z_a`` under
    the current θ: ``a | b ~ p(a | b, θ)``, so ``Σ_a = K_aa − K_ab K_bb⁻¹ K_ba + K_ab K_bb⁻¹ S_b K_bb⁻¹ K_ba``."""
    eps = old.jitter
    Za = old.Z
    B = solve_triangular(Lb, inducing_cross(hyper.kernel, hyper.Z, Za, eps), lower=True)
    Kaa = kernel_matrix(hyper.kernel, Za, Za) + eps * jnp.eye(Za.shape[0], dtype=Za.dtype)
    U = q.chol.T @ B
    return B.T @ q.mean, Kaa - B.T @ B + U.T @ U


def old_term(hyper, old, Lb, q) -> jax.Array:
    r"""``E_{q(a)}[log q_old(a) − log p(a|θ_old)]`` (zero for the prior state, exactly)."""
    mu_a, Sig_a = old_marginal(hyper, old, Lb, q)
    LS, LK = old.chol_cov, old.chol_Kzz
    d = mu_a - old.mean
    log_q = (-jnp.sum(jnp.log(jnp.diag(LS))) - 0.5 * jnp.trace(cho_solve((LS, True), Sig_a))
             - 0.5 * jnp.dot(d, cho_solve((LS, True), d)))
    log_p = (-jnp.sum(jnp.log(jnp.diag(LK))) - 0.5 * jnp.trace(cho_solve((LK, True), Sig_a))
             - 0.5 * jnp.dot(mu_a, cho_solve((LK, True), mu_a)))
    return log_q - log_p


def uncollapsed_bound(hyper, old, X, y, mask, q) -> jax.Array:
    """The uncollapsed online bound ``L`` (module docstring).

    :param Hyper hyper: θ, likelihood and ``Z_b``.
    :param GPState old: old state (``prior_state`` for the first batch).
    :param X: inputs ``(N, D)``, padded rows allowed.
    :param y: targets ``(N,)``.
    :param mask: 1 for real rows, 0 for padding.
    :param WhitenedQ q: the variational ``q(v)``.
    :return: scalar bound.
    """
    Zb = hyper.Z
    Lb = chol(kernel_matrix(hyper.kernel, Zb, Zb) + old.jitter * jnp.eye(Zb.shape[0], dtype=Zb.dtype))
    mu, var = marginals(hyper, Lb, q, X)
    ell = jnp.sum(expected_log_lik(hyper, y, mu, var) * mask)
    diag = jnp.diag(q.chol)
    kl = 0.5 * (jnp.sum(q.chol ** 2) + jnp.dot(q.mean, q.mean) - q.mean.shape[0]) - jnp.sum(jnp.log(jnp.abs(diag)))
    return ell - kl + old_term(hyper, old, Lb, q)
