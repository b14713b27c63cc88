r"""Adding and deleting examples of an exponential-family posterior (paper §3.1–3.2).

The options are those of the Gaussian posterior's :meth:`~numpyro_pc.DualPosterior.update` and
:meth:`~numpyro_pc.DualPosterior.delete`, read by the same rules (the corrected set :math:`C`
by :func:`numpyro_pc.sites.memory_sets.corrected_ids`); what has no meaning for these families is
refused with the reason.

An update solves :math:`\lambda = c - \sum_{i \in C \cup \text{new}} g_i(\lambda) [- g_0(\lambda)]`
with :math:`c = \lambda_t - \sum_{i\in C} \hat\lambda_{i|t}` (the stale sites of :math:`C` divided
out, eq. ``postcorr``); a deletion by site removal is
:math:`\lambda_{-J} = \lambda + \sum_{j\in J} g_j`, exact for conjugate sites, and
``"corrected"`` then recomputes every retained site (eq. ``corrected_deletion``).
"""

from __future__ import annotations

import warnings
from typing import cast
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.errors import (
    ConvergenceError,
    DataShapeError,
    InvalidOptionError,
    NonFiniteResultError,
    OutOfDomainError,
    UnknownExampleError,
)
from numpyro_pc.model.likelihood import ModelData, bind_model
from numpyro_pc.model.rows import as_ids, check_keep, concat_data, join_rows, positions, retain, take_data, take_rows, to_device
from numpyro_pc.options import MAX_SEED, check_count, check_finite, check_flag, check_solver_options
from numpyro_pc.protocols.posterior import Posterior
from numpyro_pc.protocols.records import DeleteInfo, RefineInfo, UpdateInfo
from numpyro_pc.sites.expfam import EFSites
from numpyro_pc.sites.expfam_table import EFSiteTable, EFState
from numpyro_pc.sites.memory_sets import check_stochastic_options, corrected_ids
from numpyro_pc.solvers.expfam import SolveInfo, blr_solve, bucketed_target, config_rows, solve_every_site
from numpyro_pc.solvers.fixed_point import default_tol, largest_inside_fraction, progress_bar

__all__ = ["update_ef", "delete_ef", "refine_ef", "recompute_rows", "split_frozen", "checked_retained_ids", "solve_with_rows_live", "KPRIOR_REFUSAL",
           "DELETE_METHODS"]

DELETE_METHODS = ("remove_site", "corrected", "retrain")
_WEIGHTED_REFUSAL = ("correction='weighted' rescales a memory set's sites to stand for all retained data; an "
                     "exponential-family posterior stores λ = -g_0 - Σ g_i with no term outside its sites, so the "
                     "scaled part would have nowhere to live. Use correction='memory' (the same memory, unscaled), "
                     "'stochastic' or 'exact'")

KPRIOR_REFUSAL = ("correction='kprior' replaces each memory example's loss by the KL between its old and new "
                   "predictive distributions; what that matching does not re-express of the old sites (the "
                   "linearisation error of paper eq. pred_match_general) is a term outside every site, and an "
                   "exponential-family posterior stores λ = -g_0 - Σ g_i with no such term. Use correction='memory' "
                   "(the memory's true losses), 'stochastic' or 'exact'")


def split_frozen(post: Posterior) -> tuple[np.ndarray, np.ndarray]:
    """``(live, frozen)``: the site rows with retained data (in :attr:`data_ids` order) and the rows
    without (held fixed by every fixed point: :func:`~numpyro_pc.solvers.expfam.fixed_part`)."""
    ids = np.asarray(post.sites.ids)
    if post.num_retained == post.num_examples:  # every site's data, in the sites' order
        return np.arange(ids.size), np.zeros(0, np.int64)
    live = positions(ids, np.asarray(post.data_ids))
    return live, np.setdiff1d(np.arange(ids.size), live)


def checked_retained_ids(retained_ids, held: np.ndarray, data) -> jax.Array | None:
    """The ids of the examples whose data is kept, checked against the sites ``held`` and the data rows:
    fewer than the sites, in the sites' order (what every operation keeps, so that "as many data rows as
    sites" means "aligned"); ``None`` when they are every site's, in order.

    :raises DataShapeError: ids that are not such a subsequence of ``held``, or not one per data row."""
    if retained_ids is None:
        return None
    ids = np.asarray(retained_ids, np.int64).ravel()
    if np.array_equal(ids, held):
        return None
    rows = int(data.per_example[0].shape[0]) if data.per_example else ids.size
    known = bool(np.all(np.isin(ids, held)))
    in_order = known and bool(np.all(np.diff(positions(held, ids)) > 0)) if ids.size > 1 else known
    if rows != ids.size or ids.size >= held.size or not in_order:
        raise DataShapeError(f"the retained data's ids must be fewer than the {held.size} sites' ids, in the sites' "
                             f"order, one per data row ({rows} rows); found {ids.size} id(s), "
                             f"{int(np.sum(~np.isin(ids, held)))} without a site{'' if in_order or not known else ', out of order'}")
    return to_device(ids.astype(np.asarray(held).dtype))


