r"""Per-example sites ``ℓ̂_i(z) = zᵀĝ_i + ½ (z − m)ᵀ Ĥ_i (z − m)`` of a Gaussian posterior.

:func:`compute_sites` evaluates ``ĝ_i = E_q[∇ℓ_i]`` and ``Ĥ_i = E_q[∇²ℓ_i]`` (or its
Gauss–Newton form) for every element of the data plate plus the prior site
``(ĝ_0, Ĥ_0)``, with one of the expectation rules of :mod:`numpyro_pc.expectations`.

The per-example curvatures are held by one of the storage classes of
:mod:`numpyro_pc.curvature` (``Sites.curv``): ``"factor"`` (``Ĥ_i = J_iᵀ Λ_i J_i``, exact
for GLM-type models, Gauss–Newton otherwise), ``"dense"`` (only when asked, or
automatically for small problems without an exact factorisation), ``"diag"`` (the diagonal
family) or ``"none"`` (the isotropic family).

Examples are processed in chunks (``lax.scan`` over padded, masked chunks) so that
transient per-example Hessians never exceed a fixed memory budget, and chunks are
sharded over local devices when more than one is present. Monte Carlo samples are
accumulated with ``lax.scan``; ``samples × N × d × d`` is never formed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from .curvature import FULL, CurvatureStore, Dense, Factor, get_store
from .errors import DataShapeError, InvalidOptionError, SiteStorageError
from .expectations import hermite_nodes, mc_noise, subspace_basis, tensor_hermite_nodes
from .families import GaussianNatural
from .likelihood import example_loss, example_params, prior_loss
from .rowops import bucket_size, filled, is_every_row, join_rows, pad_last_row, shifted, take_rows

__all__ = ["Sites", "SiteSums", "SiteConfig", "compute_sites", "resolve_storage", "trace_count"]

_DENSE_AUTO_LIMIT = 2**22  # numbers: automatic dense storage only below ~32 MB in float64
_CHUNK_BUDGET = 2**23  # numbers per chunk of transient per-example curvature
_TRACES = {"compute": 0}


@partial(jax.jit, static_argnums=0)
def _natural_sum(family, sites, weights):
    linear = weights @ (sites.curvature_matvec(sites.refs()) - sites.grad)
    return GaussianNatural(linear, sites.example_curvature_sum(family, weights))


def trace_count():
    """Number of times the site computation has been traced (compiled) in this process."""
    return _TRACES["compute"]


@partial(jax.tree_util.register_dataclass,
         data_fields=["grad", "curv", "loss", "ids", "ref_index", "ref_means", "prior_grad", "prior_curvature",
                      "prior_loss", "prior_ref"],
         meta_fields=[])
@dataclass(frozen=True)
class Sites:
    """Cached sites of every example and of the prior.

    :ivar grad: ``(N, d)`` expected gradients ``ĝ_i``.
    :ivar curv: the per-example curvatures ``Ĥ_i``, a
        :class:`~numpyro_pc.curvature.CurvatureStore` (factorised, dense, diagonal or none).
    :ivar loss: ``(N,)`` expected losses ``E_q[ℓ_i]``.
    :ivar ids: ``(N,)`` stable integer example ids.
    :ivar ref_index: ``(N,)`` row of ``ref_means`` holding the mean each site was computed at.
    :ivar ref_means: ``(T, d)`` the posterior means the sites were computed at (one row per
        computation; sites from earlier posteriors keep their own row, so stale and fresh
        sites coexist).
    :ivar prior_grad: ``ĝ_0``.
    :ivar prior_curvature: dense ``Ĥ_0``.
    :ivar prior_loss: ``E_q[ℓ_0]``.
    :ivar prior_ref: the mean the prior site was computed at.
    """

    grad: jax.Array
    curv: CurvatureStore
    loss: jax.Array
    ids: jax.Array
    ref_index: jax.Array
    ref_means: jax.Array
    prior_grad: jax.Array
    prior_curvature: jax.Array
    prior_loss: jax.Array
    prior_ref: jax.Array

    @property
    def storage(self):
        """The curvature storage's name (``"factor"``, ``"dense"``, ``"diag"`` or ``"none"``)."""
        return self.curv.name

    @property
    def num_examples(self):
        return self.grad.shape[0]

    def grad_sum(self):
        """``Σ_{i=0..N} ĝ_i`` (prior included)."""
        return self.prior_grad + jnp.sum(self.grad, 0)

    def curvature_sum(self, family):
        """``Σ_{i=0..N} Ĥ_i`` (prior included) in the family's precision format."""
        w = jnp.ones(self.num_examples, self.grad.dtype)
        return family.target_precision(self.curv, w, self.prior_curvature)

    def example_curvature_sum(self, family, weights=None):
        """``Σ_{i=1..N} w_i Ĥ_i`` in the family's precision format (``w_i = 1`` by default)."""
        w = jnp.ones(self.num_examples, self.grad.dtype) if weights is None else weights
        return family.curvature_sum(self.curv, w)

    def dense_curvature(self):
        """Per-example dense curvatures ``(N, d, d)`` (materialised on demand)."""
        return self.curv.dense()

    def curvature_trace(self):
        """``tr Ĥ_i`` per example — a scalar 'weight' of each site in the posterior."""
        return self.curv.trace()

    def refs(self):
        """``(N, d)`` the mean each example's site was computed at."""
        return take_rows(self.ref_means, self.ref_index)

    def curvature_matvec(self, v):
        """``Ĥ_i v_i`` for every example (``v`` is ``(N, d)``)."""
        return self.curv.matvec(v)

    def grad_at(self, mean):
        """Gradient of each quadratic site at ``mean``: ``ĝ_i + Ĥ_i (mean − m_i)``, ``(N, d)``."""
        return self.grad + self.curvature_matvec(mean[None, :] - self.refs())

    def prior_grad_at(self, mean):
        """Gradient of the prior site at ``mean``."""
        return self.prior_grad + self.prior_curvature @ (mean - self.prior_ref)

    def natural(self, family):
        """Per-example site natural parameters ``(Ĥ_i m_i − ĝ_i, Ĥ_i)`` (leading axis N)."""
        return GaussianNatural(self.curvature_matvec(self.refs()) - self.grad, family.site_curvatures(self.curv))

    def natural_sum(self, family, weights=None):
        """``Σ_{i=1..N} w_i λ̂_i`` site natural parameters in the family's format (``w_i = 1`` by default).

        Computed on bucket-padded sites (copies weighted 0), so sums over a growing or
        shrinking set of sites reuse a few compilations.
        """
        if isinstance(self.grad, jax.core.Tracer):  # inside a trace the shapes are fixed anyway
            return _natural_sum(family, self, jnp.ones(self.num_examples, self.grad.dtype) if weights is None
                                else weights)
        return _natural_sum(family, *self.bucketed(weights))

    def prior_natural(self, family):
        """Natural parameters of the prior site."""
        return family.site_natural(self.prior_grad, family.project_curvature(self.prior_curvature), self.prior_ref)

    def take(self, index):
        """The sites of the examples at positions ``index`` (the prior site is kept)."""
        if is_every_row(index, self.num_examples):
            return self  # no copy
        pick = lambda x: take_rows(x, index)  # noqa: E731
        return replace(self, grad=pick(self.grad), curv=self.curv.take(index), loss=pick(self.loss),
                       ids=pick(self.ids), ref_index=pick(self.ref_index))

    def bucketed(self, weights=None):
        """``(sites, weights)`` padded to :func:`~numpyro_pc.rowops.bucket_size` rows (and reference
        rows), the copies weighted 0 (``weights=None``: 1 for every real site).

        Compiled sums over the result see a few bucket shapes instead of one per stream length.
        """
        num, dtype = self.num_examples, self.grad.dtype
        if num == 0:
            return self, jnp.zeros(0, dtype) if weights is None else weights
        size = bucket_size(num)
        weights = (filled([(num, 1.0), (size - num, 0.0)], dtype) if weights is None
                   else join_rows(jnp.asarray(weights, dtype), filled([(size - num, 0.0)], dtype)))
        return self.padded(size, bucket_size(self.ref_means.shape[0], smallest=1)), weights

    def padded(self, num, num_refs):
        """The sites followed by copies of the last one up to ``num`` rows, and ``ref_means``
        extended the same way to ``num_refs`` rows.

        Sums over padded sites must give the copies weight 0; in exchange, compiled sums see
        a few bucket shapes instead of one shape per stream length.
        """
        extra = num - self.num_examples
        pad = lambda x: pad_last_row(x, extra)  # noqa: E731
        return replace(self, grad=pad(self.grad), curv=self.curv.padded(extra), loss=pad(self.loss),
                       ids=pad(self.ids), ref_index=pad(self.ref_index),
                       ref_means=pad_last_row(self.ref_means, num_refs - self.ref_means.shape[0]))

    def concat(self, other, prior_from="other"):
        """Examples of ``self`` followed by those of ``other``; the prior site comes from ``prior_from``."""
        join = join_rows
        prior = other if prior_from == "other" else self
        return Sites(grad=join(self.grad, other.grad), curv=self.curv.join(other.curv),
                     loss=join(self.loss, other.loss), ids=join(self.ids, other.ids),
                     ref_index=join(self.ref_index, shifted(other.ref_index, self.ref_means.shape[0])),
                     ref_means=join(self.ref_means, other.ref_means), prior_grad=prior.prior_grad,
                     prior_curvature=prior.prior_curvature, prior_loss=prior.prior_loss, prior_ref=prior.prior_ref)

    def stored_numbers(self):
        """How many numbers the per-example sites hold (gradients and curvature)."""
        return int(np.prod(self.grad.shape)) + self.curv.stored_numbers()

    def arrays(self):
        """``{name: array}`` of every field, the curvature store's fields by their own names (for files)."""
        out = {name: getattr(self, name) for name in _PLAIN_FIELDS}
        out.update(self.curv.arrays())
        return out

    @classmethod
    def from_arrays(cls, storage, arrays):
        """Sites from :meth:`arrays`' output and the storage's name (a saved posterior's)."""
        store = get_store(storage)
        num = arrays["grad"].shape[0]
        curv = store.from_arrays({k: arrays[k] for k in store.file_shapes(0, 0, 0)}, num, arrays["grad"].dtype)
        return cls(curv=curv, **{name: arrays[name] for name in _PLAIN_FIELDS})


