r"""Streaming updates of a dual-form posterior with correction terms (paper §3.1; docs/adapting.md, "Adding data").

Given ``q_t`` with its sites and a new batch, the corrected update is

.. math::

    q_{t+1} = \arg\min_q\; E_q[\ell_{new}] + KL(q \| q_t) + \sum_{i \in C} E_q[\ell_i - \hat\ell_{i|t}],

which is the dual-form problem with the *cavity* ``q_t / Π_{i∈C} exp(−ℓ̂_{i|t})`` as a
fixed Gaussian factor and the true losses of the new examples and of ``C`` as live terms
(paper eq. ``postcorr``). The policy chooses ``C``:

``"none"``
    ``C = ∅`` — variational continual learning (VCL).
``"prior"``
    ``C = {0}`` — the prior site only.
``"exact"``
    every retained example and the prior — the batch posterior.
``"memory"``
    the prior and a memory of retained examples (ids, or a size and a selection rule:
    ``random``, ``residual``, ``curvature``, ``leverage``).
``"weighted"``
    the memory's corrections scaled by ``n_retained / n_memory`` so that they stand for
    all retained data; if that makes the problem unsolvable the update falls back to
    ``"memory"`` and says so (``record["fallback"]``).
``"stochastic"``
    the exact correction from a fresh random subset of the retained data at every
    iteration (stochastic average gradient, SAG): a table holds the latest site of every
    retained example, only the subset's rows are recomputed, and each natural-gradient
    step uses the table's sums — exact once every row is fresh, so the iteration
    converges to the ``"exact"`` answer while touching one subset per step (full family).

Sites of examples outside ``C`` stay as they were (stale); the result still satisfies
``λ_{t+1} = Σ_i λ̂_i`` over all sites.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

from .errors import (ConvergenceError, DataShapeError, InvalidOptionError, ModelMismatchError, NonFiniteResultError,
                     NotPositiveDefiniteError)
from .families import FullGaussian, add_site, remove_site, scale_site
from .likelihood import ModelData, _is_array, bind_model, check_finite_argument
from .rowops import as_ids, filled, to_device
from .rows import concat_data, pad_to_bucket, positions, take_data
from .sites import SiteSums, compute_sites
from .solvers import SiteProblem, default_tol, solve

__all__ = ["CORRECTIONS", "SELECTIONS", "update", "select_memory", "concat_data", "take_data"]

CORRECTIONS = ("none", "prior", "exact", "memory", "weighted", "stochastic")
SELECTIONS = ("random", "residual", "curvature", "leverage")


def _shared_names(spec):
    return tuple(n.split("[")[0] for n, k in zip(spec.arg_names, spec.kinds) if k == "shared")


def _bind_like_fitted(post, args, kwargs):
    """The new batch's :class:`ModelData` without re-tracing the model, or ``None``.

    Applies when the arguments have the fitted data's structure: the same pytree, equal
    non-array arguments, per-example arrays with the fitted trailing shapes and dtypes and
    one common leading size, shared arrays equal to the fitted ones. Anything else goes
    through the full :func:`~numpyro_pc.likelihood.bind_model` (and its error messages).
    """
    leaves, treedef = jax.tree.flatten((tuple(args), dict(kwargs)))
    spec = post.spec
    if treedef != spec.treedef or len(leaves) != len(spec.kinds):
        return None
    statics, fitted = iter(spec.statics), post.data
    old_examples, old_shared = iter(fitted.per_example), iter(fitted.shared)
    per_example, shared, sizes = [], [], set()
    for name, leaf, kind in zip(spec.arg_names, leaves, spec.kinds):
        if kind == "static":
            if _is_array(leaf) or not _same_static(leaf, next(statics)):
                return None
            continue
        if not _is_array(leaf) and not np.isscalar(leaf):
            return None
        array = to_device(leaf)
        old = next(old_shared) if kind == "shared" else next(old_examples)
        if array.dtype != old.dtype or (kind == "example" and (array.ndim != old.ndim or array.ndim == 0
                                                                 or array.shape[1:] != old.shape[1:])):
            return None
        if kind == "shared":
            if array.shape != old.shape or not bool(jnp.all(array == old)):
                return None
            shared.append(old)
            continue
        check_finite_argument(name, array)
        sizes.add(int(array.shape[0]))
        per_example.append(array)
    if len(sizes) != 1 or 0 in sizes:
        return None
    return ModelData(tuple(per_example), tuple(shared))


def _check_fixed_arguments(spec, args, kwargs):
    """Refuse a batch whose non-array model arguments differ from the fitted ones.

    A posterior is the posterior of the model *with* its fixed arguments (a noise level, a
    prior scale, a number of categories); silently keeping the old values would answer
    another question than the one asked.
    """
    leaves, treedef = jax.tree.flatten((tuple(args), dict(kwargs)))
    if treedef != spec.treedef or len(leaves) != len(spec.kinds):
        return  # structural differences get bind_model's own messages
    statics = iter(spec.statics)
    for name, leaf, kind in zip(spec.arg_names, leaves, spec.kinds):
        if kind != "static":
            continue
        old = next(statics)
        if _is_array(leaf) or not _same_static(leaf, old):
            raise ModelMismatchError(
                f"the fixed model argument {name!r} was {old!r} when the posterior was fitted and is {leaf!r} now; "
                "a posterior belongs to the model with its fixed arguments. Refit with the new value (pc.fit), or "
                "pass the fitted value.")


def _same_static(a, b):
    try:
        return type(a) is type(b) and bool(a == b)
    except (TypeError, ValueError):
        return False


def bind_batch(post, args, kwargs):
    """Bind a new batch to the posterior's model and check it is compatible.

    A batch shaped like the fitted data is bound without re-tracing the model (tracing on
    every batch cost ~0.4 s per update, mostly compiling for the new shapes); any other
    batch is inspected in full.
    """
    data = _bind_like_fitted(post, args, kwargs)
    if data is not None:
        return data
    _check_fixed_arguments(post.spec, args, kwargs)
    spec, data = bind_model(post.spec.model, args, kwargs, data_plate=post.spec.plate, shared=_shared_names(post.spec))
    if spec.latent.signature() != post.latent.signature() or spec.observed != post.spec.observed:
        def describe(s):
            return {n: tuple(shape) for n, shape in zip(s.latent.names, s.latent.unconstrained_shapes)}
        raise DataShapeError(
            "the new batch gives the model different latent or observed sites: latent (unconstrained shapes) "
            f"{describe(spec)} and observed {spec.observed} where the posterior has {describe(post.spec)} and "
            f"{post.spec.observed}; was another model called, or a per-example argument passed with other "
            "trailing dimensions?")
    if spec.kinds != post.spec.kinds or spec.treedef != post.spec.treedef:
        raise DataShapeError("the new batch passes the model's arguments differently from the fitted data")
    for old, new in zip(post.data.shared, data.shared):
        if old.shape != new.shape or not bool(jnp.all(old == new)):
            raise DataShapeError("a shared (not per-example) argument changed between batches")
    return data


def select_memory(post, size, rule="random", seed=0):
    """Choose ``size`` retained examples to correct.

    :param str rule: ``"random"``; ``"residual"`` (largest stale site gradient ``‖ĝ_i‖``);
        ``"curvature"`` (largest ``tr Ĥ_i``); ``"leverage"`` (largest ``tr(Ĥ_i S⁻¹)``).
    :return: the chosen ids.
    """
    ids = np.asarray(post.data_ids)
    size = int(min(max(size, 0), ids.size))
    if size == 0:
        return ids[:0]
    rows = positions(post.sites.ids, ids)
    sites = post.sites.take(rows)
    if rule == "random":
        chosen = np.random.default_rng(seed).choice(ids.size, size=size, replace=False)
        return ids[np.sort(chosen)]
    if rule == "residual":
        score = np.asarray(jnp.linalg.norm(sites.grad, axis=1))
    elif rule == "curvature":
        score = np.asarray(sites.curvature_trace())
    elif rule == "leverage":
        cov = post.covariance
        score = np.asarray(jnp.einsum("nde,ed->n", sites.dense_curvature(), cov)) if sites.storage != "factor" else \
            np.asarray(jnp.einsum("nkl,nld,de,nke->n", sites.lam, sites.jac, cov, sites.jac))
    else:
        raise InvalidOptionError(f"unknown selection rule {rule!r}; expected one of {SELECTIONS}")
    return ids[np.sort(np.argsort(-score, kind="stable")[:size])]


def _corrected_ids(post, correction, memory, selection, seed):
    if correction not in CORRECTIONS:
        raise InvalidOptionError(f"unknown correction {correction!r}; expected one of {CORRECTIONS}")
    retained = np.asarray(post.data_ids)
    if correction in ("none", "prior"):
        return retained[:0], correction == "prior"
    if correction in ("exact", "stochastic"):
        return retained, True
    if memory is None:
        raise InvalidOptionError("correction='memory' needs memory= (a size or a list of example ids)")
    if np.ndim(memory) == 0:
        return select_memory(post, int(memory), selection, seed), True
    chosen = as_ids(memory)
    positions(retained, chosen, "retained example (its data was not kept)")
    return chosen, True


def _reservoir(ids_old, ids_new, size, seen_before, seed):
    """Reservoir sampling (algorithm R) of ``size`` ids over the whole stream."""
    rng = np.random.default_rng(seed)
    kept = list(np.asarray(ids_old)[:size])
    for k, new in enumerate(np.asarray(ids_new)):
        seen = seen_before + k + 1
        if len(kept) < size:
            kept.append(int(new))
        else:
            slot = rng.integers(0, seen)
            if slot < size:
                kept[slot] = int(new)
    return np.asarray(sorted(kept), dtype=np.int64)


def update(post, *args, correction="exact", memory=None, selection="random", keep="all", seed=0, tol=None,
           max_iters=100, progress=False, raise_on_failure=True, batch_fraction=0.1, epochs=None, **kwargs):
    """Add a batch of examples to ``post`` (see :meth:`numpyro_pc.DualPosterior.update`)."""
    start = time.perf_counter()
    residual = post.residual
    if not np.isfinite(residual):
        raise NonFiniteResultError(f"the posterior's dual-form residual is {residual}: its sites or state hold "
                                   "non-finite values, so no update can be trusted; refit the posterior.")
    if residual > 100 * default_tol(post.state.mean.dtype):
        warnings.warn(f"updating a posterior whose dual-form residual is {residual:.1e}; refine() it first "
                      "so that its sites represent it", RuntimeWarning, stacklevel=3)
    new_data = bind_batch(post, args, kwargs)
    num_new = int(new_data.per_example[0].shape[0])
    new_ids = np.arange(post.next_id, post.next_id + num_new, dtype=np.int64)
    corrected, correct_prior = _corrected_ids(post, correction, memory, selection, seed)
    site_rows = positions(post.sites.ids, corrected)
    weight = 1.0
    if correction == "weighted":
        weight = post.num_retained / max(corrected.size, 1)
    solve_options = dict(tol=tol, max_iters=max_iters, progress=progress)
    fallback = None
    if correction == "stochastic":
        from .stochastic import stochastic_update

        q, fresh, history, touched = stochastic_update(post, new_data, new_ids, corrected, batch_fraction, seed,
                                                       solve_options, raise_on_failure, epochs)
        offset = post.offset
    else:
        stale = post.sites.take(site_rows)
        try:
            q, fresh, history, offset = _solve_update(post, new_data, new_ids, corrected, correct_prior, weight,
                                                      solve_options, raise_on_failure or weight != 1.0, stale)
        except (ConvergenceError, NotPositiveDefiniteError) as err:
            if weight == 1.0:
                raise
            fallback = f"weighted correction failed ({type(err).__name__}); fell back to the unweighted memory"
            warnings.warn(fallback, RuntimeWarning, stacklevel=3)
            q, fresh, history, offset = _solve_update(post, new_data, new_ids, corrected, correct_prior, 1.0,
                                                      solve_options, raise_on_failure, stale)
        touched = corrected.size * (len(history) - 1)

    stale_rows = np.setdiff1d(np.arange(post.num_examples), site_rows)
    sites = post.sites.take(stale_rows).concat(fresh, prior_from="other" if correct_prior else "self")
    data, data_ids = _retain(post, new_data, new_ids, keep, seed)
    record = dict(operation="update", correction=correction, corrected=int(corrected.size), new=num_new,
                  iterations=len(history) - 1, kl_to_previous=float(post.family.kl(q, post.state)),
                  weight=weight, fallback=fallback, past_examples_touched=int(touched),
                  reused_sites=int(history[0].get("reused_sites", 0)))
    if corrected.size and correction != "stochastic":
        from .diagnostics import site_mismatch

        # bucket-padded (rows beyond the corrected ones are dropped): the jitted diagnostic compiles once per bucket
        magnitude = site_mismatch(stale.bucketed()[0], fresh.take(np.arange(corrected.size)).bucketed()[0], q,
                                  post.family, post.spec.affine)[0]
        magnitude = np.asarray(magnitude)[:corrected.size]
        record["correction_magnitude"] = dict(ids=corrected, magnitude=magnitude, total=float(np.sum(magnitude)))
    record["seconds"] = time.perf_counter() - start
    return post._replace(spec=replace(post.spec, num_examples=int(np.asarray(data_ids).size)), data=data,
                         data_ids=to_device(data_ids), state=q, sites=sites, history=history,
                         next_id=post.next_id + num_new, record=record, offset=offset)


def _cavity(post, corrected_sum, correct_prior, weight, corrects_all=False):
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
    if corrected_sum is not None:
        cavity = remove_site(cavity, corrected_sum, weight)
    if correct_prior:
        cavity = remove_site(cavity, post.sites.prior_natural(family))
    return cavity


def _solve_update(post, new_data, new_ids, corrected, correct_prior, weight, solve_options, raise_on_failure,
                  stale=None):
    """Solve the corrected update; ``stale`` are the corrected examples' current sites (taken here if not given)."""
    family = post.family
    if stale is None:
        stale = post.sites.take(positions(post.sites.ids, corrected))
    stale_sum = stale.natural_sum(family) if corrected.size else None
    corrects_all = corrected.size == post.sites.num_examples and np.array_equal(
        np.sort(corrected), np.sort(np.asarray(post.sites.ids)))
    cavity = _cavity(post, stale_sum, correct_prior, weight, corrects_all)
    data_rows = positions(post.data_ids, corrected)
    active = concat_data(take_data(post.data, data_rows), new_data) if corrected.size else new_data
    active_ids = np.concatenate([corrected, new_ids])
    dtype = post.state.mean.dtype
    weights = filled([(corrected.size, weight), (new_ids.size, 1.0)], dtype)
    num_active = int(active_ids.size)
    active, weights, padded_ids = pad_to_bucket(active, weights, active_ids)
    spec = replace(post.spec, num_examples=int(padded_ids.size))
    problem = SiteProblem(spec, active, family, post.rule, post.curvature, post.sites.storage, post.chunk_size,
                          jnp.asarray(padded_ids), cavity, correct_prior, weights)
    start_sites, start_sums = _sites_at_start(post, problem, stale, new_data, new_ids, weights)
    q, fresh, history = solve(problem, post.state, raise_on_failure=raise_on_failure, sites=start_sites,
                              sums=start_sums, **solve_options)
    history[0]["reused_sites"] = 0 if start_sites is None else int(corrected.size)
    fresh = fresh.take(np.arange(num_active))
    offset = post.offset
    if weight != 1.0:  # λ_{t+1} − Σ sites: the part of the scaled correction no single site holds
        new_fresh = fresh.take(np.arange(corrected.size))
        extra = add_site(scale_site(new_fresh.natural_sum(family), weight - 1.0), scale_site(stale_sum, 1.0 - weight))
        offset = extra if offset is None else add_site(offset, extra)
    return q, fresh, history, offset