def _check_sites_represent(post: Posterior) -> None:
    """An update keeps the stale sites it does not correct: refuse non-finite ones, warn when the sites
    do not represent the posterior (after a damped removal, a stopped solve), as the Gaussian update does."""
    residual = float(post.site_identity_residual)
    if not np.isfinite(residual):
        raise NonFiniteResultError(f"the posterior's dual-form residual is {residual}: its sites or natural "
                                   "parameters hold non-finite values, so no update can be trusted; refit it")
    if residual > 100 * default_tol(post.natural.dtype):
        warnings.warn(f"updating a posterior whose sites do not add up to it (dual-form residual {residual:.1e}); "
                      "refine() it first so that its sites represent it", RuntimeWarning, stacklevel=4)


def update_ef(post: Posterior, *args, correction: str = "exact", memory=None, selection: str = "random",
              keep="all", seed: int = 0, tol: float | None = None, max_iters: int | None = None,
              progress: bool = False, raise_on_failure: bool = True, batch_fraction: float = 0.1,
              epochs: int | None = None, **kwargs) -> Posterior:
    """Add a batch to an exponential-family posterior (see :meth:`numpyro_pc.dual.expfam.EFPosterior.update`)."""
    check_solver_options(tol, max_iters)
    check_count(seed, "seed", minimum=0, allow_none=False, maximum=MAX_SEED)
    check_flag(progress, "progress")
    check_flag(raise_on_failure, "raise_on_failure")
    check_keep(keep)
    if correction == "weighted":
        raise InvalidOptionError(_WEIGHTED_REFUSAL)
    if correction == "kprior":
        raise InvalidOptionError(KPRIOR_REFUSAL)
    _check_sites_represent(post)
    corrected, _ = corrected_ids(post, correction, memory, selection, seed)
    check_stochastic_options(correction, epochs)
    if correction == "stochastic":
        past = post.num_examples
        updated = _stochastic(post, args, kwargs, batch_fraction, epochs, seed, tol, max_iters, progress,
                              raise_on_failure)
        return _retain(updated, post, np.asarray(updated.ids)[past:], keep, seed)
    spec, new = bind_model(post.config.spec.model, args, kwargs, data_plate=post.config.spec.plate,
                           allow_discrete=True)
    if spec.latent != post.config.spec.latent or spec.observed != post.config.spec.observed:
        raise DataShapeError("the new batch binds the model to other latent or observed sites")
    start = post.next_id  # never an id held or deleted before
    ids = jnp.arange(start, start + spec.num_examples)
    if correction == "exact":
        _, frozen = split_frozen(post)
        data = concat_data(post.data, new)
        solved = solve_every_site(post, data, jnp.concatenate([post.data_ids, ids]), post.natural, tol, max_iters,
                                  raise_on_failure, progress, frozen=post.sites.take(frozen))
        solved = solved.evolve(record=UpdateInfo(**solved.record.solve_fields(), correction="exact",
                                                 corrected=int(post.num_retained), new=int(spec.num_examples)))
        return _retain(solved, post, np.asarray(ids), keep, seed)
    rows = positions(post.ids, corrected) if corrected.size else np.zeros(0, np.int64)
    data_rows = positions(post.data_ids, corrected) if corrected.size else np.zeros(0, np.int64)
    prior_active = correction != "none" and not post.conjugate_prior
    active = ModelData(tuple(join_rows(take_rows(x, data_rows), y) for x, y in zip(post.data.per_example,
                                                                                   new.per_example)), new.shared)
    lam, sites, info = solve_with_rows_live(post, rows, active, prior_active, tol, max_iters, raise_on_failure,
                                             progress)
    added = EFSiteTable(sites.grads[rows.size:], sites.prior if prior_active else post.sites.prior, ids)
    state = EFState(lam, post.sites.with_rows(rows, sites.grads[:rows.size]).concat(added))
    updated = post.evolve(config=config_rows(post.config, post.num_retained + spec.num_examples),
                          data=concat_data(post.data, new), state=state,
                          data_ids=jnp.concatenate([post.data_ids, ids.astype(post.data_ids.dtype)]),
                          record=UpdateInfo(correction=correction, corrected=int(rows.size),
                                            new=int(spec.num_examples), **info._asdict()))
    return _retain(updated, post, np.asarray(ids), keep, seed)


