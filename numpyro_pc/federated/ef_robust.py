r"""Privacy and bounded aggregation for exponential-family federated runs (:mod:`numpyro_pc.federated.ef`).

The exponential-family counterparts of :mod:`~numpyro_pc.federated.privacy` and
:mod:`~numpyro_pc.federated.robust`, in the family's natural parameters: a private client's
release (:func:`clipped_site_ef`, :func:`release_ef`), the server's tempering of sites that
take too large a share or move the posterior too far (:func:`bound_sites_ef`), and the step
that keeps a noisy global posterior inside the family's domain (:func:`retreat_ef`). All are
pure and traced (``vmap`` over clients); :func:`domain_boundary` is the bisection they share
with the safeguard :func:`~numpyro_pc.federated.ef.safe_rho_ef`.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from numpyro_pc.model.likelihood import ModelData
from numpyro_pc.sites.expfam import compute_sites

from .privacy import add_noise_natural, clip_rows, finite_rows
from .robust import leave_one_out

__all__ = ["domain_boundary", "clipped_site_ef", "release_ef", "bound_sites_ef", "retreat_ef"]


def domain_boundary(inside, top, steps=60) -> jax.Array:
    """The largest ``t ∈ [0, top]`` that bisection finds with ``inside(t)`` true, for a test true at 0 and
    monotone (true up to a point, false after it); the returned point has passed the test (or is 0)."""
    def halve(_, bounds) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        mid = 0.5 * (lo + hi)
        ok = inside(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    top = jnp.asarray(top)
    lo, _ = jax.lax.fori_loop(0, steps, halve, (jnp.zeros_like(top), top))
    return lo


def clipped_site_ef(config, lam, per_example, mask, shared, weight, prior, mech) -> jax.Array:
    """:math:`\\sum_j c_j s_j` at :math:`\\lambda`: each example's term :math:`s_j = -g_j(\\lambda)` clipped to the
    Euclidean norm ``mech.clip_natural`` (:mod:`~numpyro_pc.federated.privacy`), plus — ``weight`` 1 — the
    non-conjugate prior's correction, which depends on :math:`\\lambda` only (no example moves it)."""
    sites = compute_sites(config, lam, ModelData(per_example, shared))
    terms = -sites.grads
    return (mask * clip_rows(terms, mech.clip_natural)) @ finite_rows(terms) - weight * (sites.prior + prior)


def release_ef(config, lam, per_example, mask, shared, weight, prior, mech, key) -> jax.Array:
    """The site a private client sends: :func:`clipped_site_ef` at the global :math:`\\lambda` the server sent,
    plus the mechanism's noise (:func:`~numpyro_pc.federated.privacy.add_noise_natural`). As for Gaussian sites
    (:func:`~numpyro_pc.federated.core.local_update`) no local problem is solved: a local fixed point depends on
    every example of the shard, which would break the per-example bound the accounting needs; this is the
    ``ρ → ∞`` limit of the local step, with the same fixed point."""
    return add_noise_natural(mech, clipped_site_ef(config, lam, per_example, mask, shared, weight, prior, mech), key)


