r"""The exponential-family fixed point over a set of examples: the target and the solve.

The natural-gradient iteration of :func:`~numpyro_pc.ef_sites.blr_solve` looks for
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

import jax
import jax.numpy as jnp
import numpy as np

from .ef_site_table import EFSiteTable, EFState
from .ef_sites import EFConfig, blr_solve, compute_sites, relative_residual
from .errors import MonteCarloErrorWarning
from .fixed_point import default_tol
from .posterior_protocol import Posterior
from .rows import pad_to_bucket

__all__ = ["bucketed_target", "config_rows", "solve_every_site"]


@partial(jax.jit, static_argnums=(0, 3))
def _target(config, lam, data, prior_active, const, weights, seed):
    """:math:`\\tau(\\lambda) = c - \\sum_i w_i g_i(\\lambda) [- g_0(\\lambda)]` and the sites at ``lam``
    (``weights`` 0 on the rows that only pad the data to its bucket)."""
    sites = compute_sites(config, lam, data, seed)
    tau = const - weights @ sites.grads
    if prior_active:
        tau = tau - sites.prior
    return tau, sites


def bucketed_target(config, data, prior_active, const, seed=None) -> Callable:
    """``λ -> (τ(λ), sites)`` over ``data`` padded to :func:`numpyro_pc.rows.bucket_size` rows
    (repeats of the last row with weight 0), so that batches of other sizes reuse the same
    compiled site computation; the sites returned are those of the real rows."""
    num = int(data.per_example[0].shape[0])
    padded, weights, _ = pad_to_bucket(data, None, np.arange(num), const.dtype)
    cfg = config_rows(config, int(weights.shape[0]))
    seed = jnp.asarray(config.seed if seed is None else seed, jnp.uint32)

    def target(lam: jax.Array) -> tuple[jax.Array, object]:
        tau, sites = _target(cfg, lam, padded, prior_active, const, weights, seed)
        return tau, sites._replace(grads=sites.grads[:num], residual=sites.residual[:num])

    return target


def config_rows(config: EFConfig, num: int) -> EFConfig:
    """``config`` for ``num`` examples (the static size the site computation is compiled for)."""
    return replace(config, spec=replace(config.spec, num_examples=num))


def solve_every_site(post: Posterior, data, ids, start, tol, max_iters, raise_on_failure, progress=False,
                     rho=1.0) -> Posterior:
    """``post`` solved to the fixed point over all ``data`` (every site active, ids ``ids``) from the
    natural parameters ``start``; the prior term is active unless conjugate-form."""
    num = int(ids.shape[0])
    cfg = config_rows(post.config, num)
    tol = default_tol(start.dtype) if tol is None else tol
    const = post.sites.prior_natural() if post.conjugate_prior else jnp.zeros_like(start)
    lam, sites, info = blr_solve(bucketed_target(cfg, data, not post.conjugate_prior, const),
                                 post.family.in_domain, start, tol, max_iters, rho=rho,
                                 raise_on_failure=raise_on_failure, progress=progress)
    prior = post.sites.prior if post.conjugate_prior else sites.prior
    state = EFState(lam, EFSiteTable(sites.grads, prior, ids))
    record = dict(info._asdict(), max_site_nonlinearity=float(jnp.max(sites.residual)))
    if cfg.rule != "quadrature" and info.converged:
        record["expectation_error"] = _draw_error(cfg, data, not post.conjugate_prior, const, lam, tol)
    return post.evolve(config=cfg, data=data, state=state, record=record, stale_sites=False)


def _draw_error(config, data, prior_active, const, lam, tol):
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
        return dict(rotated_cubature_residual=residual, num_points=config.family.cubature_size())
    return dict(independent_draws_residual=residual, num_samples=int(config.num_samples))
