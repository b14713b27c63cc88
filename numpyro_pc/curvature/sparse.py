r"""Sparse per-example curvature: ``Ĥ_i = J_iᵀ Λ_i J_i`` with each ``J_i`` held by its nonzero columns.

The storage kind ``"sparse"`` (:class:`SparseFactor`), registered with
:func:`numpyro_pc.curvature.stores.register_store`; see :mod:`numpyro_pc.curvature.stores` for what every
store answers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import ClassVar

import jax
import jax.numpy as jnp

from numpyro_pc.errors import SiteStorageError
from numpyro_pc.model.rows import join_rows

from .stores import FULL, NONE, CurvatureStore, JacobianFactor, register_store
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Self

if TYPE_CHECKING:
    from typing import Any

__all__ = ["SparseFactor"]


_MATMAT_NUMBERS = 2**24  # gathered numbers per batch of weighted_matmat (128 MiB in float64)
_SPARSE_BATCH = 2**22  # numbers of transient dense Jacobian rows per batch when a sparse store densifies


@register_store
@partial(jax.tree_util.register_dataclass, data_fields=["index", "jac", "lam", "nnz"], meta_fields=["dim"])
@dataclass(frozen=True)
class SparseFactor(CurvatureStore):
    r"""``Ĥ_i = J_iᵀ Λ_i J_i`` with each ``J_i`` held by its nonzero columns (``"sparse"``).

    ``index`` ``(N, s)`` lists the columns where some row of ``J_i`` is nonzero (ascending,
    padded with column 0 and zero values), ``jac`` ``(N, k, s)`` their values, ``lam``
    ``(N, k, k)``, ``nnz`` ``(N,)`` the number of real columns; ``dim`` is ``d``. ``O(N·k·s)``
    numbers instead of :class:`JacobianFactor`'s ``O(N·k·d)``: for a design with ``s ≪ d`` nonzeros per
    row (a sparse GLM: ``s = 10`` at ``d = 100,000``) the ``(N, d)`` arrays are never stored.
    The site gradients ``ĝ_i = J_iᵀ γ_i`` lie in the same columns, so the sites hold them
    as ``(N, s)`` values on ``index`` too (:attr:`sparse_rows`).

    Sums and products — what the low-rank family's solver asks for (``weighted_matmat``,
    ``weighted_diagonal``) — are gathers and scatter-adds, ``O(N k s p)``; per-example
    ``(N, d, d)`` questions (``dense``, ``trace_quad``, ``low_rank_factors``) materialise the
    dense Jacobians and are for small ``d``; the stale-versus-fresh ``mismatch`` densifies
    them in batches. The width ``s`` is chosen by the site computation
    (:func:`~numpyro_pc.sites.gaussian.compute_sites`), which checks ``nnz ≤ s`` for every example and
    widens otherwise, so no nonzero is ever dropped.
    """

    index: jax.Array
    jac: jax.Array
    lam: jax.Array
    nnz: jax.Array
    dim: int = 0
    name: ClassVar[str] = "sparse"
    detail: ClassVar[int] = FULL
    keeps_jacobian: ClassVar[bool] = True
    sparse_rows: ClassVar[bool] = True

    @staticmethod
    def from_point(jac, curv) -> tuple[Any, None]:
        return curv, None

    @staticmethod
    def compress(jac, grad, width) -> tuple[tuple[Any, Any, jax.Array], Any]:
        nonzero = jnp.any(jac != 0, 0)
        count = jnp.sum(nonzero, dtype=jnp.int32)
        index = jnp.nonzero(nonzero, size=width, fill_value=0)[0].astype(jnp.int32)
        real = (jnp.arange(width) < count).astype(jac.dtype)
        return (index, jac[:, index] * real, count), grad[index] * real

    @classmethod
    def assemble(cls, jac, stored, num, dtype, dim=None) -> SparseFactor:
        index, values, count = jac
        return cls(index=index, jac=values, lam=stored, nnz=count, dim=int(dim))

    @classmethod
    def file_shapes(cls, num, k, dim, width=0) -> dict[str, Any]:
        return {"index": (num, width), "jac": (num, k, width), "lam": (num, k, k), "nnz": (num,)}

    @classmethod
    def grad_shape(cls, num, dim, width=0) -> tuple[Any, Any]:
        return (num, width)

    @classmethod
    def from_arrays(cls, arrays, num, dtype, dim=None) -> SparseFactor:
        return cls(dim=int(dim), **arrays)

    def arrays(self) -> dict[str, Any]:
        return {"index": self.index, "jac": self.jac, "lam": self.lam, "nnz": self.nnz}

    def scaled(self, alpha) -> CurvatureStore:
        return replace(self, lam=alpha * self.lam)

    @property
    def width(self) -> int:
        return self.index.shape[1]

    def widened(self, width) -> SparseFactor:
        """The same store with ``width`` columns per example (extra columns: index 0, value 0)."""
        extra = width - self.width
        if extra <= 0:
            return self
        return replace(self, index=jnp.pad(self.index, ((0, 0), (0, extra))),
                       jac=jnp.pad(self.jac, ((0, 0), (0, 0), (0, extra))))

    def join(self, other) -> Self:
        if type(other) is not type(self):
            raise SiteStorageError(f"cannot join sites stored as {self.name!r} and {other.name!r}")
        width = max(self.width, other.width)
        return jax.tree.map(join_rows, self.widened(width), other.widened(width))

    def capped(self, detail) -> CurvatureStore:
        """:meth:`CurvatureStore.capped` on the same index (the sites' gradients stay ``(N, s)`` values on
        it): no curvature is ``Λ_i = 0``; diagonals are ``J_i = I_s``, ``Λ_i = diag(diag Ĥ_i)`` on the index."""
        if detail >= self.detail:
            return self
        if detail == NONE:
            return replace(self, lam=jnp.zeros_like(self.lam))
        values = jnp.einsum("nks,nkl,nls->ns", self.jac, self.lam, self.jac)
        eye = jnp.broadcast_to(jnp.eye(self.width, dtype=self.jac.dtype), values.shape + (self.width,))
        return replace(self, jac=eye, lam=values[:, :, None] * eye)

    # --- rows on the index ----------------------------------------------------------------
    def scatter(self, values, weights=None) -> jax.Array:
        """``Σ_i w_i`` of per-example values ``(N, s[, p])`` placed at their columns: ``(d[, p])``."""
        if weights is not None:
            values = values * jnp.reshape(weights, weights.shape + (1,) * (values.ndim - 1))
        out = jnp.zeros((self.dim,) + values.shape[2:], values.dtype)
        return out.at[self.index].add(values)

    def dense_rows(self, values) -> jax.Array:
        """Per-example values ``(N, s)`` as dense ``(N, d)`` rows (small ``d``)."""
        rows = jnp.zeros((values.shape[0], self.dim), values.dtype)
        return rows.at[jnp.arange(values.shape[0])[:, None], self.index].add(values)

    def rows_at(self, values, mean, ref_means, ref_index) -> jax.Array:
        r"""``ĝ_i + Ĥ_i (m − m_i)`` on the index, from the gradient values ``ĝ_i`` ``(N, s)``."""
        shift = mean[self.index] - ref_means[ref_index[:, None], self.index]  # (N, s): (m − m_i) on the columns
        proj = jnp.einsum("nks,ns->nk", self.jac, shift)
        return values + jnp.einsum("nks,nkl,nl->ns", self.jac, self.lam, proj)

    def curvature_values(self, points) -> jax.Array:
        """``Ĥ_i x_i`` on the index for per-example points ``x_i`` given on the index ``(N, s)``."""
        proj = jnp.einsum("nks,ns->nk", self.jac, points)
        return jnp.einsum("nks,nkl,nl->ns", self.jac, self.lam, proj)

    def dense_jac(self) -> jax.Array:
        """The Jacobians as dense ``(N, k, d)`` arrays (small ``d``)."""
        k = self.jac.shape[1]
        return jax.vmap(lambda idx, j: jnp.zeros((k, self.dim), j.dtype).at[:, idx].add(j))(self.index, self.jac)

    def _batch(self) -> int:
        return max(1, _SPARSE_BATCH // max(self.dim * max(self.jac.shape[1], 1), 1))

    # --- algebra ---------------------------------------------------------------------------
    def low_rank_factors(self) -> tuple[Any, Any]:
        return self.dense_jac(), self.lam

    def weighted_dense(self, weights) -> jax.Array:
        return JacobianFactor(self.dense_jac(), self.lam).weighted_dense(weights)

    def weighted_diagonal(self, weights) -> jax.Array:
        return self.scatter(jnp.einsum("nks,nkl,nls->ns", self.jac, self.lam, self.jac), weights)

    def weighted_matmat(self, weights, mat) -> jax.Array:
        """``Σ_i w_i J_iᵀ Λ_i J_i V`` over batches of examples (a ``lax.scan`` whose carry is the ``(d, p)`` sum):
        the gathered rows ``V[index_i]`` are ``(batch, s, p)``, never ``(N, s, p)`` — ``N·d·p`` numbers for a
        dense design (6.4 GB at N = 2,000, d = 20,000, p = 20 in float64)."""
        num, width, cols = self.index.shape[0], self.index.shape[1], mat.shape[1]
        batch = max(1, min(num, _MATMAT_NUMBERS // max(width * cols * max(self.jac.shape[1], 1), 1)))
        pad = (-num) % batch
        rows: tuple[jax.Array, ...] = (self.index, self.jac, self.lam, weights)
        if pad:  # zero rows: weight 0 and zero Jacobian, at column 0
            rows = tuple(jnp.concatenate([x, jnp.zeros((pad,) + x.shape[1:], x.dtype)]) for x in rows)
        blocks = tuple(jnp.reshape(x, (-1, batch) + x.shape[1:]) for x in rows)

        def body(acc, block) -> tuple[jax.Array, None]:
            index, jac, lam, w = block
            proj = jnp.einsum("nks,nsp->nkp", jac, mat[index])  # J_i V, O(batch k s p)
            back = jnp.einsum("nks,nkp->nsp", jac, jnp.einsum("n,nkl,nlp->nkp", w, lam, proj))
            return acc.at[index].add(back), None

        out, _ = jax.lax.scan(body, jnp.zeros((self.dim, cols), jnp.result_type(self.jac, mat)), blocks)
        return out

    def dense(self) -> jax.Array:
        return JacobianFactor(self.dense_jac(), self.lam).dense()

    def diagonals(self) -> jax.Array:
        return self.dense_rows(jnp.einsum("nks,nkl,nls->ns", self.jac, self.lam, self.jac))

    def trace(self) -> jax.Array:
        return jnp.einsum("nks,nkl,nls->n", self.jac, self.lam, self.jac)

    def matvec(self, v) -> jax.Array:
        picked = jnp.take_along_axis(v, self.index, 1)
        return self.dense_rows(self.curvature_values(picked))

    def trace_quad(self, cov, diff) -> tuple[jax.Array, jax.Array]:
        return JacobianFactor(self.dense_jac(), self.lam).trace_quad(cov, diff)

    def row_quad(self, values, cov_rows) -> jax.Array:
        r"""``xᵢᵀ Σ xᵢ`` for rows given by values on the index ``(N, s)``, densified in batches."""
        def one(idx, val) -> jax.Array:
            row = jnp.zeros((1, self.dim), val.dtype).at[0, idx].add(val)
            return jnp.sum(cov_rows(row)[0, idx] * val)

        return jax.lax.map(lambda a: one(*a), (self.index, values), batch_size=self._batch())

    def mismatch(self, stale, cov_rows, shared_jacobian) -> jax.Array:
        """:meth:`JacobianFactor.mismatch` on the Jacobians densified in batches (no ``(N, d)`` array)."""
        if not isinstance(stale, SparseFactor):
            return super().mismatch(stale, cov_rows, shared_jacobian)

        def one(fresh, old) -> jax.Array:
            dense = lambda s: JacobianFactor(s.dense_jac(), s.lam)  # noqa: E731
            expand = lambda x: jax.tree.map(lambda a: a[None], x)  # noqa: E731
            return dense(expand(fresh)).mismatch(dense(expand(old)), cov_rows, shared_jacobian)[0]

        return jax.lax.map(lambda a: one(*a), (self, stale), batch_size=self._batch())
