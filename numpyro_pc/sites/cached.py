r"""The cached sites of a Gaussian posterior: :class:`Sites` (a pytree) and :class:`SiteSums`.

``Sites`` holds, for every example ``i``, the site ``ℓ̂_i(z) = zᵀĝ_i + ½ (z − m_i)ᵀ Ĥ_i (z − m_i)``
(paper Table 1; docs/notation.md, "Sites") — its gradient ``ĝ_i``, its curvature ``Ĥ_i`` in
one of the stores of :mod:`numpyro_pc.curvature.stores`, its expected loss, its id and the mean
``m_i`` it was computed at — and the prior site; it answers sums, natural parameters and
row operations, and implements :class:`~numpyro_pc.protocols.sites.SiteTable`.
:func:`numpyro_pc.sites.gaussian.compute_sites` computes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.curvature.stores import FULL, CurvatureStore, get_store
from numpyro_pc.families.registry import GaussianNatural, add_site
from numpyro_pc.protocols.capabilities import FixedPrecision, capability
from numpyro_pc.model.rows import (
    bucket_size,
    filled,
    is_every_row,
    join_rows,
    pad_last_row,
    shifted,
    take_rows,
    to_device,
)

from .prior import prior_dense, prior_matvec
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["Sites", "SiteSums", "site_mismatch"]


@partial(jax.jit, static_argnums=0)
def _natural_sum(family, sites, weights) -> GaussianNatural:
    return GaussianNatural(sites.linear_sum(weights), sites.example_curvature_sum(family, weights))


@partial(jax.tree_util.register_dataclass,
         data_fields=["grad", "curv", "loss", "ids", "ref_index", "ref_means", "prior_grad", "prior_curvature",
                      "prior_loss", "prior_ref"],
         meta_fields=["detail"])
@dataclass(frozen=True)
class Sites:
    """Cached sites of every example and of the prior.

    :ivar grad: ``(N, d)`` expected gradients ``ĝ_i``; for a store with
        :attr:`~numpyro_pc.curvature.stores.CurvatureStore.sparse_rows` (``"sparse"``) their ``(N, s)``
        values on the store's per-example index (``ĝ_i = J_iᵀ γ_i`` lies in those columns).
    :ivar curv: the per-example curvatures ``Ĥ_i``, a
        :class:`~numpyro_pc.curvature.stores.CurvatureStore` (factorised, dense, diagonal or none).
    :ivar loss: ``(N,)`` expected losses ``E_q[ℓ_i]``.
    :ivar ids: ``(N,)`` stable integer example ids.
    :ivar ref_index: ``(N,)`` row of ``ref_means`` holding the mean each site was computed at.
    :ivar ref_means: ``(T, d)`` the posterior means the sites were computed at (one row per
        computation; sites from earlier posteriors keep their own row, so stale and fresh
        sites coexist).
    :ivar prior_grad: ``ĝ_0``.
    :ivar prior_curvature: ``Ĥ_0``: dense ``(d, d)``, or its diagonal ``(d,)`` for a separable prior
        of a family with matrix-free sites (:mod:`numpyro_pc.sites.prior`).
    :ivar prior_loss: ``E_q[ℓ_0]``.
    :ivar prior_ref: the mean the prior site was computed at.
    :ivar detail: how much of each ``Ĥ_i`` the family's sites carry (``2`` matrices, ``1`` diagonals, ``0``
        none: :class:`~numpyro_pc.protocols.capabilities.SiteCurvature`). The store may keep more (the
        Jacobians the matrix-free Newton step of the diagonal and isotropic families needs at large ``d``);
        every site quadratic, value and natural parameter reads :attr:`site_curv`, the store capped at it.
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
    detail: int = FULL
    kind: ClassVar[str] = "gaussian"

    @property
    def site_curv(self) -> CurvatureStore:
        """The curvatures the sites carry for their family (:meth:`CurvatureStore.capped` at :attr:`detail`)."""
        return self.curv.capped(self.detail)

    @property
    def storage(self) -> str:
        """The curvature storage's name (``"factor"``, ``"dense"``, ``"diag"`` or ``"none"``)."""
        return self.curv.name

    @property
    def num_examples(self) -> int:
        """``N``, the number of example sites."""
        return self.grad.shape[0]

    def grad_sum(self) -> jax.Array:
        """``Σ_{i=0..N} ĝ_i`` (prior included)."""
        if self.curv.sparse_rows:
            return self.prior_grad + self.curv.scatter(self.grad)
        return self.prior_grad + jnp.sum(self.grad, 0)

    def dense_grad(self) -> jax.Array:
        """``(N, d)`` expected gradients ``ĝ_i`` (materialised from a sparse store: small ``d`` only)."""
        return self.curv.dense_rows(self.grad) if self.curv.sparse_rows else self.grad

    def grad_totals(self, mean, weights=None) -> tuple[jax.Array, jax.Array]:
        r"""``(Σ_i w_i ∇ℓ̂_i(m), Σ_i ‖w_i ∇ℓ̂_i(m)‖)`` over the example sites, without ``(N, d)`` rows
        for a sparse store."""
        if self.curv.sparse_rows:
            values = self.site_curv.rows_at(self.grad, mean, self.ref_means, self.ref_index)
            if weights is not None:
                values = values * weights[:, None]
            return self.curv.scatter(values), jnp.sum(jnp.linalg.norm(values, axis=1))
        grads = self.grad_at(mean)
        if weights is not None:
            grads = grads * weights[:, None]
        return jnp.sum(grads, 0), jnp.sum(jnp.linalg.norm(grads, axis=1))

    def grad_values_at(self, mean) -> jax.Array:
        """A sparse store's ``∇ℓ̂_i(m)`` as ``(N, s)`` values on its index."""
        return self.site_curv.rows_at(self.grad, mean, self.ref_means, self.ref_index)

    def prior_curvature_dense(self) -> jax.Array:
        """``Ĥ_0`` as a dense ``(d, d)`` matrix (whichever form it is held in; small ``d``)."""
        return prior_dense(self.prior_curvature)

    def curvature_sum(self, family) -> Any:
        """``Σ_{i=0..N} Ĥ_i`` (prior included) in the family's precision format."""
        w = jnp.ones(self.num_examples, self.grad.dtype)
        return family.target_precision(self.curv, w, self.prior_curvature)

    def example_curvature_sum(self, family, weights=None) -> Any:
        """``Σ_{i=1..N} w_i Ĥ_i`` in the family's precision format (``w_i = 1`` by default)."""
        w = jnp.ones(self.num_examples, self.grad.dtype) if weights is None else weights
        return family.curvature_sum(self.curv, w)

    def dense_curvature(self) -> jax.Array:
        """Per-example dense curvatures ``(N, d, d)`` (materialised on demand)."""
        return self.curv.dense()

    def curvature_trace(self) -> jax.Array:
        """``tr Ĥ_i`` per example — a scalar 'weight' of each site in the posterior."""
        return self.curv.trace()

    def refs(self) -> jax.Array:
        """``(N, d)`` the mean each example's site was computed at."""
        return take_rows(self.ref_means, self.ref_index)

    def curvature_matvec(self, v) -> jax.Array:
        """``Ĥ_i v_i`` for every example (``v`` is ``(N, d)``), with the curvature the sites carry."""
        return self.site_curv.matvec(v)

    def grad_at(self, mean) -> jax.Array:
        """Gradient of each quadratic site at ``mean``: ``ĝ_i + Ĥ_i (mean − m_i)``, ``(N, d)``."""
        if self.curv.sparse_rows:
            return self.curv.dense_rows(self.grad_values_at(mean))
        return self.grad + self.curvature_matvec(mean[None, :] - self.refs())

    def prior_grad_at(self, mean) -> jax.Array:
        """Gradient of the prior site at ``mean``."""
        return self.prior_grad + prior_matvec(self.prior_curvature, mean - self.prior_ref)

    def linear_sum(self, weights) -> jax.Array:
        """``Σ_i w_i (Ĥ_i m_i − ĝ_i)``: the linear natural parameter of the weighted example sites."""
        if self.curv.sparse_rows:
            refs = self.ref_means[self.ref_index[:, None], self.curv.index]
            return self.curv.scatter(self.site_curv.curvature_values(refs) - self.grad, weights)
        return weights @ (self.curvature_matvec(self.refs()) - self.grad)

    def natural(self, family) -> GaussianNatural:
        """Per-example site natural parameters ``(Ĥ_i m_i − ĝ_i, Ĥ_i)`` (leading axis N)."""
        return GaussianNatural(self.curvature_matvec(self.refs()) - self.dense_grad(), family.site_curvatures(self.curv))

    def natural_sum(self, family, weights=None) -> GaussianNatural:
        """``Σ_{i=1..N} w_i λ̂_i`` site natural parameters in the family's format (``w_i = 1`` by default).

        Computed on bucket-padded sites (copies weighted 0), so sums over a growing or
        shrinking set of sites reuse a few compilations.
        """
        if isinstance(self.grad, jax.core.Tracer):  # inside a trace the shapes are fixed anyway
            return _natural_sum(family, self, jnp.ones(self.num_examples, self.grad.dtype) if weights is None
                                else weights)
        return _natural_sum(family, *self.bucketed(weights))

    def prior_natural(self, family) -> GaussianNatural:
        """Natural parameters of the prior site."""
        return family.site_natural(self.prior_grad, self.prior_precision(family), self.prior_ref)

    def prior_removal(self, family, natural) -> GaussianNatural:
        """What correcting the prior divides out of a posterior of natural parameters ``natural``: the prior
        site, and for a fixed-precision family also the base measure ``exp(−τ‖z‖²/2)`` that the prior site
        carries (``λ = τ m + offset + Σ_{i≥0} λ̂_i``, :class:`~numpyro_pc.families.gaussians.IsotropicGaussian`)."""
        prior = self.prior_natural(family)
        return add_site(prior, natural) if capability(family, FixedPrecision) else prior

    def prior_precision(self, family) -> Any:
        """``Ĥ_0`` in the family's precision format (a diagonal ``Ĥ_0`` is projected matrix-free)."""
        if self.prior_curvature.ndim == 1:
            return family.project_diagonal(self.prior_curvature)
        return family.project_curvature(self.prior_curvature)

    def take(self, index) -> Sites:
        """The sites of the examples at positions ``index`` (the prior site is kept)."""
        if is_every_row(index, self.num_examples):
            return self  # no copy
        pick = lambda x: take_rows(x, index)  # noqa: E731
        return replace(self, grad=pick(self.grad), curv=self.curv.take(index), loss=pick(self.loss),
                       ids=pick(self.ids), ref_index=pick(self.ref_index))

    def scale(self, alpha) -> Sites:
        """Every example site raised to the power ``alpha`` (tempering): ``α ĝ_i``, ``α Ĥ_i`` and ``α E_q[ℓ_i]``
        at the same reference means, so its natural parameters are ``α λ̂_i``; the prior site is unchanged."""
        return replace(self, grad=alpha * self.grad, curv=self.curv.scaled(alpha), loss=alpha * self.loss)

    def bucketed(self, weights=None) -> tuple[Any, Any]:
        """``(sites, weights)`` padded to :func:`~numpyro_pc.model.rows.bucket_size` rows (and reference
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

    def padded(self, num, num_refs) -> Sites:
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

    def concat(self, other, prior_from="other") -> Sites:
        """Examples of ``self`` followed by those of ``other``; the prior site comes from ``prior_from``."""
        join = join_rows
        prior = other if prior_from == "other" else self
        if self.curv.sparse_rows and self.grad.shape[1] != other.grad.shape[1]:  # widths differ: pad the narrower
            width = max(self.grad.shape[1], other.grad.shape[1])
            widen = lambda x: replace(x, grad=jnp.pad(x.grad, ((0, 0), (0, width - x.grad.shape[1]))),  # noqa: E731
                                      curv=x.curv.widened(width))
            self, other = widen(self), widen(other)
        joined = Sites(grad=join(self.grad, other.grad), curv=self.curv.join(other.curv),
                       loss=join(self.loss, other.loss), ids=join(self.ids, other.ids),
                       ref_index=join(self.ref_index, shifted(other.ref_index, self.ref_means.shape[0])),
                       ref_means=join(self.ref_means, other.ref_means), prior_grad=prior.prior_grad,
                       prior_curvature=prior.prior_curvature, prior_loss=prior.prior_loss, prior_ref=prior.prior_ref,
                       detail=min(self.detail, other.detail))
        return joined if isinstance(joined.ref_index, jax.core.Tracer) else joined.compacted()

    def compacted(self) -> Sites:
        """The sites with ``ref_means`` cut to the rows some site refers to, when it holds more rows
        than their :func:`~numpyro_pc.model.rows.bucket_size` (host arrays only; the sites are unchanged).

        :meth:`take` keeps every reference row and :meth:`concat` appends the other's, so without
        this a stream that adds and removes sites (an exact update, then a site removal, repeated)
        grows ``ref_means`` by a row per cycle and every compiled sum over the sites meets a new
        shape. The kept rows, in their order, are padded with copies of the last to the bucket.
        """
        index = np.asarray(self.ref_index)
        used, inverse = np.unique(index, return_inverse=True)
        size = bucket_size(max(used.size, 1), smallest=1)
        if self.ref_means.shape[0] <= size:
            return self
        refs = take_rows(self.ref_means, used if used.size else np.arange(1))
        return replace(self, ref_means=pad_last_row(refs, size - refs.shape[0]),
                       ref_index=to_device(np.ravel(inverse).astype(index.dtype)))

    def values(self, family, point) -> tuple[jax.Array, jax.Array]:
        r"""Every example site and the prior site at ``z = point``, each centred at the mean it was
        computed at: :math:`\hat\ell_i(z) = z^\top\hat g_i + \tfrac12 (z - m_i)^\top \hat H_i (z - m_i)`.

        This is the natural-parameter form :math:`-\langle\hat\lambda_i, T(z)\rangle` plus the constant
        :math:`\tfrac12 m_i^\top \hat H_i m_i`, which cancels in every density ratio; the centred form
        keeps float32 accurate where the natural form subtracts two large numbers.

        :param family: the posterior's family (unused: the sites carry their curvature).
        :param point: ``(d,)`` a point of the flat unconstrained latent space.
        :return: ``(N,)`` the example sites' values and the prior site's value.
        """
        with jax.enable_x64(self.grad.dtype == jnp.float64):
            diff = point[None, :] - self.refs()
            values = self.dense_grad() @ point + 0.5 * jnp.sum(diff * self.curvature_matvec(diff), 1)
            p_diff = point - self.prior_ref
            prior = self.prior_grad @ point + 0.5 * p_diff @ self.prior_curvature_dense() @ p_diff
        return values, prior

    def expected_values(self, family, q) -> tuple[jax.Array, jax.Array]:
        r""":math:`E_q[\hat\ell_i]` for every example site and the prior site in natural-parameter form
        (:meth:`values`) under the Gaussian ``q`` of ``family``: with :math:`\Sigma` its covariance,
        :math:`m^\top(\hat g_i - \hat H_i m_i) + \tfrac12(m^\top \hat H_i m + \mathrm{tr}\,\hat H_i\Sigma)`.

        :return: ``(N,)`` and a scalar.
        """
        with jax.enable_x64(self.grad.dtype == jnp.float64):
            return self.expected_values_at(q.mean, family.dense_covariance(q))

    def expected_values_at(self, mean, cov) -> tuple[jax.Array, jax.Array]:
        """:meth:`expected_values` under ``N(mean, cov)`` given as a mean and a dense covariance."""
        with jax.enable_x64(self.grad.dtype == jnp.float64):
            refs = self.refs()
            diff = mean[None, :] - refs
            trace, quad = self.site_curv.trace_quad(cov, diff)
            offsets = 0.5 * jnp.sum(refs * self.curvature_matvec(refs), 1)
            values = self.dense_grad() @ mean + 0.5 * (quad + trace) - offsets
            p_diff = mean - self.prior_ref
            prior_curvature = self.prior_curvature_dense()
            prior = self.prior_grad @ mean + 0.5 * (p_diff @ prior_curvature @ p_diff + jnp.sum(prior_curvature * cov)
                                                   - self.prior_ref @ prior_curvature @ self.prior_ref)
        return values, prior

    def log_normaliser(self, family, extra=None) -> jax.Array:
        r""":math:`\log \int \prod_{i=0}^N \exp(-\hat\ell_i(z))\, dz`, the Gaussian log-partition
        :math:`A(\lambda)` of :math:`\lambda = \lambda_0 + \sum_i \hat\lambda_i` (families whose site sum
        is a precision they hold: :class:`~numpyro_pc.protocols.capabilities.SiteDivision`).

        :param extra: natural parameters held outside every site (a posterior's ``offset``), added to
            :math:`\lambda`; ``None`` for none.
        """
        with jax.enable_x64(self.grad.dtype == jnp.float64):
            nat, prior = self.natural_sum(family), self.prior_natural(family)
            if extra is not None:
                nat = add_site(nat, extra)
            precision = nat.precision + prior.precision
            precision = precision if jnp.ndim(precision) == 2 else jnp.diag(precision)
            linear = nat.linear + prior.linear
            chol = jnp.linalg.cholesky(precision)
            white = jax.scipy.linalg.solve_triangular(chol, linear, lower=True)
            dim = linear.shape[0]
            return 0.5 * white @ white + 0.5 * dim * math.log(2 * math.pi) - jnp.sum(jnp.log(jnp.diag(chol)))

    def mismatch(self, fresh: Sites, family, q, shared_jacobian: bool = False) -> dict:
        """How far each of these (stale) sites is from ``fresh``, the same examples' sites at ``q``:
        the Fisher-metric norm :func:`site_mismatch`, as ``{"magnitude", "gradient", "curvature"}``
        (host arrays, one value per row)."""
        total, grad, curv = site_mismatch(self, fresh, q, family, shared_jacobian)
        return dict(magnitude=np.asarray(total), gradient=np.asarray(grad), curvature=np.asarray(curv))

    def stored_numbers(self) -> int:
        """How many numbers the per-example sites hold (gradients and curvature)."""
        return int(np.prod(self.grad.shape)) + self.curv.stored_numbers()

    def arrays(self) -> dict[Any, Any]:
        """``{name: array}`` of every field, the curvature store's fields by their own names (for files)."""
        out = {name: getattr(self, name) for name in _PLAIN_FIELDS}
        out.update(self.curv.arrays())
        return out

    @classmethod
    def from_arrays(cls, arrays, *, storage, detail=FULL) -> Sites:
        """Sites from :meth:`arrays`' output, the storage's name and the family's :attr:`detail` (a saved
        posterior's)."""
        store = get_store(storage)
        num = arrays["grad"].shape[0]
        curv = store.from_arrays({k: arrays[k] for k in store.file_shapes(0, 0, 0)}, num, arrays["grad"].dtype,
                                 dim=arrays["prior_ref"].shape[0])
        return cls(curv=curv, detail=int(detail), **{name: arrays[name] for name in _PLAIN_FIELDS})


_PLAIN_FIELDS = ("grad", "loss", "ids", "ref_index", "ref_means", "prior_grad", "prior_curvature", "prior_loss",
                 "prior_ref")


class SiteSums(NamedTuple):
    """Totals over examples computed alongside the sites (for the solver)."""

    hessian: jax.Array  # Σ_{i≥1} dense curvature, (d, d)
    loss: jax.Array     # Σ_{i≥1} E_q[ℓ_i]
    subspace_violations: jax.Array | int = 0  # examples whose likelihood leaves their rule's subspace (loss NaN)


@partial(jax.jit, static_argnames=("family", "shared_jacobian"))
def site_mismatch(stale, fresh, q, family, shared_jacobian=False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Fisher-metric norm of the natural-gradient mismatch between stale and fresh sites (aligned rows).

    Never forms per-example ``d × d`` matrices for factorised or diagonal sites:
    ``tr((δH Σ)²)`` is ``tr((C G)²)`` with ``δH = Uᵀ C U``, ``U`` the stacked Jacobians and
    ``G = U Σ Uᵀ`` (factorised), or ``δhᵀ (Σ∘Σ) δh`` (diagonal).

    :param bool shared_jacobian: the factorised sites share their Jacobians (models whose
        distribution parameters are affine in ``z``), so ``U = J`` and ``C = Λ_f − Λ_s``:
        half the work.
    """
    operand = family.covariance_operand(q)
    cov_rows = lambda mat: family.cov_times(q, operand, mat.T).T  # noqa: E731  (M Σ, Σ symmetric)
    if fresh.curv.sparse_rows and shared_jacobian and stale.grad.shape == fresh.grad.shape:
        # one Jacobian, so one index: the difference lives on it; Σ is applied to rows densified in batches
        grad_part = fresh.curv.row_quad(fresh.grad - stale.grad_values_at(q.mean), cov_rows)
    else:
        dg = fresh.dense_grad() - stale.grad_at(q.mean)
        grad_part = jnp.sum(cov_rows(dg) * dg, 1)
    if q.precision.ndim == 0:  # a fixed precision: the sites carry no curvature, whatever the store keeps
        curv_part = jnp.zeros(fresh.num_examples, grad_part.dtype)
    elif q.precision.ndim == 1:  # the diagonal family's sites are diag(Ĥ_i): δhᵀ (Σ∘Σ) δh, O(d) per example
        curv_part = _diagonal_mismatch(fresh.curv, stale.curv, 1.0 / q.precision)
    else:
        curv_part = fresh.curv.mismatch(stale.curv, cov_rows, shared_jacobian)
    return jnp.sqrt(grad_part + curv_part), jnp.sqrt(grad_part), jnp.sqrt(curv_part)


_MISMATCH_BATCH = 64  # examples whose (d,) diagonals are densified together


def _diagonal_mismatch(fresh, stale, var) -> jax.Array:
    """``½ Σ_j (δh_ij σ_j²)²`` per example, the diagonals taken one batch of examples at a time (a store that
    keeps Jacobian factors densifies only ``(batch, d)`` rows; no ``(N, d)`` and no ``(d, d)`` array)."""
    if stale.detail == 0:
        return jnp.zeros(fresh.num_examples, var.dtype)
    one = lambda store: store.diagonals()[0]  # noqa: E731
    expand = lambda x: jax.tree.map(lambda a: a[None], x)  # noqa: E731
    return jax.lax.map(lambda pair: 0.5 * jnp.sum(((one(expand(pair[0])) - one(expand(pair[1]))) * var) ** 2),
                       (fresh, stale), batch_size=_MISMATCH_BATCH)
