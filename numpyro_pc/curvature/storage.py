r"""How a Gaussian posterior's per-example curvatures are stored, and in chunks of what size.

:func:`resolve_storage` chooses the store of :mod:`numpyro_pc.curvature.stores` for ``storage="auto"``
(the family's own, Gauss–Newton factors where the sites factorise exactly, dense within the
memory budget of :func:`numpyro_pc.curvature.memory.dense_auto_budget`) and checks a named one against
what the family and the model need; a refusal is a
:class:`~numpyro_pc.errors.SiteStorageError` whose message lists options that fit.
:func:`default_chunk_size` sizes the chunks of :func:`numpyro_pc.sites.gaussian.compute_sites` so that
transient per-example curvature stays within a fixed budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from numpyro_pc.errors import SiteStorageError
from numpyro_pc.protocols.capabilities import matrix_free_sites, site_curvature

from .memory import dense_auto_budget, format_bytes, machine_memory
from .sparse import SparseFactor
from .stores import Dense, JacobianFactor, get_store
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .stores import CurvatureStore

__all__ = ["SiteConfig", "resolve_storage", "mc_along_subspace", "default_chunk_size", "uses_params"]

_CHUNK_BUDGET = 2**23  # numbers per chunk of transient per-example curvature


@dataclass(frozen=True)
class SiteConfig:
    """Static options of a site computation (hashable, part of the jit cache key)."""

    rule: object
    curvature: str = "hessian"
    storage: type = JacobianFactor
    chunk_size: int = 256
    num_devices: int = 1
    need_hessian_sum: bool = False
    width: int = 0  # columns per example of a sparse store
    prior_diagonal: bool = False  # hold Ĥ_0 as its diagonal (a separable prior, a family with matrix-free sites)


_DENSE_AUTO_LIMIT = dense_auto_budget(machine_memory())  # bytes, read once on import


def resolve_storage(storage, family, spec, rule, curvature, dtype=None) -> type[CurvatureStore]:
    r"""The storage class for ``storage="auto"`` (or a name) after checking that it suits the family and model.

    ``"auto"`` takes the family's own store (``"diag"``, ``"none"``) where it has one, unless the family's
    sites are matrix-free at this ``d`` (:func:`~numpyro_pc.protocols.capabilities.matrix_free_sites`: the
    diagonal and isotropic families above ``MATRIX_FREE_DIM`` latents) and factorise: then ``"sparse"``, whose
    products give the solver's Newton step without a ``(d, d)`` sum; else
    ``"factor"`` (``Ĥ_i = J_iᵀ Λ_i J_i``, ``O(N·k·d)``; ``"sparse"`` for a family with
    matrix-free sites) where the sites factorise exactly: distribution parameters affine in
    ``z``, the ``"gh"`` or ``"mc"`` rule over a fixed dependence subspace
    (:func:`mc_along_subspace`), or ``curvature="ggn"`` with the ``"delta"`` rule; else ``"dense"`` when its ``N·d²`` numbers, counted in bytes of ``dtype``,
    fit the budget ``_DENSE_AUTO_LIMIT`` (:func:`dense_auto_budget`: 1/8 of
    :func:`machine_memory`, or 1 GiB where that cannot be read). Otherwise, and for a store that
    cannot hold what the family or model needs, it raises
    :class:`~numpyro_pc.errors.SiteStorageError`, whose ``remedies`` are the option sets its
    message suggests.

    :param dtype: floating dtype of the sites (default: float64 with x64 enabled, else float32).
    """
    d, n = spec.latent.dim, spec.num_examples
    family.check_dimension(d)
    factorisable = (rule.kind == "gh" or spec.affine or (curvature == "ggn" and rule.kind == "delta")
                    or mc_along_subspace(rule, curvature)) and spec.num_params > 0 and spec.local is None
    if isinstance(storage, str) and storage == "auto":
        needs = site_curvature(family)
        free = matrix_free_sites(family, d)
        if needs.default_storage is not None and not (free and factorisable):
            return get_store(needs.default_storage)
        if factorisable:
            return SparseFactor if free else JacobianFactor
        size = n * d * d * np.dtype(jnp.result_type(float) if dtype is None else dtype).itemsize
        if size <= _DENSE_AUTO_LIMIT:
            return Dense
        diagonal = [({"family": "diagonal"}, "diagonal sites, N·d numbers")] if family.name == "full" else []
        remedies = _factorised(spec, rule) + diagonal + [({"storage": "dense"}, "to accept the memory")]
        raise SiteStorageError(
            f"the per-example Hessians of this model do not factorise exactly ({_why(spec, rule)}) and dense "
            f"storage would hold N·d² = {n * d * d:.3g} numbers ({format_bytes(size)}), more than the budget of "
            f"storage='auto' ({format_bytes(_DENSE_AUTO_LIMIT)}: numpyro_pc.curvature.memory.dense_auto_budget); "
            f"{_say(remedies)}.", [r for r, _ in remedies])
    store = get_store(storage)
    if store.keeps_jacobian and not factorisable:
        remedies = _factorised(spec, rule) + [({"storage": "dense"}, "")]
        raise SiteStorageError(f"storage={store.name!r} holds J_iᵀ Λ_i J_i, which needs distribution parameters "
                               f"affine in z, the 'gh' rule, the 'mc' rule along a fixed subspace (expectation="
                               f"'auto' finds it), or curvature='ggn' with the 'delta' rule "
                               f"({_why(spec, rule)}); {_say(remedies)}.", [r for r, _ in remedies])
    if store.detail < site_curvature(family).detail:
        try:
            auto = resolve_storage("auto", family, spec, rule, curvature, dtype)
        except SiteStorageError:
            auto = None
        remedy = ({"storage": "dense"}, "") if auto is None else ({"storage": "auto"}, f"here {auto.name!r}")
        raise SiteStorageError(f"the {family.name} family needs more per-example curvature than "
                               f"storage={store.name!r} holds; {_say([remedy])}.", [remedy[0]])
    return store


def mc_along_subspace(rule, curvature) -> bool:
    """Whether the ``"mc"`` rule differentiates each example along its dependence subspace
    (``rule.subspace_dim > 0``, exact Hessians): its sites are then stored as ``(P_i, E[∇²_u φ_i])``."""
    return rule.kind == "mc" and rule.subspace_dim > 0 and curvature == "hessian" and rule.mc_precision == "hessian"


def _why(spec, rule) -> str:
    if spec.local is not None:
        return (f"each example's loss integrates its local latents {list(spec.local.names)}: a marginal likelihood "
                "whose Hessian in z has no Jacobian factor")
    if spec.num_params == 0:
        return "its likelihood has no distribution parameters that depend on z"
    if rule.kind == "delta":
        return (f"its {spec.num_params} distribution parameter(s) are not affine in z, so the Hessian has "
                "terms beyond J_iᵀ Λ_i J_i")
    return (f"its {spec.num_params} distribution parameter(s) are not affine in z, so their Jacobian J_i "
            f"changes over the points the {rule.kind!r} rule averages")


def _factorised(spec, rule) -> list[tuple[dict[str, str], str]]:
    """The options under which this model's sites factorise (Gauss–Newton at the mean), with their meaning."""
    if spec.num_params == 0 or spec.local is not None:
        return []
    if rule.kind == "delta":
        return [({"curvature": "ggn"}, "Gauss–Newton, stored factorised")]
    return [({"expectation": "delta", "curvature": "ggn"}, "the Laplace–Gauss–Newton posterior, stored factorised")]


