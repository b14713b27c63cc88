r"""Every correction as a pure function of a table of sites (``jax.jit``/``jax.lax.scan``-able).

:mod:`numpyro_pc.kernels.stream_state` holds the data and ``q`` only, which is enough for the exact
operations (every site recomputed). The approximate operations need the cached sites
themselves: the *stale* sites stand in for the examples that are not corrected. This
module keeps them in a fixed-capacity pytree :class:`TableState` — the posterior ``q``,
one site per table row (with the mean it was computed at), the rows' data, and the natural
parameters no site holds (``offset``), so that

.. math:: \lambda_q = \text{offset} + \hat\lambda_0 + \textstyle\sum_{i\,\in\,\text{sites}} \hat\lambda_i

(docs/notation.md, "Dual form") — and writes the operations of docs/adapting.md as pure
functions ``(config, state, …) → (state, StepInfo)``:

.. code-block:: python

    config, state = from_posterior(post, capacity=1000)
    state, info = correct_step(config, state, batch, mask, corrected, correct_prior)   # any correction
    state, info = stochastic_step(config, state, batch, mask, key, subset_size=64)     # SAG (site_table_sag)
    state, info = remove_step(config, state, rows, valid)                              # site removal
    state, info = forget_step(config, state, rows, valid, corrected, correct_prior)    # corrected deletion
    state = merge_tables(config, [state_a, state_b])                                   # Bayesian arithmetic
    post = to_posterior(config, state, like=post)

**One program for every correction.** ``corrected`` is a ``(capacity,)`` boolean mask of
the table rows whose sites are recomputed and ``correct_prior`` a traced boolean, so
``"none"`` (VCL: nothing corrected), ``"prior"``, ``"memory"`` (any subset, chosen on the
host or inside a scan, e.g. by :func:`random_memory`), ``"weighted"`` (``weight`` > 1) and
``"exact"`` (every row and the prior) are the same compiled step with other values. The
live terms — the new rows and the corrected ones — are gathered into ``work_size`` rows
(a static option, default the capacity), so a small memory costs a small site computation.

The update solves the dual-form problem with the cavity (paper eq. ``postcorr``)

.. math:: \lambda_{cav} = \lambda_q - w\textstyle\sum_{i\in C}\hat\lambda_i - [\hat\lambda_0]

as a fixed Gaussian factor by natural-gradient steps (paper App. A.3; a step that leaves
the positive-definite cone is halved), writes the fresh sites of the live rows into the
table, keeps the stale ones, and with ``w ≠ 1`` moves ``(w − 1)`` times the change of the
corrected sites into the offset — exactly the host driver
:func:`numpyro_pc.ops.streaming.update` does, to the solver's tolerance (tests:
``tests/kernels/test_site_table.py``). When every row and the prior are corrected, the cavity is
the offset itself rather than a difference of two large sums (as in
:mod:`numpyro_pc.ops.correction`).

Inside a trace nothing can raise: a step that does not reach ``tol`` in ``max_iters``
steps, leaves the cone, or does not fit the table (``info.overflow``) reports it, and a step
that cannot be taken leaves the state unchanged. :func:`to_posterior` refuses a state
whose last step did not converge. Families whose precision is a projection of the site
sum (no :class:`~numpyro_pc.protocols.capabilities.SiteSum`, e.g. the low-rank family) are refused: their stale
sites are not factors of ``q``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.dual.base import DualPosteriorBase, PosteriorState
from numpyro_pc.errors import ConvergenceError, InvalidOptionError
from numpyro_pc.families.registry import Gaussian, GaussianNatural, add_site, remove_site, scale_site
from numpyro_pc.model.likelihood import ModelData
from numpyro_pc.protocols.capabilities import SiteSum, require
from numpyro_pc.protocols.records import ExportInfo
from numpyro_pc.sites.gaussian import Sites
from numpyro_pc.solvers.fixed_point import default_tol
from numpyro_pc.solvers.site_problem import live_totals

from .stream_state import StepInfo, iterate

__all__ = ["TableState", "TableConfig", "from_posterior", "correct_step", "remove_step",
           "forget_step", "refine_step", "merge_tables", "random_memory", "table_residual", "to_posterior"]

class TableState(NamedTuple):
    """Numeric state of a posterior held as a table of sites (a pytree).

    :ivar q: the posterior :class:`~numpyro_pc.families.registry.Gaussian`.
    :ivar sites: :class:`~numpyro_pc.sites.gaussian.Sites` with ``capacity`` rows; row ``j`` was
        computed at ``sites.ref_means[j]``.
    :ivar data: the example table, ``capacity`` rows per per-example array.
    :ivar has_site: ``(capacity,)`` the row's site is a factor of ``q``.
    :ivar has_data: ``(capacity,)`` the row's data is held (it can be corrected).
    :ivar removed: ``(capacity,)`` the row's example was deleted (its id is a tombstone).
    :ivar offset: natural parameters attributed to no site.
    :ivar count: table rows used.
    :ivar next_id: the id the next new example gets.
    :ivar converged: whether the last step reached the tolerance.
    """

    q: Gaussian
    sites: Sites
    data: ModelData
    has_site: jax.Array
    has_data: jax.Array
    removed: jax.Array
    offset: GaussianNatural
    count: jax.Array
    next_id: jax.Array
    converged: jax.Array


@dataclass(frozen=True)
class TableConfig:
    """Static options of a table (hashable; part of the compiled program's key).

    :ivar spec: the model binding (any ``num_examples``; steps size it themselves).
    :ivar family: the variational family.
    :ivar rule: the prepared expectation rule.
    :ivar curvature: ``"hessian"`` or ``"ggn"``.
    :ivar storage: the curvature storage's name (the posterior's).
    :ivar chunk_size: examples per chunk of the site computation (``None``: automatic).
    :ivar tol: residual tolerance of every step.
    :ivar max_iters: natural-gradient steps allowed per step.
    :ivar work_size: most live rows (new plus corrected) one step computes sites for.
    """

    spec: object
    family: object
    rule: object
    curvature: str
    storage: str
    chunk_size: int | None
    tol: float
    max_iters: int
    work_size: int


def _zero_natural(family, q) -> GaussianNatural:
    natural = family.natural(q)
    return remove_site(natural, natural)


def _per_row(sites, capacity) -> Sites:
    """``sites`` padded to ``capacity`` rows, each row holding its own reference mean."""
    refs = sites.refs()
    extra = capacity - sites.num_examples
    padded = sites.padded(capacity, sites.ref_means.shape[0])
    refs = jnp.concatenate([refs, jnp.repeat(refs[-1:], extra, 0)]) if extra else refs
    return replace(padded, ref_means=refs, ref_index=jnp.arange(capacity, dtype=jnp.int32))


def from_posterior(post, capacity: int, work_size: int | None = None, tol: float | None = None,
                   max_iters: int = 50) -> tuple[TableConfig, TableState]:
    """The table of a fitted posterior: its sites, data, offset and ``q``.

    :param post: a :class:`~numpyro_pc.posterior.DualPosterior` (frozen sites — examples
        whose data was dropped — are kept as sites that cannot be corrected).
    :param int capacity: the most examples the table will hold.
    :param int work_size: the most live rows of one step (default ``capacity``).
    :param float tol: residual tolerance (default: the dtype's, as :func:`pc.fit`).
    :param int max_iters: natural-gradient steps allowed per step.
    :return: ``(config, state)``.
    :raises UnsupportedModelError: a family whose precision is not the sum of its sites.
    :raises InvalidOptionError: a capacity below the posterior's number of sites.
    """
    family = post.family
    require(family, SiteSum, "a site table (stale sites that are factors of q, corrected piecewise)",
            "Use numpyro_pc.kernels.stream_state (exact operations) or the posterior's own methods.")
    num = post.num_examples
    capacity = int(capacity)
    if capacity < num:
        raise InvalidOptionError(f"capacity {capacity} is below the {num} sites the posterior already holds")
    work_size = capacity if work_size is None else int(work_size)
    if not 1 <= work_size <= capacity:
        raise InvalidOptionError(f"work_size must be in [1, capacity={capacity}], got {work_size}")
    _, pstate, data = post.tree()
    site_ids = np.asarray(pstate.sites.ids)
    data_ids = np.asarray(pstate.data_ids)
    data_row = {int(i): k for k, i in enumerate(data_ids)}
    rows = np.asarray([data_row.get(int(i), -1) for i in site_ids], np.int64)
    held = rows >= 0
    per_example = []
    for x in data.per_example:
        template = jnp.zeros((capacity,) + x.shape[1:], x.dtype)
        if held.any():
            template = template.at[np.flatnonzero(held)].set(x[rows[held]])
        per_example.append(template)
    dtype = post.state.mean.dtype
    mask = lambda n: jnp.asarray(np.arange(capacity) < n)  # noqa: E731
    offset = _zero_natural(family, post.state) if post.offset is None else post.offset
    config = TableConfig(post.spec, family, post.rule, post.curvature, post.sites.storage, post.chunk_size,
                         default_tol(dtype) if tol is None else float(tol), int(max_iters), work_size)
    state = TableState(post.state, _per_row(pstate.sites, capacity), ModelData(tuple(per_example), data.shared),
                       mask(num), jnp.asarray(np.pad(held, (0, capacity - num))), jnp.zeros(capacity, bool), offset,
                       jnp.asarray(num, jnp.int32), jnp.asarray(int(post.next_id), jnp.int32), jnp.asarray(True))
    return config, state


# ---------------------------------------------------------------------------------- the solve
def gather(tree, index) -> Any:
    return jax.tree.map(lambda x: x[index], tree)


def live_set(config, state, live) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Indices of the live rows padded to ``work_size`` (padding points past the table), and overflow."""
    capacity = live.shape[0]
    index = jnp.nonzero(live > 0, size=config.work_size, fill_value=capacity)[0]
    valid = index < capacity
    return jnp.where(valid, index, 0), valid, jnp.sum(live > 0) > config.work_size


def write_sites(table, rows, valid, fresh, mean) -> Sites:
    """Write the live rows' fresh sites (computed at ``mean``) into the table; padding rows are dropped."""
    capacity = table.num_examples
    target = jnp.where(valid, rows, capacity)
    put = lambda a, b: a.at[target].set(b, mode="drop")  # noqa: E731
    refs = jnp.broadcast_to(mean, (rows.shape[0], mean.shape[0]))
    return replace(table, grad=put(table.grad, fresh.grad), curv=jax.tree.map(put, table.curv, fresh.curv),
                   loss=put(table.loss, fresh.loss), ref_means=put(table.ref_means, refs))


def with_prior_site(table, fresh) -> Sites:
    return replace(table, prior_grad=fresh.prior_grad, prior_curvature=fresh.prior_curvature,
                   prior_loss=fresh.prior_loss, prior_ref=fresh.prior_ref)


def choose(flag, new, old) -> Any:
    return jax.tree.map(lambda a, b: jnp.where(flag, a, b), new, old)


def _solve_corrected(config, state, table, data, has_data, new_rows, corrected, correct_prior, weight, dropped,
                     extra_failure) -> tuple[TableState, StepInfo]:
    """The corrected problem on the table (see the module docstring); ``dropped`` rows leave the posterior."""
    family = config.family
    sites = table
    dtype = state.q.mean.dtype
    corrected = corrected & state.has_site & has_data & ~dropped
    stale_w = (corrected | dropped).astype(dtype) * jnp.where(dropped, 1.0, weight)
    prior_site = sites.prior_removal(family, family.natural(state.q))
    every = jnp.all(corrected == (state.has_site & ~dropped)) & correct_prior & (weight == 1.0)
    difference = remove_site(family.natural(state.q), sites.natural_sum(family, stale_w))
    cavity = choose(every, state.offset, remove_site(difference, prior_site, correct_prior.astype(dtype)))
    live = corrected.astype(dtype) * weight + new_rows.astype(dtype)
    index, valid, too_many = live_set(config, state, live)
    work = ModelData(gather(data.per_example, index), data.shared)
    weights = jnp.where(valid, live[index], 0.0)
    # the cavity keeps the prior site when it is not corrected
    q, fresh, residual, iterations = iterate(config, state.q, work, sites.ids[index], weights, cavity,
                                              correct_prior)
    failure = extra_failure | too_many
    converged = (residual <= config.tol) & ~failure
    table = write_sites(table, index, valid, fresh, q.mean)
    table = choose(correct_prior, with_prior_site(table, fresh), table)
    # λ_{t+1} − Σ sites: the part of a scaled correction no site holds (nothing, and no pass over
    # the table, when w = 1)
    def scaled_change(_) -> GaussianNatural:
        changed = remove_site(table.natural_sum(family, corrected.astype(dtype)),
                              sites.natural_sum(family, corrected.astype(dtype)))
        return add_site(state.offset, scale_site(changed, weight - 1.0))

    offset = jax.lax.cond(weight != 1.0, scaled_change, lambda _: state.offset, None)
    has_site = (state.has_site | new_rows) & ~dropped
    candidate = TableState(q, table, data, has_site, has_data & ~dropped, state.removed | dropped, offset,
                           state.count, state.next_id, converged)
    return candidate, StepInfo(residual, iterations, converged, failure)


def finish(state, candidate, info, count, next_id) -> tuple[TableState, StepInfo]:
    """The candidate (with the new row count and ids) unless the step could not be taken at all."""
    candidate = candidate._replace(count=jnp.asarray(count, state.count.dtype),
                                   next_id=jnp.asarray(next_id, state.next_id.dtype))
    unchanged = state._replace(converged=jnp.asarray(False))
    return choose(info.overflow, unchanged, candidate), info


def written_batch(state, batch, mask) -> tuple[Sites, ModelData, jax.Array, jax.Array, jax.Array]:
    """Write the batch into the next free rows: ``(table sites, data, has_data, new-row mask, ids, overflow)``."""
    size = mask.shape[0]
    capacity = state.has_site.shape[0]
    overflow = state.count + size > capacity
    rows = jnp.minimum(state.count, capacity - size) + jnp.arange(size)
    ids = state.next_id + jnp.cumsum(mask.astype(jnp.int32)) - 1
    per_example = tuple(x.at[rows].set(b.astype(x.dtype)) for x, b in zip(state.data.per_example, batch.per_example))
    sites = replace(state.sites, ids=state.sites.ids.at[rows].set(ids.astype(state.sites.ids.dtype)))
    new_rows = jnp.zeros(capacity, bool).at[rows].set(mask)
    has_data = state.has_data | new_rows
    return sites, ModelData(per_example, state.data.shared), has_data, new_rows, overflow


def correct_step(config: TableConfig, state: TableState, batch: ModelData, mask: jax.Array, corrected: jax.Array,
                 correct_prior=True, weight=1.0) -> tuple[TableState, StepInfo]:
    """Add a batch with any correction: the rows ``corrected`` and, if ``correct_prior``, the prior site
    (pure; jit or scan it; docs/adapting.md, "Adding data").

    ``corrected`` all false and ``correct_prior=False`` is VCL (``correction="none"``); all
    retained rows and the prior is the exact update; ``weight`` > 1 scales the corrections
    (``"weighted"``).

    :param batch: the batch's :class:`~numpyro_pc.model.likelihood.ModelData` (``B`` rows).
    :param mask: ``(B,)`` booleans, false for padding rows.
    :param corrected: ``(capacity,)`` booleans: table rows whose sites are recomputed (rows
        without data or without a site are ignored).
    :param correct_prior: traced boolean.
    :param weight: traced scalar weight of the corrections.
    :return: ``(state, StepInfo)``; a batch that does not fit the free rows, or more live rows
        than ``work_size``, leaves the state unchanged with ``info.overflow`` set.
    """
    sites, data, has_data, new_rows, overflow = written_batch(state, batch, jnp.asarray(mask, bool))
    dtype = state.q.mean.dtype
    candidate, info = _solve_corrected(config, state, sites, data, has_data, new_rows, jnp.asarray(corrected, bool),
                                       jnp.asarray(correct_prior, bool), jnp.asarray(weight, dtype),
                                       jnp.zeros_like(new_rows), overflow)
    size = jnp.sum(jnp.asarray(mask, jnp.int32))
    return finish(state, candidate, info, state.count + mask.shape[0], state.next_id + size)


def _rows_mask(state, rows, valid) -> tuple[jax.Array, jax.Array]:
    capacity = state.has_site.shape[0]
    rows = jnp.asarray(rows)
    valid = jnp.ones(rows.shape, bool) if valid is None else jnp.asarray(valid, bool)
    outside = jnp.any(valid & ((rows < 0) | (rows >= capacity)))
    target = jnp.where(valid, rows, capacity)
    return jnp.zeros(capacity, bool).at[target].set(True, mode="drop") & state.has_site, outside


def forget_step(config: TableConfig, state: TableState, rows: jax.Array, valid: jax.Array | None = None,
                corrected: jax.Array | None = None, correct_prior=True) -> tuple[TableState, StepInfo]:
    """Delete table rows, correcting the rows ``corrected`` (default: every row with data) and the prior.

    With every remaining row corrected this is ``post.delete(ids, method="corrected")``: the
    posterior of the remaining examples (paper §3.2); with a memory it is the deletion
    analogue of the memory correction. Pure; jit or scan it.

    :param rows: ``(K,)`` table rows to delete; ``valid``: ``(K,)`` false for padding entries.
    :return: ``(state, StepInfo)``; ``info.overflow`` (nothing deleted) when a valid row is
        outside the table.
    """
    dropped, outside = _rows_mask(state, rows, valid)
    corrected = state.has_data if corrected is None else jnp.asarray(corrected, bool)
    dtype = state.q.mean.dtype
    candidate, info = _solve_corrected(config, state, state.sites, state.data, state.has_data,
                                       jnp.zeros_like(dropped), corrected, jnp.asarray(correct_prior, bool),
                                       jnp.asarray(1.0, dtype), dropped, outside)
    return finish(state, candidate, info, state.count, state.next_id)


def refine_step(config: TableConfig, state: TableState) -> tuple[TableState, StepInfo]:
    """Recompute every site that has its data, and the prior site, until the residual is below ``tol``
    (the posterior of the table's examples; e.g. after :func:`merge_tables`). Pure; jit it."""
    return forget_step(config, state, jnp.zeros(1, jnp.int32), jnp.zeros(1, bool))


def remove_step(config: TableConfig, state: TableState, rows: jax.Array,
                valid: jax.Array | None = None) -> tuple[TableState, StepInfo]:
    r"""Delete table rows by dividing their sites out, ``λ ← λ − Σ_{i∈D} λ̂_i`` (site removal, paper §3.2).

    No site is recomputed; ``info.residual`` is the dual-form residual of the result over
    the table's own (stale) sites, which is zero up to rounding by construction. A result
    that is not positive definite is refused (``info.converged`` false, state unchanged).

    :return: ``(state, StepInfo)``.
    """
    family = config.family
    dropped, outside = _rows_mask(state, rows, valid)
    dtype = state.q.mean.dtype
    natural = remove_site(family.natural(state.q), state.sites.natural_sum(family, dropped.astype(dtype)))
    q = family.from_natural(natural)
    proper = jnp.all(jnp.isfinite(q.mean)) & family.is_positive_definite(q.precision)
    candidate = state._replace(q=q, has_site=state.has_site & ~dropped, has_data=state.has_data & ~dropped,
                               removed=state.removed | dropped)
    residual = table_residual(config, candidate)
    converged = proper & ~outside & jnp.isfinite(residual)
    info = StepInfo(residual, jnp.asarray(0), converged, outside | ~proper)
    return finish(state, candidate._replace(converged=converged), info, state.count, state.next_id)


def table_residual(config: TableConfig, state: TableState) -> jax.Array:
    """Dual-form residual of ``q`` against the table's own sites, offset and prior site (no model
    evaluation: the identity ``λ = offset + λ̂_0 + Σ λ̂_i`` checked where it is cheap)."""
    family = config.family
    weights = state.has_site.astype(state.q.mean.dtype)
    grad, norms, target, _, _ = live_totals(family, True, state.q, state.sites, None, state.offset, weights)
    return jnp.maximum(jnp.linalg.norm(grad) / jnp.maximum(norms, jnp.finfo(grad.dtype).tiny),
                       family.precision_residual(state.q.precision, target))


def random_memory(key: jax.Array, state: TableState, size: int) -> jax.Array:
    """A ``(capacity,)`` mask of ``size`` rows drawn uniformly without replacement among the rows
    that hold a site and their data (all of them when fewer); traceable."""
    eligible = state.has_site & state.has_data
    keys = jnp.where(eligible, jax.random.uniform(key, eligible.shape), 2.0)
    order = jnp.argsort(keys)
    chosen = jnp.zeros(eligible.shape, bool).at[order[:size]].set(True)
    return chosen & eligible


# ---------------------------------------------------------------------------------- merging, export
def merge_tables(config: TableConfig, states, alphas=None,
                 capacity: int | None = None) -> tuple[TableConfig, TableState]:
    r"""Merge tables of posteriors fitted on disjoint data (paper §3.3; docs/merging.md).

    Each table's likelihood part is its dual form without its prior site,
    ``λ_k − λ̂_{0,k} = offset_k + Σ_{i∈k} λ̂_i``, so Bayesian arithmetic from the prior is

    .. math:: \lambda = \hat\lambda_0 + \textstyle\sum_k \alpha_k\,(\text{offset}_k + \sum_{i\in k}\hat\lambda_i),

    the dual form of the union of the data (``α_k = 1``) with the first table's prior site:
    the sites are concatenated and the scaled remainder goes to the offset. A
    :func:`refine_step` then reaches the joint posterior. With a
    Gaussian prior and unit weights, ``q`` equals ``pc.merge(None, posteriors)``'s.

    :param states: :class:`TableState` s of the same model, family and configuration.
    :param alphas: one weight per table (default all 1).
    :param int capacity: rows of the merged table (default the sum of the capacities).
    :return: ``(config, state)``: the configuration with ``work_size`` the merged capacity, and the
        merged :class:`TableState` (rows: each table's used rows in turn, then free rows; ids renumbered).
    :raises InvalidOptionError: no tables, a wrong number of weights, or too small a capacity.
    """
    states = list(states)
    if not states:
        raise InvalidOptionError("merge_tables needs at least one table")
    alphas = [1.0] * len(states) if alphas is None else [float(a) for a in np.ravel(alphas)]
    if len(alphas) != len(states):
        raise InvalidOptionError(f"got {len(alphas)} alphas for {len(states)} tables")
    family = config.family
    counts = [int(s.count) for s in states]
    capacity = sum(int(s.has_site.shape[0]) for s in states) if capacity is None else int(capacity)
    if capacity < sum(counts):
        raise InvalidOptionError(f"capacity {capacity} is below the {sum(counts)} rows the tables use")
    dtype = states[0].q.mean.dtype
    first = states[0]
    prior = first.sites.prior_natural(family)
    natural, offset = prior, _zero_natural(family, first.q)
    for a, s, n in zip(alphas, states, counts):
        own = add_site(s.offset, s.sites.natural_sum(family, s.has_site.astype(dtype)))
        natural = add_site(natural, own, a)
        offset = add_site(offset, add_site(scale_site(s.offset, a), s.sites.natural_sum(family, s.has_site.astype(dtype)),
                                           a - 1.0))
    free = capacity - sum(counts)

    def joined(get, fill=None) -> Any:
        """The used rows of every table in turn, then ``free`` rows (copies of the last, or ``fill``)."""
        parts = [jax.tree.map(lambda x, n=n: x[:n], get(s)) for s, n in zip(states, counts)]
        out = jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)
        pad = (lambda x: jnp.repeat(x[-1:], free, 0)) if fill is None else (lambda x: jnp.full((free,), fill))
        return jax.tree.map(lambda x: jnp.concatenate([x, pad(x)]) if free else x, out)

    sites = replace(first.sites, grad=joined(lambda s: s.sites.grad), curv=joined(lambda s: s.sites.curv),
                    loss=joined(lambda s: s.sites.loss), ref_means=joined(lambda s: s.sites.ref_means),
                    ids=jnp.arange(capacity, dtype=first.sites.ids.dtype),
                    ref_index=jnp.arange(capacity, dtype=jnp.int32))
    per_example = joined(lambda s: s.data.per_example)
    has_site, has_data = joined(lambda s: s.has_site, False), joined(lambda s: s.has_data, False)
    q = family.from_natural(natural)
    return replace(config, work_size=capacity), TableState(q, sites, ModelData(per_example, first.data.shared), has_site, has_data,
                      jnp.zeros(capacity, bool), offset, jnp.asarray(sum(counts), jnp.int32),
                      jnp.asarray(capacity, jnp.int32),
                      jnp.asarray(bool(family.is_positive_definite(q.precision))))


