r"""How the per-example site curvatures ``Ĥ_i`` are held: one class per storage kind.

Every kind is a pytree whose leaves all have the examples on their leading axis, so row
operations (take, pad, join) are the same for all of them, and every kind answers the
questions the solver, the diagnostics and the files ask of the curvature:

* :class:`JacobianFactor` (``"factor"``): ``Ĥ_i = J_iᵀ Λ_i J_i`` with ``J`` ``(N, k, d)`` and
  ``Λ`` ``(N, k, k)``; gives dense and diagonal sums.
* :class:`~numpyro_pc.curvature.sparse.SparseFactor` (``"sparse"``, its own module): the
  same with each ``J_i`` held by its ``s`` nonzero columns, ``(N, k, s)`` values and
  ``(N, s)`` indices; gives products and diagonal sums without any ``(N, d)`` array (the
  low-rank family's automatic choice).
* :class:`Dense` (``"dense"``): ``(N, d, d)`` matrices; gives dense and diagonal sums.
* :class:`Diagonal` (``"diag"``): ``(N, d)`` diagonals; gives diagonal sums.
* :class:`NoCurvature` (``"none"``): nothing (an ``(N, 0)`` placeholder); gives no sums.

``JacobianFactor`` is exact for GLM-type models (distribution parameters ``θ_i`` affine in ``z``)
and the Gauss–Newton approximation otherwise, at ``O(N·k·d)`` numbers; see docs/notation.md,
"Sites". A family chooses which sum it needs (:meth:`~numpyro_pc.families.registry.GaussianFamily.curvature_sum`);
a store that cannot give it raises :class:`~numpyro_pc.errors.SiteStorageError`.

Adding a storage kind is one class with these methods, registered with :func:`register_store`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields, replace
from typing import ClassVar

import jax
import jax.numpy as jnp

from numpyro_pc.deprecation import warn_renamed
from numpyro_pc.errors import InvalidOptionError, SiteStorageError
from numpyro_pc.model.rows import join_rows, pad_last_row, take_rows
from numpyro_pc.options import is_choice
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any, Self

__all__ = ["CurvatureStore", "JacobianFactor", "Dense", "Diagonal", "NoCurvature", "STORES", "get_store",
           "register_store"]

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
    def from_point(jac, curv) -> tuple[Any, jax.Array | None]:
        """``(stored, dense)`` for one example: ``curv`` is ``Λ`` ``(k, k)`` when ``jac``
        ``(k, d)`` is given, else the dense ``(d, d)`` Hessian; ``dense`` is the example's
        dense curvature, or ``None`` when the store never needs it."""

    @classmethod
    @abstractmethod
    def assemble(cls, jac, stored, num, dtype, dim=None) -> CurvatureStore:
        """The store of ``num`` examples from the stacked ``from_point`` outputs (and Jacobians)."""

    @staticmethod
    def compress(jac, grad, width) -> tuple[Any, Any]:
        """What one example keeps of its Jacobian ``(k, d)`` and gradient ``(d,)`` (all of both by default)."""
        return jac, grad

    @classmethod
    def file_shapes(cls, num, k, dim) -> dict[Any, Any]:
        """The arrays a saved posterior holds for this store: ``{field: shape}``."""
        return {}

    @classmethod
    def from_arrays(cls, arrays, num, dtype, dim=None) -> CurvatureStore:
        """The store from a saved posterior's arrays (``{field: array}``)."""
        return cls(**arrays)

    @classmethod
    def grad_shape(cls, num, dim, width=0) -> tuple[Any, Any]:
        """The shape of the sites' gradient array in a saved posterior."""
        return (num, dim)

    def arrays(self) -> dict[Any, Any]:
        """``{field: array}`` to save (what :meth:`from_arrays` reads back)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    # --- row operations (shared) ---------------------------------------------------------
    @property
    def num_examples(self) -> int:
        return jax.tree.leaves(self)[0].shape[0]

    def take(self, index) -> Self:
        """The curvatures of the examples at positions ``index``."""
        return jax.tree.map(lambda x: take_rows(x, index), self)

    def padded(self, extra) -> Self:
        """Followed by ``extra`` copies of the last row."""
        return jax.tree.map(lambda x: pad_last_row(x, extra), self)

    def join(self, other) -> Self:
        """Rows of ``self`` then rows of ``other`` (same kind)."""
        if type(other) is not type(self):
            raise SiteStorageError(f"cannot join sites stored as {self.name!r} and {other.name!r}")
        return jax.tree.map(join_rows, self, other)

    def stored_numbers(self) -> int:
        return sum(int(x.size) for x in jax.tree.leaves(self))

    def scaled(self, alpha) -> CurvatureStore:
        """The curvatures ``α Ĥ_i`` (every site raised to the power ``α``: tempering)."""
        raise SiteStorageError(f"sites stored as {self.name!r} cannot be scaled")

    def capped(self, detail) -> CurvatureStore:
        """The curvatures as a family that reads only ``detail`` of them sees its sites: unchanged up to the
        store's own detail, else their diagonals or none. A store may keep more than the family's sites carry
        (the Jacobians the matrix-free Newton step of the diagonal and isotropic families needs at large
        ``d``); the sites themselves, their natural parameters and their values are the family's."""
        if detail >= self.detail:
            return self
        if detail == NONE:
            return NoCurvature(rows=jnp.zeros((self.num_examples, 0), self.dtype))
        return Diagonal(curvature=self.diagonals())

    # --- algebra -------------------------------------------------------------------------
    def weighted_dense(self, weights) -> jax.Array:
        """``Σ_i w_i Ĥ_i`` as a ``(d, d)`` matrix."""
        raise SiteStorageError(f"sites stored as {self.name!r} cannot give a full curvature sum")

    def weighted_diagonal(self, weights) -> jax.Array:
        """``Σ_i w_i diag(Ĥ_i)``, ``(d,)``."""
        raise SiteStorageError(f"sites stored as {self.name!r} carry no curvature")

    def weighted_matmat(self, weights, mat) -> jax.Array:
        """``(Σ_i w_i Ĥ_i) V`` for a ``(d, p)`` matrix ``V`` (matrix-free where the store allows)."""
        raise SiteStorageError(f"sites stored as {self.name!r} cannot give curvature products")

    @abstractmethod
    def dense(self) -> jax.Array:
        """Per-example dense curvatures ``(N, d, d)`` (materialised on demand)."""

    def diagonals(self) -> jax.Array:
        """Per-example diagonals ``(N, d)``."""
        return jnp.diagonal(self.dense(), axis1=1, axis2=2)

    @abstractmethod
    def trace(self) -> jax.Array:
        """``tr Ĥ_i`` per example ``(N,)``."""

    @abstractmethod
    def matvec(self, v) -> jax.Array:
        """``Ĥ_i v_i`` for every example (``v`` is ``(N, d)``)."""

    @abstractmethod
    def trace_quad(self, cov, diff) -> tuple[jax.Array, jax.Array]:
        """``(tr(Ĥ_i Σ), dᵢᵀ Ĥ_i dᵢ)`` per example, for a dense covariance ``Σ`` and rows ``diff``."""

    @property
    def dtype(self):
        return jax.tree.leaves(self)[0].dtype

    def low_rank_factors(self) -> tuple[jax.Array, jax.Array] | None:
        """``(J, Λ)`` with ``Ĥ_i = J_iᵀ Λ_i J_i`` when the store keeps them, else ``None``."""
        return None

    def mismatch(self, stale, cov_rows, shared_jacobian) -> jax.Array:
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


