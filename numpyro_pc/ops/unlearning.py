r"""Deleting examples from a dual-form posterior (unlearning and influence), paper §3.2; docs/adapting.md, "Deleting data".

Removing a set ``J`` solves

.. math::

    q_{t\setminus J} = \arg\min_q\; -\sum_{j\in J} E_q[\hat\ell_{j|t}] + KL(q\|q_t)
        + \sum_{i\in C,\,i\notin J} E_q[\ell_i - \hat\ell_{i|t}]

(paper eq. ``postcorr_influence``). The methods differ in how they treat the correction:

``"remove_site"``
    ignore it: ``λ_{t∖J} = λ_t − Σ_J λ̂_j`` — the memory-perturbation equation (Nickl et al.
    2023), i.e. ``S_{∖J} = S_t − Σ_J Ĥ_j`` and ``m_{∖J} = m_t + S_{∖J}⁻¹ Σ_J ĝ_j`` for sites
    fresh at ``q_t``;
``"influence"``
    the delta method with ``S_t`` replaced by the Hessian at the mean (paper eq.
    ``if_deriv``): ``m_{∖J} = m_t + H_{∖J}⁻¹ Σ_J ∇ℓ_j(m_t)``;
``"tracin"``
    the isotropic family: ``m_{∖J} = m_t + Σ_J ∇ℓ_j(m_t)`` (paper eq. ``tracin_deriv``);
``"corrected"``
    keep the correction over every retained example (exact when all data is retained);
``"retrain"``
    solve the problem without ``J`` from scratch — the oracle.

A result whose precision is not positive definite (stale sites, leverage near one) is never
returned silently: it raises :class:`~numpyro_pc.errors.NotPositiveDefiniteError`, or with
``damping=True`` the removal is scaled by the largest ``α ∈ (0, 1]`` that keeps it positive
definite, reported in ``record["damping"]``.
"""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.dual.base import DualPosteriorBase, RowSelection
from numpyro_pc.errors import InvalidOptionError, NotPositiveDefiniteError, UnknownExampleError
from numpyro_pc.families.registry import DiagonalGaussian, Gaussian, GaussianNatural, add_site, remove_site
from numpyro_pc.model.rows import as_ids, bucket_size, pad_to_bucket, positions, stand_in_row, take_data, to_device
from numpyro_pc.options import is_choice
from numpyro_pc.protocols.capabilities import SiteSum, capability, require
from numpyro_pc.protocols.posterior import provides
from numpyro_pc.protocols.records import DeleteInfo
from numpyro_pc.sites.expectations import get_rule
from numpyro_pc.sites.gaussian import compute_sites
from numpyro_pc.solvers.fixed_point import largest_inside_fraction
from numpyro_pc.solvers.gaussian import default_tol, solve
from numpyro_pc.solvers.site_problem import SiteProblem

__all__ = ["METHODS", "APPROXIMATE_METHODS", "delete"]

METHODS = ("remove_site", "influence", "tracin", "corrected", "retrain")
APPROXIMATE_METHODS = ("remove_site", "influence", "tracin")  # the retained examples' sites are not recomputed


def _check_ids(post, ids) -> tuple[np.ndarray, np.ndarray]:
    """Unique ids to delete and their site rows (raises for deleted or unknown ids)."""
    ids = as_ids(ids)
    dead = sorted(set(ids.tolist()) & set(post.tombstones))
    if dead:
        raise UnknownExampleError(f"example id(s) {dead[:10]} were already deleted")
    return ids, positions(post.ids, ids)