def _say(remedies) -> str:
    """``pass a='x' with b='y' (meaning), or c='z' …``"""
    parts = [" with ".join(f"{k}={v!r}" for k, v in r.items()) + (f" ({note})" if note else "")
             for r, note in remedies]
    return "pass " + ", or ".join(parts)


def default_chunk_size(spec, storage, curvature, num_examples, need_hessian_sum=True, rule=None) -> int:
    """Examples per chunk: as many as the transient-memory budget allows, balanced so that
    padding is at most one example per chunk."""
    d, k = spec.latent.dim, max(spec.num_params, 1)
    if rule is not None and mc_along_subspace(rule, curvature):  # r + 3 probe Jacobians and r Hessian tangents
        r = rule.subspace_dim
        largest = max(1, _CHUNK_BUDGET // (((r + 3) * k + 2 * r) * d))
        chunks = int(math.ceil(num_examples / largest))
        return int(math.ceil(num_examples / chunks))
    # a d × d curvature per example is formed by the dense store, by models without distribution
    # parameters, and by the diag/none stores only when the dense sum Σ Ĥ_i is asked for (their
    # own stored terms come from J_i, Λ_i directly: Diagonal.from_point never forms J_iᵀ Λ_i J_i)
    dense_transient = (storage is Dense or not uses_params(spec, storage, curvature)
                       or (need_hessian_sum and not storage.keeps_jacobian))
    per_example = d * d if dense_transient else 4 * k * d
    largest = max(1, _CHUNK_BUDGET // max(per_example, 1))
    chunks = int(math.ceil(num_examples / largest))
    return int(math.ceil(num_examples / chunks))


def uses_params(spec, storage, curvature) -> bool:
    """Whether per-example curvature goes through the distribution parameters (``J_iᵀ Λ_i J_i``)."""
    return spec.num_params > 0 and (storage.keeps_jacobian or curvature == "ggn" or spec.affine)
