r"""The ``"stochastic"`` correction as a pure function of a table of sites (SAG; ``jax.lax.scan``-able).

The jittable twin of :mod:`numpyro_pc.ops.stochastic` on a :class:`~numpyro_pc.kernels.site_table.TableState`:
see :func:`stochastic_step`.
"""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp

from numpyro_pc.errors import InvalidOptionError
from numpyro_pc.families.registry import Gaussian, GaussianNatural, add_site, remove_site
from numpyro_pc.model.likelihood import ModelData
from numpyro_pc.protocols.capabilities import gaussian_solver
from numpyro_pc.sites.gaussian import Sites, compute_sites

from .site_table import (
    TableConfig,
    TableState,
    choose,
    finish,
    gather,
    live_set,
    with_prior_site,
    write_sites,
    written_batch,
)
from .stream_state import StepInfo

__all__ = ["stochastic_step"]


def _sag_sums(family, table, weights) -> tuple[GaussianNatural, jax.Array]:
    natural = table.natural_sum(family, weights)
    return natural, weights @ jnp.linalg.norm(table.grad, axis=1)


def stochastic_step(config: TableConfig, state: TableState, batch: ModelData, mask: jax.Array, key: jax.Array,
                    subset_size: int, max_passes: int = 20) -> tuple[TableState, StepInfo]:
    r"""Add a batch with the ``"stochastic"`` correction: SAG over the table (pure; jit or scan it).

    The rows to correct are every row with a site and data, plus the new rows; each
    iteration recomputes the sites of ``subset_size`` of them at the current ``q`` (random
    reshuffling: a fresh permutation per pass), keeps the table's natural-parameter sums
    up to date and takes the full natural-gradient step those sums give (as
    :mod:`numpyro_pc.ops.stochastic`), so the iteration converges to the exact update while
    touching one subset per step. It stops once the estimated residual is below ``tol``
    after at least two passes, or after ``max_passes`` passes (``info.converged`` false).
    Full family only (the step's preconditioner is the table's curvature sum).

    :param key: a ``jax.random`` key (traced: every step may get its own).
    :param int subset_size: rows recomputed per iteration (static).
    :param int max_passes: passes over the rows allowed (static).
    :return: ``(state, StepInfo)`` with ``iterations`` the SAG steps taken.
    """
    family = config.family
    if gaussian_solver(family).dense_sum:
        raise InvalidOptionError(f"stochastic_step needs the full family (found {family.name}): the table's "
                                 "curvature sum preconditions each step")
    mask = jnp.asarray(mask, bool)
    table, data, has_data, new_rows, overflow = written_batch(state, batch, mask)
    capacity = state.has_site.shape[0]
    subset_size = int(min(subset_size, capacity))
    dtype = state.q.mean.dtype
    q0 = state.q
    new_index, new_valid, _ = live_set(replace(config, work_size=mask.shape[0]), state, new_rows.astype(dtype))
    new_sites, _ = compute_sites(replace(config.spec, num_examples=mask.shape[0]),
                                 ModelData(gather(data.per_example, new_index), data.shared), family, q0, config.rule,
                                 curvature=config.curvature, storage=config.storage, chunk_size=config.chunk_size,
                                 ids=table.ids[new_index])
    table = write_sites(table, new_index, new_valid, new_sites, q0.mean)
    past = state.has_site & has_data
    live = past | new_rows
    every = jnp.all(past == state.has_site)
    stale_sum = state.sites.natural_sum(family, past.astype(dtype))
    difference = remove_site(remove_site(family.natural(q0), stale_sum), state.sites.prior_removal(family, family.natural(q0)))
    cavity = choose(every, state.offset, difference)
    sums = _sag_sums(family, table, live.astype(dtype))
    num_live = jnp.sum(live)
    steps_per_pass = (num_live + subset_size - 1) // subset_size
    spec = replace(config.spec, num_examples=subset_size)

    def shuffle(k) -> jax.Array:
        return jnp.argsort(jnp.where(live, jax.random.uniform(k, (capacity,)), 2.0))

    def cond(c) -> jax.Array:
        it, residual, ok = c[0], c[5], c[6]
        return ok & (it < max_passes * steps_per_pass) & ~((it >= 2 * steps_per_pass) & (residual <= config.tol))

    def body(c) -> tuple[jax.Array, Gaussian, Sites, tuple[GaussianNatural, jax.Array], tuple[jax.Array, jax.Array, jax.Array], jax.Array, jax.Array]:
        it, q, table, (natural, grad_norms), (order, pos, k), _, _ = c
        pick = jax.lax.dynamic_slice(order, (jnp.minimum(pos, capacity - subset_size),), (subset_size,))
        weights = ((jnp.minimum(pos, capacity - subset_size) + jnp.arange(subset_size)) < num_live).astype(dtype)
        weights = weights * ((jnp.minimum(pos, capacity - subset_size) + jnp.arange(subset_size)) >= pos)
        subset = ModelData(gather(data.per_example, pick), data.shared)
        fresh, _ = compute_sites(spec, subset, family, q, config.rule, curvature=config.curvature,
                                 storage=config.storage, chunk_size=config.chunk_size, ids=table.ids[pick])
        old = table.take(pick)
        gained, lost = fresh.natural_sum(family, weights), old.natural_sum(family, weights)
        natural = add_site(remove_site(natural, lost), gained)
        grad_norms = grad_norms + weights @ (jnp.linalg.norm(fresh.grad, axis=1) - jnp.linalg.norm(old.grad, axis=1))
        grad = (natural.precision @ q.mean - natural.linear + fresh.prior_grad + cavity.precision @ q.mean
                - cavity.linear)
        target = natural.precision + family.project_curvature(fresh.prior_curvature) + cavity.precision
        mean = q.mean - jax.scipy.linalg.cho_solve((jnp.linalg.cholesky(target), True), grad)
        residual = jnp.maximum(jnp.linalg.norm(grad) / (jnp.linalg.norm(fresh.prior_grad) + grad_norms),
                               jnp.linalg.norm(target - q.precision) / jnp.linalg.norm(target))
        table = with_prior_site(write_sites(table, pick, weights > 0, fresh, q.mean), fresh)
        q_next = Gaussian(mean, target)
        ok = jnp.all(jnp.isfinite(mean)) & family.is_positive_definite(target)
        pos = pos + subset_size
        k, sub = jax.random.split(k)
        order, pos = jax.lax.cond(pos >= num_live, lambda: (shuffle(sub), jnp.asarray(0)), lambda: (order, pos))
        return it + 1, choose(ok, q_next, q), table, (natural, grad_norms), (order, pos, k), residual, ok

    key, sub = jax.random.split(key)
    start = (jnp.asarray(0), q0, table, sums, (shuffle(sub), jnp.asarray(0), key), jnp.asarray(jnp.inf, dtype),
             jnp.asarray(True))
    iterations, q, table, _, _, residual, ok = jax.lax.while_loop(cond, body, start)
    converged = ok & (residual <= config.tol) & ~overflow
    candidate = TableState(q, table, data, state.has_site | new_rows, has_data, state.removed, state.offset,
                           state.count, state.next_id, converged)
    info = StepInfo(residual, iterations, converged, overflow)
    return finish(state, candidate, info, state.count + mask.shape[0], state.next_id + jnp.sum(mask))
