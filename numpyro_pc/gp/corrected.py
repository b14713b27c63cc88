r"""Posterior-corrected streaming update for non-Gaussian likelihoods (Khan, §4.6).

Bui's uncollapsed update replaces the old data by ``q_old(a)/p(a|θ_old)``, i.e. (dual form)
by the quadratic sites ``ℓ̂_i`` of the old examples at the old posterior. The corrected
update keeps a memory ``C`` of past examples and adds back their correction
(paper §3.1, the streaming update; docs/gp.md):

.. math::

    \mathcal L_{\rm corr} = \mathcal L_{\rm Bui} − \sum_{i∈C} \mathbb E_q[ℓ_i(f_i) − \hat ℓ_{i|t}(a)],\qquad
    \hat ℓ_{i|t}(a) = \hat g_i \bar f_i(a) + \tfrac12 \hat h_i (\bar f_i(a) − m_i)^2,

with ``ℓ_i(f) = −log p(y_i | f)``, ``(m_i, v_i)`` the old posterior's marginal of ``f(x_i)``
(old θ, old ``q``), the function-space site ``ĝ_i = E[ℓ_i'(f)]``, ``ĥ_i = E[ℓ_i''(f)]`` under
``N(m_i, v_i)`` (Gauss–Hermite, 20 nodes), and ``f̄_i(a) = μ'(x_i) + w_iᵀ a``,
``w_i = K'^{-1}_{aa} k'_{a i}`` (old θ', old ``Z_a``). The site is a function of the old inducing
variables ``a``, as the old data are in Bui's term ``q_old(a)/p(a|θ_old) = exp(−Σ_i ℓ̂_i(a))`` (the
dual form of the old fit): with every past example in the memory the two cancel and the corrected
bound is the batch bound on all data for any θ. A site written in ``f_i`` instead would keep
``½ ĥ_i (k_ii − q_ii)``, the conditional variance of ``f_i`` given ``a`` under the new θ, which grows
without bound with the kernel variance (the corrected Bernoulli bound then has no maximum).
Sites are recomputed at every batch at the posterior being updated. The memory has a fixed
capacity (reservoir sampling over the stream), padded and masked so that its shape never changes.
"""

from __future__ import annotations


from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .state import kernel_diag, kernel_matrix, mean_vector, noise_variance, predict_from_q
from .uncollapsed import expected_log_lik, marginals, old_marginal
from numpyro_pc.deprecation import warn_renamed

__all__ = ["Memory", "FunctionSites", "GaussianSites", "empty_memory", "update_memory", "memory_sites", "empty_sites", "gaussian_sites",
           "correction_term"]

_GH_T, _GH_W = np.polynomial.hermite_e.hermegauss(20)
_GH_W = _GH_W / np.sqrt(2 * np.pi)


class Memory(NamedTuple):
    """Fixed-capacity memory of past examples: ``X (C, D)``, ``y (C,)``, ``mask (C,)``, ``seen`` (count),
    and ``ss (C,)``, each row's frozen noise statistic ``(y − μ)² + v`` (see ``noise_memory``)."""

    X: np.ndarray
    y: np.ndarray
    mask: np.ndarray
    seen: int
    ss: np.ndarray | None = None


class GaussianSites(NamedTuple):
    r"""Sites of the memory rows in the collapsed (Gaussian) bound, as a function of ``a = u(Z_a)``.

    ``t_i(a) = log N(r_i | w_iᵀ a, σ'²) − (k'_ii − w_iᵀ k'_i) / (2σ'²)`` with ``w_i = K'^{-1}_{aa} k'_{a i}``
    under the old θ' (Titsias' site). Stored as ``U = [w_i / σ']`` (``(M_a, C)``, masked columns),
    ``Ur = Σ_i w_i r_i / σ'²`` and ``const = Σ_i ½ log 2πσ'² + r_i² / (2σ'²) + (k'_ii − q'_ii) / (2σ'²)``,
    so that ``−Σ_i t_i(a) = const − Urᵀ a + ½ ‖Uᵀ a‖²``.
    """

    U: jnp.ndarray
    Ur: jnp.ndarray
    const: jnp.ndarray


class FunctionSites(NamedTuple):
    """Sites of the memory at the old posterior: ``g``, ``h``, ``m`` and ``offset`` (each ``(C,)``), and the
    old projections ``W = [w_i]`` (``(M_a, C)``), so that ``f̄_i(a) = offset_i + w_iᵀ a`` (module docstring)."""

    g: jnp.ndarray
    h: jnp.ndarray
    m: jnp.ndarray
    W: jnp.ndarray
    offset: jnp.ndarray


def empty_sites(num_inducing, capacity) -> FunctionSites:
    """Zero sites for an empty memory of ``capacity`` rows (the first batch)."""
    zeros = jnp.zeros(capacity)
    return FunctionSites(zeros, zeros, zeros, jnp.zeros((num_inducing, capacity)), zeros)