def _sites_at_start(post, problem, cached, new_data, new_ids, weights):
    """The problem's sites at ``q_t`` without recomputing the corrected ones, when their cache is fresh.

    Sites of corrected examples that were computed at ``q_t`` itself (the usual case after
    an exact or memory update, or a fit) are taken from the posterior; only the new batch is
    evaluated. This saves one pass over the corrected data per update and does not change
    the answer: the solver recomputes every site at each trial point, and its residual test
    uses those. Returns ``(None, None)`` — compute everything — when nothing is corrected,
    when a cached site was computed at another mean, or when the solver needs a dense
    curvature sum the stored sites cannot give (diagonal storage).
    """
    mean = post.state.mean
    dense_sum = not isinstance(problem.family, FullGaussian)
    if cached.num_examples == 0 or (dense_sum and cached.storage not in ("factor", "dense")):
        return None, None
    used_refs = np.asarray(cached.ref_means)[np.unique(np.asarray(cached.ref_index))]
    if not np.all(used_refs == np.asarray(mean)[None, :]):
        return None, None
    padded_new, new_weights, padded_new_ids = pad_to_bucket(new_data, None, new_ids, mean.dtype)
    new_sites, _ = compute_sites(replace(post.spec, num_examples=int(padded_new_ids.size)), padded_new,
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
    hessian = (start.example_curvature_sum(FullGaussian(), weights) if dense_sum
               else jnp.zeros(2 * mean.shape, mean.dtype))
    return start, SiteSums(hessian=hessian, loss=weights @ start.loss)


def _retain(post, new_data, new_ids, keep, seed):
    if keep == "all":
        return concat_data(post.data, new_data), np.concatenate([np.asarray(post.data_ids), new_ids])
    if keep == "none":
        empty = take_data(post.data, np.zeros(0, np.int64))
        return empty, np.zeros(0, np.int64)
    if isinstance(keep, (int, np.integer)) and keep >= 0:
        seen = int(post.next_id) - len(post.tombstones)
        kept = _reservoir(post.data_ids, new_ids, int(keep), seen, seed)
        both = concat_data(post.data, new_data)
        rows = positions(np.concatenate([np.asarray(post.data_ids), new_ids]), kept)
        return take_data(both, rows), kept
    raise InvalidOptionError(f"keep must be 'all', 'none' or a reservoir size, got {keep!r}")
