r"""Streaming exact updates as pure functions of a fixed-capacity state (``jax.lax.scan``-able).

:meth:`DualPosterior.update <numpyro_pc.posterior.DualPosterior.update>` is a host-side
driver: it pads to buckets, checks every trial step and raises typed errors. This module is
the same exact update (``correction="exact"``: every retained example's site recomputed at
the new posterior, docs/adapting.md, "Adding data") written in the style of BlackJAX's
kernels and NumPyro's ``SVIState``: a pytree :class:`StreamState`, a static
:class:`StreamConfig`, and

.. code-block:: python

    state, info = stream_step(config, state, batch, mask)      # one batch, jittable
    state, info = delete_step(config, state, rows)             # exact deletion of table rows
    state, info = window_step(config, state, batch, mask)      # add a batch, forget the oldest rows
    state, infos = run_stream(config, state, batches, masks)   # T batches under lax.scan

The state holds a table of ``capacity`` examples (the retained data, weight 1 for live rows
and 0 for empty slots), so every step has the same shapes and the whole stream compiles
once. Each step writes the batch into the next free rows and runs natural-gradient steps
(paper App. A.3; :func:`iterate`, which first tries the Anderson extrapolation of the last
three steps, as the host solver does) on the whole table until the dual-form residual is
below ``tol`` — the fixed point of a batch fit on all the data seen.

Inside a trace nothing can raise, so a step reports instead: ``info.converged`` is false
when the residual did not reach ``tol`` in ``max_iters`` steps, when an iterate lost
finiteness or positive definiteness (the step stops at the last good iterate), or when the
batch did not fit in the table (``info.overflow``). :func:`run_stream` checks the capacity
on the host before tracing and raises :class:`~numpyro_pc.errors.InvalidOptionError`;
:func:`to_posterior` refuses a state whose last step did not converge.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from numpyro_pc.dual.base import DualPosteriorBase
from numpyro_pc.dual.build import build_posterior
from numpyro_pc.errors import ConvergenceError, DataShapeError, InvalidOptionError
from numpyro_pc.families.registry import Gaussian
from numpyro_pc.model.likelihood import ModelData
from numpyro_pc.protocols.capabilities import needs_dense_sum
from numpyro_pc.protocols.records import ExportInfo
from numpyro_pc.sites.gaussian import Sites, compute_sites
from numpyro_pc.solvers.fixed_point import (
    anderson_init,
    anderson_mix,
    anderson_push,
    anderson_restart,
    backtrack,
    default_tol,
)
from numpyro_pc.solvers.site_problem import live_totals

__all__ = ["StreamState", "StreamConfig", "StepInfo", "from_posterior", "stream_step", "window_step", "delete_step",
           "run_stream", "split_batches", "to_posterior", "IterateState", "iterate_init",
           "iterate_step", "iterate", "newton_terms"]


class StreamState(NamedTuple):
    """Numeric state of a stream (a pytree).

    :ivar q: the current posterior :class:`~numpyro_pc.families.registry.Gaussian`.
    :ivar data: the example table, ``capacity`` rows per per-example array (shared arrays
        as bound).
    :ivar weights: ``(capacity,)`` 1 for live examples, 0 for empty or masked slots.
    :ivar count: number of table rows used (live or masked).
    :ivar converged: whether the last step reached the tolerance.
    """

    q: Gaussian
    data: ModelData
    weights: jax.Array
    count: jax.Array
    converged: jax.Array


@dataclass(frozen=True)
class StreamConfig:
    """Static options of a stream (hashable; part of the compiled program's key).

    :ivar spec: the model binding, sized to the table (``num_examples = capacity``).
    :ivar family: the variational family.
    :ivar rule: the prepared expectation rule of the posterior the stream started from.
    :ivar curvature: ``"hessian"`` or ``"ggn"``.
    :ivar storage: the curvature storage's name.
    :ivar chunk_size: examples per chunk of the site computation (``None``: automatic).
    :ivar tol: residual tolerance of every step.
    :ivar max_iters: natural-gradient steps allowed per batch.
    """

    spec: object
    family: object
    rule: object
    curvature: str
    storage: str
    chunk_size: int | None
    tol: float
    max_iters: int = 50


class StepInfo(NamedTuple):
    """What one step did: final ``residual``, ``iterations`` taken, ``converged``, and
    ``overflow``: the step could not be taken (a batch larger than the free rows, a deleted
    row outside the table) and left the state unchanged."""

    residual: jax.Array
    iterations: jax.Array
    converged: jax.Array
    overflow: jax.Array


def from_posterior(post, capacity: int, tol: float | None = None,
                   max_iters: int = 50) -> tuple[StreamConfig, StreamState]:
    """Start a stream from a fitted posterior whose every site has its data retained.

    :param post: a :class:`~numpyro_pc.posterior.DualPosterior` (e.g. ``pc.fit`` on a first batch).
    :param int capacity: the most examples the stream will hold (its table size).
    :param float tol: residual tolerance (default: the dtype's, as :func:`pc.fit`).
    :param int max_iters: natural-gradient steps allowed per batch.
    :return: ``(config, state)``.
    :raises InvalidOptionError: examples without data (frozen sites), a non-zero offset, or a
        capacity below the number of examples already held.
    """
    num = post.num_examples
    if post.num_retained != num or post.offset is not None:
        raise InvalidOptionError(
            f"a stream recomputes every site from its data: this posterior keeps data for {post.num_retained} of "
            f"its {num} sites{' and carries an offset' if post.offset is not None else ''}; start from a "
            "posterior that keeps all its data (update(..., keep='all'))")
    capacity = int(capacity)
    if capacity < num:
        raise InvalidOptionError(f"capacity {capacity} is below the {num} examples the posterior already holds")
    dtype = post.state.mean.dtype
    data = post.data
    per_example = tuple(jnp.concatenate([x, jnp.zeros((capacity - num,) + x.shape[1:], x.dtype)])
                        if capacity > num else x for x in data.per_example)
    weights = jnp.concatenate([jnp.ones(num, dtype), jnp.zeros(capacity - num, dtype)])
    config = StreamConfig(replace(post.spec, num_examples=capacity), post.family, post.rule, post.curvature,
                          post.sites.storage, post.chunk_size, default_tol(dtype) if tol is None else float(tol),
                          int(max_iters))
    state = StreamState(post.state, ModelData(per_example, data.shared), weights, jnp.asarray(num, jnp.int32),
                        jnp.asarray(True))
    return config, state


_MIN_STEP = 2.0**-20


def _live_totals(config, q, sites, sums, weights, base, prior_live) -> tuple[Any, Any, Any, Any, Any]:
    """The live totals with the prior site live or (inside ``base``) fixed: one program for both."""
    family = config.family
    if isinstance(prior_live, bool):  # known when tracing: one branch (the family's terms may differ in structure)
        return live_totals(family, prior_live, q, sites, sums, base, weights)
    return jax.lax.cond(prior_live,
                        lambda: live_totals(family, True, q, sites, sums, base, weights),
                        lambda: live_totals(family, False, q, sites, sums, base, weights))


def newton_terms(config, q, data, ids, weights, base, prior_live) -> tuple[jax.Array, Sites, jax.Array, Any]:
    """Sites at ``q`` of the live rows ``(data, ids, weights)``, the residual there and the undamped
    step from it (the prior site live when ``prior_live``; ``base`` a fixed Gaussian factor)."""
    family = config.family
    spec = replace(config.spec, num_examples=int(ids.shape[0]))
    sites, sums = compute_sites(spec, data, family, q, config.rule, curvature=config.curvature,
                                storage=config.storage, chunk_size=config.chunk_size, ids=ids,
                                need_hessian_sum=needs_dense_sum(family, config.spec.latent.dim), weights=weights)
    grad, norms, target, dense, _ = _live_totals(config, q, sites, sums, weights, base, prior_live)
    precision, pre = family.fixed_point(q, target, dense)
    residual = jnp.maximum(jnp.linalg.norm(grad) / jnp.maximum(norms, jnp.finfo(grad.dtype).tiny),
                           family.precision_residual(q.precision, target))
    residual = jnp.where(jnp.all(jnp.isfinite(sites.grad)), residual, jnp.inf)
    # the family's traceable solve (dense Cholesky, or CG for the low-rank family); a failed
    # factorisation gives a non-finite step, which the iteration halves until it stops unconverged
    direction = -family.traced_precondition(pre, grad)
    return residual, sites, direction, precision


class IterateState(NamedTuple):
    """The carry of :func:`iterate`: the iterate and what its sites give.

    :ivar q: the current Gaussian.
    :ivar residual: its dual-form residual (``inf`` where its site gradients are not finite).
    :ivar sites: the live sites at ``q``.
    :ivar direction: the undamped mean step from ``q``.
    :ivar target: the undamped precision from ``q``.
    :ivar iteration: accepted steps.
    :ivar history: the :class:`~numpyro_pc.solvers.fixed_point.AndersonHistory`.
    :ivar stalled: no halving of the damped step down to ``2⁻²⁰`` is a proper Gaussian.
    """

    q: Gaussian
    residual: jax.Array
    sites: object
    direction: jax.Array
    target: jax.Array
    iteration: jax.Array
    history: object
    stalled: jax.Array


def iterate_init(config, q0, data, ids, weights, base, prior_live, memory=3) -> IterateState:
    """The carry of :func:`iterate` at ``q0`` (one site computation)."""
    return IterateState(q0, *newton_terms(config, q0, data, ids, weights, base, prior_live), jnp.asarray(0),
                        anderson_init(ravel_pytree(q0)[0], memory), jnp.asarray(False))


def iterate_step(config, state: IterateState, data, ids, weights, base, prior_live) -> IterateState:
    """One step of :func:`iterate` (pure, traceable): the Anderson extrapolation of the last undamped
    steps when it is a proper Gaussian that lowers the residual (Walker & Ni 2011, as the host
    solver), else the undamped step :func:`~numpyro_pc.solvers.fixed_point.backtrack`-ed until it is a
    proper Gaussian (a halved step restarts the extrapolation from the current point)."""
    family = config.family
    q = state.q
    x, unravel = ravel_pytree(q)
    history = anderson_push(state.history, x, ravel_pytree(Gaussian(q.mean + state.direction, state.target))[0] - x)

    def proper(trial) -> jax.Array:
        return jnp.all(jnp.isfinite(trial.mean)) & family.is_positive_definite(trial.precision)

    def evaluate(trial) -> tuple[Gaussian, jax.Array, Sites, jax.Array, Any]:
        return (trial, *newton_terms(config, trial, data, ids, weights, base, prior_live))

    accelerated = unravel(anderson_mix(history))

    def try_anderson(_) -> tuple[tuple[Gaussian, jax.Array, Sites, jax.Array, Any], jax.Array]:
        out = evaluate(accelerated)
        return out, out[1] < state.residual

    def skip(_) -> tuple[tuple[Gaussian, jax.Array, Sites, jax.Array, Any], jax.Array]:
        return (q, state.residual, state.sites, state.direction, state.target), jnp.asarray(False)

    candidate, better = jax.lax.cond((history.count > 1) & proper(accelerated), try_anderson, skip, None)

    def damped_at(rho) -> Gaussian:
        return Gaussian(q.mean + rho * state.direction, family.blend(q.precision, state.target, rho))

    def damped(_) -> IterateState:
        rho = backtrack(lambda r: proper(damped_at(r)), jnp.asarray(1.0, q.mean.dtype), _MIN_STEP)
        kept = jax.tree.map(lambda full, restarted: jnp.where(rho < 1.0, restarted, full),
                            history, anderson_restart(history, keep=1))
        stalled = rho < _MIN_STEP

        def advance(_) -> IterateState:
            return IterateState(*evaluate(damped_at(rho)), state.iteration + 1, kept, jnp.asarray(False))

        return jax.lax.cond(stalled, lambda _: state._replace(stalled=jnp.asarray(True)), advance, None)

    return jax.lax.cond(better, lambda _: IterateState(*candidate, state.iteration + 1, history, jnp.asarray(False)),
                        damped, None)


def iterate(config, q0, data, ids, weights, base, prior_live, memory=3) -> tuple[Gaussian, Sites, jax.Array, jax.Array]:
    """Natural-gradient steps from ``q0`` until the residual is below ``tol`` (pure; the kernels of this
    module and of :mod:`numpyro_pc.kernels.site_table`); returns ``q``, the live sites at ``q``, the
    residual and the steps taken (``config`` needs ``family, spec, rule, curvature, storage,
    chunk_size, tol, max_iters``).

    The traced driver of :func:`iterate_init` / :func:`iterate_step`: one ``lax.while_loop``
    that stops at the tolerance, after ``max_iters`` steps, or when the step stalls.
    """
    def cond(state) -> jax.Array:
        return (state.residual > config.tol) & (state.iteration < config.max_iters) & ~state.stalled

    state = jax.lax.while_loop(
        cond, lambda state: iterate_step(config, state, data, ids, weights, base, prior_live),
        iterate_init(config, q0, data, ids, weights, base, prior_live, memory))
    return state.q, state.sites, state.residual, state.iteration


def _solve(config, state, data, weights, count, extra_failure) -> tuple[StreamState, StepInfo]:
    """Natural-gradient steps on the table ``(data, weights)`` from ``state.q`` until the residual is
    below ``tol``; the new state, or the old one unchanged when ``extra_failure`` (e.g. an overflow)."""
    ids = jnp.arange(weights.shape[0])
    q, _, residual, iterations = iterate(config, state.q, data, ids, weights, None, True)
    converged = (residual <= config.tol) & ~extra_failure
    candidate = StreamState(q, data, weights, count, converged)
    unchanged = state._replace(converged=jnp.asarray(False))  # a step that cannot be taken changes nothing
    new_state = jax.tree.map(lambda old, new: jnp.where(extra_failure, old, new), unchanged, candidate)
    return new_state, StepInfo(residual, iterations, converged, extra_failure)


def _written(state, batch, mask, rows) -> tuple[ModelData, jax.Array]:
    """The table with the batch's rows written at table rows ``rows`` (weights: the mask)."""
    per_example = tuple(x.at[rows].set(b.astype(x.dtype)) for x, b in zip(state.data.per_example, batch.per_example))
    weights = state.weights.at[rows].set(mask.astype(state.weights.dtype))
    return ModelData(per_example, state.data.shared), weights


def stream_step(config: StreamConfig, state: StreamState, batch: ModelData,
                mask: jax.Array) -> tuple[StreamState, StepInfo]:
    """Add one batch and solve the exact update (pure; jit or scan it).

    :param StreamConfig config: static options (from :func:`from_posterior`).
    :param StreamState state: the stream so far.
    :param batch: the batch's :class:`~numpyro_pc.model.likelihood.ModelData` (``B`` rows; its
        shared arrays are ignored: the stream's are used).
    :param mask: ``(B,)`` booleans, false for padding rows (kept out of the posterior).
    :return: ``(state, StepInfo)``; a batch that does not fit in the free rows leaves the
        state unchanged with ``info.overflow`` set.
    """
    size = mask.shape[0]
    capacity = state.weights.shape[0]
    overflow = state.count + size > capacity
    rows = jnp.minimum(state.count, capacity - size) + jnp.arange(size)
    data, weights = _written(state, batch, mask, rows)
    return _solve(config, state, data, weights, state.count + size, overflow)


def window_step(config: StreamConfig, state: StreamState, batch: ModelData,
                mask: jax.Array) -> tuple[StreamState, StepInfo]:
    """Add one batch to a sliding window and solve (pure; jit or scan it).

    The table is a ring: the batch is written over the oldest ``B`` rows (table rows
    ``count, …, count + B − 1`` modulo the capacity), so once the table is full every step
    adds a batch *and* deletes the oldest examples, and the result is the batch posterior
    of the last ``capacity`` table rows — a moving-window posterior whose deletions are
    exact (every retained site is recomputed at the new posterior, as in
    ``post.delete(ids, method="corrected")``).
    """
    size = mask.shape[0]
    capacity = state.weights.shape[0]
    rows = (state.count + jnp.arange(size)) % capacity
    data, weights = _written(state, batch, mask, rows)
    return _solve(config, state, data, weights, state.count + size, jnp.asarray(size > capacity))


def delete_step(config: StreamConfig, state: StreamState, rows: jax.Array,
                valid: jax.Array | None = None) -> tuple[StreamState, StepInfo]:
    """Delete table rows exactly: the posterior of the remaining examples (pure; jit or scan it).

    Equals ``post.delete(ids, method="corrected")`` with all data retained, i.e. retraining
    without the rows (paper §3.2), reached by natural-gradient steps from the current ``q``.

    :param rows: ``(K,)`` table rows to delete (the order examples entered the stream:
        row ``j`` holds the ``j``-th example written, while the table has not wrapped).
    :param valid: ``(K,)`` booleans, false for padding entries of ``rows`` (default: all valid),
        so deletions of different sizes share one compiled program.
    :return: ``(state, StepInfo)``; ``info.overflow`` is set, and nothing deleted, when a valid
        row is outside the table.
    """
    rows = jnp.asarray(rows)
    valid = jnp.ones(rows.shape, bool) if valid is None else jnp.asarray(valid, bool)
    capacity = state.weights.shape[0]
    outside = jnp.any(valid & ((rows < 0) | (rows >= capacity)))
    keep = jnp.where(valid, 0.0, 1.0).astype(state.weights.dtype)
    weights = state.weights.at[jnp.clip(rows, 0, capacity - 1)].multiply(keep)
    return _solve(config, state, state.data, weights, state.count, outside)


def run_stream(config: StreamConfig, state: StreamState, batches: ModelData, masks: jax.Array,
               window: bool = False) -> tuple[StreamState, StepInfo]:
    """Run :func:`stream_step` (or :func:`window_step`) over ``T`` batches with ``jax.lax.scan``
    (one compilation).

    :param batches: :class:`~numpyro_pc.model.likelihood.ModelData` whose per-example arrays have
        leading axes ``(T, B)`` (see :func:`split_batches`).
    :param masks: ``(T, B)`` booleans.
    :param bool window: a sliding window over the table (:func:`window_step`): each batch
        replaces the oldest rows once the table is full.
    :return: ``(final state, StepInfo with a leading axis T)``.
    :raises InvalidOptionError: the batches do not fit in the table's free rows (or, with
        ``window``, one batch is larger than the table).
    """
    masks = jnp.asarray(masks, bool)
    steps, size = masks.shape
    capacity = int(state.weights.shape[0])
    free = capacity - int(state.count)
    if window and size > capacity:
        raise InvalidOptionError(f"a window of {capacity} rows cannot hold a batch of {size} rows")
    if not window and steps * size > free:
        raise InvalidOptionError(f"{steps} batches of {size} rows need {steps * size} free rows; the stream has "
                                 f"{free} (capacity {capacity}); start it with a larger capacity, or pass "
                                 "window=True for a sliding window")
    return _scan(config, bool(window), state, batches, masks)


@partial(jax.jit, static_argnums=(0, 1))
def _scan(config, window, state, batches, masks) -> tuple[StreamState, StepInfo]:
    step = window_step if window else stream_step

    def body(carry, xs) -> tuple[StreamState, StepInfo]:
        batch, mask = xs
        return step(config, carry, ModelData(batch, carry.data.shared), mask)

    return jax.lax.scan(body, state, (batches.per_example, masks))


def split_batches(data: ModelData, batch_size: int) -> tuple[ModelData, jax.Array]:
    """Rows of ``data`` (a :class:`~numpyro_pc.model.likelihood.ModelData`) as ``(batches, masks)``
    for :func:`run_stream`: ``T = ⌈N / batch_size⌉`` batches, the last padded with masked rows."""
    num = int(data.per_example[0].shape[0])
    if num == 0 or int(batch_size) < 1:
        raise DataShapeError(f"split_batches needs examples and a positive batch size, found N={num}, "
                             f"batch_size={batch_size}")
    steps = -(-num // int(batch_size))
    pad = steps * int(batch_size) - num
    per_example = tuple(jnp.reshape(jnp.concatenate([x, jnp.repeat(x[-1:], pad, 0)]) if pad else x,
                                    (steps, int(batch_size)) + x.shape[1:]) for x in data.per_example)
    masks = jnp.reshape(jnp.arange(steps * int(batch_size)) < num, (steps, int(batch_size)))
    return ModelData(per_example, data.shared), masks


def to_posterior(config: StreamConfig, state: StreamState, like) -> DualPosteriorBase:
    """The stream's posterior as a :class:`~numpyro_pc.posterior.DualPosterior` (sites recomputed once at ``q``).

    :param like: the posterior the stream started from (its class and guide are kept).
    :raises ConvergenceError: the last step did not converge.
    """
    if not bool(state.converged):
        raise ConvergenceError("the stream's last step did not reach its tolerance (see its StepInfo); its "
                               "posterior is not returned")
    live = np.flatnonzero(np.asarray(state.weights) > 0)
    data = ModelData(tuple(x[live] for x in state.data.per_example), state.data.shared)
    spec = replace(config.spec, num_examples=int(live.size))
    post = build_posterior(spec, data, config.family, state.q, config.rule, config.curvature, config.storage,
                           config.chunk_size, like.guide, False, None, 0, False, True, cls=type(like))
    return post.evolve(record=ExportInfo(operation="stream_state"))
