r"""Diagnostics of adaptation: KL, information gain and correction magnitude.

Information gain (paper eq. ``knowledge_gap``). With both posteriors in dual form,
``q ∝ Π_i exp(−ℓ̂_i)``, the log-ratio of new to old is a sum of site differences, so

.. math::

    KL(q_{new}\|q_{old}) = \underbrace{-\sum_{i\in new\setminus old} E_{q_{new}}[\hat\ell_i^{new}]}_{\text{new data}}
      \underbrace{-\sum_{i\in new\cap old} E_{q_{new}}[\hat\ell_i^{new} - \hat\ell_i^{old}]}_{\text{correction}}
      + \underbrace{\sum_{i\in old\setminus new} E_{q_{new}}[\hat\ell_i^{old}]}_{\text{removed}}
      + \log\frac{Z_{old}}{Z_{new}} .

(The paper writes the correction expectation under ``q_t``; the identity holds with
``q_{t+1}``, which is what is computed here and checked in the tests.) Each site is taken in
its natural-parameter form :math:`\hat\ell_i = -\langle\hat\lambda_i, T\rangle`, without an
additive constant, so that ``Z = exp(A(λ))`` and a site that is exact — the same factor
whatever ``q`` it was computed at — contributes no correction (with the constant of a
second-order expansion at ``m_i`` it would, by an amount that means nothing).

Correction magnitude (paper eq. ``nat_grad_mismatch``): the mismatch between a fresh site
``λ̂_i(q)`` and a stale one, measured in the Fisher metric of ``q`` — the standard
deviation under ``q`` of the log-ratio of the two site factors:

.. math::

    \|\Delta\lambda_i\|_{q} = \sqrt{\delta g_i^\top \Sigma\, \delta g_i + \tfrac12 \operatorname{tr}((\delta H_i \Sigma)^2)},
    \quad \delta g_i = \hat g_i(q) - \nabla\hat\ell_i^{stale}(m),\; \delta H_i = \hat H_i(q) - \hat H_i^{stale}.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.errors import IncompatiblePosteriorsError, UnsupportedGuideError
from numpyro_pc.model.rows import positions
from numpyro_pc.protocols.capabilities import SiteDivision, require
from numpyro_pc.protocols.posterior import Posterior, require_posterior
from numpyro_pc.sites.cached import site_mismatch
from numpyro_pc.deprecation import warn_renamed

__all__ = ["kl", "information_gain", "correction_magnitude", "site_mismatch", "expected_site_values",
           "log_normaliser", "count_compilations"]


def kl(q, p) -> jax.Array:
    """``KL(q ‖ p)`` between two :class:`~numpyro_pc.DualPosterior` of the same model and family."""
    return q.kl(p)


def expected_site_values(sites, mean, cov) -> tuple[jax.Array, jax.Array]:
    """Deprecated: ``sites.expected_values(family, q)`` (:meth:`~numpyro_pc.protocols.sites.SiteTable.expected_values`),
    which every family's site table answers; this name is removed in the next release."""
    warn_renamed("pc.diagnostics.expected_site_values is deprecated: use post.sites.expected_values(post.family, "
                 "post.q), defined for every family")
    return sites.expected_values_at(mean, cov)


def log_normaliser(sites, family) -> jax.Array:
    """``log ∫ Π_i exp(−ℓ̂_i)``, the log-partition of the prior and example sites' product
    (:meth:`~numpyro_pc.protocols.sites.SiteTable.log_normaliser`)."""
    return sites.log_normaliser(family)


def information_gain(old, new) -> dict[str, float]:
    r"""Decompose ``KL(new ‖ old)`` into new-data, correction, removed and normaliser terms.

    One formula for every family with :class:`~numpyro_pc.protocols.capabilities.SiteDivision`: each site in
    natural-parameter form, :math:`\hat\ell_i = -\langle\hat\lambda_i, T\rangle`, has
    :math:`E_{q_{new}}[\hat\ell_i] = -\langle\hat\lambda_i, \mu_{new}\rangle`
    (:meth:`~numpyro_pc.protocols.sites.SiteTable.expected_values`; for a product's sites
    :math:`\langle g_i, \mu_{new}\rangle`), and :math:`\log Z` is the log-partition of the sites'
    product (:meth:`~numpyro_pc.protocols.sites.SiteTable.log_normaliser`). New examples' sites count
    as new data, deleted ones' as removed, and the change of the common examples' and the prior's
    sites (zero for a conjugate-form prior and exact sites) as correction.

    :param old: the posterior before the adaptation (same model and family as ``new``).
    :param new: the posterior after it.
    :return: dict with ``kl`` (closed form), ``new_data``, ``correction``, ``removed``,
        ``log_normaliser_ratio`` and ``identity_error`` (sum of the parts minus ``kl``: the
        dual-form residuals of both posteriors, so ``~tol``).
    :raises MissingCapabilityError: for a family without cavities (isotropic: its sites carry no curvature;
        low-rank: its precision is a projection of the site sum); before this release the isotropic
        refusal was an ``InvalidOptionError``.
    :raises IncompatiblePosteriorsError: posteriors of different models (model objects) or families, or
        ``new`` not a posterior.
    :raises UnsupportedGuideError: ``old`` not a posterior.
    """
    if not isinstance(old, Posterior):
        raise UnsupportedGuideError(f"pc.information_gain needs dual-form posteriors (from pc.fit or pc.dual_form); "
                                    f"found {type(old).__name__}")
    old.check_comparable(new, "pc.information_gain")
    if new.spec.model is not old.spec.model:
        raise IncompatiblePosteriorsError("pc.information_gain needs two posteriors of one model (the same model "
                                          "object): the sites of another model's posterior are other losses, so "
                                          "their differences are not a correction")
    require(new.family, SiteDivision, "pc.information_gain")
    family = new.family
    with jax.enable_x64(jnp.result_type(*jax.tree.leaves(new.q)) == jnp.float64):
        v_new, p_new = new.sites.expected_values(family, new.q)
        v_old, p_old = old.sites.expected_values(family, new.q)  # the old sites, under the new q
        # natural parameters no site holds (a weighted correction's offset) count with the prior's term
        p_new, p_old = p_new + _offset_value(new, new.q), p_old + _offset_value(old, new.q)
        old_ids, new_ids = np.asarray(old.sites.ids), np.asarray(new.sites.ids)
        common = np.intersect1d(old_ids, new_ids)
        rows_new, rows_old = positions(new_ids, common), positions(old_ids, common)
        new_data = -float(jnp.sum(v_new[~np.isin(new_ids, old_ids)]))
        correction = -float(jnp.sum(v_new[rows_new]) - jnp.sum(v_old[rows_old]) + p_new - p_old)
        removed = float(jnp.sum(v_old[~np.isin(old_ids, new_ids)]))
        ratio = float(_log_normaliser(old) - _log_normaliser(new))
        total = float(new.kl(old))
    parts = new_data + correction + removed + ratio
    return dict(kl=total, new_data=new_data, correction=correction, removed=removed, log_normaliser_ratio=ratio,
                identity_error=parts - total)


