r"""The ``"stochastic"`` correction of a streaming update: SAG over a table of sites.

The exact correction needs the sites of every retained example at the new posterior.
Stochastic average gradient (SAG) replaces that by a *table* holding the latest site of
every retained *and* new example, all computed at ``q_t`` to begin with: each step
recomputes the sites of a random subset ``B`` (the same fraction of the past and of the
new rows) at the current ``q``, writes them into the table, and takes a natural-gradient
step with the table's sums

.. math::

    S \leftarrow (1-\rho) S + \rho\,\Big(\sum_{i} \hat H_i + \hat H_0 + S_{cav}\Big),
    \qquad
    m \leftarrow m - \rho\, S^{-1} \Big(\sum_i \hat g_i(m) + \hat g_0 + S_{cav} m - \lambda_{cav}\Big),

with ``ĝ_i(m) = ĝ_i + Ĥ_i (m − m_i)`` the quadratic site of row ``i`` (computed at
``m_i``) and ``ĥ_0`` the prior site at the current ``q``. Once every row has been
refreshed at the current ``q`` the step is the exact update's fixed-point step, so the
iteration converges to the ``"exact"`` answer while touching one subset per step.
Subsets follow random reshuffling (a fresh permutation per pass, so one pass refreshes
every row exactly once), and the step is ``ρ = 1`` unless it must be halved to keep
``S`` positive definite. The first step, with every row still at ``q_t``, is the first
step of the exact update.

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

from numpyro_pc.errors import ConvergenceError, InvalidOptionError, NotPositiveDefiniteError
from numpyro_pc.families.registry import Gaussian, GaussianNatural, add_site, remove_site
from numpyro_pc.model.rows import bucket_size, concat_data, join_rows, pad_to_bucket, positions, take_data, to_device
from numpyro_pc.protocols.capabilities import SiteSum, gaussian_solver, require
from numpyro_pc.protocols.records import IterationInfo
from numpyro_pc.sites.cached import Sites
from numpyro_pc.sites.gaussian import compute_sites
from numpyro_pc.solvers.gaussian import default_tol

from .correction import solve_update

__all__ = ["stochastic_update", "subset_bucket"]

_MIN_STEP = 1e-6


def subset_bucket(num) -> int:
    """Padded size of a subset of ``num`` rows: the next ``m·2^k`` with ``m ∈ {4, 5, 6, 7}`` (≥ 8).

    Four sizes per octave keep the padding (wasted site computations) below 25 % while a
    stream whose memory grows reuses a handful of compiled steps.
    """
    return bucket_size(num, fine_from=8)


def _pad_rows(rows, size) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` followed by copies of its last entry up to ``size``, and 0/1 weights."""
    rows = np.asarray(rows, dtype=np.int64)
    padded = np.concatenate([rows, np.full(size - rows.size, rows[-1], np.int64)])
    weights = np.zeros(size)
    weights[:rows.size] = 1.0
    return padded, weights


@partial(jax.jit, donate_argnums=0)
def _write_rows(table, rows, fresh, mean) -> Sites:
    """Write the refreshed rows (and the prior site) into the table, in place (the table is donated).

    Kept apart from :func:`_sag_step`, which reads the table: a scatter into a buffer
    that the same program also gathers from makes XLA copy the whole table first.
    """
    put = lambda a, b: a.at[rows].set(b)  # noqa: E731
    return replace(table, grad=put(table.grad, fresh.grad), curv=jax.tree.map(put, table.curv, fresh.curv),
                   loss=put(table.loss, fresh.loss),
                   ref_means=table.ref_means.at[rows].set(jnp.broadcast_to(mean, (rows.shape[0], mean.shape[0]))),
                   prior_grad=fresh.prior_grad, prior_curvature=fresh.prior_curvature, prior_loss=fresh.prior_loss,
                   prior_ref=fresh.prior_ref)


