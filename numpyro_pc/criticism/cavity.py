r"""Leave-one-out cavities of every example at once, and predictive densities under them.

Removing the site of example ``i`` from ``q = N(m, S⁻¹)`` leaves the *cavity*
(paper §3.2, memory-perturbation equation)

.. math::

    S_{\setminus i} = S - \hat H_i, \qquad
    m_{\setminus i} = m + S_{\setminus i}^{-1}\, g_i, \qquad g_i = \hat g_i + \hat H_i (m - m_i),

with ``m_i`` the mean the site was computed at (``g_i = ĝ_i`` for fresh sites). For the
full family with factorised sites ``Ĥ_i = J_iᵀ Λ_i J_i`` (``J_i`` of ``k`` rows) all ``N``
cavities come from one Cholesky factor ``S = L Lᵀ`` and rank-``k`` Woodbury downdates,

.. math::

    S_{\setminus i}^{-1} = Σ + Σ J_iᵀ (I - Λ_i B_i)^{-1} Λ_i J_i Σ, \qquad B_i = J_i Σ J_iᵀ,

evaluated as two triangular solves with ``N·k`` right-hand sides; no ``d × d`` matrix per
example is formed. Other storages (diagonal family, dense sites) downdate per example
inside a batched ``lax.map``.

**Reliability.** Under ``q`` the density ratio ``q_{∖i}(z)/q(z) ∝ exp(ℓ̂_i(z))`` has a
Pareto tail whose shape is the site's *leverage*

.. math::

    κ_i = \lambda_{\max}\big(Σ^{1/2} \hat H_i Σ^{1/2}\big) = \lambda_{\max}(B_i^{1/2} Λ_i B_i^{1/2})

(``P(r > t) ∝ t^{-1/κ_i}`` for ``r = exp(½ κ_i χ²)``), the share of the posterior precision
that example ``i`` contributes along its own directions; ``κ_i ≥ 1`` means the cavity is
not a distribution. Site removal is exact when the other examples' losses are quadratic;
its error grows with how far the cavity moves away from ``q``, where the other sites were
cached. That distance is

.. math::

    KL(q_{\setminus i} \| q) = \tfrac12 \Big[\sum_j \Big(\frac{κ_{ij}}{1-κ_{ij}} + \log(1-κ_{ij})\Big)
        + Δ_iᵀ S Δ_i\Big],

(``κ_{ij}`` all eigenvalues of ``Σ^{1/2}Ĥ_iΣ^{1/2}``, ``Δ_i = m_{∖i} − m``), which adds the
mean shift to the leverage. The reliability ``k̂_i`` reported in ArviZ's ``pareto_k`` slot is
the leverage of a pure-variance removal with the same KL, the root of
``½(k/(1−k) + log(1−k)) = KL_i`` — so ``k̂_i = κ_i`` when the mean does not move, and
ArviZ's threshold 0.7 means ``KL_i > 0.565``. Validated against brute-force refits in
``benchmarks/bench_loo.py`` (rank correlation with the refit error).

**Predictive densities** use the posterior's expectation rule:
``gh`` — Gauss–Hermite over the example's dependence subspace ``u = Q_i z`` with
``u ~ N(Q_i m_{∖i}, Q_i Σ_{∖i} Q_iᵀ)``; ``mc`` — the rule's fixed draws mapped through the
cavity, ``z_s = m_{∖i} + L_{∖i}^{-ᵀ} ε_s``; ``delta`` — the plug-in ``p(y_i | m_{∖i})``.
The example's log density is the joint over all its observed sites.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import solve_triangular
from jax.scipy.special import logsumexp

from numpyro_pc.curvature.stores import FULL
from numpyro_pc.families.registry import Gaussian, GaussianNatural
from numpyro_pc.model.likelihood import ModelData, example_loss, example_params
from numpyro_pc.protocols.capabilities import site_curvature
from numpyro_pc.sites.expectations import hermite_nodes, mc_noise, subspace_basis, tensor_hermite_nodes
from numpyro_pc.sites.gaussian import compute_sites

from ..errors import InvalidOptionError
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["Cavities", "cavities", "downdates", "kl_shape", "log_predictive", "refit_predictive", "rule_nodes",
           "taylor_cavities"]

_POINT_BUDGET = 2**22  # numbers per batch of predictive evaluation points (examples × nodes × d)


class Cavities(NamedTuple):
    """Leave-one-out cavities and predictive log densities of ``N`` examples.

    :ivar shift: ``(N, d)`` mean changes ``m_{∖i} − m``.
    :ivar leverage: ``(N,)`` ``κ_i``, the tail shape of ``q_{∖i}/q``.
    :ivar kl: ``(N,)`` ``KL(q_{∖i} ‖ q)``.
    :ivar elpd: ``(N,)`` ``log p(y_i | y_{−i})`` under the cavity.
    :ivar lppd: ``(N,)`` ``log p(y_i | y)`` under ``q`` (same rule).
    """

    shift: jax.Array
    leverage: jax.Array
    kl: jax.Array
    elpd: jax.Array
    lppd: jax.Array


def rule_nodes(rule, spec, dim, dtype) -> tuple[jax.Array, jax.Array]:
    """Standard-normal nodes ``(K, r)`` and weights ``(K,)`` of the rule (``r = d`` for ``mc``)."""
    if rule.kind == "gh" and rule.subspace_dim:
        return tensor_hermite_nodes(rule.nodes_per_dim, rule.subspace_dim, dtype)
    if rule.kind == "gh":
        nodes, weights = hermite_nodes(rule.num_nodes, dtype)
        return nodes[:, None], weights
    if rule.kind == "mc":
        noise = mc_noise(rule, dim, dtype)
        return noise, jnp.full(noise.shape[0], 1.0 / noise.shape[0], dtype)
    return jnp.zeros((1, 0), dtype), jnp.ones(1, dtype)


def _query(spec, rule, mean, ex, shared) -> jax.Array:
    """Rows ``Q_i`` spanning the directions the example's likelihood depends on (``gh`` only)."""
    if rule.subspace_dim:
        return subspace_basis(spec, mean, ex, shared, rule.subspace_dim)
    return jax.jacfwd(lambda zz: example_params(spec, zz, ex, shared)[0])(mean)


