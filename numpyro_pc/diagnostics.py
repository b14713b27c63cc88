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

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from .capabilities import SiteDivision, require
from .batches import bind_batch
from . import ef_sites
from .dual import DualPosteriorBase, by_posterior_kind
from .ef_posterior import EFPosterior
from .errors import IncompatiblePosteriorsError
from .rows import positions
from .sites import compute_sites

__all__ = ["kl", "information_gain", "correction_magnitude", "site_mismatch", "expected_site_values",
           "log_normaliser", "count_compilations"]


def kl(q, p) -> jax.Array:
    """``KL(q ‖ p)`` between two :class:`~numpyro_pc.DualPosterior` of the same model and family."""
    return q.kl(p)


def expected_site_values(sites, mean, cov):
    """``E_q[ℓ̂_i]`` for every example site and the prior site under ``N(mean, cov)``, each site in its
    natural-parameter form ``ℓ̂_i(z) = −⟨λ̂_i, T(z)⟩ = zᵀ(ĝ_i − Ĥ_i m_i) + ½ zᵀĤ_i z`` (no constant:
    a site recomputed at another point but unchanged as a factor keeps its value)."""
    refs = sites.refs()
    diff = mean[None, :] - refs
    trace, quad = sites.curv.trace_quad(cov, diff)
    offsets = 0.5 * jnp.sum(refs * sites.curvature_matvec(refs), 1)
    values = sites.dense_grad() @ mean + 0.5 * (quad + trace) - offsets
    p_diff = mean - sites.prior_ref
    prior_curvature = sites.prior_curvature_dense()
    prior = sites.prior_grad @ mean + 0.5 * (p_diff @ prior_curvature @ p_diff + jnp.sum(prior_curvature * cov)
                                             - sites.prior_ref @ prior_curvature @ sites.prior_ref)
    return values, prior


def log_normaliser(sites, family):
    """``log ∫ Π_i exp(−ℓ̂_i(z)) dz`` over the prior and example sites in natural-parameter form:
    the Gaussian log-partition ``A(λ)`` of ``λ = Σ_i λ̂_i``."""
    nat = sites.natural_sum(family)
    prior = sites.prior_natural(family)
    precision = _dense(family, nat.precision + prior.precision)
    linear = nat.linear + prior.linear
    chol = jnp.linalg.cholesky(precision)
    white = jax.scipy.linalg.solve_triangular(chol, linear, lower=True)
    d = linear.shape[0]
    return 0.5 * white @ white + 0.5 * d * math.log(2 * math.pi) - jnp.sum(jnp.log(jnp.diag(chol)))


def _dense(family, precision):
    return precision if jnp.ndim(precision) == 2 else jnp.diag(precision)


def information_gain(old, new) -> dict[str, float]:
    r"""Decompose ``KL(new ‖ old)`` into new-data, correction, removed and normaliser terms.

    For an :class:`~numpyro_pc.EFPosterior` the sites are linear in the statistics,
    :math:`\hat\ell_i = \langle g_i, T\rangle`, so :math:`E_{q_{new}}[\hat\ell_i] = \langle g_i,
    \mu_{new}\rangle` and :math:`\log Z = A(\lambda)`; the prior term's change (zero for a
    conjugate-form prior) counts as correction.

    :param old: the posterior before the adaptation (same model and family as ``new``).
    :param new: the posterior after it.
    :return: dict with ``kl`` (closed form), ``new_data``, ``correction``, ``removed``,
        ``log_normaliser_ratio`` and ``identity_error`` (sum of the parts minus ``kl``: the
        dual-form residuals of both posteriors, so ``~tol``).
    :raises MissingCapabilityError: for a family without cavities (isotropic: its sites carry no curvature;
        low-rank: its precision is a projection of the site sum); before this release the isotropic
        refusal was an ``InvalidOptionError``.
    :raises IncompatiblePosteriorsError: posteriors of different kinds or families.
    """
    if _information_gain.dispatch(type(old)) is not _information_gain.dispatch(type(new)):
        raise IncompatiblePosteriorsError(f"pc.information_gain compares two posteriors of one kind; found "
                                          f"{type(old).__name__} and {type(new).__name__}")
    return _information_gain(new, old)


_information_gain = by_posterior_kind("pc.information_gain")


@_information_gain.register
def _ef_information_gain(new: EFPosterior, old):
    if new.family != old.family or new.spec.model is not old.spec.model:
        raise IncompatiblePosteriorsError("pc.information_gain needs posteriors of one model in one family; found "
                                          f"{new.family.names} and {old.family.names}")
    with jax.enable_x64(new.natural.dtype == jnp.float64):
        family = new.family
        mu = family.expectation(new.natural)
        v_new, v_old = np.asarray(new.state.grads @ mu), np.asarray(old.state.grads @ mu)
        old_ids, new_ids = np.asarray(old.ids), np.asarray(new.ids)
        in_old, in_new = np.isin(new_ids, old_ids), np.isin(old_ids, new_ids)
        common = np.intersect1d(old_ids, new_ids)
        rows_new, rows_old = positions(new_ids, common), positions(old_ids, common)
        new_data = -float(np.sum(v_new[~in_old]))
        prior_change = float(jnp.dot(new.state.prior - old.state.prior, mu))
        correction = -float(np.sum(v_new[rows_new]) - np.sum(v_old[rows_old])) - prior_change
        removed = float(np.sum(v_old[~in_new]))
        ratio = float(family.log_normalizer(old.natural) - family.log_normalizer(new.natural))
        total = float(family.kl(new.natural, old.natural))
    parts = new_data + correction + removed + ratio
    return dict(kl=total, new_data=new_data, correction=correction, removed=removed, log_normaliser_ratio=ratio,
                identity_error=parts - total)