def _delta_terms(post, rows) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Delta-method gradients of the examples at ``rows`` and Hessian sums at the mean.

    :return: ``(Σ_rows ∇ℓ_j(m), H_rows, H_all)`` with ``H_all`` the prior plus all
        retained examples; computed by the jitted site machinery with diagonal storage, so
        per-example ``d × d`` Hessians are summed chunk by chunk, never stored.
    """
    q = Gaussian(post.state.mean, jnp.ones_like(post.state.mean))
    options = dict(curvature="hessian", storage="diag", need_hessian_sum=True)
    subset = take_data(post.data, rows)
    sub, sub_sums = compute_sites(replace(post.spec, num_examples=len(rows)), subset, DiagonalGaussian(), q,
                                  get_rule("delta"), **options)
    everything, sums = compute_sites(post.spec, post.data, DiagonalGaussian(), q, get_rule("delta"), **options)
    return jnp.sum(sub.grad, 0), sub_sums.hessian, sums.hessian + everything.prior_curvature_dense()


@partial(jax.jit, static_argnums=0)
def _selected_natural_sum(family, sites, rows, weights) -> GaussianNatural:
    return sites.take(rows).natural_sum(family, weights)


def _removed_natural(post, rows) -> GaussianNatural:
    """``Σ_{j ∈ rows} λ̂_j`` gathered from the (possibly deferred) sites inside one jitted call.

    ``rows`` is padded to a bucket (:func:`~numpyro_pc.model.rows.bucket_size`) with zero
    weights so that deleting different numbers of examples reuses a few compiled shapes.
    """
    raw = post.raw_sites
    source, rows = (raw.source, raw.rows[rows]) if isinstance(raw, RowSelection) else (raw, np.asarray(rows))
    size = bucket_size(rows.size)
    padded = np.zeros(size, np.int64)
    padded[:rows.size] = rows
    weights = np.zeros(size, np.asarray(source.grad).dtype)
    weights[:rows.size] = 1.0
    return _selected_natural_sum(post.family, source, jnp.asarray(padded), jnp.asarray(weights))


@partial(jax.jit, static_argnums=0)
def _removed(family, state, removal, alpha) -> tuple[jax.Array, Gaussian]:
    """``q`` with ``α·removal`` taken out of its natural parameters, and whether that is positive definite."""
    natural = remove_site(family.natural(state), removal, alpha)
    return family.is_positive_definite(natural.precision), family.from_natural(natural)


@partial(jax.jit, static_argnums=0)
def _assess(family, q, previous) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Positive definiteness, finiteness of the mean, and ``KL(q ‖ previous)`` in one compiled call."""
    return family.is_positive_definite(q.precision), jnp.all(jnp.isfinite(q.mean)), family.kl(q, previous)


def _remove(post, removal, damping, what) -> tuple[Gaussian, float]:
    family = post.family
    alpha = 1.0
    positive, q = _removed(family, post.state, removal, alpha)
    if not bool(positive):
        if not damping:
            raise NotPositiveDefiniteError(
                f"{what} leaves a precision that is not positive definite (the removed sites carry more "
                "curvature than the posterior can lose); pass damping=True to shrink the removal, or use "
                "method='corrected'/'retrain'."
            )
        natural = family.natural(post.state)
        alpha = largest_inside_fraction(
            lambda a: bool(family.is_positive_definite(remove_site(natural, removal, a).precision)))
        if alpha <= 0.0:
            raise NotPositiveDefiniteError(f"{what}: no damping keeps the precision positive definite")
        _, q = _removed(family, post.state, removal, alpha)
    return q, alpha


def _live_rows(post, data_keep, live) -> tuple:
    """``(data, weights, ids)`` of the examples a corrected deletion or retrain recomputes, padded to a bucket.

    With no example left the problem is the prior (and any frozen sites) alone: it is solved on
    one row of the deleted data at weight 0, since the site machinery traces the model on a row.
    """
    dtype = post.state.mean.dtype
    if live.size:
        return pad_to_bucket(take_data(post.data, data_keep), None, live, dtype)
    row = take_data(post.data, np.arange(1)) if post.num_retained else stand_in_row(post.data)
    return pad_to_bucket(row, np.zeros(1, dtype), np.array([-1]), dtype)