_PLAIN_FIELDS = ("grad", "loss", "ids", "ref_index", "ref_means", "prior_grad", "prior_curvature", "prior_loss",
                 "prior_ref")


class SiteSums(NamedTuple):
    """Totals over examples computed alongside the sites (for the solver)."""

    hessian: jax.Array  # Σ_{i≥1} dense curvature, (d, d)
    loss: jax.Array     # Σ_{i≥1} E_q[ℓ_i]


@dataclass(frozen=True)
class SiteConfig:
    """Static options of a site computation (hashable, part of the jit cache key)."""

    rule: object
    curvature: str = "hessian"
    storage: type = Factor
    chunk_size: int = 256
    num_devices: int = 1
    need_hessian_sum: bool = False


def resolve_storage(storage, family, spec, rule, curvature):
    """The storage class for ``storage="auto"`` (or a name) after checking that it suits the family and model."""
    d, n = spec.latent.dim, spec.num_examples
    family.check_dimension(d)
    factorisable = rule.kind == "gh" or spec.affine or (curvature == "ggn" and rule.kind == "delta")
    if isinstance(storage, str) and storage == "auto":
        if family.default_storage is not None:
            return get_store(family.default_storage)
        if factorisable and spec.num_params > 0:
            return Factor
        if n * d * d <= _DENSE_AUTO_LIMIT:
            return Dense
        raise SiteStorageError(
            f"the per-example Hessians of this model do not factorise exactly (its {spec.num_params} "
            f"distribution parameter(s) are not affine in z) and dense storage would hold N·d² = {n * d * d:.3g} "
            "numbers; pass curvature='ggn' (Gauss–Newton, factorised), or storage='dense' to accept the memory."
        )
    store = get_store(storage)
    if store.keeps_jacobian and not (factorisable and spec.num_params > 0):
        raise SiteStorageError(f"storage={store.name!r} needs distribution parameters affine in z, or "
                               "curvature='ggn' with the delta rule; use storage='dense'.")
    if store.detail < family.curvature_detail:
        raise SiteStorageError(f"the {family.name} family needs more per-example curvature than "
                               f"storage={store.name!r} holds")
    return store