@_information_gain.register
def _gaussian_information_gain(new: DualPosteriorBase, old):
    require(new.family, SiteDivision, "pc.information_gain")
    require(old.family, SiteDivision, "pc.information_gain")
    with jax.enable_x64(new.state.mean.dtype == jnp.float64):
        mean, cov = new.state.mean, new.covariance
        old_ids, new_ids = np.asarray(old.sites.ids), np.asarray(new.sites.ids)
        common = np.intersect1d(old_ids, new_ids)
        v_new, p_new = expected_site_values(new.sites, mean, cov)
        v_old, p_old = expected_site_values(old.sites, mean, cov)
        in_old = np.isin(new_ids, old_ids)
        new_data = -float(jnp.sum(v_new[~in_old]))
        rows_new, rows_old = positions(new_ids, common), positions(old_ids, common)
        correction = -float(jnp.sum(v_new[rows_new]) - jnp.sum(v_old[rows_old]) + p_new - p_old)
        removed = float(jnp.sum(v_old[~np.isin(old_ids, new_ids)]))
        ratio = float(log_normaliser(old.sites, old.family) - log_normaliser(new.sites, new.family))
        total = float(new.kl(old))
    parts = new_data + correction + removed + ratio
    return dict(kl=total, new_data=new_data, correction=correction, removed=removed, log_normaliser_ratio=ratio,
                identity_error=parts - total)


@partial(jax.jit, static_argnames=("family", "shared_jacobian"))
def site_mismatch(stale, fresh, q, family, shared_jacobian=False):
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
    curv_part = fresh.curv.mismatch(stale.curv, cov_rows, shared_jacobian)
    return jnp.sqrt(grad_part + curv_part), jnp.sqrt(grad_part), jnp.sqrt(curv_part)


def correction_magnitude(post, *args, **kwargs) -> dict:
    r"""Interference map: how much each retained past example's site would go stale under new data.

    The new batch (``args``/``kwargs`` as for the model) is added without correction (VCL);
    at that posterior the fresh site of every retained past example is compared with its
    stored site (:func:`site_mismatch`). For an :class:`~numpyro_pc.EFPosterior` the log-ratio
    of a fresh to a stale site is :math:`\langle \delta g_i, T(x)\rangle`, whose standard
    deviation under the VCL posterior is :math:`\sqrt{\delta g_i^\top F(\lambda)\, \delta g_i}`
    (Fisher–vector products, never ``F`` itself); ``F`` is block diagonal, so the squares add
    over the latent sites (``by_site``).

    :param post: a dual-form posterior with retained data.
    :return: dict with ``ids``, ``magnitude`` (per example), ``total`` (sum of magnitudes),
        and ``gradient`` and ``curvature`` parts (Gaussian) or ``by_site`` parts
        (exponential-family product).
    """
    return _correction_magnitude(post, args, kwargs)


_correction_magnitude = by_posterior_kind("pc.correction_magnitude")


@_correction_magnitude.register
def _ef_correction_magnitude(post: EFPosterior, args, kwargs):
    vcl = post.update(*args, correction="none", **kwargs)
    family = vcl.family
    with jax.enable_x64(post.natural.dtype == jnp.float64):
        fresh = ef_sites.compute_sites(post.config, vcl.natural, post.data).grads  # the config is sized to the data
        delta = fresh - post.state.grads
        fisher_times = jax.vmap(lambda v: jax.jvp(family.expectation, (vcl.natural,), (v,))[1])
        weighted = delta * fisher_times(delta)  # δg ∘ F δg: F is block diagonal over the factors
        by_site = {f.site: np.sqrt(np.maximum(np.asarray(jnp.sum(part, 1)), 0.0))
                   for f, part in zip(family.factors, family.split(weighted))}
        total = np.sqrt(np.maximum(np.asarray(jnp.sum(weighted, 1)), 0.0))
    return dict(ids=np.asarray(post.ids), magnitude=total, by_site=by_site, total=float(np.sum(total)))


@_correction_magnitude.register
def _gaussian_correction_magnitude(post: DualPosteriorBase, args, kwargs):
    bind_batch(post, args, kwargs)
    vcl = post.update(*args, correction="none", **kwargs)
    with jax.enable_x64(post.state.mean.dtype == jnp.float64):
        ids = np.asarray(post.data_ids)
        stale = post.sites.take(positions(post.sites.ids, ids))
        fresh, _ = compute_sites(post.spec, post.data, post.family, vcl.state, post.rule, curvature=post.curvature,
                                 storage=post.sites.storage, chunk_size=post.chunk_size, ids=jnp.asarray(ids))
        total, grad, curv = site_mismatch(stale, fresh, vcl.state, post.family, post.spec.affine)
    return dict(ids=ids, magnitude=np.asarray(total), gradient=np.asarray(grad), curvature=np.asarray(curv),
                total=float(jnp.sum(total)))


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

    def _listen(self, event, seconds, **kwargs):
        if "backend_compile" in event:
            self.count += 1
            self.names.append(str(kwargs.get("fun_name", "")))

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listen)