@partial(jax.jit, static_argnums=0)
def _sag_step(static, q, table, sums, data, pick, pick_weights, cavity, rho) -> tuple[Gaussian, Sites, tuple[GaussianNatural, jax.Array], jax.Array, jax.Array, jax.Array, jax.Array]:
    """One SAG step (see the module docstring); returns the new state and the residuals."""
    spec_pick, family, rule, curvature, storage, chunk_size = static
    subset = type(data)(tuple(x[pick] for x in data.per_example), data.shared)
    fresh, _ = compute_sites(spec_pick, subset, family, q, rule, ids=table.ids[pick], curvature=curvature,
                             storage=storage, chunk_size=chunk_size)
    # duplicated (padding) rows carry weight 0 in the sums and write the same values twice
    old = table.take(pick)
    gained, lost = fresh.natural_sum(family, pick_weights), old.natural_sum(family, pick_weights)
    natural, grad_norms = sums
    natural = GaussianNatural(natural.linear + gained.linear - lost.linear,
                              natural.precision + gained.precision - lost.precision)
    grad_norms = grad_norms + pick_weights @ (jnp.linalg.norm(fresh.grad, axis=1) - jnp.linalg.norm(old.grad, axis=1))

    grad = natural.precision @ q.mean - natural.linear + fresh.prior_grad + cavity.precision @ q.mean - cavity.linear
    target = natural.precision + fresh.prior_precision(family) + cavity.precision

    def attempt(step) -> tuple[jax.Array, jax.Array, jax.Array]:
        precision = (1.0 - step) * q.precision + step * target
        chol = jnp.linalg.cholesky(precision)
        return precision, chol, jnp.all(jnp.isfinite(chol))

    def halve(carry) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        step = 0.5 * carry[0]
        return (step, *attempt(step))

    step, precision, chol, ok = jax.lax.while_loop(lambda c: (~c[3]) & (c[0] >= _MIN_STEP), halve,
                                                   (rho, *attempt(rho)))
    mean = q.mean - step * jax.scipy.linalg.cho_solve((chol, True), grad)
    mean_residual = jnp.linalg.norm(grad) / (jnp.linalg.norm(fresh.prior_grad) + grad_norms)
    precision_residual = jnp.linalg.norm(precision - target) / jnp.linalg.norm(precision)
    return Gaussian(mean, precision), fresh, (natural, grad_norms), mean_residual, precision_residual, step, ok


class _Shuffler:
    """Random reshuffling of ``n`` rows in subsets of ``size`` (a new permutation per pass)."""

    def __init__(self, rng, n, size):
        self.rng, self.n, self.size, self.order = rng, n, size, np.zeros(0, np.int64)

    def next(self) -> np.ndarray:
        if self.order.size == 0:
            self.order = self.rng.permutation(self.n)
        chosen, self.order = np.sort(self.order[:self.size]), self.order[self.size:]
        return chosen