def to_posterior(config: TableConfig, state: TableState, like) -> DualPosteriorBase:
    """The table's posterior as a :class:`~numpyro_pc.posterior.DualPosterior` (no site recomputed).

    :param like: the posterior the table started from (its class, guide and tombstones are kept).
    :raises ConvergenceError: the last step did not converge.
    """
    if not bool(state.converged):
        raise ConvergenceError("the table's last step did not converge (see its StepInfo); its posterior is not "
                               "returned")
    has_site = np.asarray(state.has_site)
    rows = np.flatnonzero(has_site)
    sites = state.sites.take(rows)
    refs, ref_index = np.unique(np.asarray(sites.refs()), axis=0, return_inverse=True)
    sites = replace(sites, ref_means=jnp.asarray(refs), ref_index=jnp.asarray(np.ravel(ref_index), jnp.int32))
    data_rows = np.flatnonzero(has_site & np.asarray(state.has_data))
    data = ModelData(tuple(x[data_rows] for x in state.data.per_example), state.data.shared)
    ids = np.asarray(state.sites.ids)
    tombstones = np.union1d(np.asarray(like.tombstones, np.int64), ids[np.asarray(state.removed)])
    offset = state.offset
    if all(not np.any(np.asarray(x)) for x in jax.tree.leaves(offset)) and like.offset is None:
        offset = None
    spec = replace(config.spec, num_examples=int(data_rows.size))
    pconfig = replace(like.config, spec=spec)
    pstate = PosteriorState(state.q, sites, offset, jnp.asarray(ids[data_rows]), jnp.asarray(tombstones),
                            jnp.asarray(int(state.next_id)))
    return type(like).from_tree(pconfig, pstate, data, history=(), guide=like.guide,
                                record=ExportInfo(operation="site_table"))