def _retain(updated: Posterior, before: Posterior, new_ids: np.ndarray, keep, seed: int) -> Posterior:
    """``updated`` (holding the data of ``before`` and of the new examples ``new_ids``, in that order) with
    the data ``keep`` retains (:func:`numpyro_pc.model.rows.retain`); the sites of the others stay, frozen."""
    if isinstance(keep, str) and keep == "all":
        return updated
    old = before.num_retained
    rows = np.arange(old)
    new_rows = np.arange(old, old + new_ids.size)
    data, kept = retain(take_data(updated.data, rows), before.data_ids, take_data(updated.data, new_rows), new_ids,
                        keep, int(before.next_id) - len(before.tombstones), seed)
    return updated.evolve(config=config_rows(updated.config, int(kept.size)), data=data,
                          data_ids=to_device(kept.astype(np.asarray(updated.ids).dtype)))


def solve_with_rows_live(post, rows, active, prior_active, tol, max_iters, raise_on_failure, progress=False) -> tuple[jax.Array, EFSites, SolveInfo]:
    r"""The fixed point with the sites at positions ``rows`` (and the prior term when ``prior_active``)
    divided out of ``q`` and solved for again over the ``active`` data, every other site (frozen ones
    included) held:
    :math:`\lambda = c - \sum_{i \in active} g_i(\lambda) [- g_0(\lambda)]`, ``c`` what the held sites leave."""
    const = post.natural - post.sites.take(rows).natural_sum()
    if prior_active:
        const = const + post.sites.prior
    tol = default_tol(const.dtype) if tol is None else tol
    lam, sites, info = blr_solve(bucketed_target(post.config, active, prior_active, const), post.family.in_domain,
                                 post.natural, tol, max_iters, raise_on_failure=raise_on_failure, progress=progress)
    return lam, cast(EFSites, sites), info


def _stochastic(post, args, kwargs, batch_fraction, epochs, seed, tol, max_iters, progress, raise_on_failure) -> Posterior:
    """The ``"prior"`` update, then ``epochs`` passes of block Gauss–Seidel over every example's site."""
    epochs = 1 if epochs is None else epochs
    if isinstance(epochs, (bool, np.bool_)) or not isinstance(epochs, (int, np.integer)) or epochs < 1:
        raise InvalidOptionError(f"the stochastic correction needs epochs, a whole number ≥ 1; got {epochs!r}")
    if isinstance(batch_fraction, (bool, np.bool_)) or not 0.0 < float(batch_fraction) <= 1.0:
        raise InvalidOptionError(f"the stochastic correction needs 0 < batch_fraction ≤ 1; got {batch_fraction!r}")
    past, retained = post.num_examples, post.num_retained
    post = update_ef(post, *args, correction="prior", tol=tol, max_iters=max_iters, raise_on_failure=raise_on_failure,
                     **kwargs)
    rng = np.random.default_rng(seed)
    blocks = int(np.ceil(1.0 / float(batch_fraction)))
    bar = progress_bar(progress, int(epochs) * blocks, "stochastic correction")
    try:
        for _ in range(int(epochs)):
            for rows in np.array_split(rng.permutation(post.num_retained), blocks):
                if not rows.size:  # fewer retained examples than blocks
                    continue
                post = recompute_rows(post, np.sort(rows), tol, max_iters, raise_on_failure)
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return post.evolve(record=UpdateInfo(**post.record.solve_fields(), correction="stochastic",
                                         corrected=retained, new=post.num_examples - past,
                                         batch_fraction=float(batch_fraction), epochs=int(epochs)))


def recompute_rows(post: Posterior, rows: np.ndarray, tol: float | None, max_iters: int | None,
                   raise_on_failure: bool) -> Posterior:
    """The sites of the examples at data rows ``rows`` (and the prior term unless conjugate-form)
    recomputed at the fixed point with every other site held."""
    prior_active = not post.conjugate_prior
    active = take_data(post.data, rows)
    site_rows = positions(post.ids, np.asarray(post.data_ids)[rows])
    lam, sites, info = solve_with_rows_live(post, site_rows, active, prior_active, tol, max_iters,
                                             raise_on_failure)
    table = post.sites.with_rows(site_rows, sites.grads)
    state = EFState(lam, replace(table, prior=sites.prior) if prior_active else table)
    return post.evolve(state=state, record=RefineInfo(**info._asdict()))


