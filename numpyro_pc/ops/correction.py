r"""The corrected update's fixed-point problem, shared by the streaming and stochastic updates.

The update (paper eq. ``postcorr``; docs/adapting.md, "Adding data") is the dual-form
problem whose fixed Gaussian factor is the *cavity* ``q_t / Π_{i∈C} exp(−ℓ̂_{i|t})`` and
whose live terms are the new examples and the corrected examples ``C``.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import jax.numpy as jnp
import numpy as np

from numpyro_pc.curvature.stores import FULL
from numpyro_pc.errors import ConvergenceError, NonFiniteResultError
from numpyro_pc.families.registry import Gaussian, GaussianNatural, add_site, remove_site, scale_site
from numpyro_pc.model.rows import concat_data, filled, pad_to_bucket, positions, stand_in_row, take_data
from numpyro_pc.protocols.capabilities import SiteSum, needs_dense_sum, require
from numpyro_pc.protocols.records import IterationInfo
from numpyro_pc.sites.cached import Sites
from numpyro_pc.sites.gaussian import SiteSums, compute_sites
from numpyro_pc.solvers.fixed_point import default_tol
from numpyro_pc.solvers.gaussian import solve
from numpyro_pc.solvers.site_problem import SiteProblem
from numpyro_pc.solvers.start import default_start

__all__ = ["solve_update", "check_sites_represent"]


def check_sites_represent(post, operation: str, stacklevel: int) -> None:
    """Refuse a posterior whose dual-form identity is not finite, and warn when its sites do not add up to it
    (a correction divides those sites out): ``operation`` names what is being done (``"an update"``).

    :raises NonFiniteResultError: the sites or the state hold non-finite values.
    """
    residual = post.site_identity_residual
    if not np.isfinite(residual):
        raise NonFiniteResultError(f"the posterior's dual-form residual is {residual}: its sites or state hold "
                                   f"non-finite values, so {operation} cannot be trusted; refit the posterior.")
    if residual > 100 * default_tol(post.state.mean.dtype):
        warnings.warn(f"{operation} of a posterior whose dual-form residual is {residual:.1e}; refine() it first "
                      "so that its sites represent it", RuntimeWarning, stacklevel=stacklevel + 1)


def _cavity(post, corrected_sum, correct_prior, weight, corrects_all=False) -> GaussianNatural:
    """``λ_t − w Σ_C λ̂_i [− λ̂_0]``: the old posterior with the corrected sites divided out.

    When every site and the prior are corrected with weight 1 (the exact update), the dual
    form ``λ_t = offset + λ̂_0 + Σ_i λ̂_i`` says the cavity is the offset alone; it is taken so,
    not as the difference of two large sums, whose rounding error would otherwise be carried
    into every later posterior (a float32 stream of 1,000 single-example exact updates drifted
    to KL 1e-3 from the batch posterior that way).
    """
    family = post.family
    natural = family.natural(post.state)
    if corrects_all and correct_prior and weight == 1.0:
        zero = remove_site(natural, natural)
        return zero if post.offset is None else add_site(zero, post.offset)
    cavity = natural
    if corrected_sum is not None or correct_prior:
        # correction="none" (VCL) divides nothing out: the old posterior itself is the prior of the new
        # batch, well defined in any family
        require(family, SiteSum, "a partial correction (dividing stale sites out of q)",
                "Use correction='exact' (every site recomputed) or 'none' (the old posterior as the prior).")
    if corrected_sum is not None:
        cavity = remove_site(cavity, corrected_sum, weight)
    if correct_prior:
        cavity = remove_site(cavity, post.sites.prior_removal(family, natural))
    return cavity


def solve_update(post, new_data, new_ids, corrected, correct_prior, weight, solve_options, raise_on_failure,
                 stale=None, spec=None, past=None, replaces_sites=True
                 ) -> tuple[Gaussian, Sites, list[IterationInfo], GaussianNatural | None]:
    """Solve the corrected update of ``post`` with a new batch (docs/adapting.md, "Adding data").

    The live terms are the new examples and the ``corrected`` ones (weighted by ``weight``),
    the fixed factor is the cavity of the old posterior, and the solver starts from
    ``q_t`` with the corrected examples' cached sites where they are fresh. When every site and
    the prior are corrected (the exact update, whose fixed point is the batch fit's) and the solve
    from ``q_t`` fails, it is repeated from the batch fit's start
    (:func:`~numpyro_pc.solvers.start.default_start`); ``history[0].restart`` says so and why.

    :param post: the :class:`~numpyro_pc.posterior.DualPosterior` ``q_t``.
    :param new_data: the new batch's :class:`~numpyro_pc.model.likelihood.ModelData`.
    :param new_ids: ids given to the new examples.
    :param corrected: ids of the past examples whose sites are corrected.
    :param bool correct_prior: whether the prior site is corrected too.
    :param float weight: weight of the corrections (``1`` except for ``"weighted"``).
    :param dict solve_options: passed to :func:`~numpyro_pc.solvers.gaussian.solve`.
    :param bool raise_on_failure: raise if the solver misses its tolerance.
    :param stale: the sites divided out of ``q_t`` for the corrected examples (their current sites if not given).
    :param spec: the binding of the live terms (``post.spec`` if not given; a matching binding for the K-prior).
    :param past: the corrected examples' rows as ``spec`` reads them (taken from ``post.data`` if not given).
    :param bool replaces_sites: ``stale`` are the posterior's own sites of the corrected examples, so that
        correcting all of them and the prior leaves the offset as the cavity (``False`` for the K-prior,
        whose divided-out sites are those of other losses).
    :return: ``(q, fresh sites of corrected + new examples, solver history, offset)``.
    """
    family = post.family
    if stale is None:
        stale = post.sites.take(positions(post.sites.ids, corrected))
    corrects_all = replaces_sites and corrected.size == post.sites.num_examples and np.array_equal(
        np.sort(corrected), np.sort(np.asarray(post.sites.ids)))
    needs_sum = corrected.size and not (corrects_all and correct_prior and weight == 1.0)
    stale_sum = stale.natural_sum(family) if needs_sum else None
    cavity = _cavity(post, stale_sum, correct_prior, weight, corrects_all)
    spec = post.spec if spec is None else spec
    if past is None:
        past = take_data(post.data, positions(post.data_ids, corrected))
    active = concat_data(past, new_data) if corrected.size else new_data
    unpadded = active
    active_ids = np.concatenate([corrected, new_ids])
    dtype = post.state.mean.dtype
    weights = filled([(corrected.size, weight), (new_ids.size, 1.0)], dtype)
    num_active = int(active_ids.size)
    active, weights, padded_ids = pad_to_bucket(active, weights, active_ids)
    if num_active == 0:  # only the prior is live (a prior change correcting no example): one zero-weight row
        active = take_data(post.data, np.zeros(1, np.int64)) if post.num_retained else stand_in_row(post.data)
        weights, padded_ids = filled([(1, 0.0)], dtype), -np.ones(1, np.int64)
    problem = SiteProblem(replace(spec, num_examples=int(padded_ids.size)), active, family, post.rule, post.curvature, post.sites.storage, post.chunk_size,
                          jnp.asarray(padded_ids), cavity, correct_prior, weights)
    start_sites, start_sums = _sites_at_start(post, problem, stale, new_data, new_ids, weights)
    # the exact update's fixed point is the batch fit's: where the warm start q_t is too far from it (a new
    # batch that informs latents the old data left at their prior), the batch fit's own start is tried next
    batch_problem = corrects_all and correct_prior and weight == 1.0
    try:
        q, fresh, history = solve(problem, post.state, raise_on_failure=raise_on_failure or batch_problem,
                                  sites=start_sites, sums=start_sums, **solve_options)
        history[0] = history[0].replace(reused_sites=0 if start_sites is None else int(corrected.size))
    except ConvergenceError as err:
        if not batch_problem:
            raise
        cold = default_start(replace(spec, num_examples=num_active), unpadded, family, None, dtype, post.curvature)
        q, fresh, history = solve(problem, cold.start, raise_on_failure=raise_on_failure, **solve_options)
        restart = cold.info(reason=f"from q_t: {type(err).__name__}: {str(err).split(';')[0]}")
        history[0] = history[0].replace(reused_sites=0, restart=restart)
    fresh = fresh.take(np.arange(num_active))
    offset = post.offset
    if weight != 1.0:  # λ_{t+1} − Σ sites: the part of the scaled correction no single site holds
        new_fresh = fresh.take(np.arange(corrected.size))
        extra = add_site(scale_site(new_fresh.natural_sum(family), weight - 1.0), scale_site(stale_sum, 1.0 - weight))
        offset = extra if offset is None else add_site(offset, extra)
    return q, fresh, history, offset


def _sites_at_start(post, problem, cached, new_data, new_ids, weights) -> tuple[Sites | None, SiteSums | None]:
    """The problem's sites at ``q_t`` without recomputing the corrected ones, when their cache is fresh.

    Sites of corrected examples that were computed at ``q_t`` itself (the usual case after
    an exact or memory update, or a fit) are taken from the posterior; only the new batch is
    evaluated. This saves one pass over the corrected data per update and does not change
    the answer: the solver recomputes every site at each trial point, and its residual test
    uses those. Returns ``(None, None)`` — compute everything — when nothing is corrected or
    nothing is new (the prior site is then the new batch's: a prior change computes its own),
    when a cached site was computed at another mean, or when the solver needs a dense
    curvature sum the stored sites cannot give (diagonal storage).
    """
    mean = post.state.mean
    if cached.num_examples == 0 or new_ids.size == 0 or (needs_dense_sum(problem.family, mean.shape[0]) and cached.curv.detail < FULL):
        return None, None
    used_refs = np.asarray(cached.ref_means)[np.unique(np.asarray(cached.ref_index))]
    if not np.all(used_refs == np.asarray(mean)[None, :]):
        return None, None
    padded_new, new_weights, padded_new_ids = pad_to_bucket(new_data, None, new_ids, mean.dtype)
    new_sites, _ = compute_sites(replace(problem.spec, num_examples=int(padded_new_ids.size)), padded_new,
                                 problem.family, post.state, problem.rule, curvature=problem.curvature,
                                 storage=cached.storage, chunk_size=problem.chunk_size,
                                 ids=jnp.asarray(padded_new_ids), weights=new_weights)
    num_pad = int(problem.ids.shape[0]) - cached.num_examples - new_ids.size
    rows = np.concatenate([np.arange(new_ids.size), np.full(num_pad, new_ids.size - 1)])
    start = cached.concat(new_sites.take(rows), prior_from="other")
    # every row was computed at ``mean``: one reference row, so the solver's compiled sums
    # see the same shapes as for the sites it computes itself (no recompilation per update)
    start = replace(start, ids=problem.ids, ref_means=mean[None, :],
                    ref_index=filled([(start.num_examples, 0)], start.ref_index.dtype))
    hessian = (start.curv.weighted_dense(weights) if needs_dense_sum(problem.family, mean.shape[0])
               else jnp.zeros((), mean.dtype))
    return start, SiteSums(hessian=hessian, loss=weights @ start.loss)
