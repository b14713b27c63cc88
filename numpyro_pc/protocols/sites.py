r"""One protocol for the table of cached sites that every dual-form posterior keeps.

A posterior in dual form is :math:`\lambda = \lambda_0 + \sum_{i=1}^N \hat\lambda_i` (paper
eq. ``qdualform``): the natural parameters of a prior site and of one site per example. Both
kinds of posterior keep those sites in a table — the Gaussian families in
:class:`numpyro_pc.sites.cached.Sites` (gradients, curvatures in a
:mod:`~numpyro_pc.curvature.stores` store, reference means), the exponential-family products in
:class:`numpyro_pc.sites.expfam_table.EFSiteTable` (the gradients :math:`g_i` in the mean
parameters, :math:`\hat\lambda_i = -g_i`) — and :class:`SiteTable` is what the solver, the
adaptations (streaming, deletion, merging, tempering) and the files ask of either:

* rows: :attr:`~SiteTable.ids`, :attr:`~SiteTable.num_examples`, :meth:`~SiteTable.take`,
  :meth:`~SiteTable.concat`;
* algebra: :meth:`~SiteTable.natural_sum` (:math:`\sum_i w_i \hat\lambda_i`),
  :meth:`~SiteTable.prior_natural` (:math:`\lambda_0`), :meth:`~SiteTable.scale`
  (:math:`\alpha \hat\lambda_i`, tempering), :meth:`~SiteTable.log_normaliser`;
* evaluation: :meth:`~SiteTable.values` (:math:`\hat\ell_i(x)`) and
  :meth:`~SiteTable.expected_values` (:math:`E_q[\hat\ell_i]`), :meth:`~SiteTable.mismatch`
  (how stale a site is against its recomputation);
* files: :meth:`~SiteTable.arrays` and :meth:`~SiteTable.from_arrays`, and
  :attr:`~SiteTable.kind`, the kind of saved posterior the arrays belong to.

Natural parameters are returned in the family's own format (a pytree for the Gaussian
families, a flat ``(P,)`` vector for the products); ``family`` is the posterior's family and
a table that does not need it ignores it. The protocol is ``runtime_checkable``:
``isinstance(post.sites, SiteTable)`` holds for every posterior's table.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

import jax

__all__ = ["SiteTable"]


@runtime_checkable
class SiteTable(Protocol):
    """The cached sites of a dual-form posterior: one per example, in rows, and the prior site.

    A table is an immutable pytree; every operation returns a new table. Row operations keep
    the prior site (:meth:`concat` says whose).

    :cvar kind: the kind of saved posterior whose arrays :meth:`arrays` gives (``"gaussian"``
        or ``"ef"``).
    :ivar ids: ``(N,)`` stable integer ids of the examples, aligned with the rows.
    """

    kind: ClassVar[str]
    ids: jax.Array

    @property
    def num_examples(self) -> int:
        """``N``, the number of example sites (rows)."""

    def take(self, index) -> SiteTable:
        """The sites of the examples at positions ``index`` (the prior site is kept).

        :param index: host or device integer positions.
        """

    def concat(self, other: SiteTable, prior_from: str = "other") -> SiteTable:
        """Rows of ``self`` followed by those of ``other`` (a table of the same kind).

        :param str prior_from: whose prior site the result keeps, ``"other"`` or ``"self"``.
        """

    def natural_sum(self, family, weights=None) -> Any:
        r""":math:`\sum_{i=1}^N w_i \hat\lambda_i`, the example sites' natural parameters summed in
        the family's format (:math:`w_i = 1` by default).

        :param family: the posterior's family.
        :param weights: optional ``(N,)`` weights.
        """

    def prior_natural(self, family) -> Any:
        r""":math:`\lambda_0`, the prior site's natural parameters in the family's format."""

    def scale(self, alpha) -> SiteTable:
        r"""Every example site raised to the power ``alpha`` (tempering), :math:`\alpha \hat\lambda_i`;
        the prior site is unchanged.

        :param alpha: a scalar.
        """

    def values(self, family, point) -> tuple[Any, Any]:
        r"""Every example site and the prior site at ``point``: the natural-parameter form
        :math:`\hat\ell_i(x) = -\langle\hat\lambda_i, T(x)\rangle` up to a constant per site (which
        cancels in every density ratio; a table chooses the constant that evaluates accurately, e.g.
        the Gaussian sites centred at the means they were computed at).

        :param family: the posterior's family.
        :param point: a point in the family's coordinates (:meth:`Posterior.model_point
            <numpyro_pc.protocols.posterior.Posterior.model_point>` maps it to the model's).
        :return: ``(N,)`` values and the prior site's value.
        """

    def expected_values(self, family, q) -> tuple[Any, Any]:
        r""":math:`E_q[\hat\ell_i]` for every example site and the prior site in natural-parameter form
        (no constant) under ``q``, a member of ``family`` (:attr:`Posterior.q <numpyro_pc.protocols.posterior.Posterior.q>`).

        :return: ``(N,)`` values and the prior site's value.
        """

    def log_normaliser(self, family) -> Any:
        r""":math:`\log\int \prod_{i=0}^N e^{-\hat\ell_i}`, the log-partition :math:`A(\lambda_0 + \sum_i
        \hat\lambda_i)` of the sites' product (families with
        :class:`~numpyro_pc.protocols.capabilities.SiteDivision`)."""

    def mismatch(self, fresh: SiteTable, family, q, shared_jacobian: bool = False) -> dict:
        r"""How stale each of these sites is: the standard deviation under ``q`` of the log-ratio of
        ``fresh`` (the same examples' sites recomputed at ``q``) to the stored site, as
        ``{"magnitude": (N,), <parts>}`` — the Gaussian tables add ``gradient`` and ``curvature``
        parts, a product's ``by_site``.

        :param bool shared_jacobian: the model's distribution parameters are affine in the latents
            (a Gaussian table's shortcut).
        """

    def arrays(self) -> dict[str, jax.Array]:
        """``{name: array}`` of the table as a saved posterior holds it."""

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, jax.Array], **static) -> SiteTable:
        """The table from :meth:`arrays`' output and the static description the arrays do not carry
        (the Gaussian table's ``storage``)."""