def empty_memory(capacity, dim) -> Memory:
    """An empty memory of ``capacity`` rows."""
    return Memory(np.zeros((capacity, dim)), np.zeros(capacity), np.zeros(capacity), 0, np.zeros(capacity))


def update_memory(memory, X, y, rng, ss=None) -> Memory:
    """Reservoir sampling: every example seen so far is in the memory with equal probability.

    :param ss: optional per-row noise statistics of the new rows (stored beside them).
    """
    Xm, ym, mask = memory.X.copy(), memory.y.copy(), memory.mask.copy()
    ssm = np.zeros(len(ym)) if memory.ss is None else memory.ss.copy()
    ss = np.zeros(len(y)) if ss is None else np.asarray(ss)
    seen = memory.seen
    C = Xm.shape[0]
    for i in range(len(y)):
        j = seen if seen < C else int(rng.integers(0, seen + 1))
        if j < C:
            Xm[j], ym[j], mask[j], ssm[j] = X[i], y[i], 1.0, ss[i]
        seen += 1
    return Memory(Xm, ym, mask, seen, ssm)


def gaussian_sites(old, X, y, mask) -> GaussianSites:
    """:class:`GaussianSites` of the memory rows ``(X, y, mask)`` at the old state (old θ', ``Z_a``, ``K'_aa``)."""
    h = old.hyper
    s2 = noise_variance(h)
    Kaf = kernel_matrix(h.kernel, old.Z, X)
    W = jax.scipy.linalg.cho_solve((old.chol_Kzz, True), Kaf)
    r = (y - mean_vector(h.mean_function, X)) * mask
    U = W * (mask / jnp.sqrt(s2))[None, :]
    qnn = jnp.sum(W * Kaf, 0)
    const = jnp.sum(mask * (0.5 * jnp.log(2 * jnp.pi * s2) + (r * r + kernel_diag(h.kernel, X) - qnn) / (2 * s2)))
    return GaussianSites(U=U, Ur=W @ r / s2, const=const)


def _neg_log_lik(hyper, y, f) -> jax.Array:
    return -expected_log_lik(hyper, jnp.atleast_1d(y), jnp.atleast_1d(f), jnp.zeros(1))[0] \
        if hyper.noise is not None else -hyper.likelihood.link_function(f).log_prob(y)


def memory_sites(old, X, y) -> FunctionSites:
    """Sites ``(ĝ_i, ĥ_i, m_i)`` and projections ``f̄_i(a)`` of the memory examples at the old posterior
    (module docstring)."""
    h = old.hyper
    m, v = predict_from_q(h, old.Z, old.mean, old.cov, old.chol_Kzz, X)
    W = jax.scipy.linalg.cho_solve((old.chol_Kzz, True), kernel_matrix(h.kernel, old.Z, X))
    f = m[:, None] + jnp.sqrt(jnp.maximum(v, 0.0))[:, None] * _GH_T[None, :]
    d1 = jax.vmap(jax.vmap(jax.grad(lambda ff, yy: _neg_log_lik(h, yy, ff)), (0, None)), (0, 0))
    d2 = jax.vmap(jax.vmap(jax.grad(jax.grad(lambda ff, yy: _neg_log_lik(h, yy, ff))), (0, None)), (0, 0))
    g = d1(f, y) @ _GH_W
    hh = d2(f, y) @ _GH_W
    return FunctionSites(g, hh, m, W, mean_vector(h.mean_function, X))


def correction_term(hyper, old, Lb, q, X, y, mask, sites) -> jax.Array:
    r"""``−Σ_{i∈C} E_q[ℓ_i(f_i) − ℓ̂_i(a)]`` (to be added to the bound being maximised); ``f_i`` under the
    current θ, ``a`` the marginal of ``q(b)`` at the old inducing inputs (:func:`~numpyro_pc.gp.uncollapsed.old_marginal`)."""
    mu, var = marginals(hyper, Lb, q, X)
    ell = expected_log_lik(hyper, y, mu, var)
    mu_a, Sig_a = old_marginal(hyper, old, Lb, q)
    fbar = sites.offset + sites.W.T @ mu_a
    var_a = jnp.sum(sites.W * (Sig_a @ sites.W), 0)
    site = sites.g * fbar + 0.5 * sites.h * ((fbar - sites.m) ** 2 + var_a)
    return jnp.sum((ell + site) * mask)


def __getattr__(name: str):
    if name == "Sites":  # renamed: numpyro_pc.sites.cached.Sites are a dual-form posterior's sites
        warn_renamed("numpyro_pc.gp.corrected.Sites is now FunctionSites (Sites are a dual-form posterior's, "
                     "numpyro_pc.sites); the old name will be removed in the next release")
        return FunctionSites
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