def default_chunk_size(spec, storage, curvature, num_examples, need_hessian_sum=True):
    """Examples per chunk: as many as the transient-memory budget allows, balanced so that
    padding is at most one example per chunk."""
    d, k = spec.latent.dim, max(spec.num_params, 1)
    # a d × d curvature per example is formed by the dense store, by models without distribution
    # parameters, and by the diag/none stores only when the dense sum Σ Ĥ_i is asked for (their
    # own stored terms come from J_i, Λ_i directly: Diagonal.from_point never forms J_iᵀ Λ_i J_i)
    dense_transient = (storage is Dense or not _uses_params(spec, storage, curvature)
                       or (need_hessian_sum and not storage.keeps_jacobian))
    per_example = d * d if dense_transient else 4 * k * d
    largest = max(1, _CHUNK_BUDGET // max(per_example, 1))
    chunks = int(math.ceil(num_examples / largest))
    return int(math.ceil(num_examples / chunks))


def _uses_params(spec, storage, curvature):
    """Whether per-example curvature goes through the distribution parameters (``J_iᵀ Λ_i J_i``)."""
    return spec.num_params > 0 and (storage.keeps_jacobian or curvature == "ggn" or spec.affine)


def _psd(lam):
    vals, vecs = jnp.linalg.eigh(lam)
    return (vecs * jnp.maximum(vals, 0.0)) @ vecs.T


def _point_terms(spec, cfg, z, ex, shared):
    """Loss, gradient and curvature of one example at one point ``z``."""
    if _uses_params(spec, cfg.storage, cfg.curvature):
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


def _chunk_fn(spec, cfg, family, q, shared, extra, ex_chunk, mask):
    """Stored per-example terms of a chunk and its masked, weighted dense-curvature sum."""
    rule = cfg.rule
    *ex_chunk, example_weights = ex_chunk
    ex_chunk = tuple(ex_chunk)
    weights = mask.astype(q.mean.dtype) * example_weights

    def dense_sum(dense):
        if dense is None or not cfg.need_hessian_sum:
            return jnp.zeros((), q.mean.dtype)  # not asked for: no (d, d) carry
        return jnp.einsum("n,nde->de", weights, dense)

    if rule.kind == "gh" and rule.subspace_dim:
        (loss, grad, jac, stored), dense = jax.vmap(
            lambda ex: _subspace_terms(spec, cfg, family, q, shared, extra, ex))(ex_chunk)
        return (loss, grad, jac, stored), dense_sum(dense)

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

        def body_reparam(acc, draw):
            return jax.tree.map(jnp.add, acc, at_draw(*draw)), None

        shapes = jax.eval_shape(at_draw, draws[0], eps[0])
        init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        total, _ = jax.lax.scan(body_reparam, init, (draws, eps))
        loss, grad, cross = jax.tree.map(lambda x: x / draws.shape[0], total)
        return (loss, grad, None, cross), dense_sum(None)  # cross → Ĥ in _compute

    samples = extra  # (S, d) fixed draws
    jac_at_mean = None
    if cfg.storage.keeps_jacobian:  # affine: the Jacobian does not depend on z
        jac_at_mean = jax.vmap(lambda ex: _point_terms(spec, cfg, q.mean, ex, shared)[2])(ex_chunk)

    def at_sample(z):
        def one(ex):
            loss, grad, jac, curv = _point_terms(spec, cfg, z, ex, shared)
            stored, dense = cfg.storage.from_point(jac, curv)
            return (loss, grad, stored), dense

        (loss, grad, stored), dense = jax.vmap(one)(ex_chunk)
        return loss, grad, stored, dense_sum(dense)

    def body(acc, z):
        return jax.tree.map(jnp.add, acc, at_sample(z)), None

    shapes = jax.eval_shape(at_sample, samples[0])
    init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    total, _ = jax.lax.scan(body, init, samples)
    loss, grad, stored, dsum = jax.tree.map(lambda x: x / samples.shape[0], total)
    return (loss, grad, jac_at_mean, stored), dsum


def _subspace_terms(spec, cfg, family, q, shared, extra, ex):
    """Gauss–Hermite site of one example over its dependence subspace (``rule.subspace_dim > 0``).

    With ``u = P z ~ N(P m, V)``, ``V = P Σ Pᵀ = L Lᵀ``, the points ``z_k = m + Σ Pᵀ L⁻ᵀ ξ_k``
    satisfy ``P z_k = P m + L ξ_k``; derivatives are taken along ``Pᵀ v`` only (an
    ``r``-dimensional Hessian per node), so ``E[∇ℓ] = Pᵀ E[∇_v]`` and ``E[∇²ℓ] = Pᵀ E[∇²_v] P``.
    """
    nodes, node_w, cov = extra
    basis = subspace_basis(spec, q.mean, ex, shared, cfg.rule.subspace_dim)  # (r, d)
    spread = family.cov_times(q, cov, basis.T)  # Σ Pᵀ, (d, r)
    v = basis @ spread
    eye = jnp.eye(v.shape[0], dtype=v.dtype)
    chol = jnp.linalg.cholesky(0.5 * (v + v.T) + eye * jnp.finfo(v.dtype).eps * jnp.trace(v))
    shift = jax.scipy.linalg.solve_triangular(chol, spread.T, lower=True)  # L⁻¹ P Σ, (r, d)
    points = q.mean[None, :] + nodes @ shift

    def restricted(z):
        f = lambda t: example_loss(spec, z + t @ basis, ex, shared)  # noqa: E731
        zero = jnp.zeros(basis.shape[0], z.dtype)
        value, grad = jax.value_and_grad(f)(zero)
        return value, grad, jax.hessian(f)(zero)

    values, grads, hessians = jax.vmap(restricted)(points)
    lam = jnp.einsum("k,kab->ab", node_w, hessians)
    if cfg.curvature == "ggn":
        lam = _psd(lam)
    stored, dense = cfg.storage.from_point(basis, lam)
    return (node_w @ values, (node_w @ grads) @ basis, basis, stored), dense


def _map_chunks(fn, leaves, num, chunk, num_devices):
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

    def per_device(xs, mk):
        xs = tuple(x[0] for x in xs)
        mk = mk[0]
        first = jax.eval_shape(fn, tuple(x[0] for x in xs), mk[0])
        init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), first[1])

        def body(carry, inp):
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