def log_predictive(spec, rule, family, shared, nodes, weights, ex, mean, query, marginal, precision) -> jax.Array:
    r"""``log ∫ p(y_i | z) N(z | mean, ·) dz`` by the rule: ``gh`` uses ``marginal = Q Σ Qᵀ``
    over ``query = Q``; ``mc`` draws ``z = mean + L⁻ᵀ ε`` from ``precision``; ``delta`` is the plug-in."""
    if rule.kind == "gh":
        eye = jnp.eye(marginal.shape[0], dtype=marginal.dtype)
        sym = 0.5 * (marginal + marginal.T)
        chol = jnp.linalg.cholesky(sym + eye * jnp.finfo(sym.dtype).eps * jnp.maximum(jnp.trace(sym), 1e-300))
        points = mean[None, :] + (nodes @ chol.T) @ jnp.linalg.pinv(query).T
    elif rule.kind == "mc":
        points = family.draws(Gaussian(mean, precision), nodes)
    else:
        points = mean[None, :]
    values = jax.vmap(lambda z: -example_loss(spec, z, ex, shared))(points)
    return logsumexp(values, b=weights)


def _batch(num, nodes, dim) -> int:
    return int(max(1, min(num, _POINT_BUDGET // max(1, nodes * dim))))


def _downdated_precision(family, state, row) -> Any:
    """``S − Ĥ_i`` in the family's precision format from one example's row of the curvature store."""
    return state.precision - family.site_curvatures(jax.tree.map(lambda x: x[None], row))[0]


def _kl(eig, mahalanobis) -> jax.Array:
    """``KL(q_{∖i} ‖ q)`` from the eigenvalues of ``Σ^{1/2}Ĥ_iΣ^{1/2}`` and ``Δᵀ S Δ`` (inf if not PD)."""
    safe = jnp.minimum(eig, 1.0 - 1e-300)
    terms = jnp.sum(safe / (1.0 - safe) + jnp.log1p(-safe), axis=-1)
    return jnp.where(jnp.max(eig, axis=-1) < 1.0, 0.5 * (terms + mahalanobis), jnp.inf)


@partial(jax.jit, static_argnames=("spec", "rule", "family", "predict"))
def _woodbury_cavities(spec, rule, family, predict, state, data, grads, jac, lam) -> Cavities:
    """Cavities of the full family with factorised sites: rank-``k`` downdates of one Cholesky."""
    num, k, d = jac.shape
    chol = jnp.linalg.cholesky(state.precision)
    lam = 0.5 * (lam + jnp.swapaxes(lam, 1, 2))
    a = solve_triangular(chol, grads.T, lower=True)  # L⁻¹ g_i, (d, N)
    w = solve_triangular(chol, jnp.reshape(jac, (num * k, d)).T, lower=True)
    w = jnp.swapaxes(jnp.reshape(w.T, (num, k, d)), 1, 2)  # L⁻¹ J_iᵀ, (N, d, k)
    b = jnp.einsum("ndk,ndl->nkl", w, w)  # J Σ Jᵀ
    c = jnp.einsum("ndk,dn->nk", w, a)  # J Σ g
    eye = jnp.eye(k, dtype=b.dtype)
    downdate = eye - lam @ b  # I − Λ B
    coef = jnp.linalg.solve(downdate, jnp.einsum("nkl,nl->nk", lam, c)[..., None])[..., 0]
    inner = a.T + jnp.einsum("ndk,nk->nd", w, coef)
    shift = solve_triangular(chol.T, inner.T, lower=False).T
    marginal = jnp.swapaxes(jnp.linalg.solve(jnp.swapaxes(downdate, 1, 2), b), 1, 2)  # B (I − ΛB)⁻¹
    vals, vecs = jnp.linalg.eigh(b)
    root = jnp.einsum("nij,nj,nkj->nik", vecs, jnp.sqrt(jnp.maximum(vals, 0.0)), vecs)
    eig = jnp.linalg.eigvalsh(root @ lam @ root)
    khat = eig[:, -1]
    kl = _kl(eig, jnp.einsum("nd,de,ne->n", shift, state.precision, shift))

    if not predict:
        return Cavities(shift, khat, kl, jnp.zeros(num, shift.dtype), jnp.zeros(num, shift.dtype))
    nodes, weights = rule_nodes(rule, spec, d, state.mean.dtype)
    base = _base_predictive(spec, rule, family, state, data, nodes, weights, jac, b)

    def one(args) -> jax.Array:
        ex, sh, q_rows, marg, jj, ll = args
        prec = state.precision - jj.T @ ll @ jj if rule.kind == "mc" else state.precision
        return log_predictive(spec, rule, family, data.shared, nodes, weights, ex, state.mean + sh, q_rows, marg,
                              prec)

    elpd = jax.lax.map(one, (data.per_example, shift, jac, marginal, jac, lam),
                       batch_size=_batch(num, nodes.shape[0], d))
    return Cavities(shift, khat, kl, elpd, base)


def _base_predictive(spec, rule, family, state, data, nodes, weights, queries, marginals) -> jax.Array:
    """``log p(y_i | y)`` under ``q`` itself for every example (the in-sample term of ``p_loo``)."""
    num, d = data.per_example[0].shape[0], state.mean.shape[0]

    def one(args) -> jax.Array:
        ex, q_rows, marg = args
        return log_predictive(spec, rule, family, data.shared, nodes, weights, ex, state.mean, q_rows, marg,
                              state.precision)

    return jax.lax.map(one, (data.per_example, queries, marginals), batch_size=_batch(num, nodes.shape[0], d))


@partial(jax.jit, static_argnames=("spec", "rule", "family", "predict"))
def _general_cavities(spec, rule, family, predict, state, data, grads, curv) -> Cavities:
    """Cavities for any family and storage, one small downdate per example inside ``lax.map``."""
    num, d = grads.shape
    nodes, weights = rule_nodes(rule, spec, d, state.mean.dtype)
    cov = family.dense_covariance(state)

    def one(args) -> tuple[Any, jax.Array, jax.Array, jax.Array, jax.Array]:
        ex, g, row = args
        prec = _downdated_precision(family, state, row)
        linear = family.natural(Gaussian(state.mean, prec)).linear + g
        cavity = family.from_natural(GaussianNatural(linear, prec))
        eig = family.relative_eigenvalues(state, state.precision - prec)
        shift = cavity.mean - state.mean
        kl = _kl(eig, jnp.sum(shift * family.natural(Gaussian(shift, state.precision)).linear))
        if not predict:
            return shift, jnp.max(eig), kl, jnp.zeros((), g.dtype), jnp.zeros((), g.dtype)
        if rule.kind == "gh":
            q_rows = _query(spec, rule, state.mean, ex, data.shared)
            marg = q_rows @ family.dense_covariance(cavity) @ q_rows.T
            base_marg = q_rows @ cov @ q_rows.T
        else:
            q_rows = marg = base_marg = jnp.zeros((1, 1), grads.dtype)
        elpd = log_predictive(spec, rule, family, data.shared, nodes, weights, ex, cavity.mean, q_rows, marg, prec)
        lppd = log_predictive(spec, rule, family, data.shared, nodes, weights, ex, state.mean, q_rows, base_marg,
                              state.precision)
        return shift, jnp.max(eig), kl, elpd, lppd

    out = jax.lax.map(one, (data.per_example, grads, curv), batch_size=_batch(num, nodes.shape[0], d))
    return Cavities(*out)


def cavities(post, sites, data, predict=True) -> Cavities:
    """All-``N`` cavities of ``post`` for the site rows ``sites`` and their data ``data`` (aligned).

    :param bool predict: also compute the predictive densities (else ``elpd``/``lppd`` are zeros).
    :return: :class:`Cavities`, every field computed in one jitted call.
    """
    return downdates(post.spec, post.rule, post.family, post.state, sites, data, predict=predict)


def downdates(spec, rule, family, state, sites, data, predict=True) -> Cavities:
    """:func:`cavities` for an explicit ``state`` and ``sites`` (e.g. Hessians at the mean)."""
    grads = sites.grad_at(state.mean)
    spec = replace(spec, num_examples=int(grads.shape[0]))
    factors = sites.curv.low_rank_factors()
    if site_curvature(family).detail == FULL and factors is not None:  # a dense precision and J_iᵀ Λ_i J_i sites
        return _woodbury_cavities(spec, rule, family, predict, state, data, grads, *factors)
    return _general_cavities(spec, rule, family, predict, state, data, grads, sites.curv)


def refit_predictive(post, data, means, precisions) -> jax.Array:
    """``log p(y_i | ·)`` of examples ``data`` (aligned with ``means``/``precisions``, one
    exact refit posterior each) by the posterior's rule."""
    num = int(np.asarray(means).shape[0])
    spec = replace(post.spec, num_examples=num)
    return _refit_predictive(spec, post.rule, post.family, data, jnp.asarray(means), jnp.asarray(precisions))


@partial(jax.jit, static_argnames=("spec", "rule", "family"))
def _refit_predictive(spec, rule, family, data, means, precisions) -> jax.Array:
    d = means.shape[1]
    nodes, weights = rule_nodes(rule, spec, d, means.dtype)

    def one(args) -> jax.Array:
        ex, mean, prec = args
        q = Gaussian(mean, prec)
        if rule.kind == "gh":
            q_rows = _query(spec, rule, mean, ex, data.shared)
            marg = q_rows @ family.dense_covariance(q) @ q_rows.T
        else:
            q_rows = marg = jnp.zeros((1, 1), means.dtype)
        return log_predictive(spec, rule, family, data.shared, nodes, weights, ex, mean, q_rows, marg, prec)

    return jax.lax.map(one, (data.per_example, means, precisions), batch_size=8)


TAYLOR_ITERS = 30  # most fixed-point iterations of the deletion under the Taylor model
TAYLOR_TOL = 1e-10  # convergence: squared Mahalanobis length of the last mean step
_FD_STEP = 1e-3  # central-difference step, in units of the posterior's standard deviations
_TAYLOR_BUDGET = 2**26  # numbers in ∂H/∂Σ (d(d+1)/2 · d²) that method="taylor" may form


def taylor_cavities(post, sites, data, shift, iters=TAYLOR_ITERS) -> Any:
    r"""Leave-one-out posteriors with the retained sites' total expanded to second order around ``q``.

    Site removal treats every retained example's loss as the quadratic cached at ``q``. The
    deletion fixed point asks instead for ``E_{q_i}[∇ℓ_{−i}] = 0`` and ``S_i = E_{q_i}[∇²ℓ_{−i}]``,
    where ``ℓ_{−i}`` is the prior plus every other example. With a learned noise scale the
    other examples' expected curvature moves with the deleted posterior, and the neglect gives
    every example a small error of one sign (posteriordb ``kidiq``: Σ −1.0e−2 over 434). Here
    the total ``G(m, Σ) = E[∇ℓ]``, ``H(m, Σ) = E[∇²ℓ]`` (all sites and the prior, by the
    posterior's rule) is replaced by its expansion at ``q``

    .. math::

        G ≈ G_0 + H_0 δ + \tfrac12 T[δ, δ] + ∂_Σ G[Δ], \qquad H ≈ H_0 + T[δ] + ∂_Σ H[Δ],

    (``δ = m_i − m``, ``Δ = Σ_i − Σ``, ``T = ∂H/∂m``), the removed example's own site is
    evaluated exactly at each iterate, ``g_i``, ``h_i``, and the deletion's fixed-point map
    ``S_i ← H − h_i``, ``m_i ← m_i − S_i^{-1}(G − g_i)`` runs from the cavity to convergence.
    The derivatives come from central differences along ``d + d(d+1)/2`` directions at ``q``
    (two site passes each, once for all examples); each iterate then costs one site evaluation
    of its own example: ``O(N)`` site evaluations in all, ``O(N d⁴)`` arithmetic, and a
    ``d³(d+1)/2`` tensor (refused above :data:`_TAYLOR_BUDGET` numbers, ``d ≳ 90``).

    The iteration stops being trusted unless its last mean step is below :data:`TAYLOR_TOL`
    in the Mahalanobis norm of the new precision after ``iters`` steps (it can diverge when
    deleting one example moves the posterior far, e.g. eight schools with ``N = 8``): those
    examples keep their site-removal cavity and are reported.

    :return: ``(means, precisions, converged)``, ``(N, d)``, ``(N, d, d)`` and ``(N,)`` booleans.
    """
    d = post.dim
    if d * d * d * (d + 1) // 2 > _TAYLOR_BUDGET:
        raise InvalidOptionError(
            f"method='taylor' forms ∂H/∂Σ with d³(d+1)/2 = {d ** 3 * (d + 1) // 2:,} numbers for d = {d} (limit "
            f"{_TAYLOR_BUDGET:,}); use method='remove_site' or 'corrected'.")
    spec = replace(post.spec, num_examples=int(shift.shape[0]))
    return _taylor(spec, post.rule, post.family, post.curvature, post.sites.storage, post.chunk_size, int(iters),
                   post.state, data, sites.curv, shift)


@partial(jax.jit, static_argnames=("spec", "rule", "family", "curvature", "storage", "chunk_size", "iters"))
def _taylor(spec, rule, family, curvature, storage, chunk_size, iters, state, data, curv, shift):
    num, d = shift.shape
    dtype = shift.dtype
    one_spec = replace(spec, num_examples=1)

    def expected(sp, dat, mean, cov) -> tuple[jax.Array, Any, Any, Any]:
        out, _ = compute_sites(sp, dat, family, Gaussian(mean, jnp.linalg.inv(cov)), rule, curvature=curvature,
                               storage=storage, chunk_size=chunk_size, num_devices=1)
        ones = jnp.ones(out.grad.shape[0], dtype)
        return ones @ out.dense_grad(), out.curv.weighted_dense(ones), out.prior_grad, out.prior_curvature_dense()

    def total(mean, cov) -> tuple[Any, Any]:
        g, h, pg, ph = expected(spec, data, mean, cov)
        return g + pg, h + ph

    cov0 = family.dense_covariance(state)
    cov0 = 0.5 * (cov0 + cov0.T)
    g0, h0 = total(state.mean, cov0)
    sd = jnp.sqrt(jnp.diag(cov0))
    eye = jnp.eye(d, dtype=dtype)
    upper = np.triu_indices(d)
    basis = eye[upper[0]][:, :, None] * eye[upper[1]][:, None, :]
    basis = basis + jnp.swapaxes(basis, 1, 2) - basis * (upper[0] == upper[1])[:, None, None]  # E_ab + E_ba

    def central(dm, dc, h) -> tuple[Any, Any]:
        (gp, hp), (gm, hm) = total(state.mean + h * dm, cov0 + h * dc), total(state.mean - h * dm, cov0 - h * dc)
        return (gp - gm) / (2 * h), (hp - hm) / (2 * h)

    zero_c = jnp.zeros((d, d), dtype)
    _, t_mean = jax.lax.map(lambda a: central(a[0], zero_c, a[1]), (eye, _FD_STEP * sd))  # T[e_a]: (d, d, d)
    g_cov, h_cov = jax.lax.map(lambda a: central(jnp.zeros(d, dtype), a[0], a[1]),
                               (basis, _FD_STEP * sd[upper[0]] * sd[upper[1]]))  # ∂/∂Σ_ab: (p, d), (p, d, d)

    def one(args) -> tuple[jax.Array, jax.Array, Any]:
        ex, row, sh = args
        one_data = ModelData(tuple(x[None] for x in ex), data.shared)
        h_site = family.site_curvatures(jax.tree.map(lambda x: x[None], row))[0]
        prec = state.precision - 0.5 * (h_site + h_site.T)
        mean = state.mean + sh

        def step(carry, _) -> tuple[tuple[Any, Any, jax.Array], None]:
            mean, prec, _ = carry
            cov = jnp.linalg.inv(prec)
            cov = 0.5 * (cov + cov.T)
            delta, change = mean - state.mean, (cov - cov0)[upper]
            t_delta = jnp.einsum("a,akl->kl", delta, t_mean)
            grad = g0 + h0 @ delta + 0.5 * t_delta @ delta + change @ g_cov
            hess = h0 + t_delta + jnp.einsum("p,pkl->kl", change, h_cov)
            g_i, h_i, _, _ = expected(one_spec, one_data, mean, cov)
            new_prec = hess - h_i
            new_prec = 0.5 * (new_prec + new_prec.T)
            move = jnp.linalg.solve(new_prec, grad - g_i)
            return (mean - move, new_prec, move @ new_prec @ move), None

        start = (mean, prec)
        (mean, prec, last), _ = jax.lax.scan(step, (mean, prec, jnp.asarray(jnp.inf, dtype)), None, length=iters)
        converged = jnp.isfinite(last) & (last <= TAYLOR_TOL) & jnp.all(jnp.isfinite(mean))
        return (jnp.where(converged, mean, start[0]), jnp.where(converged, prec, start[1]), converged)

    return jax.lax.map(one, (data.per_example, curv, shift), batch_size=min(num, 64))


def kl_shape(kl) -> np.ndarray:
    r"""The leverage ``k ∈ [0, 1]`` whose pure-variance removal has ``KL = kl``: the root of
    ``½(k/(1−k) + log(1−k)) = kl`` (vectorised bisection; ``inf`` maps to 1)."""
    kl = np.asarray(kl, np.float64)
    lo, hi = np.zeros_like(kl), np.ones_like(kl)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        above = 0.5 * (mid / (1.0 - mid) + np.log1p(-mid)) > kl
        hi, lo = np.where(above, mid, hi), np.where(above, lo, mid)
    return np.where(np.isfinite(kl), 0.5 * (lo + hi), 1.0)