def stochastic_update(post, new_data, new_ids, corrected, fraction, seed, solve_options, raise_on_failure,
                      epochs=None) -> tuple[Gaussian, Sites, list[IterationInfo], int]:
    """SAG iterations for :func:`numpyro_pc.ops.streaming.update` with ``correction="stochastic"``.

    The table holds the corrected (retained) examples and the new ones, all starting at
    ``q_t``; every step refreshes ``⌈f·n_past⌉`` past and ``⌈f·n_new⌉`` new rows
    (``f = batch_fraction``), so one pass takes about ``1/f`` steps. Without ``epochs``
    the iteration runs until the estimated residual is below ``tol`` (after at least two
    passes). With ``epochs`` it stops at ``tol`` or after ``epochs`` passes, whichever
    comes first; stopping at the budget is the requested trade-off, not a failure
    (``history[-1]["residual"]`` says how far from the exact answer it is).

    With full steps the returned ``q`` is exactly the product of the returned sites and
    the cavity (``λ = Σ_i λ̂_i``), converged or not.

    :return: ``(q, sites of corrected then new examples, history, past rows touched)``.
    """

    family, dtype = post.family, post.state.mean.dtype
    require(family, SiteSum, "correction='stochastic' (a table of stale sites whose product is the posterior)",
            "Use correction='exact' (every site recomputed) or 'none'.")
    if gaussian_solver(family).dense_sum:
        raise InvalidOptionError(
            f"correction='stochastic' needs the full family (found {family.name}): its table of sites gives the "
            "full curvature that preconditions each step, which diagonal sites cannot; use correction='exact' "
            "or 'memory' with this family"
        )
    if not 0.0 < fraction <= 1.0:
        raise InvalidOptionError(f"batch_fraction must be in (0, 1], got {fraction!r}")
    if epochs is not None and not epochs > 0:
        raise InvalidOptionError(f"epochs must be positive, got {epochs!r}")
    tol = solve_options.get("tol") or default_tol(dtype)
    n, num_new = int(corrected.size), int(new_ids.size)
    if n == 0:
        q, fresh, history, _ = solve_update(post, new_data, new_ids, corrected, True, 1.0, solve_options,
                                             raise_on_failure)
        return q, fresh, history, 0
    past_batch, new_batch = (int(max(1, np.ceil(fraction * k))) for k in (n, num_new))
    steps_per_pass = int(max(np.ceil(n / past_batch), np.ceil(num_new / new_batch)))
    max_iters = max(int(solve_options.get("max_iters") or 100), 1) * 10
    min_iters = 2 * steps_per_pass
    if epochs is not None:
        max_iters = max(1, int(np.ceil(epochs * steps_per_pass)))
        min_iters = min(min_iters, max_iters)

    # table = [past rows | padding | new rows | padding]; padding rows are never picked
    past_size, new_size = bucket_size(n), bucket_size(num_new)
    site_rows, past_mask = _pad_rows(positions(post.sites.ids, corrected), past_size)
    data_rows, _ = _pad_rows(positions(post.data_ids, corrected), past_size)
    past_sites = post.sites.take(site_rows)
    new_data, new_weights, padded_new_ids = pad_to_bucket(new_data, None, new_ids, dtype)
    new_sites, _ = compute_sites(replace(post.spec, num_examples=new_size), new_data, family, post.state, post.rule,
                                 curvature=post.curvature, storage=post.sites.storage, chunk_size=post.chunk_size,
                                 ids=jnp.asarray(padded_new_ids))
    table = past_sites.concat(new_sites)
    table = replace(table, ref_means=table.refs(), ref_index=to_device(np.arange(past_size + new_size, dtype=np.int32)))
    past_weights = to_device(np.asarray(past_mask, dtype))
    table_weights = join_rows(past_weights, new_weights)
    past_sum = past_sites.natural_sum(family, past_weights)
    sums = (add_site(past_sum, new_sites.natural_sum(family, new_weights)),
            table_weights @ jnp.linalg.norm(table.grad, axis=1))
    data = concat_data(take_data(post.data, data_rows), new_data)
    # the old posterior with the past sites and the prior site divided out
    natural = family.natural(post.state)
    cavity = remove_site(remove_site(natural, past_sum), post.sites.prior_removal(family, natural))
    pick_sizes = (subset_bucket(past_batch), subset_bucket(new_batch))
    static = (replace(post.spec, num_examples=sum(pick_sizes)), family, post.rule, post.curvature,
              post.sites.storage, post.chunk_size)

    # the mean each row's site was computed at, tracked on the host: the returned sites get one
    # reference row per mean used (a few per step) instead of the table's one per example
    ref_pool = [np.asarray(past_sites.ref_means), np.asarray(post.state.mean)[None, :]]
    row_ref = np.concatenate([np.asarray(past_sites.ref_index), np.full(new_size, ref_pool[0].shape[0])])
    num_refs = ref_pool[0].shape[0] + 1
    rng = np.random.default_rng(seed)
    past_rows, new_rows = _Shuffler(rng, n, past_batch), _Shuffler(rng, num_new, new_batch)
    q, rho = post.state, jnp.asarray(1.0, dtype)
    steps: list[IterationInfo] = []
    touched, start = 0, time.perf_counter()
    for it in range(max_iters):
        chosen_past, chosen_new = past_rows.next(), new_rows.next()
        pick_past, w_past = _pad_rows(chosen_past, pick_sizes[0])
        pick_new, w_new = _pad_rows(past_size + chosen_new, pick_sizes[1])
        pick_host = np.concatenate([pick_past, pick_new])
        pick = to_device(pick_host.astype(np.int32))
        pick_weights = jnp.asarray(np.concatenate([w_past, w_new]), dtype)
        q_next, fresh, sums, res_mean, res_prec, step, ok = _sag_step(static, q, table, sums, data, pick,
                                                                      pick_weights, cavity, rho)
        row_ref[pick_host], num_refs = num_refs, num_refs + 1
        ref_pool.append(np.asarray(q.mean)[None, :])
        table, q = _write_rows(table, pick, fresh, q.mean), q_next
        touched += chosen_past.size
        if not bool(ok):
            raise NotPositiveDefiniteError("the stochastic correction's curvature estimate is not positive "
                                           "definite; use a larger batch_fraction or correction='exact'")
        res_mean, res_prec = float(res_mean), float(res_prec)
        steps.append(IterationInfo(iteration=it + 1, residual=max(res_mean, res_prec), residual_mean=res_mean,
                                     residual_precision=res_prec, step=float(step),
                                     seconds=time.perf_counter() - start))
        if it + 1 >= min_iters and max(res_mean, res_prec) < tol:
            break

    keep = np.concatenate([np.arange(n), past_size + np.arange(num_new)])
    used, ref_index = np.unique(row_ref[keep], return_inverse=True)
    fresh = replace(table.take(keep), ref_means=to_device(np.concatenate(ref_pool)[used]),
                    ref_index=to_device(ref_index.astype(np.int32)))
    if not steps[-1].residual <= tol and epochs is None:  # a NaN estimate is not converged either
        message = (f"stochastic correction stopped at estimated residual {steps[-1].residual:.2e} after "
                   f"{len(steps)} iterations")
        if raise_on_failure:
            raise ConvergenceError(message, posterior=(q, fresh), history=steps)
        warnings.warn(message, RuntimeWarning, stacklevel=4)
    steps.insert(0, IterationInfo(iteration=0, residual=float("nan"), step=0.0, seconds=0.0))
    return q, fresh, steps, touched