@provides("delete")
def delete(post, ids, method="remove_site", damping=False, tol=None, max_iters=None,
           raise_on_failure=True) -> DualPosteriorBase:
    """Delete examples (see :meth:`numpyro_pc.DualPosterior.delete`)."""
    if not is_choice(method, METHODS):
        raise InvalidOptionError(f"unknown deletion method {method!r}; expected one of {METHODS}")
    start = time.perf_counter()
    ids = as_ids(ids)  # once: an iterator of ids is consumed by reading it
    if ids.size == 0:  # nothing to delete: the same posterior, with a record saying so
        return post.evolve(record=DeleteInfo(method=method, deleted=0, damping=1.0, seconds=0.0, kl_to_previous=0.0))
    ids, site_rows = _check_ids(post, ids)
    family = post.family
    keep_rows = np.delete(np.arange(post.num_examples), site_rows)
    retained = np.asarray(post.data_ids)
    data_keep = np.flatnonzero(~np.isin(retained, ids))
    alpha, history = 1.0, ()

    if method in ("remove_site", "corrected") and capability(family, SiteSum) is None:
        lacking = np.setdiff1d(np.asarray(post.sites.ids)[keep_rows], retained)
        if method == "remove_site" or lacking.size:
            require(family, SiteSum, f"delete(method={method!r}) (dividing sites out of q)",
                    "Use method='corrected' with the data of every remaining example kept (every site "
                    "recomputed), or method='retrain'.")
    if method == "remove_site" and not keep_rows.size and post.site_identity_residual <= default_tol(
            post.state.mean.dtype):
        # nothing remains but the prior's site (and the offset): taken as it is, exactly, rather than as
        # λ_t − Σ_i λ̂_i, a difference of large sums that carries their rounding (equal to the tolerance
        # when q is the product of its sites; otherwise the subtraction below says what q holds)
        natural = post.sites.prior_natural(family)
        q = family.from_natural(natural if post.offset is None else add_site(natural, post.offset))
        sites = RowSelection.of(post.raw_sites, keep_rows)
    elif method == "remove_site":
        q, alpha = _remove(post, _removed_natural(post, site_rows), damping, "site removal")
        sites = RowSelection.of(post.raw_sites, keep_rows)
    elif method in ("influence", "tracin"):
        if not keep_rows.size:
            raise InvalidOptionError(
                f"method={method!r} cannot delete every example ({ids.size} of {post.num_examples}): it is a "
                "first-order step from the current posterior, exact only when the deleted examples change little, "
                "and a posterior with no data left is the prior, as far from q_t as the data moved it. Use "
                "method='remove_site', 'corrected' or 'retrain', which return the prior-only posterior.")
        rows = positions(retained, ids, "example with retained data (influence needs the data of the deleted ids)")
        g, h_gone, h_all = _delta_terms(post, rows)
        if method == "tracin":
            q = Gaussian(post.state.mean + g, post.state.precision)
        else:
            h_rest = h_all - h_gone
            chol = jnp.linalg.cholesky(h_rest)
            if not bool(jnp.all(jnp.isfinite(chol))):
                raise NotPositiveDefiniteError("the Hessian without the deleted examples is not positive definite")
            mean = post.state.mean + jax.scipy.linalg.cho_solve((chol, True), g)
            precision = family.keep_fixed(post.state.precision, family.project_curvature(h_rest))
            q = Gaussian(mean, precision)
        sites = RowSelection.of(post.raw_sites, keep_rows)
    else:
        if method == "retrain":
            lacking = np.setdiff1d(np.asarray(post.sites.ids)[keep_rows], retained)
            if lacking.size:
                raise UnknownExampleError(f"retrain needs the data of every remaining example; {lacking.size} "
                                          "example(s) had their data dropped")
        live = retained[data_keep]
        live_rows = positions(post.sites.ids, live)
        frozen_rows = np.setdiff1d(keep_rows, live_rows)
        if method == "corrected" and not frozen_rows.size:
            # every remaining site is recomputed: by the dual form λ_t = offset + λ̂_0 + Σ_i λ̂_i the
            # fixed factor is the offset alone (taken so, not as a difference of large sums; see
            # correction._cavity)
            base = post.offset
        elif method == "corrected":
            lam = family.natural(post.state)
            natural = remove_site(lam, post.sites.take(np.concatenate([site_rows, live_rows])).natural_sum(family))
            base = remove_site(natural, post.sites.prior_removal(family, lam))
        else:
            base = post.sites.take(frozen_rows).natural_sum(family) if frozen_rows.size else None
        # padded to a bucket (weight 0): deletions one by one reuse the compiled solver
        data, weights, padded_ids = _live_rows(post, data_keep, live)
        spec = replace(post.spec, num_examples=int(padded_ids.size))
        problem = SiteProblem(spec, data, family, post.rule, post.curvature, post.sites.storage, post.chunk_size,
                              jnp.asarray(padded_ids), base, True, weights)
        # the oracle starts from q_t too: the fixed point does not depend on the start
        q, fresh, history = solve(problem, post.state, tol=tol, max_iters=max_iters, raise_on_failure=raise_on_failure)
        fresh = fresh.take(np.arange(live.size))
        sites = post.sites.take(frozen_rows).concat(fresh) if frozen_rows.size else fresh
    positive, finite, kl_to_previous = _assess(family, q, post.state)
    if not bool(positive):
        family.check_positive_definite(q.precision, f"posterior after deletion ({method})")  # raises
    if not bool(finite):
        raise NotPositiveDefiniteError(f"deletion ({method}) produced a non-finite mean")
    record = DeleteInfo(method=method, deleted=int(ids.size), damping=alpha, seconds=time.perf_counter() - start,
                        kl_to_previous=float(kl_to_previous), iterations=len(history) - 1 if history else None)
    return post.evolve(spec=replace(post.spec, num_examples=int(data_keep.size)),
                         data=RowSelection.of(post.raw_data, data_keep), data_ids=to_device(retained[data_keep]), state=q,
                         sites=sites, history=history, tombstones=post.tombstones + tuple(int(i) for i in ids),
                         record=record,
                         # the retained sites stay q_t's after an approximate method: post.residual then measures
                         # this deletion (a frozen site without data is never recomputed, so it does not count)
                         stale_sites=method in APPROXIMATE_METHODS)