def _reparam(cfg, family):
    """Whether the Monte Carlo sites take the reparameterisation precision estimator."""
    return (cfg.rule.kind == "mc" and cfg.rule.mc_precision == "reparam" and not family.needs_dense_sum
            and cfg.storage is Dense and cfg.curvature == "hessian")


def _reparam_curvature(chol, cross):
    r"""Site precision ``Ĥ = 2 ∂E_K[ℓ]/∂Σ`` from ``G = (1/K) Σ_s ∇ℓ(z_s) ε_sᵀ``.

    With ``z_s = m + Cε_s``, ``C = L⁻ᵀ`` and ``S = LLᵀ``, the chain rule through the
    Cholesky factor gives

    .. math::

        \hat H = L \, \mathrm{sym}_\downarrow(Gᵀ L^{-ᵀ}) \, Lᵀ,

    where ``sym↓(M)`` keeps the strict lower triangle of ``M``, mirrors it above the
    diagonal, and keeps the diagonal. For a quadratic ``ℓ = ½zᵀAz`` and ``E[G] = AC`` this
    is ``A``: the estimator is unbiased for ``E_q[∇²ℓ]`` and is the exact derivative of the
    fixed-draw expectation, so ``S = Σ_i Ĥ_i`` holds exactly at a stationary point of the
    fixed-draw variational objective.
    """
    m = jax.scipy.linalg.solve_triangular(chol, cross, lower=True).T  # Gᵀ L⁻ᵀ
    low = jnp.tril(m, -1)
    sym = low + low.T + jnp.diag(jnp.diagonal(m))
    return chol @ sym @ chol.T