def delete_ef(post: Posterior, ids, method: str = "remove_site", damping: bool = False, tol: float | None = None,
              max_iters: int | None = None, raise_on_failure: bool = True) -> Posterior:
    """Remove examples from an exponential-family posterior (see :meth:`numpyro_pc.dual.expfam.EFPosterior.delete`)."""
    check_solver_options(tol, max_iters)
    check_flag(damping, "damping")
    check_flag(raise_on_failure, "raise_on_failure")
    if method in ("influence", "tracin"):
        raise InvalidOptionError(
            f"method={method!r} approximates a deletion by a {'Newton' if method == 'influence' else 'gradient'} "
            "step in a Gaussian's mean; an exponential-family posterior removes the sites exactly in its natural "
            "parameters (λ + Σ g_j). Use 'remove_site', 'corrected' (the retained sites recomputed) or 'retrain'.")
    if not isinstance(method, str) or method not in DELETE_METHODS:
        raise InvalidOptionError(f"method for exponential-family posteriors is 'remove_site', 'corrected' or "
                                 f"'retrain'; got {method!r}")
    wanted = np.asarray(as_ids(ids))
    held = np.asarray(post.ids)
    missing = sorted(set(wanted.tolist()) - set(held.tolist()))
    if missing:
        raise UnknownExampleError(f"example ids {missing[:10]} are not in this posterior")
    drop = np.isin(held, wanted)
    keep = np.flatnonzero(~drop)
    retained = np.asarray(post.data_ids)
    data_keep = np.flatnonzero(~np.isin(retained, wanted))
    tombstones = post.tombstones + tuple(held[drop].tolist())
    removal = post.sites.take(np.flatnonzero(drop)).natural_sum()  # λ̂_J = -Σ_J g_j
    removed = post.natural - removal
    inside = bool(post.family.in_domain(removed))
    data = take_data(post.data, data_keep)
    if method == "remove_site":
        alpha = 1.0
        if not inside:
            if not damping:
                raise OutOfDomainError("removing the sites leaves a non-positive shape parameter "
                                       f"({post.family.describe(removed)}); pass damping=True to shrink the removal, "
                                       "or use method='corrected'")
            alpha = largest_inside_fraction(lambda a: bool(post.family.in_domain(post.natural - a * removal)))
            if alpha <= 0.0:
                raise OutOfDomainError("site removal: no fraction of it keeps every shape parameter positive")
            removed = post.natural - alpha * removal
        state = EFState(removed, post.sites.take(keep))
        return post.evolve(config=config_rows(post.config, int(data_keep.size)), data=data, state=state,
                           data_ids=to_device(retained[data_keep]),
                           record=DeleteInfo(method=method, deleted=int(drop.sum()), damping=alpha),
                           stale_sites=True, tombstones=tombstones)
    frozen = keep[~np.isin(held[keep], retained)]  # remaining sites whose data was dropped
    if method == "retrain" and frozen.size:
        raise UnknownExampleError(f"retrain needs the data of every remaining example; {frozen.size} example(s) had "
                                  "their data dropped (update(keep=...)). Use method='corrected', which recomputes "
                                  "the retained examples' sites and holds the others")
    start = removed if inside else post.natural
    if method == "retrain":
        start = (post.sites.prior_natural() if post.conjugate_prior
                 else post.family.default_natural(post.natural.dtype))
    solved = solve_every_site(post, data, to_device(retained[data_keep]), start, tol, max_iters, raise_on_failure,
                              frozen=post.sites.take(frozen))
    return solved.evolve(record=DeleteInfo(**solved.record.solve_fields(), method=method, deleted=int(drop.sum()),
                                           damping=1.0), tombstones=tombstones)


def refine_ef(post: Posterior, tol: float | None = None, max_iters: int | None = None, step_size: float = 1.0,
              raise_on_failure: bool = True, progress: bool = False) -> Posterior:
    """Every site recomputed at the fixed point, starting from the current natural parameters (see
    :meth:`numpyro_pc.dual.expfam.EFPosterior.refine`)."""
    check_solver_options(tol, max_iters)
    step_size = check_finite(step_size, "step_size", low=2.0**-30, high=1.0)
    check_flag(raise_on_failure, "raise_on_failure")
    check_flag(progress, "progress")
    if post.num_examples == 0:
        raise DataShapeError("refine needs at least one example: this posterior holds none (it is its prior)")
    _, frozen = split_frozen(post)
    with warnings.catch_warnings():  # the solver's own warning is replaced by refine's, below
        warnings.simplefilter("ignore", RuntimeWarning)
        solved = solve_every_site(post, post.data, post.data_ids, post.natural, tol, max_iters, False, progress,
                                  step_size, frozen=post.sites.take(frozen))
    record = RefineInfo(**solved.record.solve_fields())
    solved = solved.evolve(record=record)
    if not record.converged:
        message = (f"refine did not reach tol={default_tol(post.natural.dtype) if tol is None else tol:g} in "
                   f"{record.iterations} iterations (relative residual {record.residual:.3g})")
        if raise_on_failure:
            raise ConvergenceError(message, posterior=solved, history=[record])
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    return solved
