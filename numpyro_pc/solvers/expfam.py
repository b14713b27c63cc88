r"""The exponential-family fixed point over a set of examples: the target and the solve.

The natural-gradient iteration of :func:`~numpyro_pc.solvers.expfam.blr_solve` looks for
:math:`\lambda = \tau(\lambda)` with :math:`\tau(\lambda) = c - \sum_i w_i g_i(\lambda) [- g_0(\lambda)]`
(paper eq. ``qdualform`` in the natural parameters): ``c`` holds the sites that stay fixed, the
sum runs over the active examples. :func:`bucketed_target` pads the active rows to a bucket so
that batches of other sizes reuse one compiled site computation; :func:`solve_every_site` is
the batch fixed point (fit, exact update, corrected deletion, refined merge) with the
independent-points check of its Monte Carlo or cubature error.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.errors import ConvergenceError, MonteCarloErrorWarning, NonFiniteResultError, OutOfDomainError
from numpyro_pc.model.rows import pad_to_bucket, stand_in_row
from numpyro_pc.protocols.posterior import Posterior
from numpyro_pc.protocols.records import ExpectationError, FitInfo
from numpyro_pc.sites.expfam import EFConfig, compute_sites
from numpyro_pc.sites.expfam_table import EFSiteTable, EFState

from . import fixed_point
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["SolveInfo", "blr_solve", "relative_residual", "bucketed_target", "config_rows", "fixed_part",
           "solve_every_site", "coarse_config", "trimmed"]

_P = TypeVar("_P", bound=Posterior)


@partial(jax.jit, static_argnums=0)
def _target(config, lam, data, prior_active, const, weights, seed) -> tuple[Any, Any]:
    """:math:`\\tau(\\lambda) = c - \\sum_i w_i g_i(\\lambda) [- g_0(\\lambda)]` and the sites at ``lam``
    (``weights`` 0 on the rows that only pad the data to its bucket). ``prior_active`` is traced: the sites,
    the prior's included, are computed either way, so one program serves both."""
    sites = compute_sites(config, lam, data, seed)
    tau = const - weights @ jnp.where(weights[:, None] > 0, sites.grads, 0.0)  # a weight-0 row adds nothing
    return jnp.where(prior_active, tau - sites.prior, tau), sites


def bucketed_target(config, data, prior_active, const, seed=None, trim=True) -> Callable:
    """``λ -> (τ(λ), sites)`` over ``data`` padded to :func:`numpyro_pc.model.rows.bucket_size` rows
    (repeats of the last row with weight 0), so that batches of other sizes reuse the same
    compiled site computation; the sites returned are those of the real rows (with ``trim=False``,
    those of every padded row: a solve trims only the sites it returns). With no rows (every
    example's data dropped or deleted) the model is traced on one row of zeros at weight 0: the target
    is then the prior term and the fixed sites alone."""
    cfg, padded, weights, num = _padded(config, data, const.dtype)
    seed = jnp.asarray(config.seed if seed is None else seed, jnp.uint32)

    def target(lam: jax.Array) -> tuple[jax.Array, object]:
        tau, sites = _target(cfg, lam, padded, prior_active, const, weights, seed)
        return tau, trimmed(sites, num) if trim else sites

    return target


def _padded(config, data, dtype) -> tuple[EFConfig, object, jax.Array, int]:
    """``data`` padded to its bucket with the weights marking the real rows, the configuration for that many
    rows, and the number of real rows (one stand-in row at weight 0 when there are none)."""
    num = int(data.per_example[0].shape[0])
    if num:
        padded, weights, _ = pad_to_bucket(data, None, np.arange(num), dtype)
    else:
        padded, weights = stand_in_row(data), jnp.zeros(1, dtype)
    return config_rows(config, int(weights.shape[0])), padded, weights, num