def _prior_terms_reparam(spec, chol, data, draws, eps):
    """The prior site under the reparameterisation estimator, with the examples' draws."""
    def one(z, e):
        loss, grad = jax.value_and_grad(lambda zz: prior_loss(spec, zz, data))(z)
        return loss, grad, jnp.outer(grad, e)

    loss, grad, cross = jax.tree.map(lambda x: jnp.mean(x, 0), jax.lax.map(lambda a: one(*a), (draws, eps),
                                                                                batch_size=8))
    return loss, grad, _reparam_curvature(chol, cross)


def _prior_terms(spec, rule, family, q, data, extra):
    f = lambda z: prior_loss(spec, z, data)  # noqa: E731
    vgh = lambda z: (*jax.value_and_grad(f)(z), jax.hessian(f)(z))  # noqa: E731
    if rule.kind == "delta":
        return vgh(q.mean)
    if rule.kind == "mc":
        vals = jax.lax.map(vgh, extra, batch_size=8)
        return jax.tree.map(lambda x: jnp.mean(x, 0), vals)
    if rule.prior_mode == "quadratic":
        loss, grad, hess = vgh(q.mean)
        return loss + 0.5 * family.trace_dense_with_covariance(q, hess), grad, hess
    if rule.prior_mode == "qmc":
        chol = jnp.linalg.cholesky(family.dense_covariance(q))
        points = q.mean[None, :] + _sobol_normals(rule.num_prior_points, q.mean.shape[0], rule.seed, q.mean.dtype) @ chol.T
        vals = jax.lax.map(vgh, points, batch_size=32)
        return jax.tree.map(lambda x: jnp.mean(x, 0), vals)
    nodes, node_w = extra[:2] if rule.subspace_dim == 0 else hermite_nodes(rule.num_nodes, q.mean.dtype)
    std = jnp.sqrt(family.marginal_variance(q))

    def vgd(z):  # separable prior: its Hessian is diagonal, so diag H = H·1 (one product, no d × d per node)
        value, grad = jax.value_and_grad(f)(z)
        return value, grad, jax.jvp(jax.grad(f), (z,), (jnp.ones_like(z),))[1]

    vals = jax.lax.map(lambda xi: vgd(q.mean + std * xi), nodes, batch_size=8)
    loss = jnp.dot(node_w, vals[0])
    grad = node_w @ vals[1]
    hess = jnp.diag(node_w @ vals[2])
    return loss, grad, hess