def _dense_cov(cov_rows, dim, dtype) -> jax.Array:
    return cov_rows(jnp.eye(dim, dtype=dtype))


def _register(cls):
    names = [f.name for f in fields(cls)]
    return jax.tree_util.register_dataclass(cls, data_fields=names, meta_fields=[])


@_register
@dataclass(frozen=True)
class JacobianFactor(CurvatureStore):
    """``Ĥ_i = J_iᵀ Λ_i J_i`` with ``J`` ``(N, k, d)`` the parameter Jacobians and ``Λ`` ``(N, k, k)``."""

    jac: jax.Array
    lam: jax.Array
    name: ClassVar[str] = "factor"
    detail: ClassVar[int] = FULL
    keeps_jacobian: ClassVar[bool] = True

    @staticmethod
    def from_point(jac, curv) -> tuple[Any, None]:
        return curv, None

    @classmethod
    def assemble(cls, jac, stored, num, dtype, dim=None) -> JacobianFactor:
        return cls(jac=jac, lam=stored)

    @classmethod
    def file_shapes(cls, num, k, dim) -> dict[str, tuple[Any, Any, Any]]:
        return {"jac": (num, k, dim), "lam": (num, k, k)}

    def low_rank_factors(self) -> tuple[Any, Any]:
        return self.jac, self.lam

    def scaled(self, alpha) -> CurvatureStore:
        return replace(self, lam=alpha * self.lam)

    def weighted_dense(self, weights) -> jax.Array:
        return jnp.einsum("n,nkd,nkl,nle->de", weights, self.jac, self.lam, self.jac)

    def weighted_diagonal(self, weights) -> jax.Array:
        return jnp.einsum("n,nkd,nkl,nld->d", weights, self.jac, self.lam, self.jac)

    def weighted_matmat(self, weights, mat) -> jax.Array:
        proj = jnp.einsum("nkd,dp->nkp", self.jac, mat)  # O(N k d p), no d × d
        return jnp.einsum("nkd,nkp->dp", self.jac, jnp.einsum("n,nkl,nlp->nkp", weights, self.lam, proj))

    def dense(self) -> jax.Array:
        return jnp.einsum("nkd,nkl,nle->nde", self.jac, self.lam, self.jac)

    def diagonals(self) -> jax.Array:
        return jnp.einsum("nkd,nkl,nld->nd", self.jac, self.lam, self.jac)

    def trace(self) -> jax.Array:
        return jnp.einsum("nkd,nkl,nld->n", self.jac, self.lam, self.jac)

    def matvec(self, v) -> jax.Array:
        return jnp.einsum("nkd,nkl,nle,ne->nd", self.jac, self.lam, self.jac, v)

    def trace_quad(self, cov, diff) -> tuple[jax.Array, jax.Array]:
        jsj = jnp.einsum("nkd,de,nle->nkl", self.jac, cov, self.jac)
        trace = jnp.einsum("nkl,nlk->n", self.lam, jsj)
        proj = jnp.einsum("nkd,nd->nk", self.jac, diff)
        return trace, jnp.einsum("nk,nkl,nl->n", proj, self.lam, proj)

    def mismatch(self, stale, cov_rows, shared_jacobian) -> jax.Array:
        r"""``tr((C G)²)/2`` with ``δH = Uᵀ C U``, ``U`` the stacked Jacobians and ``G = U Σ Uᵀ``:
        no ``d × d`` matrix (``shared_jacobian``: ``U = J``, ``C = Λ − Λ^{stale}``)."""
        if not isinstance(stale, JacobianFactor):
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
    def from_point(jac, curv) -> tuple[Any, Any]:
        dense = curv if jac is None else jac.T @ curv @ jac
        return dense, dense

    @classmethod
    def assemble(cls, jac, stored, num, dtype, dim=None) -> Dense:
        return cls(curvature=stored)

    @classmethod
    def file_shapes(cls, num, k, dim) -> dict[str, tuple[Any, Any, Any]]:
        return {"curvature": (num, dim, dim)}

    def scaled(self, alpha) -> CurvatureStore:
        return replace(self, curvature=alpha * self.curvature)

    def weighted_dense(self, weights) -> jax.Array:
        return jnp.einsum("n,nde->de", weights, self.curvature)

    def weighted_diagonal(self, weights) -> jax.Array:
        return weights @ jnp.diagonal(self.curvature, axis1=1, axis2=2)

    def weighted_matmat(self, weights, mat) -> jax.Array:
        return jnp.einsum("n,nde,ep->dp", weights, self.curvature, mat)

    def dense(self) -> jax.Array:
        return self.curvature

    def trace(self) -> jax.Array:
        return jnp.trace(self.curvature, axis1=1, axis2=2)

    def matvec(self, v) -> jax.Array:
        return jnp.einsum("nde,ne->nd", self.curvature, v)

    def trace_quad(self, cov, diff) -> tuple[jax.Array, jax.Array]:
        return (jnp.einsum("nde,ed->n", self.curvature, cov), jnp.einsum("nd,nde,ne->n", diff, self.curvature, diff))


