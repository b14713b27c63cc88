"""The numeric state and the static configuration of a Gaussian dual-form posterior.

:class:`PosteriorState` is a pytree (it passes through ``jax.jit``, ``jax.vmap`` and
``jax.lax.scan``); :class:`PosteriorConfig` is hashable (a compiled program's key). A
:class:`~numpyro_pc.dual.base.DualPosteriorBase` is the pair with the data
(:meth:`~numpyro_pc.dual.base.DualPosteriorBase.tree`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax

__all__ = ["PosteriorState", "PosteriorConfig"]


class PosteriorState(NamedTuple):
    """The numeric state of a dual-form posterior: a pytree, so it passes through ``jax.jit``,
    ``jax.vmap`` and ``jax.lax.scan`` (see :meth:`DualPosteriorBase.tree`).

    :ivar q: the family member (e.g. :class:`~numpyro_pc.families.registry.Gaussian`).
    :ivar sites: the :class:`~numpyro_pc.sites.gaussian.Sites`, one row per example with a site.
    :ivar offset: natural parameters attributed to no single site, or ``None``
        (``λ = offset + Σ_i λ̂_i``).
    :ivar data_ids: ids of the examples whose data is retained, aligned with the data rows.
    :ivar tombstones: ids of deleted examples (never reused).
    :ivar next_id: the id the next new example gets.
    :ivar stale_sites: a boolean array: the retained sites belong to an earlier ``q`` (after an
        approximate deletion; ``None`` counts as ``False``).
    """

    q: Any
    sites: Any
    offset: Any
    data_ids: jax.Array
    tombstones: jax.Array
    next_id: jax.Array
    stale_sites: Any = None


@dataclass(frozen=True)
class PosteriorConfig:
    """The static configuration of a dual-form posterior (hashable: a compiled program's key).

    :ivar spec: the model binding (:class:`~numpyro_pc.model.likelihood.ModelSpec`).
    :ivar family: the :class:`~numpyro_pc.families.registry.GaussianFamily`.
    :ivar rule: the prepared expectation rule.
    :ivar curvature: ``"hessian"`` or ``"ggn"``.
    :ivar storage: the requested curvature storage (``"auto"`` or a store's name).
    :ivar chunk_size: examples per chunk of the site computation (``None``: automatic).
    """

    spec: Any
    family: Any
    rule: Any
    curvature: str
    storage: str
    chunk_size: int | None
