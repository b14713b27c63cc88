r"""The line search of FedPC's global step: a round that would increase the joint objective is damped.

The double loop of :mod:`numpyro_pc.federated.core` has a known objective whose stationary point is
its fixed point, the joint posterior of the family:

.. math::
    J(q) = \sum_k E_q[\ell_k] + \mathrm{KL}(q \,\|\, q_0)

(Gauss–Hermite expectations; ``q_0`` the prior in the family's format). Its derivative in the mean
is exactly the sites' (the same nodes on both sides); its derivative in the precision matches the
sites' expected Hessians only as closely as the quadrature satisfies Stein's identity, so ``J``'s own
minimum and the fixed point differ slightly (1e-9 in ``J`` ≈ 67 on breast cancer). With the delta
rule, where the fixed point is the MAP mean with its Laplace precision, ``J`` is the MAP objective
``Σ_k ℓ_k(m) + ½ (m − m_0)ᵀ P_0 (m − m_0)``. The isotropic family keeps its precision fixed: its
objective is that form, with ``E_q`` in place of the plug-in when ``expectation="gh"``.

A round proposes new sites ``η̃_k`` (the clients' local solves). The server forms the candidates

.. math::
    \eta_k(\beta) = \eta_k + \beta\,(\tilde\eta_k - \eta_k), \qquad
    \lambda(\beta) = \lambda_0 + \textstyle\sum_k \eta_k(\beta),

so that ``λ = λ_0 + Σ sites`` holds for every ``β``. Candidates, in order: the Anderson extrapolation
of the sites' fixed-point map, the proposal with ``β = 1, ½, …, 1/16``, and the natural-gradient step
(every client's site at the current ``q``) with ``β`` down to 2⁻²⁰. With ``ρ → ∞`` the proposal is
that step, ``dλ = −∇_μ J``, a descent direction: ``dJ/dβ = −∇_μJᵀ F ∇_μJ < 0`` with ``F = ∂μ/∂λ``
positive definite (Khan & Rue 2023, the Bayesian learning rule).

:func:`acceptable` decides. Far from the fixed point (natural-gradient residual at least
:data:`NEAR_RESIDUAL`) a candidate must lower ``J`` below its lowest accepted value by more than
``J``'s rounding (:func:`objective_slack`): a round that would raise ``J`` there is never accepted,
and since ``J`` is bounded below (log-losses and a KL) the accepted values converge. Near the fixed
point, where the quadrature's mismatch is larger than the rounding, a candidate is accepted when its
residual is no larger than the largest of the last three rounds' while ``J`` stays within
:data:`NEAR_BAND` (relative) of its lowest value.

For every candidate each client reports its term of ``J`` (one number) and its site at the
candidate (for the residual; it also serves as the next natural-gradient proposal): one site message
per client per candidate, counted in the round's bytes.
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from numpyro_pc.families.registry import Gaussian, GaussianNatural
from numpyro_pc.model.likelihood import example_loss, example_params
from numpyro_pc.protocols.capabilities import FixedPrecision, capability
from numpyro_pc.solvers.fixed_point import AndersonHistory, anderson_init, anderson_mix, anderson_push, anderson_restart

from .core import _chunks, _rule_nodes, client_site, global_state
from .robust import aggregate_sites
from .stacking import map_buckets

__all__ = ["Candidate", "MIN_STEP", "NEAR_BAND", "NEAR_RESIDUAL", "SearchState", "StepResult", "candidate",
           "acceptable", "client_value", "objective_slack", "prior_term", "search_init", "search_step"]

#: ``J``'s rounding: this many machine epsilons times the sum of its terms' magnitudes
OBJECTIVE_ROUNDING = 64.0
#: the smallest damping of the natural-gradient fallback (2⁻²⁰)
MIN_STEP = 2.0 ** -20
#: the smallest damping of the clients' proposal before the fallback
PROPOSAL_MIN_STEP = 2.0 ** -4
#: past rounds the Anderson extrapolation of the sites combines
ANDERSON_MEMORY = 5
#: below this natural-gradient residual a candidate that lowers the residual is accepted while ``J`` stays
#: within :data:`NEAR_BAND` of its lowest value (the central solver's rule, :mod:`numpyro_pc.solvers.gaussian`)
NEAR_RESIDUAL = 1e-2
#: how far above its lowest value (relative) ``J`` may go near the fixed point
NEAR_BAND = 1e-6


class Candidate(NamedTuple):
    """One candidate global step.

    :ivar eta: the damped sites ``η_k(β)``, stacked over clients.
    :ivar q: the global posterior they give.
    :ivar objective: ``J(q)`` (``nan`` when a client's value is not finite).
    :ivar magnitude: the sum of the absolute values of ``J``'s terms (for its rounding error).
    :ivar clipped: which clients bounded aggregation tempered.
    :ivar kl: ``KL(q ‖ q_current)``.
    :ivar residual: the natural-gradient residual at ``q``, ``‖λ(q⁺) − λ(q)‖ / ‖λ(q)‖`` with ``q⁺`` the global
        posterior of every client's site at ``q`` (zero exactly at the fixed point).
    :ivar at_q: every client's site at ``q`` (stacked): the natural-gradient proposal from ``q``.
    """

    eta: GaussianNatural
    q: Gaussian
    objective: jax.Array
    magnitude: jax.Array
    clipped: jax.Array
    kl: jax.Array
    residual: jax.Array
    at_q: GaussianNatural


def client_value(cfg, q, per_example, mask, shared) -> jax.Array:
    """``Σ_j w_j E_q[ℓ_j]`` of one client: Gauss–Hermite over each example's affine parameter for a
    GLM with ``cfg.rule == "gh"``, the plug-in ``ℓ_j(m)`` with the delta rule (in chunks of
    ``cfg.chunk_size`` examples for a model that is not a GLM)."""
    spec = cfg.spec
    if cfg.factored:
        nodes, weights = _rule_nodes(cfg, q.mean.dtype)
        cov = cfg.family.dense_covariance(q) if cfg.rule == "gh" else None

        def one(ex) -> jax.Array:
            theta, phi = example_params(spec, q.mean, ex, shared)
            if cfg.rule != "gh":
                return phi(jnp.reshape(theta[0], (1,)))
            a = jax.jacfwd(lambda z: example_params(spec, z, ex, shared)[0])(q.mean)[0]
            sd = jnp.sqrt(jnp.maximum(a @ cov @ a, 0.0))
            return weights @ jax.vmap(lambda t: phi(jnp.reshape(t, (1,))))(theta[0] + sd * nodes)

        values = jax.vmap(one)(per_example)
        return jnp.sum(jnp.where(mask > 0, mask * values, 0.0))
    leaves, w = _chunks(per_example, mask, cfg.chunk_size)

    def body(acc, xs) -> tuple[jax.Array, None]:
        ex, wc = xs
        values = jax.vmap(lambda e: example_loss(spec, q.mean, e, shared))(ex)
        return acc + jnp.sum(jnp.where(wc > 0, wc * values, 0.0)), None

    total, _ = jax.lax.scan(body, jnp.zeros((), q.mean.dtype), (leaves, w))
    return total


def prior_term(cfg, prior, prior_nat, q) -> jax.Array:
    """The prior's part of ``J``: ``KL(q ‖ q_0)`` (Gauss–Hermite), or ``½ (m − m_0)ᵀ P_0 (m − m_0)`` (the
    delta rule, and the isotropic family's fixed precision, where only the mean moves)."""
    family = cfg.family
    if capability(family, FixedPrecision):
        diff = q.mean - prior.mean
        return 0.5 * diff @ (prior.precision @ diff)
    q0 = family.from_natural(prior_nat)
    if cfg.rule == "gh":
        return family.kl(q, q0)
    diff = q.mean - q0.mean
    return 0.5 * diff @ (family.dense_precision(q0) @ diff)


def objective_slack(magnitude, eps) -> float:
    """``J``'s float rounding: ``OBJECTIVE_ROUNDING · ε`` times the sum of its terms' magnitudes (a sum of ``N``
    log-losses carries about ``√N ε`` of that; near the fixed point successive values differ by less than
    this, and a strict comparison would halve the step for ever). ``eps`` is the run's machine epsilon."""
    return OBJECTIVE_ROUNDING * eps * magnitude


@partial(jax.jit, static_argnames=("cfg",))
def candidate(cfg, prior, prior_nat, eta, proposal, beta, q_current, stack, bounds) -> Candidate:
    """The candidate ``β`` of a round: damped sites, their global posterior and its ``J`` (every client
    reports its value at it)."""
    family = cfg.family
    eta_b = jax.tree.map(lambda old, new: old + beta * (new - old), eta, proposal)
    eta_sum, clipped = aggregate_sites(family, prior_nat, eta_b, bounds)
    q = global_state(family, prior, prior_nat, eta_sum)
    shared = stack.stacks[0].shared  # stack: the clients' Buckets (numpyro_pc.federated.stacking)
    values = map_buckets(lambda ex, mk: client_value(cfg, q, ex, mk, shared), stack)
    prior_part = prior_term(cfg, prior, prior_nat, q)
    objective = jnp.sum(values) + prior_part
    proper = jnp.all(jnp.isfinite(q.mean)) & family.is_positive_definite(q.precision)
    objective = jnp.where(proper & jnp.isfinite(objective), objective, jnp.nan)
    magnitude = jnp.sum(jnp.abs(values)) + jnp.abs(prior_part)
    at_q = map_buckets(lambda ex, mk: client_site(cfg, q, ex, mk, shared), stack)
    q_next = global_state(family, prior, prior_nat, aggregate_sites(family, prior_nat, at_q, bounds)[0])
    lam, lam_next = _flat(family.natural(q)), _flat(family.natural(q_next))
    residual = jnp.linalg.norm(lam_next - lam) / jnp.linalg.norm(lam)
    return Candidate(eta_b, q, objective, magnitude, clipped, family.kl(q, q_current), residual, at_q)


class SearchState(NamedTuple):
    """What the line search carries from round to round.

    :ivar current: the current global posterior as a :class:`Candidate` (its ``objective``, ``residual``).
    :ivar history: past ``(η, proposal − η)`` pairs (Anderson).
    :ivar best: the lowest ``J`` accepted so far: a candidate above it by more than ``J``'s rounding is refused,
        so that accepted values cannot creep upwards by sub-rounding steps (near the fixed point: by more than
        :data:`NEAR_BAND` relative).
    :ivar recent: the natural-gradient residuals of the last three rounds; near the fixed point a candidate must
        fall below their largest (non-monotone, as the central solver's).
    """

    current: Candidate
    history: AndersonHistory
    best: float
    recent: tuple[float, ...]


class StepResult(NamedTuple):
    """The accepted step of a round (``candidate`` is ``None`` when no step decreased ``J``).

    :ivar candidate: the accepted :class:`Candidate`.
    :ivar step: its damping ``β`` (``1`` for an Anderson step).
    :ivar trials: candidates the clients evaluated this round.
    :ivar kind: ``"anderson"``, ``"proposal"`` (the clients' local solves, damped by ``step``),
        ``"natural_gradient"`` (the fallback: every client's site at the current ``q``) or ``"none"``.
    """

    candidate: Candidate | None
    step: float
    trials: int
    kind: str


def _flat(tree) -> jax.Array:
    return jnp.concatenate([jnp.ravel(leaf) for leaf in jax.tree.leaves(tree)])


def _unflat(vector, like) -> GaussianNatural:
    leaves, treedef = jax.tree.flatten(like)
    out, at = [], 0
    for leaf in leaves:
        out.append(jnp.reshape(vector[at:at + leaf.size], leaf.shape))
        at += leaf.size
    return jax.tree.unflatten(treedef, out)


def search_init(cfg, prior, prior_nat, eta, q, stack, bounds, memory=ANDERSON_MEMORY) -> SearchState:
    """The line search's state at the run's first global posterior ``q`` (its sites ``eta``)."""
    current = candidate(cfg, prior, prior_nat, eta, eta, jnp.zeros((), q.mean.dtype), q, stack, bounds)
    return SearchState(current, anderson_init(_flat(eta), memory), float(current.objective),
                       (float(current.residual),))


def acceptable(value, residual, magnitude, current_residual, current_magnitude, best, reference, eps) -> bool:
    """Whether a candidate with objective ``value``, natural-gradient ``residual`` and term magnitude
    ``magnitude`` is accepted from a point with ``current_residual``, the lowest accepted objective ``best``
    and the residual ``reference`` (the largest of the last three rounds'); ``eps`` is the run's machine epsilon.
    A NaN value or residual is never accepted; a non-finite ``best`` (a start where ``J`` overflowed) accepts the
    first finite candidate."""
    if not (math.isfinite(value) and math.isfinite(residual)):
        return False
    if not math.isfinite(best):
        return True
    scale = max(magnitude, current_magnitude if math.isfinite(current_magnitude) else 0.0)
    slack = objective_slack(scale, eps)
    if value < best - slack:  # a decrease beyond rounding
        return True
    near = max(residual, current_residual) < NEAR_RESIDUAL
    floor = objective_slack(1.0, eps)  # an exact fixed point's residual is rounding
    return near and value <= best + max(slack, NEAR_BAND * (1.0 + abs(best))) and residual <= max(reference, floor)


def search_step(cfg, prior, prior_nat, eta, proposal, q, stack, bounds, state) -> tuple[StepResult, SearchState]:
    """The round's accepted step: the Anderson extrapolation of the sites' fixed-point map when it lowers
    ``J``, else the proposal damped by ``β = 1, ½, …, 1/16``, else the natural-gradient proposal damped down
    to :data:`MIN_STEP`: the first candidate whose ``J`` is below ``state.best`` beyond its rounding (near the
    fixed point: whose residual falls, ``J`` within the band).

    :return: the step and the state after it (unchanged but for the Anderson history when no step is accepted).
    """
    dtype = q.mean.dtype
    eps = float(jnp.finfo(dtype).eps)
    current, best = state.current, state.best
    reference = max(state.recent[-3:])
    trials = 0
    x = _flat(eta)
    history = anderson_push(state.history, x, _flat(proposal) - x)

    def accepts(cand) -> bool:
        return acceptable(float(cand.objective), float(cand.residual), float(cand.magnitude), float(current.residual),
                          float(current.magnitude), best, reference, eps)

    def accepted(cand, step, kind, history) -> tuple[StepResult, SearchState]:
        value = float(cand.objective)
        lowest = value if not math.isfinite(best) else min(best, value)
        return StepResult(cand, step, trials, kind), SearchState(cand, history, lowest,
                                                                  (*state.recent[-2:], float(cand.residual)))

    if int(history.count) >= 3:
        mixed = _unflat(anderson_mix(history), eta)
        cand = candidate(cfg, prior, prior_nat, eta, mixed, jnp.asarray(1.0, dtype), q, stack, bounds)
        trials += 1
        if accepts(cand):
            return accepted(cand, 1.0, "anderson", history)
        history = anderson_restart(history, keep=1)
    for kind, smallest in (("proposal", PROPOSAL_MIN_STEP), ("natural_gradient", MIN_STEP)):
        if kind == "natural_gradient":
            proposal = current.at_q  # every client's site at q: reported with the current candidate
        beta = 1.0
        while beta >= smallest:
            cand = candidate(cfg, prior, prior_nat, eta, proposal, jnp.asarray(beta, dtype), q, stack, bounds)
            trials += 1
            if accepts(cand):
                return accepted(cand, beta, kind, history)
            beta *= 0.5
    return StepResult(None, 0.0, trials, "none"), state._replace(history=anderson_restart(history))