@_register
@dataclass(frozen=True)
class Diagonal(CurvatureStore):
    """Per-example diagonals ``(N, d)`` (the diagonal family's sites)."""

    curvature: jax.Array
    name: ClassVar[str] = "diag"
    detail: ClassVar[int] = DIAGONAL

    @staticmethod
    def from_point(jac, curv) -> tuple[jax.Array, Any]:
        if jac is None:
            return jnp.diag(curv), curv
        # diag(J_iᵀ Λ_i J_i) from the factors, O(k² d): the d × d product is only formed when the
        # caller uses ``dense`` (the solver's dense sum), and sized for by default_chunk_size
        return jnp.einsum("kd,kl,ld->d", jac, curv, jac), jac.T @ curv @ jac

    @classmethod
    def assemble(cls, jac, stored, num, dtype, dim=None) -> Diagonal:
        return cls(curvature=stored)

    @classmethod
    def file_shapes(cls, num, k, dim) -> dict[str, tuple[Any, Any]]:
        return {"curvature": (num, dim)}

    def scaled(self, alpha) -> CurvatureStore:
        return replace(self, curvature=alpha * self.curvature)

    def weighted_diagonal(self, weights) -> jax.Array:
        return weights @ self.curvature

    def weighted_matmat(self, weights, mat) -> jax.Array:
        return (weights @ self.curvature)[:, None] * mat

    def dense(self) -> jax.Array:
        return jax.vmap(jnp.diag)(self.curvature)

    def diagonals(self) -> jax.Array:
        return self.curvature

    def trace(self) -> jax.Array:
        return jnp.sum(self.curvature, 1)

    def matvec(self, v) -> jax.Array:
        return self.curvature * v

    def trace_quad(self, cov, diff) -> tuple[jax.Array, jax.Array]:
        return self.curvature @ jnp.diag(cov), jnp.sum(self.curvature * diff**2, 1)

    def mismatch(self, stale, cov_rows, shared_jacobian) -> jax.Array:
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
    def from_point(jac, curv) -> tuple[None, Any]:
        # nothing is stored, but the solver still sums the dense curvature to precondition the mean
        return None, (curv if jac is None else jac.T @ curv @ jac)

    @classmethod
    def assemble(cls, jac, stored, num, dtype, dim=None) -> NoCurvature:
        return cls(rows=jnp.zeros((num, 0), dtype))

    @classmethod
    def from_arrays(cls, arrays, num, dtype, dim=None) -> NoCurvature:
        return cls(rows=jnp.zeros((num, 0), dtype))

    def arrays(self) -> dict[Any, Any]:
        return {}

    def scaled(self, alpha) -> CurvatureStore:
        return self  # no curvature to scale

    def dense(self) -> jax.Array:
        raise SiteStorageError("isotropic sites carry no curvature")

    def trace(self) -> jax.Array:
        return jnp.zeros(self.rows.shape[0], self.rows.dtype)

    def matvec(self, v) -> jax.Array:
        return jnp.zeros_like(v)

    def trace_quad(self, cov, diff) -> tuple[jax.Array, jax.Array]:
        zero = jnp.zeros(self.rows.shape[0], diff.dtype)
        return zero, zero

    def mismatch(self, stale, cov_rows, shared_jacobian) -> jax.Array:
        return jnp.zeros(self.rows.shape[0], self.rows.dtype)


STORES = {cls.name: cls for cls in (JacobianFactor, Dense, Diagonal, NoCurvature)}


def register_store(cls) -> type[CurvatureStore]:
    """Make a :class:`CurvatureStore` subclass known to :func:`get_store` (and saved files) by its ``name``."""
    STORES[cls.name] = cls
    return cls



def get_store(name) -> type[CurvatureStore]:
    """The storage class called ``name`` (``"factor"``, ``"sparse"``, ``"dense"``, ``"diag"`` or ``"none"``)."""
    if isinstance(name, type) and issubclass(name, CurvatureStore):
        return name
    if not is_choice(name, STORES):
        raise InvalidOptionError(f"unknown storage {name!r}; expected 'auto' or one of {sorted(STORES)}")
    return STORES[name]


def __getattr__(name: str) -> type:
    if name == "Factor":  # renamed: numpyro_pc.families.expfam.Factor is an exponential-family factor
        warn_renamed("numpyro_pc.curvature.Factor is now JacobianFactor (the store of H_i = J_i^T Lambda_i J_i; "
                     "Factor is the exponential-family factor of numpyro_pc.families.expfam); the old name will be "
                     "removed in the next release")
        return JacobianFactor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
