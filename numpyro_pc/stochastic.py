r"""The ``"stochastic"`` correction of a streaming update: SAG over a table of sites.

The exact correction needs the sites of every retained example at the new posterior.
Stochastic average gradient (SAG) replaces that by a *table* holding the latest site of
every retained example: each step recomputes the sites of a random subset ``B`` (a
fraction of the retained data) and of the new batch at the current ``q``, writes them
into the table, and takes a damped natural-gradient step with the table's sums

.. math::

    S \leftarrow (1-\rho) S + \rho\,\Big(\sum_{i} \hat H_i + H_{new} + \hat H_0 + S_{cav}\Big),
    \qquad
    m \leftarrow m - \rho\, S^{-1} \Big(\sum_i \hat g_i(m) + g_{new} + \hat g_0
        + S_{cav} m - \lambda_{cav}\Big),

with ``ĝ_i(m) = ĝ_i + Ĥ_i (m − m_i)`` the quadratic site of row ``i`` (computed at
``m_i``). Once every row has been refreshed at the current ``q`` the step is the exact
update's fixed-point step, so the iteration converges to the ``"exact"`` answer while
touching one subset per step. Subsets follow random reshuffling (a fresh permutation of
the retained rows per pass, so one pass refreshes every row exactly once), and the step
is ``ρ = 1`` unless it must be halved to keep ``S`` positive definite. Before any row
is refreshed the table holds the sites at ``q_t``, so the first step is the VCL step.

The table's natural-parameter sums are kept incrementally (the refreshed rows' new sites
are added and their old ones subtracted), so a step costs ``O(|B| d²)`` besides the site
computations, never a pass over the table. The table, the retained data and both
subsets are padded to a few bucket sizes so that a stream of updates reuses the same
compiled step.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from .errors import ConvergenceError, NotPositiveDefiniteError
from .families import FullGaussian, Gaussian, GaussianNatural
from .sites import compute_sites
from .solvers import default_tol

__all__ = ["stochastic_update", "subset_bucket"]

_MIN_STEP = 1e-6


def subset_bucket(num):
    """Padded size of a subset of ``num`` rows: the next ``m·2^k`` with ``m ∈ {4, 5, 6, 7}``.

    Four sizes per octave keep the padding (wasted site computations) below 25 % while a
    stream whose memory grows reuses a handful of compiled steps.
    """
    num = max(int(num), 1)
    if num <= 8:
        return 8
    octave = 2 ** int(np.floor(np.log2(num)))
    for m in (4, 5, 6, 7, 8):
        size = m * octave // 4
        if size >= num:
            return int(size)
    return int(2 * octave)


def _pad_rows(rows, size):
    """``rows`` followed by copies of its last entry up to ``size``, and 0/1 weights."""
    rows = np.asarray(rows, dtype=np.int64)
    padded = np.concatenate([rows, np.full(size - rows.size, rows[-1], np.int64)])
    weights = np.zeros(size)
    weights[:rows.size] = 1.0
    return padded, weights


def _write_rows(table, rows, fresh, mean):
    put = lambda a, b: None if a is None else a.at[rows].set(b)  # noqa: E731
    return replace(table, grad=put(table.grad, fresh.grad), curvature=put(table.curvature, fresh.curvature),
                   jac=put(table.jac, fresh.jac), lam=put(table.lam, fresh.lam), loss=put(table.loss, fresh.loss),
                   ref_means=table.ref_means.at[rows].set(jnp.broadcast_to(mean, (rows.shape[0], mean.shape[0]))))


@partial(jax.jit, static_argnums=0)
def _sag_step(static, q, table, sums, table_weights, past, pick, pick_weights, new_data, new_weights, new_ids,
              cavity, rho):
    """One SAG step (see the module docstring); returns the new state and the residuals."""
    spec_new, spec_pick, family, rule, curvature, storage, chunk_size = static
    options = dict(curvature=curvature, storage=storage, chunk_size=chunk_size)
    fresh_new, _ = compute_sites(spec_new, new_data, family, q, rule, ids=new_ids, **options)
    subset = type(past)(tuple(x[pick] for x in past.per_example), past.shared)
    fresh_pick, _ = compute_sites(spec_pick, subset, family, q, rule, ids=table.ids[pick], **options)
    old_pick = table.take(pick)
    # duplicated (padding) rows carry weight 0 in the sums and write the same values twice
    gained = fresh_pick.natural_sum(family, pick_weights)
    lost = old_pick.natural_sum(family, pick_weights)
    sums = GaussianNatural(sums.linear + gained.linear - lost.linear,
                           sums.precision + gained.precision - lost.precision)
    table = _write_rows(table, pick, fresh_pick, q.mean)

    grad = (sums.precision @ q.mean - sums.linear + new_weights @ fresh_new.grad + fresh_new.prior_grad
            + cavity.precision @ q.mean - cavity.linear)
    target = (sums.precision + fresh_new.example_curvature_sum(family, new_weights)
              + family.project_curvature(fresh_new.prior_curvature) + cavity.precision)

    def attempt(step):
        precision = (1.0 - step) * q.precision + step * target
        chol = jnp.linalg.cholesky(precision)
        return precision, chol, jnp.all(jnp.isfinite(chol))

    def halve(carry):
        step = 0.5 * carry[0]
        return (step, *attempt(step))

    step, precision, chol, ok = jax.lax.while_loop(lambda c: (~c[3]) & (c[0] >= _MIN_STEP), halve,
                                                   (rho, *attempt(rho)))
    mean = q.mean - step * jax.scipy.linalg.cho_solve((chol, True), grad)
    scale = (jnp.linalg.norm(fresh_new.prior_grad) + table_weights @ jnp.linalg.norm(table.grad, axis=1)
             + new_weights @ jnp.linalg.norm(fresh_new.grad, axis=1))
    mean_residual = jnp.linalg.norm(grad) / scale
    precision_residual = jnp.linalg.norm(precision - target) / jnp.linalg.norm(precision)
    return Gaussian(mean, precision), table, sums, mean_residual, precision_residual, step, ok


def stochastic_update(post, new_data, new_ids, corrected, fraction, seed, solve_options, raise_on_failure,
                      epochs=None):
    """SAG iterations for :func:`numpyro_pc.streaming.update` with ``correction="stochastic"``.

    Without ``epochs`` the iteration runs until the estimated residual is below ``tol``
    (after at least two passes, so that nearly every row of the table has been
    refreshed). With ``epochs`` it stops at ``tol`` or after ``ceil(epochs · n / |B|)``
    steps, whichever comes first; stopping at the budget is the requested trade-off, not
    a failure (``history[-1]["residual"]`` says how far from the exact answer it is).

    :return: ``(q, fresh sites of corrected then new examples, history, rows touched)``.
    """
    from .streaming import _cavity, _solve_update, pad_to_bucket, positions, take_data

    family, dtype = post.family, post.state.mean.dtype
    if not isinstance(family, FullGaussian):
        raise ValueError(
            f"correction='stochastic' needs the full family (found {family.name}): its table of sites gives the "
            "full curvature that preconditions each step, which diagonal sites cannot; use correction='exact' "
            "or 'memory' with this family"
        )
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"batch_fraction must be in (0, 1], got {fraction!r}")
    tol = solve_options.get("tol") or default_tol(dtype)
    max_iters = max(int(solve_options.get("max_iters") or 100), 1) * 10
    n = int(corrected.size)
    if n == 0:
        q, fresh, history, _ = _solve_update(post, new_data, new_ids, corrected, True, 1.0, solve_options,
                                             raise_on_failure)
        return q, fresh, history, 0
    batch = int(max(1, np.ceil(fraction * n)))
    min_iters = 2 * n // batch
    if epochs is not None:
        if not epochs > 0:
            raise ValueError(f"epochs must be positive, got {epochs!r}")
        max_iters = max(1, int(np.ceil(epochs * n / batch)))
        min_iters = min(min_iters, max_iters)
    rng = np.random.default_rng(seed)

    # the table and the retained data, padded to a power of two with rows that are never picked
    from .streaming import bucket_size

    site_rows, table_weights = _pad_rows(positions(post.sites.ids, corrected), bucket_size(n))
    data_rows, _ = _pad_rows(positions(post.data_ids, corrected), bucket_size(n))
    table_weights = jnp.asarray(table_weights, dtype)
    table = post.sites.take(site_rows)
    table = replace(table, ref_means=table.refs(), ref_index=jnp.arange(site_rows.size, dtype=jnp.int32))
    sums = table.natural_sum(family, table_weights)
    past = take_data(post.data, data_rows)
    cavity = _cavity(post, site_rows[:n], True, 1.0)
    num_new = int(new_ids.size)
    new_data, new_weights, padded_new_ids = pad_to_bucket(new_data, jnp.ones(num_new, dtype), new_ids)
    pick_size = subset_bucket(batch)
    static = (replace(post.spec, num_examples=int(padded_new_ids.size)),
              replace(post.spec, num_examples=pick_size), family, post.rule, post.curvature,
              post.sites.storage, post.chunk_size)
    new_ids_arr = jnp.asarray(padded_new_ids)

    q, rho = post.state, jnp.asarray(1.0, dtype)
    history, touched, start = [], 0, time.perf_counter()
    order = np.zeros(0, np.int64)
    for it in range(max_iters):
        if order.size == 0:  # random reshuffling: every row is refreshed once per pass
            order = rng.permutation(n)
        chosen, order = np.sort(order[:batch]), order[batch:]
        pick, pick_weights = _pad_rows(chosen, pick_size)
        q, table, sums, res_mean, res_prec, step, ok = _sag_step(
            static, q, table, sums, table_weights, past, jnp.asarray(pick, jnp.int32),
            jnp.asarray(pick_weights, dtype), new_data, new_weights, new_ids_arr, cavity, rho)
        touched += chosen.size
        if not bool(ok):
            raise NotPositiveDefiniteError("the stochastic correction's curvature estimate is not positive "
                                           "definite; use a larger batch_fraction or correction='exact'")
        res_mean, res_prec = float(res_mean), float(res_prec)
        history.append(dict(iteration=it + 1, residual=max(res_mean, res_prec), residual_mean=res_mean,
                            residual_precision=res_prec, step=float(step), seconds=time.perf_counter() - start))
        if it >= min_iters and max(res_mean, res_prec) < tol:
            break

    # final sites: the table (fresh within the last passes) and the new examples at the final q
    fresh_new, _ = compute_sites(static[0], new_data, family, q, post.rule, curvature=post.curvature,
                                 storage=post.sites.storage, chunk_size=post.chunk_size, ids=new_ids_arr)
    table = table.take(np.arange(n))
    table = replace(table, ref_means=table.ref_means[:n])
    fresh = table.concat(fresh_new.take(np.arange(num_new)))
    if history[-1]["residual"] > tol and epochs is None:
        message = (f"stochastic correction stopped at estimated residual {history[-1]['residual']:.2e} after "
                   f"{len(history)} iterations")
        if raise_on_failure:
            raise ConvergenceError(message, posterior=(q, fresh), history=history)
        warnings.warn(message, RuntimeWarning, stacklevel=4)
    history.insert(0, dict(iteration=0, residual=float("nan"), step=0.0, seconds=0.0))
    return q, fresh, history, touched