@partial(jax.jit, static_argnums=0)
def _device_solve(config, lam, data, prior_active, const, weights, seed, tol, max_iters, rho
                  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The natural-parameter iteration of :func:`blr_solve` as one compiled loop
    (:func:`~numpyro_pc.solvers.fixed_point.natural_solve`), in the family's domain: ``(λ, iterations,
    residual, ok)``. Compiled once per configuration (the family hashes by value)."""

    def target(x) -> tuple[jax.Array, tuple]:
        return _target(config, x, data, prior_active, const, weights, seed)[0], ()

    lam, _, iterations, residual, ok = fixed_point.natural_solve(target, config.family.in_domain, lam, tol, max_iters,
                                                                 rho)
    return lam, iterations, residual, ok


def trimmed(sites, num: int) -> object:
    """The sites of the first ``num`` (the real) rows of a padded site computation."""
    return sites._replace(grads=sites.grads[:num], residual=sites.residual[:num])


def config_rows(config: EFConfig, num: int) -> EFConfig:
    """``config`` for ``num`` examples (the static size the site computation is compiled for)."""
    return replace(config, spec=replace(config.spec, num_examples=num))


def fixed_part(post, frozen: EFSiteTable | None = None) -> jax.Array:
    r"""The constant of a fixed point over ``post``'s retained data:
    :math:`c = \lambda_0 + \sum_{i\,\text{frozen}} \hat\lambda_i` (the prior term when conjugate-form,
    and the ``frozen`` sites, those whose data was dropped; zero without either)."""
    const = post.sites.prior_natural() if post.conjugate_prior else jnp.zeros_like(post.natural)
    return const + frozen.natural_sum() if frozen is not None and frozen.num_examples else const


def solve_every_site(post: _P, data, ids, start, tol, max_iters, raise_on_failure, progress=False,
                     rho=1.0, frozen: EFSiteTable | None = None, warm: bool = True) -> _P:
    """``post`` solved to the fixed point over all ``data`` (every site active, ids ``ids``) from the
    natural parameters ``start``; the prior term is active unless conjugate-form. Its ``record`` is a
    :class:`~numpyro_pc.protocols.records.FitInfo` (callers that are not a fit take its
    :meth:`~numpyro_pc.protocols.records.SolveFields.solve_fields`).

    :param frozen: sites held fixed, those of examples whose data was dropped (``update(keep=...)``):
        their natural-parameter sum is part of the constant, and they stay in the result's site table
        before the solved ones; the result keeps the data of ``ids`` only.
    :param bool warm: ``start`` may already be the fixed point (``False`` for a fit from the prior, see
        :func:`_coarse_start`)."""
    num = int(ids.shape[0])
    cfg = config_rows(post.config, num)
    tol = fixed_point.default_tol(start.dtype) if tol is None else tol
    const = fixed_part(post, frozen)
    target = bucketed_target(cfg, data, not post.conjugate_prior, const, trim=False)
    start, first, coarse_iterations = _coarse_start(cfg, target, (data, not post.conjugate_prior, const), start, tol,
                                                    max_iters, rho, warm)
    lam, sites, info = blr_solve(target, post.family.in_domain, start, tol, max_iters, rho=rho,
                                 raise_on_failure=raise_on_failure, progress=progress, first=first)
    sites = trimmed(sites, num)
    prior = post.sites.prior if post.conjugate_prior else sites.prior
    table = EFSiteTable(sites.grads, prior, ids)
    if frozen is not None and frozen.num_examples:
        table = frozen.concat(table)
    error = (_draw_error(cfg, data, not post.conjugate_prior, const, lam, tol)
             if cfg.rule != "quadrature" and info.converged else None)
    record = FitInfo(**info._asdict(), max_site_nonlinearity=float(jnp.max(sites.residual)) if num else 0.0,
                     expectation_error=error, coarse_iterations=coarse_iterations)
    return post.evolve(config=cfg, data=data, state=EFState(lam, table), record=record, stale_sites=False,
                       data_ids=ids if frozen is not None and frozen.num_examples else None)


COARSE_NODES = 8  # Gauss nodes per scalar site of the first solve of a product with Gaussian blocks


def coarse_config(config: EFConfig) -> EFConfig | None:
    """The design of the first, cheaper solve of :func:`solve_every_site`, or ``None`` when there is none.

    A product with Gaussian blocks (rules ``"cubature"`` and ``"mixed"``) couples its factors, so its
    solve takes tens of iterations, each a site pass over the tensor grid of the scalar sites' Gauss
    nodes times the blocks' points. The same design with :data:`COARSE_NODES` nodes per scalar site
    reaches nearly the same fixed point at a fraction of the cost per pass (4x fewer points for one
    scalar site at the default 32 nodes). ``None`` where it would not be cheaper: other rules, a design
    with that few nodes already, or a grid that does not shrink (discrete factors enumerate their values
    whatever the nodes; Gaussian blocks alone have no grid).
    """
    if config.rule not in ("cubature", "mixed") or config.num_nodes <= COARSE_NODES:
        return None
    if config.family.grid_size(COARSE_NODES) >= config.family.grid_size(config.num_nodes):
        return None
    return replace(config, num_nodes=COARSE_NODES)


def _coarse_start(config, target, target_args, start, tol, max_iters, rho, warm=True
                  ) -> tuple[jax.Array, tuple | None, int | None]:
    """Where the solve under ``config`` starts: ``(start, first, coarse_iterations)``.

    ``target`` is the configured design's; its value at the start it returns is ``first`` (for
    :func:`blr_solve`, which would evaluate it there anyway). A start already within ``tol`` under
    the configured design stays (a warm start: ``refine()`` of a converged posterior runs no pass
    more). Otherwise, with a :func:`coarse_config` design, the coarse fixed point of ``target_args``
    (``(data, prior_active, const)``) is solved from ``start`` as one compiled loop (at most
    ``max_iters`` iterations; its last iterate if it does not converge, nothing of it if it leaves
    the domain or is not finite), and the solve starts from whichever of the two has the smaller
    residual under the configured design. Only the start changes: the result is the configured
    design's fixed point to ``tol``, whatever the coarse design's accuracy. ``coarse_iterations``
    counts the coarse iterations run (``None``: no coarse solve). With ``warm=False`` (a start known
    to be far, the prior of a fit) the configured design is not evaluated at the start unless the
    coarse solve fails to converge: one site pass fewer."""
    coarse = coarse_config(config)
    if coarse is None:
        return start, None, None
    first = target(start) if warm else None
    here = relative_residual(start, first[0]) if first is not None else np.inf
    if here < tol:
        return start, first, None
    data, prior_active, const = target_args
    cfg, padded, weights, _ = _padded(coarse, data, const.dtype)
    budget = EF_MAX_ITERS if max_iters is None else int(max_iters)
    lam, iterations, coarse_residual, ok = _device_solve(cfg, start, padded, prior_active, const, weights,
                                                         jnp.asarray(coarse.seed, jnp.uint32), tol, budget, rho)
    if not bool(ok):  # left the domain or not finite: nothing of it is used
        return start, first, None
    there = target(lam)
    residual = relative_residual(lam, there[0])
    if first is None and not (float(coarse_residual) < tol and np.isfinite(residual)):  # judged against the start
        first = target(start)
        here = relative_residual(start, first[0])
    if residual < here:  # a NaN residual is never smaller
        return lam, there, int(iterations)
    return start, first, int(iterations)


def _draw_error(config, data, prior_active, const, lam, tol) -> ExpectationError:
    """The fixed point's residual under an independent set of points (seed + 1): other draws,
    or the cubature rotated by another orthogonal matrix.

    The solver reaches the fixed point of the expectations under *its* points; the residual a
    second set sees at that point estimates how far the answer is from the family's true
    optimum (0 up to rounding for conjugate losses, whose sites are exact whatever the
    points, and, under ``"cubature"``, for losses of degree at most 3 in the Gaussian blocks; the
    second cubature has another rotation *and* radius, so that an error depending on the radius
    alone shows too).
    Warned about when well above the tolerance.
    """
    other, _ = bucketed_target(config, data, prior_active, const, config.seed + 1)(lam)
    residual = relative_residual(lam, other)
    cubature = config.rule == "cubature"
    if not residual <= 100 * tol:  # a NaN residual warns too
        if cubature:
            what = (f"its own cubature points but {residual:.1e} for a rotated cubature: the loss is far from a "
                    "polynomial of degree 3 in the Gaussian blocks over q, and the degree-3 rule's error shows; pass "
                    "expectation='mixed' (num_samples draws) or 'mc'")
        else:
            what = (f"its own {config.num_samples} draws but {residual:.1e} for independent draws: the answer is "
                    "only as accurate as the Monte Carlo error of the draws; raise num_samples (or give vector "
                    "sites scalar factors with Gauss rules)")
        warnings.warn(f"the fixed point's residual is below {tol:g} for {what}", MonteCarloErrorWarning, stacklevel=4)
    if cubature:
        return ExpectationError(rotated_cubature_residual=residual, num_points=config.family.cubature_size())
    return ExpectationError(independent_draws_residual=residual, num_samples=int(config.num_samples))


# --------------------------------------------------------------------------- the BLR fixed point

class SolveInfo(NamedTuple):
    """What the solver did: ``iterations``, final ``residual``, ``converged``, last step ``rho``."""

    iterations: int
    residual: float
    converged: bool
    rho: float


def relative_residual(lam, target) -> float:
    """:math:`\\|\\lambda - \\tau\\| / (1 + \\|\\tau\\|)` as a float (:func:`numpyro_pc.solvers.fixed_point.relative_residual`)."""
    return float(fixed_point.relative_residual(lam, target))


EF_MAX_ITERS = 200  # natural-gradient steps of an exponential-family solve when max_iters is None


def blr_solve(target_fn, in_domain, lam, tol=None, max_iters=None, rho=1.0, raise_on_failure=True,
              memory=5, progress=False, first=None,
              label="natural-gradient solve") -> tuple[jax.Array, object, SolveInfo]:
    r"""Run the BLR to the fixed point of ``target_fn`` (the host driver of :mod:`numpyro_pc.solvers.fixed_point`).

    Each step is :func:`numpyro_pc.solvers.fixed_point.natural_propose`: Anderson mixing over the last
    ``memory`` iterates (type II; Walker & Ni, 2011) with :math:`f_k = \tau(\lambda_k) - \lambda_k`
    and :math:`\gamma = \arg\min \|f_k - \Delta F\,\gamma\|`, the candidate
    :math:`\lambda_k + \rho f_k - (\Delta\Lambda + \rho\,\Delta F)\gamma`, used only when it
    lies inside the domain; otherwise the plain step halved until inside. The damping is
    non-monotone (:func:`numpyro_pc.solvers.fixed_point.damping_observe`): a residual above the largest of
    the last three clears the history and halves the step if the step that made it worse was a
    plain one; a residual below the smallest of the last three doubles it again (up to ``rho``).
    Simultaneous updates of the factors of a product oscillate on their way to the fixed point
    (as coordinate-ascent VB updated in parallel does), which a monotone test would reject. A
    conjugate model converges in one step (there is no history at the first step).
    :func:`numpyro_pc.solvers.fixed_point.natural_solve` is the same iteration as one ``lax.while_loop``.

    :param target_fn: ``λ -> (τ(λ), aux)``: the fixed-point target and what was computed
        with it (the sites at ``λ``); jit it.
    :param in_domain: ``λ -> bool`` (traceable).
    :param lam: the start (inside the domain).
    :param tol: relative residual tolerance (default :func:`numpyro_pc.solvers.fixed_point.default_tol`).
    :param bool progress: show a progress bar of the iterations with the residual (named ``label``).
    :param first: ``target_fn(lam)`` when the caller has it already (it is not evaluated again).
    :return: ``(λ, aux, SolveInfo)`` where ``aux`` belongs to the returned ``λ``.
    :raises OutOfDomainError: if the start is outside the domain, or no step keeps
        the iterate inside.
    :raises NonFiniteResultError: if the sites are not finite.
    :raises ConvergenceError: if ``tol`` is not met in ``max_iters`` (with ``raise_on_failure``; without
        it a ``RuntimeWarning`` says so and the last iterate is returned).
    """
    if not fixed_point.in_domain_host(in_domain, lam):
        raise OutOfDomainError("the start of the natural-parameter iteration has a non-positive shape "
                               f"parameter: {np.asarray(lam).tolist()}")
    tol = fixed_point.default_tol(lam.dtype) if tol is None else float(tol)
    max_iters = EF_MAX_ITERS if max_iters is None else int(max_iters)

    def evaluate(x, it) -> tuple[Any, Any]:
        target, aux = target_fn(x)
        if not bool(jnp.all(jnp.isfinite(target))):
            raise NonFiniteResultError(f"the sites at iteration {it} are not finite (natural parameter "
                                       f"{np.asarray(x).tolist()})")
        return target, aux

    if first is None:
        target, aux = evaluate(lam, 0)
    else:
        target, aux = first
        if not bool(jnp.all(jnp.isfinite(target))):
            raise NonFiniteResultError(f"the sites at iteration 0 are not finite (natural parameter "
                                       f"{np.asarray(lam).tolist()})")
    state = fixed_point.natural_init(lam, target, rho, memory)
    bar = fixed_point.progress_bar(progress, max_iters, label)
    try:
        while True:
            res, it = float(state.residual), int(state.iteration)
            if bar is not None:
                bar.n = it
                bar.set_postfix(residual=f"{res:.2e}")
            if res < tol:
                return state.lam, aux, SolveInfo(it, res, True, float(state.damping.step))
            if it >= max_iters:
                break
            new, state = fixed_point.natural_propose_host(state, in_domain, rho)
            if not bool(state.inside):
                raise OutOfDomainError("no step of the natural-parameter iteration keeps every shape parameter "
                                       f"positive (target {np.asarray(state.target).tolist()})")
            target, aux = evaluate(new, it + 1)
            state = fixed_point.natural_observe(state, new, target)
    finally:
        if bar is not None:
            bar.close()
    info = SolveInfo(max_iters, res, False, float(state.damping.step))
    message = (f"the natural-parameter iteration did not reach tol={tol:g} in {max_iters} iterations (relative "
               f"residual {res:.3g})")
    if raise_on_failure:
        raise ConvergenceError(message)
    warnings.warn(message + "; the result is the last iterate (record['converged'] is False)", RuntimeWarning,
                  stacklevel=3)
    return state.lam, aux, info
