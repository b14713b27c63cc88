r"""Per-example sites ``ℓ̂_i(z) = zᵀĝ_i + ½ (z − m)ᵀ Ĥ_i (z − m)`` of a Gaussian posterior.

:func:`compute_sites` evaluates ``ĝ_i = E_q[∇ℓ_i]`` and ``Ĥ_i = E_q[∇²ℓ_i]`` (or its
Gauss–Newton form) for every element of the data plate plus the prior site
``(ĝ_0, Ĥ_0)``, with one of the expectation rules of :mod:`numpyro_pc.sites.expectations`.

The per-example curvatures are held by one of the storage classes of
:mod:`numpyro_pc.curvature.stores` (``Sites.curv``): ``"factor"`` (``Ĥ_i = J_iᵀ Λ_i J_i``, exact
for GLM-type models, Gauss–Newton otherwise), ``"dense"`` (when asked, or
automatically for a model without an exact factorisation whose ``N·d²`` numbers fit the
budget of :func:`numpyro_pc.curvature.memory.dense_auto_budget`, 1/8 of the machine's memory), ``"diag"`` (the diagonal
family) or ``"none"`` (the isotropic family).

Examples are processed in chunks (``lax.scan`` over padded, masked chunks) so that
transient per-example Hessians never exceed a fixed memory budget, and chunks are
sharded over local devices when more than one is present. Monte Carlo samples are
accumulated with ``lax.scan``; ``samples × N × d × d`` is never formed.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from numpyro_pc.curvature.storage import SiteConfig, default_chunk_size, mc_along_subspace, resolve_storage, uses_params
from numpyro_pc.curvature.stores import FULL, Dense, JacobianFactor
from numpyro_pc.errors import DataShapeError, ExpectationRuleError, InvalidOptionError
from numpyro_pc.model.likelihood import example_loss, example_params
from numpyro_pc.options import is_choice
from numpyro_pc.protocols.capabilities import gaussian_solver, matrix_free_sites, site_curvature

from .cached import Sites, SiteSums  # noqa: F401  (re-exported: the package imports them from here)
from .expectations import (
    hermite_nodes,
    mc_noise,
    prior_is_separable,
    subspace_basis,
    subspace_excess,
    subspace_tolerance,
    tensor_hermite_nodes,
)
from .prior import prior_terms, prior_terms_reparam, reparam_curvature
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

__all__ = ["Sites", "SiteSums", "SiteConfig", "compute_sites", "resolve_storage", "mc_along_subspace",
           "trace_count"]  # Sites, SiteSums: re-exported

_TRACES = {"compute": 0}


def trace_count() -> int:
    """Number of times the site computation has been traced (compiled) in this process."""
    return _TRACES["compute"]


def _psd(lam) -> jax.Array:
    vals, vecs = jnp.linalg.eigh(lam)
    return (vecs * jnp.maximum(vals, 0.0)) @ vecs.T


def _point_terms(spec, cfg, z, ex, shared) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array]:
    """Loss, gradient and curvature of one example at one point ``z``."""
    if uses_params(spec, cfg.storage, cfg.curvature):
        theta_fn = lambda zz: example_params(spec, zz, ex, shared)[0]  # noqa: E731
        theta, loss_fn = example_params(spec, z, ex, shared)
        jac_fn = jax.jacrev if spec.num_params < spec.latent.dim else jax.jacfwd
        jac = jac_fn(theta_fn)(z)
        loss, g_theta = jax.value_and_grad(loss_fn)(theta)
        lam = jax.hessian(loss_fn)(theta)
        if cfg.curvature == "ggn":
            lam = _psd(lam)
        return loss, jac.T @ g_theta, jac, lam
    f = lambda zz: example_loss(spec, zz, ex, shared)  # noqa: E731
    loss, grad = jax.value_and_grad(f)(z)
    return loss, grad, None, jax.hessian(f)(z)


def _chunk_fn(spec, cfg, family, q, shared, extra, ex_chunk, mask) -> tuple[tuple[Any, Any, Any, Any], Any]:
    """Stored per-example terms of a chunk (compressed by the store) and its masked, weighted
    dense-curvature sum."""
    (loss, grad, jac, stored), dsum = _chunk_terms(spec, cfg, family, q, shared, extra, ex_chunk, mask)
    if cfg.storage.sparse_rows:  # the dense (chunk, k, d) Jacobians are transient
        jac, grad = jax.vmap(lambda j, g: cfg.storage.compress(j, g, cfg.width))(jac, grad)
    return (loss, grad, jac, stored), dsum


def _chunk_terms(spec, cfg, family, q, shared, extra, ex_chunk, mask):
    """Per-example terms of a chunk and its masked, weighted dense-curvature sum."""
    rule = cfg.rule
    *ex_chunk, example_weights = ex_chunk
    ex_chunk = tuple(ex_chunk)
    weights = mask.astype(q.mean.dtype) * example_weights

    def dense_sum(dense) -> jax.Array:
        if dense is None or not cfg.need_hessian_sum:
            return jnp.zeros((), q.mean.dtype)  # not asked for: no (d, d) carry
        return jnp.einsum("n,nde->de", weights, dense)

    if rule.kind == "gh" and rule.subspace_dim:
        (loss, grad, jac, stored), dense = jax.vmap(
            lambda ex: _subspace_terms(spec, cfg, family, q, shared, extra, ex))(ex_chunk)
        return _flag_excess(spec, q, shared, ex_chunk, mask, (loss, grad, jac, stored), dense_sum(dense))

    if rule.kind == "gh":
        nodes, node_w, cov = extra

        def one(ex):
            theta_fn = lambda zz: example_params(spec, zz, ex, shared)[0]  # noqa: E731
            theta, loss_fn = example_params(spec, q.mean, ex, shared)
            jac = jax.jacrev(theta_fn)(q.mean)
            std = jnp.sqrt(family.quad_form_cov(q, cov, jac[0]))
            points = theta[0] + std * nodes
            scalar_loss = lambda t: loss_fn(jnp.reshape(t, (1,)))  # noqa: E731
            phi = jax.vmap(scalar_loss)(points)
            d1 = jax.vmap(jax.grad(scalar_loss))(points)
            d2 = jax.vmap(jax.grad(jax.grad(scalar_loss)))(points)
            e2 = jnp.dot(node_w, d2)
            if cfg.curvature == "ggn":
                e2 = jnp.maximum(e2, 0.0)
            lam = jnp.reshape(e2, (1, 1))
            stored, dense = cfg.storage.from_point(jac, lam)
            return (jnp.dot(node_w, phi), jac[0] * jnp.dot(node_w, d1), jac, stored), dense

        (loss, grad, jac, stored), dense = jax.vmap(one)(ex_chunk)
        return (loss, grad, jac, stored), dense_sum(dense)

    if rule.kind == "delta":
        def one(ex):
            loss, grad, jac, curv = _point_terms(spec, cfg, q.mean, ex, shared)
            stored, dense = cfg.storage.from_point(jac, curv)
            return (loss, grad, jac, stored), dense

        per, dense = jax.vmap(one)(ex_chunk)
        return per, dense_sum(dense)

    if _reparam(cfg, family):
        draws, eps = extra

        def at_draw(z, e):
            def one(ex):
                loss, grad = jax.value_and_grad(lambda zz: example_loss(spec, zz, ex, shared))(z)
                return loss, grad, jnp.outer(grad, e)

            return jax.vmap(one)(ex_chunk)

        def body_reparam(acc, draw) -> tuple[Any, None]:
            return jax.tree.map(jnp.add, acc, at_draw(*draw)), None

        shapes = jax.eval_shape(at_draw, draws[0], eps[0])
        init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        total, _ = jax.lax.scan(body_reparam, init, (draws, eps))
        loss, grad, cross = jax.tree.map(lambda x: x / draws.shape[0], total)
        return (loss, grad, None, cross), dense_sum(None)  # cross → Ĥ in _compute

    if mc_along_subspace(rule, cfg.curvature):
        per, dsum = _subspace_draw_terms(spec, cfg, q, shared, extra, ex_chunk, dense_sum)
        return _flag_excess(spec, q, shared, ex_chunk, mask, per, dsum)

    samples = extra  # (S, d) fixed draws
    jac_at_mean = None
    if cfg.storage.keeps_jacobian:  # affine: the Jacobian does not depend on z
        jac_at_mean = jax.vmap(lambda ex: _point_terms(spec, cfg, q.mean, ex, shared)[2])(ex_chunk)

    def at_sample(z) -> tuple[Any, Any, Any, jax.Array]:
        def one(ex):
            loss, grad, jac, curv = _point_terms(spec, cfg, z, ex, shared)
            stored, dense = cfg.storage.from_point(jac, curv)
            return (loss, grad, stored), dense

        (loss, grad, stored), dense = jax.vmap(one)(ex_chunk)
        return loss, grad, stored, dense_sum(dense)

    def body(acc, z) -> tuple[Any, None]:
        return jax.tree.map(jnp.add, acc, at_sample(z)), None

    shapes = jax.eval_shape(at_sample, samples[0])
    init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    total, _ = jax.lax.scan(body, init, samples)
    loss, grad, stored, dsum = jax.tree.map(lambda x: x / samples.shape[0], total)
    return (loss, grad, jac_at_mean, stored), dsum


def _flag_excess(spec, q, shared, ex_chunk, mask, per, dsum) -> tuple:
    """Mark the examples of a chunk whose likelihood leaves their rule's subspace (its Hessians would
    miss directions): their loss becomes NaN and their count joins the chunk's sums
    (:attr:`SiteSums.subspace_violations`), which :func:`compute_sites` refuses with the reason."""
    loss, grad, jac, stored = per
    excess = jax.vmap(lambda ex, basis: subspace_excess(spec, q.mean, ex, shared, basis))(ex_chunk, jac)
    bad = excess > subspace_tolerance(q.mean.dtype)
    return (jnp.where(bad, jnp.nan, loss), grad, jac, stored), (dsum, jnp.sum(bad & mask))


def _subspace_draw_terms(spec, cfg, q, shared, samples, ex_chunk, dense_sum) -> tuple:
    """Monte Carlo sites of a chunk differentiated along each example's dependence subspace.

    ``ℓ_i`` depends on ``z`` only through ``P_i z`` (``P_i`` ``(r, d)``, orthonormal rows), so at
    every draw ``∇ℓ_i = P_iᵀ ∇_t`` and ``∇²ℓ_i = P_iᵀ ∇²_t P_i`` with ``t`` the subspace
    coordinates: ``r`` Hessian-vector products per draw instead of ``d``, and the site is held
    as the factor ``(P_i, E[∇²_t])`` — the numbers of the dense rule, ``O(r·d)`` per example.
    """
    r = cfg.rule.subspace_dim
    bases = jax.vmap(lambda ex: subspace_basis(spec, q.mean, ex, shared, r))(ex_chunk)  # (n, r, d)

    def at_sample(z):
        def one(ex, basis) -> tuple[Any, Any, Any]:
            f = lambda t: example_loss(spec, z + t @ basis, ex, shared)  # noqa: E731
            zero = jnp.zeros(r, z.dtype)
            value, grad = jax.value_and_grad(f)(zero)
            return value, grad, jax.hessian(f)(zero)

        return jax.vmap(one)(ex_chunk, bases)

    def body(acc, z) -> tuple[Any, None]:
        return jax.tree.map(jnp.add, acc, at_sample(z)), None

    shapes = jax.eval_shape(at_sample, samples[0])
    init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    total, _ = jax.lax.scan(body, init, samples)
    loss, grad_t, hess_t = jax.tree.map(lambda x: x / samples.shape[0], total)
    stored, dense = jax.vmap(cfg.storage.from_point)(bases, hess_t)
    grad = jnp.einsum("nr,nrd->nd", grad_t, bases)
    return (loss, grad, bases, stored), dense_sum(dense)


def _subspace_terms(spec, cfg, family, q, shared, extra, ex) -> tuple[tuple[Any, jax.Array, jax.Array, Any], Any]:
    r"""Gauss–Hermite site of one example over its dependence subspace (``rule.subspace_dim > 0``).

    With ``u = P z ~ N(P m, V)``, ``V = P Σ Pᵀ = L Lᵀ``, the points ``z_k = m + Σ Pᵀ L⁻ᵀ ξ_k``
    satisfy ``P z_k = P m + L ξ_k``; derivatives are taken along ``Pᵀ t`` only. As ``ℓ`` depends
    on ``z`` only through ``u`` and the rows of ``P`` are orthonormal (``P Pᵀ = I``,
    :func:`~numpyro_pc.sites.expectations.subspace_basis`), the gradient along ``t`` at ``z_k`` is
    ``g_k = P ∇ℓ(z_k) = ∇_u φ(u_k)`` and ``E[∇ℓ] = Pᵀ Σ_k w_k g_k``, ``E[∇²ℓ] = Pᵀ E[∇²_u φ] P``.

    ``curvature="hessian"`` takes ``E[∇²_u φ]`` from the gradients alone by Stein's identity,
    ``E[∇²_u φ] = V⁻¹ E[(u − P m) ∇_u φᵀ]`` with ``V⁻¹ (u_k − P m) = L⁻ᵀ ξ_k``:

    .. math::

        E[∇²_u φ] ≈ \operatorname{sym}\Bigl(L^{-T} \sum_k w_k ξ_k g_k^T\Bigr),

    no per-node Hessian. Its quadrature error is that of ``ξ g(ξ)`` instead of ``∇_u g(ξ)``, one
    polynomial degree higher: measured against the Hessian rule at twice the nodes per dimension
    (the same ``q``), the per-example relative error of ``E[∇²ℓ]`` is 2.7e-4 (max) on eight
    schools non-centred against 4.5e-5 for the per-node Hessians, 3.6e-5 against 4.8e-5 on a
    40-group non-centred logistic regression, and at rounding level (1e-14) for both on a normal
    varying-slope regression (``r = 2``); the fitted posteriors differ from the finer rule's by a KL
    of 5.0e-9 against 1.7e-10 (eight schools) and 8.4e-12 against 1.5e-11 (logistic) — below every
    tolerance of the solver, for a site pass without ``r`` Hessian-vector products per node.
    (At 8 nodes per dimension, 512 points, Stein's error falls below the per-node Hessians' at 7:
    2.5e-5 and 1.1e-5.)
    ``"ggn"`` keeps an ``r × r`` Hessian per node: the positive part (``_psd``) is taken of their
    weighted sum.
    """
    nodes, node_w, cov = extra
    basis = subspace_basis(spec, q.mean, ex, shared, cfg.rule.subspace_dim)  # (r, d)
    spread = family.cov_times(q, cov, basis.T)  # Σ Pᵀ, (d, r)
    v = basis @ spread
    eye = jnp.eye(v.shape[0], dtype=v.dtype)
    chol = jnp.linalg.cholesky(0.5 * (v + v.T) + eye * jnp.finfo(v.dtype).eps * jnp.trace(v))
    shift = jax.scipy.linalg.solve_triangular(chol, spread.T, lower=True)  # L⁻¹ P Σ, (r, d)
    points = q.mean[None, :] + nodes @ shift

    def along(z) -> Callable[[jax.Array], jax.Array]:
        return lambda t: example_loss(spec, z + t @ basis, ex, shared)

    zero = jnp.zeros(basis.shape[0], q.mean.dtype)
    if cfg.curvature == "ggn":
        def restricted(z) -> tuple[Any, Any, Any]:
            value, grad = jax.value_and_grad(along(z))(zero)
            return value, grad, jax.hessian(along(z))(zero)

        values, grads, hessians = jax.vmap(restricted)(points)
        lam = _psd(jnp.einsum("k,kab->ab", node_w, hessians))
    else:  # Stein: L⁻ᵀ Σ_k w_k ξ_k g_kᵀ, symmetrised
        values, grads = jax.vmap(lambda z: jax.value_and_grad(along(z))(zero))(points)
        cross = (nodes * node_w[:, None]).T @ grads  # (r, r)
        lam = jax.scipy.linalg.solve_triangular(chol, cross, lower=True, trans="T")
        lam = 0.5 * (lam + lam.T)
    stored, dense = cfg.storage.from_point(basis, lam)
    return (node_w @ values, (node_w @ grads) @ basis, basis, stored), dense


def _map_chunks(fn, leaves, num, chunk, num_devices) -> tuple[Any, Any]:
    """Run ``fn(chunk_leaves, mask) -> (per_example, sums)`` over padded chunks."""
    per_block = chunk * num_devices
    total = int(math.ceil(num / per_block)) * per_block
    pad = total - num
    padded = leaves if pad == 0 else tuple(jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), mode="edge")
                                           for x in leaves)
    mask = jnp.arange(total) < num
    n_chunks = total // per_block
    shaped = tuple(x.reshape((num_devices, n_chunks, chunk) + x.shape[1:]) for x in padded)
    mask = mask.reshape(num_devices, n_chunks, chunk)

    def per_device(xs, mk) -> tuple[Any, Any]:
        xs = tuple(x[0] for x in xs)
        mk = mk[0]
        first = jax.eval_shape(fn, tuple(x[0] for x in xs), mk[0])
        init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), first[1])

        def body(carry, inp) -> tuple[Any, Any]:
            per, sums = fn(*inp)
            return jax.tree.map(jnp.add, carry, sums), per

        sums, per = jax.lax.scan(body, init, (xs, mk))
        if num_devices > 1:
            sums = jax.lax.psum(sums, "examples")
        return jax.tree.map(lambda x: x[None], per), sums

    if num_devices > 1:
        mesh = Mesh(np.array(jax.local_devices()[:num_devices]), ("examples",))
        spec_in = PartitionSpec("examples")
        # check_vma=False: with varying-axis checking, gradients w.r.t. the replicated mean
        # would be psum-ed across devices (the transpose of an implicit broadcast).
        per, sums = jax.shard_map(per_device, mesh=mesh, in_specs=(spec_in, spec_in),
                                  out_specs=(spec_in, PartitionSpec()), check_vma=False)(shaped, mask)
    else:
        per, sums = per_device(shaped, mask)
    per = jax.tree.map(lambda x: x.reshape((total,) + x.shape[3:]), per)
    if pad:
        per = jax.tree.map(lambda x: x[:num], per)
    return per, sums


def _reparam(cfg, family) -> bool:
    """Whether the Monte Carlo sites take the reparameterisation precision estimator."""
    return (cfg.rule.kind == "mc" and cfg.rule.mc_precision == "reparam" and not gaussian_solver(family).dense_sum
            and cfg.storage is Dense and cfg.curvature == "hessian")


@partial(jax.jit, static_argnames=("spec", "cfg", "family"))
def _compute(spec, cfg, family, q, data, ids, weights) -> tuple[Sites, SiteSums]:
    _TRACES["compute"] += 1
    rule = cfg.rule
    extra: Any
    if _reparam(cfg, family):
        eps = mc_noise(rule, q.mean.shape[0], q.mean.dtype)
        extra = (family.draws(q, eps), eps)
    elif rule.kind == "mc":
        extra = family.draws(q, mc_noise(rule, q.mean.shape[0], q.mean.dtype))
    elif rule.kind == "gh":
        cov = family.covariance_operand(q)
        if rule.subspace_dim:
            extra = (*tensor_hermite_nodes(rule.nodes_per_dim, rule.subspace_dim, q.mean.dtype), cov)
        else:
            extra = (*hermite_nodes(rule.num_nodes, q.mean.dtype), cov)
    else:
        extra = None
    num = data.per_example[0].shape[0]
    fn = lambda leaves, mask: _chunk_fn(spec, cfg, family, q, data.shared, extra, leaves, mask)  # noqa: E731
    leaves = data.per_example + (weights,)
    (loss, grad, jac, stored), hess_sum = _map_chunks(fn, leaves, num, cfg.chunk_size, cfg.num_devices)
    violations = jnp.zeros((), jnp.int32)
    if _checks_subspace(cfg):
        hess_sum, violations = hess_sum
    if _reparam(cfg, family):
        chol = jnp.linalg.cholesky(q.precision)
        stored = jax.lax.map(partial(reparam_curvature, chol), stored, batch_size=cfg.chunk_size)
        p_loss, p_grad, p_hess = prior_terms_reparam(spec, chol, data, *extra)
    else:
        p_loss, p_grad, p_hess = prior_terms(spec, rule, family, q, data, extra, cfg.prior_diagonal)
    curv = cfg.storage.assemble(jac, stored, num, q.mean.dtype, dim=q.mean.shape[0])
    sites = Sites(grad=grad, curv=curv, loss=loss, ids=ids, ref_index=jnp.zeros(num, jnp.int32),
                  ref_means=q.mean[None, :], prior_grad=p_grad, prior_curvature=p_hess, prior_loss=p_loss,
                  prior_ref=q.mean, detail=site_curvature(family).detail)
    if cfg.need_hessian_sum and cfg.storage.detail == FULL:
        hess_sum = curv.weighted_dense(weights)
    return sites, SiteSums(hessian=hess_sum, loss=weights @ loss, subspace_violations=violations)


def _checks_subspace(cfg) -> bool:
    """Whether the site computation differentiates along per-example subspaces (and checks them)."""
    return bool((cfg.rule.kind == "gh" and cfg.rule.subspace_dim) or mc_along_subspace(cfg.rule, cfg.curvature))


def compute_sites(spec, data, family, q, rule, curvature="hessian", storage="auto", chunk_size=None,
                  ids=None, need_hessian_sum=False, num_devices=None, weights=None) -> tuple[Sites, SiteSums]:
    """Compute the sites of every example and of the prior at the posterior ``q``.

    :param spec: the model's :class:`~numpyro_pc.model.likelihood.ModelSpec`.
    :param data: the :class:`~numpyro_pc.model.likelihood.ModelData` to compute sites for.
    :param family: a :class:`~numpyro_pc.families.registry.GaussianFamily`.
    :param q: the :class:`~numpyro_pc.families.registry.Gaussian` to expand around.
    :param rule: a prepared :class:`~numpyro_pc.sites.expectations.ExpectationRule`.
    :param str curvature: ``"hessian"`` (exact ``E_q[∇²ℓ_i]``) or ``"ggn"`` (Gauss–Newton
        ``E_q[J_iᵀ Λ_i J_i]`` with ``Λ_i`` projected onto its positive part).
    :param str storage: ``"auto"`` (chosen by :func:`resolve_storage`), ``"diag"``, ``"factor"``, ``"sparse"``,
        ``"dense"`` or ``"none"``.
    :param int chunk_size: examples per chunk (default from a memory budget).
    :param ids: integer ids of the examples (default ``0..N-1``).
    :param bool need_hessian_sum: also return ``Σ_i`` dense curvature (for the solver).
    :param int num_devices: devices to shard chunks over (default: all local devices).
    :param weights: per-example weights of the totals in :class:`SiteSums` (the sites
        themselves are unweighted).
    :return: ``(Sites, SiteSums)``.
    """
    if not is_choice(curvature, ("hessian", "ggn")):
        raise InvalidOptionError(f"unknown curvature {curvature!r}; expected 'hessian' or 'ggn'")
    auto = isinstance(storage, str) and storage == "auto"
    storage = resolve_storage(storage, family, spec, rule, curvature, q.mean.dtype)
    if auto and storage.sparse_rows and replace(spec, num_examples=0) in _DENSE_ROWS:
        storage = JacobianFactor  # the model's rows were found dense: no (N, d) column index, products by BLAS
    num = int(data.per_example[0].shape[0])
    if num == 0:
        raise DataShapeError("no examples to compute sites for (the data is empty)")
    if num_devices is None:
        num_devices = jax.local_device_count()
    num_devices = max(1, min(int(num_devices), num))
    if chunk_size is None:
        chunk_size = default_chunk_size(spec, storage, curvature, int(math.ceil(num / num_devices)), need_hessian_sum,
                                        rule)
    if ids is None:
        ids = jnp.arange(num)
    traced = isinstance(q.mean, jax.core.Tracer)
    cfg = SiteConfig(rule=rule, curvature=curvature, storage=storage, chunk_size=int(chunk_size),
                     num_devices=num_devices, need_hessian_sum=bool(need_hessian_sum),
                     prior_diagonal=_prior_diagonal(spec, data, family, storage, rule, q, traced))
    weights = jnp.ones(num, q.mean.dtype) if weights is None else jnp.asarray(weights, q.mean.dtype)
    if not storage.sparse_rows:
        out = _compute(spec, cfg, family, q, data, jnp.asarray(ids), weights)
        return out if traced else _checked_subspaces(out, rule)
    dim = spec.latent.dim
    key = replace(spec, num_examples=0)
    width = dim if traced else _WIDTHS.get(key, min(dim, _FIRST_WIDTH))  # inside a trace nnz cannot be checked
    while True:
        out = _compute(spec, replace(cfg, width=width), family, q, data, jnp.asarray(ids), weights)
        if traced:
            return out
        need = int(jnp.max(out[0].curv.nnz))
        if need <= width:
            _WIDTHS[key] = width
            return _checked_subspaces(out, rule)
        if auto and 2 * need > dim:  # dense rows: an index of d columns per example would only cost
            _DENSE_ROWS.add(key)  # memory (N·d integers) and time (scatter-adds instead of matrix products)
            return compute_sites(spec, data, family, q, rule, curvature, "auto", chunk_size, ids, need_hessian_sum,
                                 num_devices, weights)
        width = min(dim, 1 << (need - 1).bit_length())  # a power of two: few compilations as data arrive


_FIRST_WIDTH = 16  # columns per example a sparse store tries first
_DENSE_ROWS: set = set()  # models (their specs) whose rows use more than half the columns: "auto" keeps factors


def _checked_subspaces(out, rule) -> tuple:
    """``out`` unless some example's likelihood left its rule's subspace (:func:`_flag_excess`).

    :raises ExpectationRuleError: naming those examples.
    """
    sites, sums = out
    count = int(sums.subspace_violations)
    if count:
        bad = np.asarray(sites.ids)[np.isnan(np.asarray(sites.loss))][:10].tolist()
        raise ExpectationRuleError(
            f"{count} example(s) (ids {bad}{' …' if count > 10 else ''}) depend on the latents through more than the "
            f"{rule.subspace_dim} directions the {rule.kind!r} rule differentiates along (the subspace was measured "
            "on other examples), so their Hessians would miss directions. Fit again with expectation='auto' on data "
            "that includes such examples (the subspace is measured there), or use expectation='mc' (dense Hessians).")
    return out
_WIDTHS: dict[Any, int] = {}  # the widest sparse store a model (its spec) has needed so far


def _prior_diagonal(spec, data, family, storage, rule, q, traced) -> bool:
    """Whether ``Ĥ_0`` is held as its diagonal: the family keeps its sites matrix-free, they are stored
    sparse (or as the factors ``storage="auto"`` keeps for a model whose rows proved dense), and the prior is separable (known from the ``gh`` rule's probe, else probed here, matrix-free)."""
    # factors that "auto" chose for dense rows, or any factors of a family matrix-free only at large d (diagonal,
    # isotropic: a posterior loaded in another process updates with its saved storage, "factor")
    dense_rows = storage.keeps_jacobian and (replace(spec, num_examples=0) in _DENSE_ROWS
                                             or not site_curvature(family).matrix_free)
    if not (matrix_free_sites(family, spec.latent.dim) and (storage.sparse_rows or dense_rows)):
        return False
    if rule.prior_mode is not None:
        return rule.prior_mode == "separable"
    return not traced and prior_is_separable(spec, data, q.mean)
