r"""How the per-example site curvatures ``Ĥ_i`` are held: one class per storage kind.

Every kind is a pytree whose leaves all have the examples on their leading axis, so row
operations (take, pad, join) are the same for all of them, and every kind answers the
questions the solver, the diagnostics and the files ask of the curvature:

* :class:`Factor` (``"factor"``): ``Ĥ_i = J_iᵀ Λ_i J_i`` with ``J`` ``(N, k, d)`` and
  ``Λ`` ``(N, k, k)``; gives dense and diagonal sums.
* :class:`SparseFactor` (``"sparse"``): the same with each ``J_i`` held by its ``s`` nonzero
  columns, ``(N, k, s)`` values and ``(N, s)`` indices; gives products and diagonal sums
  without any ``(N, d)`` array (the low-rank family's automatic choice).
* :class:`Dense` (``"dense"``): ``(N, d, d)`` matrices; gives dense and diagonal sums.
* :class:`Diagonal` (``"diag"``): ``(N, d)`` diagonals; gives diagonal sums.
* :class:`NoCurvature` (``"none"``): nothing (an ``(N, 0)`` placeholder); gives no sums.

``Factor`` is exact for GLM-type models (distribution parameters ``θ_i`` affine in ``z``)
and the Gauss–Newton approximation otherwise, at ``O(N·k·d)`` numbers; see docs/notation.md,
"Sites". A family chooses which sum it needs (:meth:`~numpyro_pc.families.ExponentialFamily.curvature_sum`);
a store that cannot give it raises :class:`~numpyro_pc.errors.SiteStorageError`.

Adding a storage kind is one class here with these methods plus an entry in :data:`STORES`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import ClassVar

import jax
import jax.numpy as jnp

from .errors import InvalidOptionError, SiteStorageError
from .rowops import join_rows, pad_last_row, take_rows

__all__ = ["CurvatureStore", "Factor", "SparseFactor", "Dense", "Diagonal", "NoCurvature", "STORES", "get_store"]

# what a store can give: 0 nothing, 1 diagonals, 2 full matrices (a family needs at least its own level)
NONE, DIAGONAL, FULL = 0, 1, 2


class CurvatureStore(ABC):
    """Per-example curvatures of ``N`` sites (all leaves have leading axis ``N``).

    :cvar name: the storage's name in options and files.
    :cvar detail: what it can give: ``0`` nothing, ``1`` diagonals, ``2`` full matrices.
    :cvar keeps_jacobian: the sites keep the Jacobians of the distribution parameters.
    """

    name: ClassVar[str]
    detail: ClassVar[int]
    keeps_jacobian: ClassVar[bool] = False
    #: the sites' gradients are held on the store's per-example index (``(N, s)``), not as ``(N, d)`` rows
    sparse_rows: ClassVar[bool] = False

    # --- construction -------------------------------------------------------------------
    @staticmethod
    @abstractmethod
    def from_point(jac, curv):
        """``(stored, dense)`` for one example: ``curv`` is ``Λ`` ``(k, k)`` when ``jac``
        ``(k, d)`` is given, else the dense ``(d, d)`` Hessian; ``dense`` is the example's
        dense curvature, or ``None`` when the store never needs it."""

    @classmethod
    @abstractmethod
    def assemble(cls, jac, stored, num, dtype, dim=None):
        """The store of ``num`` examples from the stacked ``from_point`` outputs (and Jacobians)."""

    @staticmethod
    def compress(jac, grad, width):
        """What one example keeps of its Jacobian ``(k, d)`` and gradient ``(d,)`` (all of both by default)."""
        return jac, grad

    @classmethod
    def file_shapes(cls, num, k, dim):
        """The arrays a saved posterior holds for this store: ``{field: shape}``."""
        return {}

    @classmethod
    def from_arrays(cls, arrays, num, dtype, dim=None):
        """The store from a saved posterior's arrays (``{field: array}``)."""
        return cls(**arrays)

    @classmethod
    def grad_shape(cls, num, dim, width=0):
        """The shape of the sites' gradient array in a saved posterior."""
        return (num, dim)

    def arrays(self):
        """``{field: array}`` to save (what :meth:`from_arrays` reads back)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    # --- row operations (shared) ---------------------------------------------------------
    @property
    def num_examples(self):
        return jax.tree.leaves(self)[0].shape[0]

    def take(self, index):
        """The curvatures of the examples at positions ``index``."""
        return jax.tree.map(lambda x: take_rows(x, index), self)

    def padded(self, extra):
        """Followed by ``extra`` copies of the last row."""
        return jax.tree.map(lambda x: pad_last_row(x, extra), self)

    def join(self, other):
        """Rows of ``self`` then rows of ``other`` (same kind)."""
        if type(other) is not type(self):
            raise SiteStorageError(f"cannot join sites stored as {self.name!r} and {other.name!r}")
        return jax.tree.map(join_rows, self, other)

    def stored_numbers(self):
        return sum(int(x.size) for x in jax.tree.leaves(self))

    # --- algebra -------------------------------------------------------------------------
    def weighted_dense(self, weights):
        """``Σ_i w_i Ĥ_i`` as a ``(d, d)`` matrix."""
        raise SiteStorageError(f"sites stored as {self.name!r} cannot give a full curvature sum")

    def weighted_diagonal(self, weights):
        """``Σ_i w_i diag(Ĥ_i)``, ``(d,)``."""
        raise SiteStorageError(f"sites stored as {self.name!r} carry no curvature")

    def weighted_matmat(self, weights, mat):
        """``(Σ_i w_i Ĥ_i) V`` for a ``(d, p)`` matrix ``V`` (matrix-free where the store allows)."""
        raise SiteStorageError(f"sites stored as {self.name!r} cannot give curvature products")

    @abstractmethod
    def dense(self):
        """Per-example dense curvatures ``(N, d, d)`` (materialised on demand)."""

    def diagonals(self):
        """Per-example diagonals ``(N, d)``."""
        return jnp.diagonal(self.dense(), axis1=1, axis2=2)

    @abstractmethod
    def trace(self):
        """``tr Ĥ_i`` per example ``(N,)``."""

    @abstractmethod
    def matvec(self, v):
        """``Ĥ_i v_i`` for every example (``v`` is ``(N, d)``)."""

    @abstractmethod
    def trace_quad(self, cov, diff):
        """``(tr(Ĥ_i Σ), dᵢᵀ Ĥ_i dᵢ)`` per example, for a dense covariance ``Σ`` and rows ``diff``."""

    @property
    def dtype(self):
        return jax.tree.leaves(self)[0].dtype

    def low_rank_factors(self):
        """``(J, Λ)`` with ``Ĥ_i = J_iᵀ Λ_i J_i`` when the store keeps them, else ``None``."""
        return None

    def mismatch(self, stale, cov_rows, shared_jacobian):
        """``½ tr((δH_i Σ)²)`` per example with ``δH_i = Ĥ_i − Ĥ_i^{stale}`` (aligned rows);
        ``cov_rows(M)`` is ``M Σ`` for an ``(m, d)`` matrix ``M`` (the family applies its covariance).

        The generic form materialises ``(N, d, d)`` differences and ``Σ``; kinds with a cheaper
        factorised form override it for a ``stale`` of their own kind.
        """
        if stale.detail == NONE:
            return jnp.zeros(self.num_examples, self.dtype)
        dh = self.dense() - stale.dense()
        cov = _dense_cov(cov_rows, dh.shape[-1], dh.dtype)
        m = jnp.einsum("nde,ef->ndf", dh, cov)
        return 0.5 * jnp.einsum("nde,ned->n", m, m)


def _dense_cov(cov_rows, dim, dtype):
    return cov_rows(jnp.eye(dim, dtype=dtype))


def _register(cls):
    names = [f.name for f in fields(cls)]
    return jax.tree_util.register_dataclass(cls, data_fields=names, meta_fields=[])


@_register
@dataclass(frozen=True)
class Factor(CurvatureStore):
    """``Ĥ_i = J_iᵀ Λ_i J_i`` with ``J`` ``(N, k, d)`` the parameter Jacobians and ``Λ`` ``(N, k, k)``."""

    jac: jax.Array
    lam: jax.Array
    name: ClassVar[str] = "factor"
    detail: ClassVar[int] = FULL
    keeps_jacobian: ClassVar[bool] = True

    @staticmethod
    def from_point(jac, curv):
        return curv, None

    @classmethod
    def assemble(cls, jac, stored, num, dtype, dim=None):
        return cls(jac=jac, lam=stored)

    @classmethod
    def file_shapes(cls, num, k, dim):
        return {"jac": (num, k, dim), "lam": (num, k, k)}

    def low_rank_factors(self):
        return self.jac, self.lam

    def weighted_dense(self, weights):
        return jnp.einsum("n,nkd,nkl,nle->de", weights, self.jac, self.lam, self.jac)

    def weighted_diagonal(self, weights):
        return jnp.einsum("n,nkd,nkl,nld->d", weights, self.jac, self.lam, self.jac)

    def weighted_matmat(self, weights, mat):
        proj = jnp.einsum("nkd,dp->nkp", self.jac, mat)  # O(N k d p), no d × d
        return jnp.einsum("nkd,nkp->dp", self.jac, jnp.einsum("n,nkl,nlp->nkp", weights, self.lam, proj))

    def dense(self):
        return jnp.einsum("nkd,nkl,nle->nde", self.jac, self.lam, self.jac)

    def diagonals(self):
        return jnp.einsum("nkd,nkl,nld->nd", self.jac, self.lam, self.jac)

    def trace(self):
        return jnp.einsum("nkd,nkl,nld->n", self.jac, self.lam, self.jac)

    def matvec(self, v):
        return jnp.einsum("nkd,nkl,nle,ne->nd", self.jac, self.lam, self.jac, v)

    def trace_quad(self, cov, diff):
        jsj = jnp.einsum("nkd,de,nle->nkl", self.jac, cov, self.jac)
        trace = jnp.einsum("nkl,nlk->n", self.lam, jsj)
        proj = jnp.einsum("nkd,nd->nk", self.jac, diff)
        return trace, jnp.einsum("nk,nkl,nl->n", proj, self.lam, proj)

    def mismatch(self, stale, cov_rows, shared_jacobian):
        r"""``tr((C G)²)/2`` with ``δH = Uᵀ C U``, ``U`` the stacked Jacobians and ``G = U Σ Uᵀ``:
        no ``d × d`` matrix (``shared_jacobian``: ``U = J``, ``C = Λ − Λ^{stale}``)."""
        if not isinstance(stale, Factor):
            return super().mismatch(stale, cov_rows, shared_jacobian)
        if shared_jacobian:
            stacked, signed = self.jac, self.lam - stale.lam
        else:
            stacked = jnp.concatenate([self.jac, stale.jac], 1)  # (n, 2k, d)
            zeros = jnp.zeros_like(self.lam)
            signed = jnp.concatenate([jnp.concatenate([self.lam, zeros], 2),
                                      jnp.concatenate([zeros, -stale.lam], 2)], 1)  # blockdiag(Λ, −Λ_stale)
        projected = jnp.reshape(cov_rows(jnp.reshape(stacked, (-1, stacked.shape[-1]))), stacked.shape)
        gram = jnp.sum(projected[:, :, None, :] * stacked[:, None, :, :], -1)  # U Σ Uᵀ per example
        cg = jnp.sum(signed[:, :, :, None] * gram[:, None, :, :], 2)
        return 0.5 * jnp.sum(cg * jnp.swapaxes(cg, 1, 2), (1, 2))


@_register
@dataclass(frozen=True)
class Dense(CurvatureStore):
    """Per-example dense curvatures ``(N, d, d)``."""

    curvature: jax.Array
    name: ClassVar[str] = "dense"
    detail: ClassVar[int] = FULL

    @staticmethod
    def from_point(jac, curv):
        dense = curv if jac is None else jac.T @ curv @ jac
        return dense, dense

    @classmethod
    def assemble(cls, jac, stored, num, dtype, dim=None):
        return cls(curvature=stored)

    @classmethod
    def file_shapes(cls, num, k, dim):
        return {"curvature": (num, dim, dim)}

    def weighted_dense(self, weights):
        return jnp.einsum("n,nde->de", weights, self.curvature)

    def weighted_diagonal(self, weights):
        return weights @ jnp.diagonal(self.curvature, axis1=1, axis2=2)

    def weighted_matmat(self, weights, mat):
        return jnp.einsum("n,nde,ep->dp", weights, self.curvature, mat)

    def dense(self):
        return self.curvature

    def trace(self):
        return jnp.trace(self.curvature, axis1=1, axis2=2)

    def matvec(self, v):
        return jnp.einsum("nde,ne->nd", self.curvature, v)

    def trace_quad(self, cov, diff):
        return (jnp.einsum("nde,ed->n", self.curvature, cov), jnp.einsum("nd,nde,ne->n", diff, self.curvature, diff))


@_register
@dataclass(frozen=True)
class Diagonal(CurvatureStore):
    """Per-example diagonals ``(N, d)`` (the diagonal family's sites)."""

    curvature: jax.Array
    name: ClassVar[str] = "diag"
    detail: ClassVar[int] = DIAGONAL

    @staticmethod
    def from_point(jac, curv):
        dense = curv if jac is None else jac.T @ curv @ jac
        return jnp.diag(dense), dense

    @classmethod
    def assemble(cls, jac, stored, num, dtype, dim=None):
        return cls(curvature=stored)

    @classmethod
    def file_shapes(cls, num, k, dim):
        return {"curvature": (num, dim)}

    def weighted_diagonal(self, weights):
        return weights @ self.curvature

    def weighted_matmat(self, weights, mat):
        return (weights @ self.curvature)[:, None] * mat

    def dense(self):
        return jax.vmap(jnp.diag)(self.curvature)

    def diagonals(self):
        return self.curvature

    def trace(self):
        return jnp.sum(self.curvature, 1)

    def matvec(self, v):
        return self.curvature * v

    def trace_quad(self, cov, diff):
        return self.curvature @ jnp.diag(cov), jnp.sum(self.curvature * diff**2, 1)

    def mismatch(self, stale, cov_rows, shared_jacobian):
        """``δhᵀ (Σ∘Σ) δh / 2`` for diagonal differences."""
        if not isinstance(stale, Diagonal):
            return super().mismatch(stale, cov_rows, shared_jacobian)
        dh = self.curvature - stale.curvature
        cov = _dense_cov(cov_rows, dh.shape[-1], dh.dtype)
        return 0.5 * jnp.sum((dh @ (cov * cov)) * dh, 1)


@_register
@dataclass(frozen=True)
class NoCurvature(CurvatureStore):
    """No curvature (the isotropic family's sites); ``rows`` is an ``(N, 0)`` placeholder that
    keeps the number of examples through row operations."""

    rows: jax.Array
    name: ClassVar[str] = "none"
    detail: ClassVar[int] = NONE

    @staticmethod
    def from_point(jac, curv):
        # nothing is stored, but the solver still sums the dense curvature to precondition the mean
        return None, (curv if jac is None else jac.T @ curv @ jac)

    @classmethod
    def assemble(cls, jac, stored, num, dtype, dim=None):
        return cls(rows=jnp.zeros((num, 0), dtype))

    @classmethod
    def from_arrays(cls, arrays, num, dtype, dim=None):
        return cls(rows=jnp.zeros((num, 0), dtype))

    def arrays(self):
        return {}

    def dense(self):
        raise SiteStorageError("isotropic sites carry no curvature")

    def trace(self):
        return jnp.zeros(self.rows.shape[0], self.rows.dtype)

    def matvec(self, v):
        return jnp.zeros_like(v)

    def trace_quad(self, cov, diff):
        zero = jnp.zeros(self.rows.shape[0], diff.dtype)
        return zero, zero

    def mismatch(self, stale, cov_rows, shared_jacobian):
        return jnp.zeros(self.rows.shape[0], self.rows.dtype)


_SPARSE_BATCH = 2**22  # numbers of transient dense Jacobian rows per batch when a sparse store densifies


@partial(jax.tree_util.register_dataclass, data_fields=["index", "jac", "lam", "nnz"], meta_fields=["dim"])
@dataclass(frozen=True)
class SparseFactor(CurvatureStore):
    r"""``Ĥ_i = J_iᵀ Λ_i J_i`` with each ``J_i`` held by its nonzero columns (``"sparse"``).

    ``index`` ``(N, s)`` lists the columns where some row of ``J_i`` is nonzero (ascending,
    padded with column 0 and zero values), ``jac`` ``(N, k, s)`` their values, ``lam``
    ``(N, k, k)``, ``nnz`` ``(N,)`` the number of real columns; ``dim`` is ``d``. ``O(N·k·s)``
    numbers instead of :class:`Factor`'s ``O(N·k·d)``: for a design with ``s ≪ d`` nonzeros per
    row (a sparse GLM: ``s = 10`` at ``d = 100,000``) the ``(N, d)`` arrays are never stored.
    The site gradients ``ĝ_i = J_iᵀ γ_i`` lie in the same columns, so the sites hold them
    as ``(N, s)`` values on ``index`` too (:attr:`sparse_rows`).

    Sums and products — what the low-rank family's solver asks for (``weighted_matmat``,
    ``weighted_diagonal``) — are gathers and scatter-adds, ``O(N k s p)``; per-example
    ``(N, d, d)`` questions (``dense``, ``trace_quad``, ``low_rank_factors``) materialise the
    dense Jacobians and are for small ``d``; the stale-versus-fresh ``mismatch`` densifies
    them in batches. The width ``s`` is chosen by the site computation
    (:func:`~numpyro_pc.sites.compute_sites`), which checks ``nnz ≤ s`` for every example and
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
    def from_point(jac, curv):
        return curv, None

    @staticmethod
    def compress(jac, grad, width):
        nonzero = jnp.any(jac != 0, 0)
        count = jnp.sum(nonzero, dtype=jnp.int32)
        index = jnp.nonzero(nonzero, size=width, fill_value=0)[0].astype(jnp.int32)
        real = (jnp.arange(width) < count).astype(jac.dtype)
        return (index, jac[:, index] * real, count), grad[index] * real

    @classmethod
    def assemble(cls, jac, stored, num, dtype, dim=None):
        index, values, count = jac
        return cls(index=index, jac=values, lam=stored, nnz=count, dim=int(dim))

    @classmethod
    def file_shapes(cls, num, k, dim, width=0):
        return {"index": (num, width), "jac": (num, k, width), "lam": (num, k, k), "nnz": (num,)}

    @classmethod
    def grad_shape(cls, num, dim, width=0):
        return (num, width)

    @classmethod
    def from_arrays(cls, arrays, num, dtype, dim=None):
        return cls(dim=int(dim), **arrays)

    def arrays(self):
        return {"index": self.index, "jac": self.jac, "lam": self.lam, "nnz": self.nnz}

    @property
    def width(self):
        return self.index.shape[1]

    def widened(self, width):
        """The same store with ``width`` columns per example (extra columns: index 0, value 0)."""
        extra = width - self.width
        if extra <= 0:
            return self
        return replace(self, index=jnp.pad(self.index, ((0, 0), (0, extra))),
                       jac=jnp.pad(self.jac, ((0, 0), (0, 0), (0, extra))))

    def join(self, other):
        if type(other) is not type(self):
            raise SiteStorageError(f"cannot join sites stored as {self.name!r} and {other.name!r}")
        width = max(self.width, other.width)
        return jax.tree.map(join_rows, self.widened(width), other.widened(width))

    # --- rows on the index ----------------------------------------------------------------
    def scatter(self, values, weights=None):
        """``Σ_i w_i`` of per-example values ``(N, s[, p])`` placed at their columns: ``(d[, p])``."""
        if weights is not None:
            values = values * jnp.reshape(weights, weights.shape + (1,) * (values.ndim - 1))
        out = jnp.zeros((self.dim,) + values.shape[2:], values.dtype)
        return out.at[self.index].add(values)

    def dense_rows(self, values):
        """Per-example values ``(N, s)`` as dense ``(N, d)`` rows (small ``d``)."""
        rows = jnp.zeros((values.shape[0], self.dim), values.dtype)
        return rows.at[jnp.arange(values.shape[0])[:, None], self.index].add(values)

    def rows_at(self, values, mean, ref_means, ref_index):
        r"""``ĝ_i + Ĥ_i (m − m_i)`` on the index, from the gradient values ``ĝ_i`` ``(N, s)``."""
        shift = mean[self.index] - ref_means[ref_index[:, None], self.index]  # (N, s): (m − m_i) on the columns
        proj = jnp.einsum("nks,ns->nk", self.jac, shift)
        return values + jnp.einsum("nks,nkl,nl->ns", self.jac, self.lam, proj)

    def curvature_values(self, points):
        """``Ĥ_i x_i`` on the index for per-example points ``x_i`` given on the index ``(N, s)``."""
        proj = jnp.einsum("nks,ns->nk", self.jac, points)
        return jnp.einsum("nks,nkl,nl->ns", self.jac, self.lam, proj)

    def dense_jac(self):
        """The Jacobians as dense ``(N, k, d)`` arrays (small ``d``)."""
        k = self.jac.shape[1]
        return jax.vmap(lambda idx, j: jnp.zeros((k, self.dim), j.dtype).at[:, idx].add(j))(self.index, self.jac)

    def _batch(self):
        return max(1, _SPARSE_BATCH // max(self.dim * max(self.jac.shape[1], 1), 1))

    # --- algebra ---------------------------------------------------------------------------
    def low_rank_factors(self):
        return self.dense_jac(), self.lam

    def weighted_dense(self, weights):
        return Factor(self.dense_jac(), self.lam).weighted_dense(weights)

    def weighted_diagonal(self, weights):
        return self.scatter(jnp.einsum("nks,nkl,nls->ns", self.jac, self.lam, self.jac), weights)

    def weighted_matmat(self, weights, mat):
        proj = jnp.einsum("nks,nsp->nkp", self.jac, mat[self.index])  # J_i V, O(N k s p)
        back = jnp.einsum("nks,nkp->nsp", self.jac, jnp.einsum("n,nkl,nlp->nkp", weights, self.lam, proj))
        return self.scatter(back)

    def dense(self):
        return Factor(self.dense_jac(), self.lam).dense()

    def diagonals(self):
        return self.dense_rows(jnp.einsum("nks,nkl,nls->ns", self.jac, self.lam, self.jac))

    def trace(self):
        return jnp.einsum("nks,nkl,nls->n", self.jac, self.lam, self.jac)

    def matvec(self, v):
        picked = jnp.take_along_axis(v, self.index, 1)
        return self.dense_rows(self.curvature_values(picked))

    def trace_quad(self, cov, diff):
        return Factor(self.dense_jac(), self.lam).trace_quad(cov, diff)

    def row_quad(self, values, cov_rows):
        r"""``xᵢᵀ Σ xᵢ`` for rows given by values on the index ``(N, s)``, densified in batches."""
        def one(idx, val):
            row = jnp.zeros((1, self.dim), val.dtype).at[0, idx].add(val)
            return jnp.sum(cov_rows(row)[0, idx] * val)

        return jax.lax.map(lambda a: one(*a), (self.index, values), batch_size=self._batch())

    def mismatch(self, stale, cov_rows, shared_jacobian):
        """:meth:`Factor.mismatch` on the Jacobians densified in batches (no ``(N, d)`` array)."""
        if not isinstance(stale, SparseFactor):
            return super().mismatch(stale, cov_rows, shared_jacobian)

        def one(fresh, old):
            dense = lambda s: Factor(s.dense_jac(), s.lam)  # noqa: E731
            expand = lambda x: jax.tree.map(lambda a: a[None], x)  # noqa: E731
            return dense(expand(fresh)).mismatch(dense(expand(old)), cov_rows, shared_jacobian)[0]

        return jax.lax.map(lambda a: one(*a), (self, stale), batch_size=self._batch())


STORES = {cls.name: cls for cls in (Factor, Dense, Diagonal, NoCurvature, SparseFactor)}


def get_store(name):
    """The storage class called ``name`` (``"factor"``, ``"sparse"``, ``"dense"``, ``"diag"`` or ``"none"``)."""
    if isinstance(name, type) and issubclass(name, CurvatureStore):
        return name
    if name not in STORES:
        raise InvalidOptionError(f"unknown storage {name!r}; expected 'auto' or one of {sorted(STORES)}")
    return STORES[name]