def _sobol_normals(num, dim, seed, dtype):
    """``num`` scrambled Sobol points mapped to standard normals (a constant of the compiled program)."""
    from scipy.special import ndtri
    from scipy.stats import qmc

    power = int(np.ceil(np.log2(max(num, 2))))
    unit = qmc.Sobol(dim, scramble=True, seed=seed).random_base2(power)[:num]
    return jnp.asarray(ndtri(np.clip(unit, 1e-12, 1 - 1e-12)), dtype)


@partial(jax.jit, static_argnames=("spec", "cfg", "family"))
def _compute(spec, cfg, family, q, data, ids, weights):
    _TRACES["compute"] += 1
    rule = cfg.rule
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
    if _reparam(cfg, family):
        chol = jnp.linalg.cholesky(q.precision)
        stored = jax.lax.map(partial(_reparam_curvature, chol), stored, batch_size=cfg.chunk_size)
        p_loss, p_grad, p_hess = _prior_terms_reparam(spec, chol, data, *extra)
    else:
        p_loss, p_grad, p_hess = _prior_terms(spec, rule, family, q, data, extra)
    curv = cfg.storage.assemble(jac, stored, num, q.mean.dtype)
    sites = Sites(grad=grad, curv=curv, loss=loss, ids=ids, ref_index=jnp.zeros(num, jnp.int32),
                  ref_means=q.mean[None, :], prior_grad=p_grad, prior_curvature=p_hess, prior_loss=p_loss,
                  prior_ref=q.mean)
    if cfg.need_hessian_sum and cfg.storage.detail == FULL:
        hess_sum = curv.weighted_dense(weights)
    return sites, SiteSums(hessian=hess_sum, loss=weights @ loss)