def _offset_value(post, q) -> jax.Array | float:
    r""":math:`E_q[\hat\ell_o]` of the natural parameters ``post.offset`` that no site holds, as a site in
    natural form (:math:`\hat\ell_o(z) = -h_o^\top z + \tfrac12 z^\top P_o z`): 0 without an offset."""
    offset = getattr(post, "offset", None)
    if offset is None:
        return 0.0
    mean, cov = q.mean, post.family.dense_covariance(q)
    precision = offset.precision if jnp.ndim(offset.precision) == 2 else jnp.diag(offset.precision)
    return -offset.linear @ mean + 0.5 * (mean @ precision @ mean + jnp.sum(precision * cov))


def _log_normaliser(post) -> jax.Array:
    """The log-partition of the product of ``post``'s sites and of any natural parameters no site holds."""
    offset = getattr(post, "offset", None)
    if offset is None:
        return post.sites.log_normaliser(post.family)
    return post.sites.log_normaliser(post.family, offset)


def correction_magnitude(post, *args, **kwargs) -> dict:
    r"""Interference map: how much each retained past example's site would go stale under new data.

    The new batch (``args``/``kwargs`` as for the model) is added without correction (VCL);
    at that posterior the fresh site of every retained past example is compared with its
    stored site (:meth:`~numpyro_pc.protocols.sites.SiteTable.mismatch`): the standard deviation
    under the VCL posterior of the log-ratio of the fresh to the stale site. For the Gaussian
    families it is the Fisher-metric norm of :func:`site_mismatch` (``gradient`` and ``curvature``
    parts); for a product, whose log-ratio is :math:`\langle \delta g_i, T(x)\rangle`, it is
    :math:`\sqrt{\delta g_i^\top F(\lambda)\, \delta g_i}` (Fisher–vector products, never ``F``
    itself); ``F`` is block diagonal, so the squares add over the latent sites (``by_site``).

    :param post: a dual-form posterior with retained data.
    :return: dict with ``ids``, ``magnitude`` (per example), ``total`` (sum of magnitudes),
        and ``gradient`` and ``curvature`` parts (Gaussian) or ``by_site`` parts
        (exponential-family product).
    """
    require_posterior(post, "pc.correction_magnitude")
    vcl = post.update(*args, correction="none", **kwargs)
    with jax.enable_x64(jnp.result_type(*jax.tree.leaves(post.q)) == jnp.float64):
        ids = np.asarray(post.data_ids)
        stale = post.sites.take(positions(post.sites.ids, ids))
        parts = stale.mismatch(post.recompute_sites(vcl.q), post.family, vcl.q, post.spec.affine)
        total = parts.pop("magnitude")
    return dict(ids=ids, magnitude=total, total=float(np.sum(total)), **parts)


class count_compilations:
    """Context manager counting the XLA programs compiled inside it.

    A stream of updates whose batches stay inside warm buckets should compile nothing;
    use this to check that your own loop (data slicing included) does not recompile::

        with pc.diagnostics.count_compilations() as compiled:
            post = post.update(X_new, y_new)
        print(compiled.count)

    :ivar int count: compilations seen so far.
    :ivar list names: the compiled functions' names, in order (e.g. to tell an expensive
        program from the tiny ones eager array operations compile for new shapes).
    """

    def __init__(self):
        self.count = 0
        self.names = []

    def _listen(self, event, seconds, **kwargs) -> None:
        if "backend_compile" in event:
            self.count += 1
            self.names.append(str(kwargs.get("fun_name", "")))

    def __enter__(self) -> count_compilations:
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listen)