@partial(jax.jit, static_argnames=("family",))
def bound_sites_ef(family, prior, sites, lam_ref, bounds) -> tuple[jax.Array, jax.Array, jax.Array]:
    r"""Bounded aggregation (:mod:`~numpyro_pc.federated.robust`) of exponential-family sites: each client's
    site is tempered, :math:`\eta_k' = s_k t_k \eta_k` with :math:`s_k, t_k \in [0, 1]` (a tempered likelihood
    stays a likelihood: the family's sites are sums over examples), so that

    * **share** ``γ``: :math:`\|\eta_k'\|_F \le \gamma\, \|\sum_{j \ne k} \eta_j\|_F`, one client's part of the
      aggregate natural-parameter update at most ``γ`` times the others' together, both measured in the
      Fisher metric :math:`\|v\|_F^2 = v^\top \nabla^2 A(\lambda_{ref})\, v` of the posterior the round started
      from (:math:`\tfrac12 \|v\|_F^2` is the KL of a small step ``v``: the metric does not depend on how the
      family's natural parameters are written). :math:`s_k = \min(1, \gamma \|\sum_{j\ne k}\eta_j\|_F /
      \|\eta_k\|_F)` — the Gaussian bound :math:`S_k \preceq \gamma P_{-k}` has no family-free analogue, as a
      natural-parameter vector has no origin to measure a ratio from; the others' update has one;
    * **shift** ``c``: :math:`\mathrm{KL}(q' \,\|\, q_{-k}) \le c^2/2` with :math:`q_{-k}` the posterior of
      :math:`\lambda_{-k} = \lambda_0 + \sum_{j\ne k} \eta_j` and :math:`q'` that of :math:`\lambda_{-k} + \eta_k'`;
      :math:`t_k` is the largest ``t`` with that bound and :math:`\lambda_{-k} + t s_k \eta_k` in the domain (by
      bisection: the KL grows with ``t``, its derivative being :math:`t\, \eta^\top \nabla^2 A\, \eta \ge 0`, and the
      domain is convex). For a Gaussian the KL is :math:`\tfrac12 \|m - m_{-k}\|^2_{P_{-k}}` plus a
      non-negative precision term, so this bound implies the Gaussian path's
      :math:`\|m - m_{-k}\|_{P_{-k}} \le c` and equals it for a site that leaves the precision alone.

    A site within both bounds is left exactly as it was. As for Gaussian sites the bound is exact for the
    client being tempered when the other clients are within their own bounds.

    :param prior: :math:`\lambda_0` ``(P,)``; ``sites`` ``(K, P)``; ``lam_ref``: the round's starting
        :math:`\lambda` (inside the domain).
    :param bounds: ``(γ, c)`` from :func:`~numpyro_pc.federated.robust.robust_bounds` (``inf``: no bound).
    :return: ``(λ_0 + Σ_k η_k', tempered (K,) bool, undefined (K,) bool)``: ``undefined`` marks clients whose
        others' posterior :math:`\lambda_{-k}` lies outside the domain, where the shift bound has no meaning.
    """
    share, shift = bounds
    rest = prior + leave_one_out(sites)
    fisher = family.fisher(lam_ref)
    norm = lambda v: jnp.sqrt(jnp.maximum(v @ fisher @ v, 0.0))  # noqa: E731
    others = jax.vmap(norm)(leave_one_out(sites))

    def one(eta, lam_rest, other) -> tuple[jax.Array, jax.Array, jax.Array]:
        own = norm(eta)
        s = jnp.where(own > share * other, share * other / jnp.maximum(own, jnp.finfo(own.dtype).tiny), 1.0)
        step, proper = s * eta, family.in_domain(lam_rest)

        def inside(t) -> jax.Array:
            lam = lam_rest + t * step
            ok = family.in_domain(lam) & proper
            return ok & (family.kl(jnp.where(ok, lam, lam_rest), lam_rest) <= 0.5 * shift**2)

        t = jnp.where(jnp.isinf(shift) | inside(1.0), 1.0, domain_boundary(inside, jnp.ones_like(s)))
        scale = s * t
        return jnp.where(scale < 1.0, scale * eta, eta), scale < 1.0, jnp.isfinite(shift) & ~proper

    bounded, tempered, undefined = jax.vmap(one)(sites, rest, others)
    return prior + jnp.sum(bounded, 0), tempered, undefined


@partial(jax.jit, static_argnames=("family",))
def retreat_ef(family, lam_prev, lam_new) -> tuple[jax.Array, jax.Array]:
    r"""Keep a private round's global posterior inside the domain: ``lam_new`` itself where it is inside,
    else the point halfway from ``lam_prev`` (inside) to the domain's boundary along the segment to ``lam_new``,
    :math:`\lambda_{prev} + \tfrac{t_b}{2}(\lambda_{new} - \lambda_{prev})` (:math:`t_b` by bisection; the domain
    is convex).

    Why this and not another rule: the noise of :mod:`~numpyro_pc.federated.privacy` is unbounded, so
    :math:`\lambda_0 + \sum_k \tilde\eta_k` can leave the domain (a Beta concentration below 0) however well the
    run is set up. Refusing the round would end private runs at random, and more often the smaller ``ε``;
    drawing the noise again until the sum is inside would be more releases, and noise conditioned on the other
    clients' messages, outside the accounting; the domain is open, so there is no nearest point to project
    on. Stepping back towards the posterior the clients were sent uses only the messages and the server's
    state — post-processing, which costs no privacy — leaves an inside sum exactly as it is, keeps the
    posterior a proper member of the family with a margin to the boundary, and is recorded (``domain_step``
    in the history: ``t_b / 2``, or 1 where the sum was inside).

    :return: ``(λ, t)``.
    """
    direction = lam_new - lam_prev
    inside = family.in_domain(lam_new)
    t = jnp.where(inside, 1.0, 0.5 * domain_boundary(lambda u: family.in_domain(lam_prev + u * direction),
                                               jnp.ones((), lam_prev.dtype)))
    return jnp.where(inside, lam_new, lam_prev + t * direction), t