def compute_sites(spec, data, family, q, rule, curvature="hessian", storage="auto", chunk_size=None,
                  ids=None, need_hessian_sum=False, num_devices=None, weights=None):
    """Compute the sites of every example and of the prior at the posterior ``q``.

    :param spec: the model's :class:`~numpyro_pc.likelihood.ModelSpec`.
    :param data: the :class:`~numpyro_pc.likelihood.ModelData` to compute sites for.
    :param family: an :class:`~numpyro_pc.families.ExponentialFamily`.
    :param q: the :class:`~numpyro_pc.families.Gaussian` to expand around.
    :param rule: a prepared :class:`~numpyro_pc.expectations.ExpectationRule`.
    :param str curvature: ``"hessian"`` (exact ``E_q[∇²ℓ_i]``) or ``"ggn"`` (Gauss–Newton
        ``E_q[J_iᵀ Λ_i J_i]`` with ``Λ_i`` projected onto its positive part).
    :param str storage: ``"auto"``, ``"diag"``, ``"factor"``, ``"dense"`` or ``"none"``.
    :param int chunk_size: examples per chunk (default from a memory budget).
    :param ids: integer ids of the examples (default ``0..N-1``).
    :param bool need_hessian_sum: also return ``Σ_i`` dense curvature (for the solver).
    :param int num_devices: devices to shard chunks over (default: all local devices).
    :param weights: per-example weights of the totals in :class:`SiteSums` (the sites
        themselves are unweighted).
    :return: ``(Sites, SiteSums)``.
    """
    if curvature not in ("hessian", "ggn"):
        raise InvalidOptionError(f"unknown curvature {curvature!r}; expected 'hessian' or 'ggn'")
    storage = resolve_storage(storage, family, spec, rule, curvature)
    num = int(data.per_example[0].shape[0])
    if num == 0:
        raise DataShapeError("no examples to compute sites for (the data is empty)")
    if num_devices is None:
        num_devices = jax.local_device_count()
    num_devices = max(1, min(int(num_devices), num))
    if chunk_size is None:
        chunk_size = default_chunk_size(spec, storage, curvature, int(math.ceil(num / num_devices)), need_hessian_sum)
    if ids is None:
        ids = jnp.arange(num)
    cfg = SiteConfig(rule=rule, curvature=curvature, storage=storage, chunk_size=int(chunk_size),
                     num_devices=num_devices, need_hessian_sum=bool(need_hessian_sum))
    weights = jnp.ones(num, q.mean.dtype) if weights is None else jnp.asarray(weights, q.mean.dtype)
    return _compute(spec, cfg, family, q, data, jnp.asarray(ids), weights)
