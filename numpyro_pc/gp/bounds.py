r"""Collapsed online bounds for a Gaussian likelihood (Bui, Nguyen & Turner 2017).

Old state ``a``: inducing inputs ``Z_a``, ``q_old(a) = N(m_a, S_a)``, old prior
covariance ``K'_aa`` (jitter included). New batch ``(X, y)`` with new inducing inputs
``Z_b`` and hyperparameters θ. The old posterior acts as ``M_a`` Gaussian pseudo-
observations ``ŷ_a = D_a S_a⁻¹ m_a`` with noise ``D_a = (S_a⁻¹ − K'_aa⁻¹)⁻¹``; ``D_a`` is
ill-conditioned (cond ≈ 1e18 on batches ordered by input) and is **never formed**: every
quantity below goes through the Cholesky factors ``L_S = chol(S_a)`` and
``L_K' = chol(K'_aa)`` (Bui et al. 2017; docs/gp.md, "The online bound"):

.. math::

    L_b &= \mathrm{chol}(K_{bb} + εI),\quad A = L_b^{-1} K_{bf}/σ,\quad B = L_b^{-1} K_{ba},\\
    D &= I + AA^\top + P_S^\top P_S − P_K^\top P_K,\quad P_S = L_S^{-1}B^\top,\ P_K = L_{K'}^{-1}B^\top,\\
    γ &= L_D^{-1}(A r/σ + B S_a^{-1} m_a),\\
    \mathcal F &= −\tfrac N2 \log 2πσ^2 − \tfrac{\|r\|^2}{2σ^2} − \tfrac12 m_a^\top S_a^{-1} m_a
        + \tfrac12\|γ\|^2 − \log|L_D| − \tfrac{\sum k_{nn}}{2σ^2} + \tfrac12\|A\|_F^2
        + \log|L_{K'}| − \log|L_S| − \tfrac12\,\mathrm{tr}[(S_a^{-1} − K'^{-1}_{aa}) E_{aa}],

with ``E_aa = K_aa + εI − BᵀB``. The optimal ``q(b)`` is ``N(R γ, R Rᵀ)``, ``R = L_b L_D^{-T}``.

**Power-EP** (α ∈ (0, 1]): the data noise becomes ``d_n = σ² + α(k_nn − q_nn)`` and the
pseudo-observation noise ``D_a + αE_aa``. With ``T = D_a⁻¹ E_aa`` (``D_a⁻¹ = S_a⁻¹ − K'_aa⁻¹``
from two Cholesky solves; ``D_a`` itself is never formed) and ``Q = I + αT`` (not
symmetric; LU), ``(D_a + αE)⁻¹ D_a = Q⁻¹`` and ``(D_a + αE)⁻¹ = D_a⁻¹ − α Q⁻¹ T D_a⁻¹``, so

.. math::

    \mathcal F_α = \dots − \tfrac12\sum_n \log d_n − \tfrac{1−α}{2α}\sum_n \log\frac{d_n}{σ^2}
        − \tfrac1{2α} \log|Q| + \tfrac α2 (S_a^{-1}m_a)^\top E_{aa} Q^{-1} S_a^{-1} m_a,

which tends to the VFE bound as α → 0 (``−log|Q|/(2α) → −½ tr(D_a⁻¹ E_aa)``). ``E_aa`` may
be singular (``Z_b ⊇ Z_a``); nothing factorises it.

Jitter is modelled, not patched: inducing variables are ``u = f(Z) + w(Z)`` with ``w``
white noise of variance ε, so ``cov(u_b, u_a) = k(Z_b, Z_a) + ε·[z_b = z_a]``
(:func:`~numpyro_pc.gp.state.inducing_cross`) and ``cov(u, f(x)) = k(Z, x)``. This keeps
``Z_b = Z_a`` streaming exactly equal to batch SGPR with the same ε.

The VFE branch reads the old state only through :class:`OldTerms` (``G = S_a⁻¹ − K'^{-1}_{aa}``, ``S_a⁻¹ m_a`` and
the constants), which an optimiser computes once per batch: ``P_SᵀP_S − P_KᵀP_K = B G Bᵀ``.

Padded rows (``mask = 0``) contribute nothing. :func:`paper_bound` is the textbook form
with ``D_a`` formed explicitly (Bui et al. 2017, eq. 5); it exists as a test oracle on
well-conditioned problems only.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
from jax.scipy.linalg import cho_solve, solve_triangular

from ..errors import InvalidOptionError
from .state import chol, inducing_cross, kernel_diag, kernel_matrix, mean_vector, noise_variance
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import jax

__all__ = ["CollapsedFit", "OldTerms", "old_terms", "collapsed_fit", "collapsed_bound", "paper_bound"]

_LOG2PI = math.log(2.0 * math.pi)   # a Python float: module import may run with x64 off


class CollapsedFit(NamedTuple):
    """Value of the collapsed bound and the optimal ``q(b)``.

    :ivar bound: ``F`` (or ``F_α``).
    :ivar mean: mean of the optimal ``q(b)``.
    :ivar cov: covariance of the optimal ``q(b)``.
    :ivar chol_D: ``L_D`` (finite iff ``D`` was positive definite).
    :ivar chol_Kbb: ``L_b``.
    """

    bound: jnp.ndarray
    mean: jnp.ndarray
    cov: jnp.ndarray
    chol_D: jnp.ndarray
    chol_Kbb: jnp.ndarray


def _tri(L, B) -> jax.Array:
    return solve_triangular(L, B, lower=True)


class OldTerms(NamedTuple):
    r"""The part of the VFE bound that depends on the old state (and the memory's sites) only.

    :ivar G: ``S_a⁻¹ − K'^{-1}_{aa} − U Uᵀ`` (``M_a × M_a``, symmetric, possibly singular; never inverted).
    :ivar h: ``S_a⁻¹ m_a − U r̃``.
    :ivar const: ``−½ m_aᵀ S_a⁻¹ m_a + log|L_{K'}| − log|L_S|`` plus the sites' constant.

    With them ``PᵀP_S − P_KᵀP_K = B G Bᵀ``, ``B S_a⁻¹ m_a = B h`` and
    ``tr[(S_a⁻¹ − K'^{-1}_{aa})E_aa] = tr(G E_aa)``: the new hyperparameters enter only through
    ``B`` and ``K_aa``, so an optimiser over θ and ``Z_b`` factorises the old state once per
    batch instead of once per objective evaluation. ``D_a = G⁻¹`` is still never formed.
    """

    G: jnp.ndarray
    h: jnp.ndarray
    const: jnp.ndarray


def old_terms(old, sites=None) -> OldTerms:
    """:class:`OldTerms` of the old state ``old`` (and the memory's :class:`~numpyro_pc.gp.corrected.GaussianSites`)."""
    LS, LK = old.chol_cov, old.chol_Kzz
    eye = jnp.eye(LS.shape[0], dtype=LS.dtype)
    G = cho_solve((LS, True), eye) - cho_solve((LK, True), eye)
    h = cho_solve((LS, True), old.mean)
    const = -0.5 * jnp.dot(old.mean, h) + jnp.sum(jnp.log(jnp.diag(LK))) - jnp.sum(jnp.log(jnp.diag(LS)))
    if sites is not None:                     # remove the memory's sites from the old term
        G = G - sites.U @ sites.U.T
        h = h - sites.Ur
        const = const + sites.const
    return OldTerms(G=0.5 * (G + G.T), h=h, const=const)


def collapsed_fit(hyper, old, X, y, mask, alpha=0.0, sites=None, terms=None) -> CollapsedFit:
    """Collapsed online bound and optimal ``q(b)`` in the stable Cholesky form.

    With ``sites`` (the memory's Gaussian sites at the old state,
    :func:`~numpyro_pc.gp.corrected.gaussian_sites`) the memory rows' sites are taken out
    of the old pseudo-observations, so that rows passed in ``X`` that are also in the memory
    enter once, through their exact likelihood: the posterior-corrected bound
    (:mod:`~numpyro_pc.gp.corrected`). ``−Σ t_i(a)`` is a Gaussian pseudo-observation of
    negative weight on ``a``: ``S_a⁻¹ − K'⁻¹ → S_a⁻¹ − K'⁻¹ − U Uᵀ``, ``S_a⁻¹ m_a → S_a⁻¹ m_a − U r̃``.

    :param Hyper hyper: current θ, noise and ``Z_b`` (``hyper.Z``).
    :param GPState old: the old state (``prior_state`` for the first batch).
    :param X: inputs ``(N, D)`` (padded rows allowed).
    :param y: targets ``(N,)``.
    :param mask: ``(N,)`` 1 for real rows, 0 for padding.
    :param float alpha: 0 for VFE, α ∈ (0, 1] for Power-EP (a Python float: static).
    :param sites: ``None`` (Bui's bound) or :class:`~numpyro_pc.gp.corrected.GaussianSites` (VFE only).
    :param terms: the :class:`OldTerms` of ``(old, sites)`` when already computed (VFE only; an optimiser
        passes them so that the old state's factorisations stay out of its loop).
    :return: :class:`CollapsedFit`.
    """
    eps = old.jitter
    Zb, Za = hyper.Z, old.Z
    Mb = Zb.shape[0]
    s2 = noise_variance(hyper)
    mask = mask.astype(X.dtype)
    N = jnp.sum(mask)
    r = (y - mean_vector(hyper.mean_function, X)) * mask
    knn = kernel_diag(hyper.kernel, X) * mask

    Lb = chol(kernel_matrix(hyper.kernel, Zb, Zb) + eps * jnp.eye(Mb, dtype=X.dtype))
    V = _tri(Lb, kernel_matrix(hyper.kernel, Zb, X) * mask[None, :])      # L_b⁻¹ K_bf
    B = _tri(Lb, inducing_cross(hyper.kernel, Zb, Za, eps))                # L_b⁻¹ K̃_ba
    Kaa = kernel_matrix(hyper.kernel, Za, Za) + eps * jnp.eye(Za.shape[0], dtype=X.dtype)

    if alpha == 0.0:
        t = old_terms(old, sites) if terms is None else terms
        A = V / jnp.sqrt(s2)
        BG = B @ t.G
        D = jnp.eye(Mb, dtype=X.dtype) + A @ A.T + BG @ B.T
        c = A @ r / jnp.sqrt(s2) + B @ t.h
        trace_old = jnp.sum(t.G * Kaa) - jnp.sum(BG * B)                       # tr(G E_aa), E_aa = K_aa − BᵀB
        LD = chol(D)
        gamma = _tri(LD, c)
        F = (-0.5 * N * (_LOG2PI + jnp.log(s2)) - 0.5 * jnp.dot(r, r) / s2 + t.const + 0.5 * jnp.dot(gamma, gamma)
             - jnp.sum(jnp.log(jnp.diag(LD))) - 0.5 * jnp.sum(knn) / s2 + 0.5 * jnp.sum(A * A) - 0.5 * trace_old)
    else:
        if sites is not None or terms is not None:
            raise InvalidOptionError("the corrected collapsed bound (sites) is implemented for VFE (alpha = 0) only")
        LS, LK = old.chol_cov, old.chol_Kzz
        PS, PK = _tri(LS, B.T), _tri(LK, B.T)
        Sinv_m = cho_solve((LS, True), old.mean)
        E = Kaa - B.T @ B
        old_logdet = jnp.sum(jnp.log(jnp.diag(LK))) - jnp.sum(jnp.log(jnp.diag(LS)))
        quad_old = -0.5 * jnp.dot(old.mean, Sinv_m)
        qnn = jnp.sum(V * V, 0)
        dff = s2 + alpha * (knn - qnn) * mask
        A = V / jnp.sqrt(dff)
        T = cho_solve((LS, True), E) - cho_solve((LK, True), E)                # D_a⁻¹ E_aa
        Qp = jnp.eye(Za.shape[0], dtype=X.dtype) + alpha * T
        H = cho_solve((LS, True), B.T) - cho_solve((LK, True), B.T)            # D_a⁻¹ Bᵀ
        D = jnp.eye(Mb, dtype=X.dtype) + A @ A.T + PS.T @ PS - PK.T @ PK - alpha * B @ jnp.linalg.solve(Qp, T @ H)
        Qinv_Sm = jnp.linalg.solve(Qp, Sinv_m)
        c = A @ (r / jnp.sqrt(dff)) + B @ Qinv_Sm
        LD = chol(D)
        gamma = _tri(LD, c)
        F = (-0.5 * N * _LOG2PI - 0.5 * jnp.sum(jnp.log(dff) * mask) - 0.5 * jnp.sum(r * r / dff) + quad_old
             + 0.5 * alpha * jnp.dot(Sinv_m, E @ Qinv_Sm) + 0.5 * jnp.dot(gamma, gamma)
             - jnp.sum(jnp.log(jnp.diag(LD))) - 0.5 * (1.0 - alpha) / alpha * jnp.sum(jnp.log(dff / s2) * mask)
             - 0.5 * jnp.linalg.slogdet(Qp)[1] / alpha + old_logdet)

    R = solve_triangular(LD, Lb.T, lower=True).T                              # L_b L_D^{-T}
    return CollapsedFit(bound=F, mean=R @ gamma, cov=R @ R.T, chol_D=LD, chol_Kbb=Lb)


def collapsed_bound(hyper, old, X, y, mask, alpha=0.0, sites=None, terms=None) -> jax.Array:
    """The collapsed bound alone (see :func:`collapsed_fit`)."""
    return collapsed_fit(hyper, old, X, y, mask, alpha, sites, terms).bound


def paper_bound(hyper, old, X, y, alpha=0.0) -> jax.Array:
    """The bound in the paper's form with ``D_a`` formed explicitly (test oracle only).

    ``F = log N(ŷ; 0, K_ŷb K_bb⁻¹ K_bŷ + Σ̂) + M_a/2 log 2π + ½ log(|K'_aa||D_a|/|S_a|)
    + ½ m_aᵀ(S_a⁻¹ D_a S_a⁻¹ − S_a⁻¹) m_a − trace terms``, with ``ŷ = [r; D_a S_a⁻¹ m_a]``;
    for Power-EP the noise is ``diag(σ² + α(k − q))`` and ``D_a + αE_aa`` and the trace terms
    become ``(1−α)/(2α)`` log-determinants. Unstable when ``S_a⁻¹ − K'_aa⁻¹`` is
    ill-conditioned; all rows of ``X`` are used.
    """
    eps = old.jitter
    Zb, Za = hyper.Z, old.Z
    s2 = noise_variance(hyper)
    N, Ma = X.shape[0], Za.shape[0]
    r = y - mean_vector(hyper.mean_function, X)
    Kbb = kernel_matrix(hyper.kernel, Zb, Zb) + eps * jnp.eye(Zb.shape[0], dtype=X.dtype)
    Kbf = kernel_matrix(hyper.kernel, Zb, X)
    Kba = inducing_cross(hyper.kernel, Zb, Za, eps)
    Kaa = kernel_matrix(hyper.kernel, Za, Za) + eps * jnp.eye(Ma, dtype=X.dtype)
    Sa, Kp, ma = old.cov, old.Kzz, old.mean
    Sinv = jnp.linalg.inv(Sa)
    Dinv = Sinv - jnp.linalg.inv(Kp)
    Da = jnp.linalg.inv(Dinv)
    Kyb = jnp.concatenate([Kbf.T, Kba.T], 0)
    Qff = Kbf.T @ jnp.linalg.solve(Kbb, Kbf)
    Eaa = Kaa - Kba.T @ jnp.linalg.solve(Kbb, Kba)
    dk = kernel_diag(hyper.kernel, X) - jnp.diag(Qff)
    Sig_f = jnp.diag(s2 + alpha * dk)
    Sig_a = Da + alpha * Eaa
    Sig = jnp.block([[Sig_f, jnp.zeros((N, Ma), X.dtype)], [jnp.zeros((Ma, N), X.dtype), Sig_a]])
    C = Kyb @ jnp.linalg.solve(Kbb, Kyb.T) + Sig
    yhat = jnp.concatenate([r, Da @ Sinv @ ma])
    logN = -0.5 * (N + Ma) * _LOG2PI - 0.5 * jnp.linalg.slogdet(C)[1] - 0.5 * yhat @ jnp.linalg.solve(C, yhat)
    F = (logN + 0.5 * Ma * _LOG2PI + 0.5 * (jnp.linalg.slogdet(Kp)[1] + jnp.linalg.slogdet(Da)[1]
                                            - jnp.linalg.slogdet(Sa)[1])
         + 0.5 * ma @ (Sinv @ Da @ Sinv - Sinv) @ ma)
    if alpha == 0.0:
        return F - 0.5 * jnp.sum(dk) / s2 - 0.5 * jnp.trace(Dinv @ Eaa)
    return (F - 0.5 * (1 - alpha) / alpha * jnp.sum(jnp.log1p(alpha * dk / s2))
            - 0.5 * (1 - alpha) / alpha * jnp.linalg.slogdet(jnp.eye(Ma, dtype=X.dtype) + alpha * Dinv @ Eaa)[1])
