r"""The cached sites of an exponential-family posterior: :class:`EFSiteTable` (a pytree).

An :class:`~numpyro_pc.dual.expfam.EFPosterior` in a product family with natural parameters
:math:`\lambda` ``(P,)`` keeps, for every example ``i``, the site's gradient in the mean
parameters :math:`g_i = \nabla_\mu E_q[\ell_i]` and, for the prior, :math:`g_0`; the site's
natural parameters are :math:`\hat\lambda_i = -g_i` (paper eq. ``qdualform``), so that at the
fixed point :math:`\lambda = -g_0 - \sum_i g_i`. The table implements
:class:`~numpyro_pc.protocols.sites.SiteTable`; its arrays are the ``grads``, ``prior`` and
``ids`` of the ``"ef"`` file (:mod:`numpyro_pc.io.expfam`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.errors import InvalidOptionError
from numpyro_pc.model.rows import is_every_row, join_rows, row_sum, take_rows
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["EFSiteTable", "EFState"]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class EFSiteTable:
    """Cached sites of every example and of the prior, in mean-parameter gradients.

    :ivar grads: ``(N, P)`` the sites :math:`g_i = \\nabla_\\mu E_q[\\ell_i]`.
    :ivar prior: ``(P,)`` the prior term :math:`g_0` (``-λ_0`` for a conjugate-form prior).
    :ivar ids: ``(N,)`` stable integer example ids.
    """

    grads: jax.Array
    prior: jax.Array
    ids: jax.Array
    kind: ClassVar[str] = "ef"

    @property
    def num_examples(self) -> int:
        """``N``, the number of example sites."""
        return int(self.grads.shape[0])

    def take(self, index) -> EFSiteTable:
        """The sites of the examples at positions ``index`` (the prior term is kept)."""
        if is_every_row(index, self.num_examples):
            return self  # no copy
        return replace(self, grads=take_rows(self.grads, index), ids=take_rows(self.ids, index))

    def concat(self, other: EFSiteTable, prior_from: str = "other") -> EFSiteTable:
        """Examples of ``self`` followed by those of ``other``; the prior term comes from ``prior_from``
        (``"other"`` or ``"self"``)."""
        if prior_from not in ("other", "self"):
            raise InvalidOptionError(f"prior_from is 'other' or 'self'; got {prior_from!r}")
        prior = other.prior if prior_from == "other" else self.prior
        return EFSiteTable(join_rows(self.grads, other.grads), prior, join_rows(self.ids, other.ids))

    def grad_sum(self, weights=None) -> jax.Array:
        r""":math:`\sum_i w_i g_i` ``(P,)`` over the example sites (:math:`w_i = 1` by default)."""
        return row_sum(self.grads) if weights is None else weights @ self.grads

    def natural_sum(self, family=None, weights=None) -> jax.Array:
        r""":math:`\sum_i w_i \hat\lambda_i = -\sum_i w_i g_i` ``(P,)`` (``family`` is not needed: the
        product family's natural parameters are a flat vector)."""
        return -self.grad_sum(weights)

    def prior_natural(self, family=None) -> jax.Array:
        r""":math:`\lambda_0 = -g_0` ``(P,)`` (constant for a conjugate-form prior, else at the ``q``
        the prior term was computed at)."""
        return -self.prior

    def values(self, family, point) -> tuple[jax.Array, jax.Array]:
        r"""Every example site and the prior site at ``point``, :math:`\hat\ell_i(x) = \langle T(x), g_i\rangle`.

        :param family: the posterior's :class:`~numpyro_pc.families.product.ProductFamily` (its statistics ``T``).
        :param dict point: one value per factor, in the factors' coordinates.
        :return: ``(N,)`` the example sites' values and the prior site's value.
        """
        with jax.enable_x64(self.grads.dtype == jnp.float64):
            stats = family.stats({name: jnp.asarray(v)[None] for name, v in point.items()})[0]
            return self.grads @ stats, self.prior @ stats

    def expected_values(self, family, q) -> tuple[jax.Array, jax.Array]:
        r""":math:`E_q[\hat\ell_i] = \langle g_i, \mu\rangle` for every example site and the prior site,
        :math:`\mu = E_q[T]` the mean parameters of the natural parameters ``q``.

        :return: ``(N,)`` and a scalar.
        """
        with jax.enable_x64(self.grads.dtype == jnp.float64):
            mu = family.expectation(q)
            return self.grads @ mu, self.prior @ mu

    def log_normaliser(self, family) -> jax.Array:
        r""":math:`A(\lambda_0 + \sum_i \hat\lambda_i)`, the log-partition of the sites' product."""
        with jax.enable_x64(self.grads.dtype == jnp.float64):
            return family.log_normalizer(self.prior_natural() + self.natural_sum())

    def mismatch(self, fresh: EFSiteTable, family, q, shared_jacobian: bool = False) -> dict:
        r"""How far each of these (stale) sites is from ``fresh``, the same examples' sites at ``q``: the
        log-ratio of a fresh to a stale site is :math:`\langle \delta g_i, T(x)\rangle`, whose standard
        deviation under ``q`` is :math:`\sqrt{\delta g_i^\top F(q)\, \delta g_i}` (Fisher–vector
        products, never ``F``). ``F`` is block diagonal over the factors, so the squares add over the
        latent sites.

        :return: ``{"magnitude": (N,), "by_site": {site: (N,)}}`` (host arrays).
        """
        with jax.enable_x64(self.grads.dtype == jnp.float64):
            return self._mismatch(fresh, family, q)

    def _mismatch(self, fresh, family, q) -> dict[Any, Any]:
        delta = fresh.grads - self.grads
        fisher_times = jax.vmap(lambda v: jax.jvp(family.expectation, (q,), (v,))[1])
        weighted = delta * fisher_times(delta)
        by_site = {f.site: np.sqrt(np.maximum(np.asarray(jnp.sum(part, 1)), 0.0))
                   for f, part in zip(family.factors, family.split(weighted))}
        return dict(magnitude=np.sqrt(np.maximum(np.asarray(jnp.sum(weighted, 1)), 0.0)), by_site=by_site)

    def scale(self, alpha) -> EFSiteTable:
        r"""Every example site raised to the power ``alpha`` (tempering): :math:`\alpha g_i`; the prior
        term is unchanged."""
        return replace(self, grads=alpha * self.grads)

    def with_rows(self, rows, grads) -> EFSiteTable:
        """The table with the sites at positions ``rows`` replaced by ``grads`` ``(len(rows), P)``."""
        return replace(self, grads=self.grads.at[rows].set(grads))

    def arrays(self) -> dict[str, jax.Array]:
        """``{"grads", "prior", "ids"}``, as the ``"ef"`` file holds them."""
        return {"grads": self.grads, "prior": self.prior, "ids": self.ids}

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, jax.Array], **static) -> EFSiteTable:
        """The table from :meth:`arrays`' output (no static description is needed)."""
        if static:
            raise InvalidOptionError(f"exponential-family sites take no static description; got {sorted(static)}")
        return cls(grads=arrays["grads"], prior=arrays["prior"], ids=arrays["ids"])


class EFState(NamedTuple):
    """``natural (P,)`` and the cached ``sites``
    (:class:`~numpyro_pc.sites.expfam_table.EFSiteTable`: ``grads (N, P)`` the sites :math:`g_i`,
    ``prior (P,)`` the prior term :math:`g_0`, ``ids (N,)``), whose fields the state also shows."""

    natural: jax.Array
    sites: EFSiteTable

    @property
    def grads(self) -> jax.Array:
        return self.sites.grads

    @property
    def prior(self) -> jax.Array:
        return self.sites.prior

    @property
    def ids(self) -> jax.Array:
        return self.sites.ids
