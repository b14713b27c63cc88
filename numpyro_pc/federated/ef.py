r"""Federated posterior correction for exponential-family product posteriors (paper §3.4).

The posterior is a mean-field product of Beta, Gamma, Dirichlet, Gaussian-block and
discrete factors (:mod:`numpyro_pc.dual.expfam`). Client ``k`` holds the shard ``D_k`` and
a site ``η_k`` of ``P`` natural parameters standing for ``−Σ_{i∈D_k} g_i``; the server keeps
``λ_0`` and forms (eq. ``global_update``)

.. math:: \lambda = \lambda_0 + \textstyle\sum_k \eta_k .

**Local step** (eq. ``local_update``). With :math:`\hat\eta_k(\lambda) = -\sum_{i\in D_k}
g_i(\lambda)` the client's site at :math:`\lambda`, the stationarity condition of
:math:`\tfrac1\rho E_q[\ell_k - \hat\ell_k] + \mathrm{KL}(q \| q_{jnt})` in the family is

.. math::
    \lambda_k = \lambda + \tfrac1\rho\big(\hat\eta_k(\lambda_k) - \eta_k\big)
    = \underbrace{\lambda - \eta_k/\rho}_{\rho\text{-cavity}} - \tfrac1\rho \textstyle\sum_{i\in D_k} g_i(\lambda_k),

a BLR fixed point solved from :math:`\lambda` by :func:`~numpyro_pc.solvers.fixed_point.natural_solve` (the
iteration of :func:`~numpyro_pc.solvers.expfam.blr_solve` as a ``lax.while_loop``), so that clients are ``vmap``-ed (shards padded as
in :mod:`numpyro_pc.federated.core`). The client sends
:math:`\eta_k' = \hat\eta_k(\lambda_k)` (with ``ρ = 1``: :math:`\lambda_k - (\lambda - \eta_k)`,
the local posterior over the cavity); PVI damping ``δ`` sends :math:`\eta_k + \delta(\eta_k'
- \eta_k)`. At a fixed point :math:`\lambda_k = \lambda` for every client, so
:math:`\lambda = \lambda_0 - \sum_i g_i(\lambda)`: the batch fixed point of
:func:`~numpyro_pc.dual.expfam_fit.fit_ef`. A conjugate model's sites do not depend on
:math:`\lambda`, so one round gives the batch posterior for any ``ρ``.

**ρ.** In the linearised dynamics of equal shards with a scalar site Jacobian :math:`j`, one
round multiplies the clients' common site error by :math:`j(\rho K - 1)/(\rho - j)` (zero for
``ρ = 1/K``, the default) and their differences by :math:`-j/(\rho - j)`. ``ρ`` is a floor:
with the safeguard (:func:`safe_rho_ef`) each client uses the smallest ``ρ_k ≥ ρ`` whose
ρ-cavity lies inside the domain with a margin (for Gaussian blocks: a positive definite
cavity precision, as :func:`~numpyro_pc.federated.core.safe_rho`), and a failed round is
repeated with the floor doubled. The fixed point does not depend on ``ρ``.

**Non-conjugate-form priors.** When the prior term is not linear in ``T`` its site
:math:`-g_0(\lambda)` moves with :math:`\lambda`. The server's :math:`\lambda_0` is then the
prior's projection onto the family (the fixed point :math:`\lambda_p = -g_0(\lambda_p)`, the
fit without data), and the prior's correction :math:`-(g_0(\lambda) - g_0(\lambda_p))` is one
more term of client 0's loss: every client holds the model, and the server holds no data to
evaluate the model on. The fixed point is again the batch one.

**ADMM** (paper eq. ``admm``). The local step is FedPC's; the server keeps the global
:math:`\lambda_{jnt}` apart from the sites and moves it by a BLR step of size
:math:`\alpha = 1/(1 + \rho M)` (``M`` clients taking part) from the clients' local posteriors,
their product taken as a geometric mean (:func:`~numpyro_pc.federated.ef_server.admm_server_ef`):

.. math::
    \lambda_{jnt} \leftarrow \alpha\big(\lambda_0 + \textstyle\sum_k \eta_k\big)
    + (1 - \alpha)\,\tfrac1M \textstyle\sum_k \lambda_k .

The natural domain of every factor (Beta and Dirichlet concentrations, Gamma shape and rate,
a Gaussian block's positive definite precision) is convex, so for :math:`\alpha \in (0, 1]`
with both ends inside the combination is inside; an ``admm_alpha`` above 1 extrapolates and
can leave it, which the server refuses (:class:`~numpyro_pc.errors.OutOfDomainError`). At a
fixed point :math:`\lambda_k = \lambda_{jnt}`, so :math:`\lambda_{jnt} = \lambda_0 + \sum_k
\eta_k`: FedPC's (the batch) fixed point. In a conjugate model the sites are exact after one
round and the error :math:`\lambda_{jnt} - \lambda_\star` is then multiplied by
:math:`1 - \alpha = \rho M/(1 + \rho M)` per round (round one leaves
:math:`(1 - \rho K)/(1 + \rho K)` of it: none for the default ``ρ = 1/K`` with equal weights).

**AMA** is MAP estimation with a precision fixed by the prior (the isotropic Gaussian family,
paper theorem "AMA as posterior correction"); an exponential-family product learns all its
natural parameters, so ``algorithm="ama"`` is refused with
:class:`~numpyro_pc.errors.MissingCapabilityError` (the family lacks
:class:`~numpyro_pc.protocols.capabilities.FixedPrecision`).

**Server checks** (:func:`~numpyro_pc.federated.ef_server.aggregate_ef`, host side, before anything is stored): a message
must be a finite floating vector of size ``P`` in the run's dtype, below ``max_abs``, and the
:math:`\lambda_0 + \sum_k \eta_k` with it must lie in the family's domain (``family.in_domain``); a bad
message raises :class:`~numpyro_pc.errors.ClientMessageError` naming the client and what was
expected, and the returned state is built only from accepted messages (states are
immutable, so a refused round leaves the caller's state as it was).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import replace
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.dual.expfam import EFPosterior, EFState
from numpyro_pc.model.likelihood import ModelData
from numpyro_pc.protocols.capabilities import FixedPrecision, SiteSum, require
from numpyro_pc.protocols.records import FederatedInfo
from numpyro_pc.sites.expfam import compute_sites
from numpyro_pc.sites.expfam_table import EFSiteTable
from numpyro_pc.solvers.fixed_point import natural_solve

from ..errors import ClientMessageError, ConvergenceError, InvalidOptionError, OutOfDomainError
from .core import FederatedResult, concat_datas, record_round
from .ef_clients import EFClients, bind_ef_clients, check_prior_data_free  # noqa: F401  (importable from here)

# the server's side and the private and bounded sites live in ef_server and ef_robust; their names stay
# importable from here, as before the split
from .ef_robust import bound_sites_ef, clipped_site_ef, domain_boundary, release_ef, retreat_ef  # noqa: F401
from .ef_server import (  # noqa: F401
    EFServerState,
    admm_server_ef,
    aggregate_ef,
    global_natural,
    server_step_ef,
    site_natural,
    validate_ef_message,
)
from .options import resolve_options
from .records import RoundInfo
from .robust import robust_bounds

__all__ = ["EFClients", "EFLocalResult", "bind_ef_clients", "check_prior_data_free", "init_ef", "safe_rho_ef", "local_update_ef",
           "client_round_ef", "kl_rounding", "round_ef", "posterior_ef", "run_ef"]


class EFLocalResult(NamedTuple):
    """One local update: the ``site`` :math:`\\hat\\eta_k(\\lambda_k)`, the ``local`` :math:`\\lambda_k`,
    ``iterations``, the final relative ``residual`` of the local fixed point and ``ok`` (finite, in the domain)."""

    site: jax.Array
    local: jax.Array
    iterations: jax.Array
    residual: jax.Array
    ok: jax.Array


def safe_rho_ef(family, lam, eta, rho, margin=0.3, steps=60) -> jax.Array:
    """Smallest weight ``ρ_k ≥ ρ`` whose ρ-cavity :math:`\\lambda - \\eta_k/\\rho_k` lies inside the domain with
    the relative ``margin``: ``max(ρ, (1 + margin) ρ*)``, ``ρ*`` the boundary (bisection on the convex domain).
    The Gaussian blocks' condition is the Gaussian safeguard's (:func:`~numpyro_pc.federated.core.safe_rho`):
    a positive definite cavity precision."""
    inside = lambda t: family.in_domain(lam - t * eta)  # noqa: E731
    top = 1.0 / rho
    lo = domain_boundary(inside, top, steps)
    return jnp.where(inside(top), rho, jnp.maximum(rho, (1.0 + margin) / jnp.maximum(lo, 1e-300)))


def local_update_ef(config, lam_jnt, eta, rho, per_example, mask, shared, weight, prior, tol, max_iters) -> EFLocalResult:
    """Solve :math:`\\lambda_k = \\lambda - \\eta_k/\\rho + \\hat\\eta_k(\\lambda_k)/\\rho` from :math:`\\lambda`
    for one client (pure; ``vmap`` over padded clients). ``weight`` (0 or 1) adds the prior's correction.

    :return: :class:`EFLocalResult`.
    """
    data, cavity = ModelData(per_example, shared), lam_jnt - eta / rho

    def target(lam) -> tuple[jax.Array, jax.Array]:
        sites = compute_sites(config, lam, data)
        s = -(mask @ sites.grads) - weight * (sites.prior + prior)  # padding rows have mask 0
        return cavity + s / rho, s

    lam, s, it, res, ok = natural_solve(target, config.family.in_domain, lam_jnt, tol, max_iters)
    return EFLocalResult(s, lam, it, res, ok & jnp.all(jnp.isfinite(s)))


@partial(jax.jit, static_argnames=("config", "num_participants", "max_iters", "privacy"))
def _local_round(config, num_participants, max_iters, state, stack, weights, rho, damping, tol, margin, key,
                 privacy=None) -> tuple[jax.Array, jax.Array, EFLocalResult, jax.Array]:
    num = state.sites.shape[0]
    idx = jnp.arange(num) if num_participants == num else jax.random.choice(key, num, (num_participants,),
                                                                              replace=False)
    lam = global_natural(state)
    old = state.sites[idx]
    keys = jax.random.split(jax.random.fold_in(key, 1), num_participants)  # the clients' own noise (privacy)

    def one(e, ex, mk, w, k) -> tuple[EFLocalResult, jax.Array]:
        rho_k = jnp.where(margin >= 0, safe_rho_ef(config.family, lam, e, rho, margin), rho)
        if privacy is not None:  # the released site at λ; the local parameters recomputed from it
            site = release_ef(config, lam, ex, mk, stack.shared, w, state.prior, privacy, k)
            local = EFLocalResult(site, lam + (site - e) / rho_k, jnp.asarray(0), jnp.zeros((), lam.dtype),
                                  jnp.all(jnp.isfinite(site)))
            return local, rho_k
        return local_update_ef(config, lam, e, rho_k, ex, mk, stack.shared, w, state.prior, tol, max_iters), rho_k

    local, rhos = jax.vmap(one)(old, jax.tree.map(lambda x: x[idx], stack.per_example), stack.mask[idx],
                                weights[idx], keys)
    return idx, old + damping * (local.site - old), local, rhos


def client_round_ef(clients, state, rho, damping=1.0, participants=None, key=None, local_tol=None, local_iters=200,
                    safeguard_margin=0.3, privacy=None) -> tuple[jax.Array, jax.Array, EFLocalResult, jax.Array]:
    """The clients' half of a round: every participant's local update and the message it sends.

    :param participants: how many clients take part (default all; a random subset drawn with ``key``).
    :param safeguard_margin: each client's weight is :func:`safe_rho_ef` with this margin (``None``: ``ρ``).
    :param privacy: a :class:`~numpyro_pc.federated.privacy.GaussianMechanism`: each participant sends
        :func:`~numpyro_pc.federated.ef_robust.release_ef` (its noise drawn from ``key``) instead of solving its local problem.
    :return: ``(indices, messages (M, P), EFLocalResult, weights used (M,))``.
    """
    dtype = state.prior.dtype
    num = int(state.sites.shape[0])
    local_tol = (1e-12 if dtype == jnp.float64 else 1e-6) if local_tol is None else float(local_tol)
    if privacy is not None and key is None:
        raise InvalidOptionError("a private round needs its own random key (key=): without one every release would "
                                 "carry the same noise, and the difference of two releases would be the noise-free "
                                 "difference of the clients' data sums — outside the privacy accounting")
    key = jax.random.PRNGKey(0) if key is None else key
    margin = -1.0 if safeguard_margin is None else float(safeguard_margin)
    return _local_round(clients.config, num if participants is None else int(participants), int(local_iters), state,
                        clients.stack, clients.prior_weight, jnp.asarray(rho, dtype), jnp.asarray(damping, dtype),
                        jnp.asarray(local_tol, dtype), jnp.asarray(margin, dtype), key, privacy)


def init_ef(clients, init="zero", local_iters=200, privacy=None, key=None, bounds=None) -> EFServerState:
    """The server's first state: ``"zero"`` sites (as in PVI; the first local step starts from
    :math:`\\lambda_0`), or ``"prior"``: each client's site at :math:`\\lambda_0` (one natural-gradient step;
    with ``privacy`` the first release, noised with ``key``; the server's step as in :func:`~numpyro_pc.federated.ef_server.server_step_ef`).

    :raises OutOfDomainError: ``"prior"`` sites that together leave the domain (use ``"zero"``).
    """
    num, size = clients.stack.mask.shape[0], clients.prior.shape[0]
    state = EFServerState(clients.prior, jnp.zeros((num, size), clients.prior.dtype))
    if init == "zero":
        return state
    if init != "prior":
        raise InvalidOptionError(f"unknown init {init!r}; expected 'zero' or 'prior'")
    # ρ → ∞: the local problem does not move, the message is the site at λ_0
    _, messages, _, _ = client_round_ef(clients, state, 1e30, key=key, local_iters=local_iters,
                                        safeguard_margin=None, privacy=privacy)
    fam = clients.config.family
    state = aggregate_ef(fam, state, dict(enumerate(np.asarray(messages))), domain=privacy is None)[0]
    if privacy is None and bounds is None:
        return state
    return server_step_ef(fam, state, clients.prior, bounds, privacy is not None)[0]


def kl_rounding(family, lam_p, lam_q) -> jax.Array:
    r"""The rounding error of :math:`KL(q_p \| q_q) = A(\lambda_q) - A(\lambda_p) - \langle \lambda_q -
    \lambda_p, \mu_p\rangle` computed in the dtype of ``lam_p``: the terms cancel for nearly equal
    posteriors, so a KL below :math:`32\,\varepsilon\,(|A(\lambda_p)| + |A(\lambda_q)| + |\langle
    \lambda_p, \mu_p\rangle| + |\langle \lambda_q, \mu_p\rangle|)` cannot be told from 0 (measured on the
    Beta–Bernoulli and Gamma–Poisson tests: at most 6.5 ε times that sum, over 200 pairs equal to 1e-15).
    """
    mu = family.expectation(lam_p)
    size = (jnp.abs(family.log_normalizer(lam_p)) + jnp.abs(family.log_normalizer(lam_q))
            + jnp.abs(lam_p @ mu) + jnp.abs(lam_q @ mu))
    return 32.0 * jnp.finfo(lam_p.dtype).eps * size


def round_ef(clients, state, rho, damping=1.0, participants=None, key=None, local_tol=None, local_iters=200,
             safeguard_margin=0.3, admm_alpha=None, privacy=None, bounds=None) -> tuple[EFServerState, dict]:
    """One round: :func:`client_round_ef`, then :func:`~numpyro_pc.federated.ef_server.aggregate_ef` (strict) and, with ``admm_alpha``,
    :func:`~numpyro_pc.federated.ef_server.admm_server_ef`; with ``bounds`` or ``privacy``, :func:`~numpyro_pc.federated.ef_server.server_step_ef`. Returns
    ``(new state, diagnostics)``.

    :param privacy: a :class:`~numpyro_pc.federated.privacy.GaussianMechanism` (:func:`~numpyro_pc.federated.ef_robust.release_ef`).
    :param bounds: ``(γ, c)`` of bounded aggregation (:func:`~numpyro_pc.federated.ef_robust.bound_sites_ef`).
    :param float admm_alpha: ``None``: a FedPC/PVI round, the new global :math:`\\lambda` is the sites' sum;
        else ADMM's server step with this :math:`\\alpha`.
    :return: ``info`` holds ``kl_to_previous``, ``kl_rounding`` (:func:`kl_rounding`), ``residual`` (the largest :math:`\\|\\lambda_k - \\lambda\\| /
        (1 + \\|\\lambda\\|)`; with ADMM also :math:`\\|\\lambda_{jnt} - \\lambda_0 - \\sum_k \\eta_k\\|` on the same
        scale, which the local posteriors do not see once they equal :math:`\\lambda_{jnt}`), ``participants``,
        ``local_iterations``, ``local_residual``, ``rho_min``, ``rho_max``; with ``bounds`` or ``privacy`` also
        ``clipped``, ``clipped_clients`` and (private) ``domain_step``.
    :raises OutOfDomainError: a local fixed point outside the domain or not finite, or a new global
        :math:`\\lambda` outside it (``state`` is not changed).
    """
    lam = global_natural(state)
    idx, messages, local, rhos = client_round_ef(clients, state, rho, damping, participants, key, local_tol,
                                                 local_iters, safeguard_margin, privacy)
    bad = np.flatnonzero(~np.asarray(local.ok))
    if bad.size:
        raise OutOfDomainError(f"the local updates of clients {np.asarray(idx)[bad].tolist()} left the family's "
                               f"domain or lost finiteness (rho={float(rho):g}); increase rho")
    fam = clients.config.family
    new, _ = aggregate_ef(fam, state, dict(zip(np.asarray(idx).tolist(), np.asarray(messages))),
                          domain=privacy is None)
    step = {}
    if admm_alpha is not None:
        new = admm_server_ef(fam, new, local.local, admm_alpha)
    elif bounds is not None or privacy is not None:
        new, step = server_step_ef(fam, new, lam, bounds, privacy is not None)
    scale = 1.0 + jnp.linalg.norm(lam)
    residual = jnp.max(jnp.linalg.norm(local.local - lam, axis=1)) / scale
    if admm_alpha is not None:  # ADMM's λ_jnt also has to reach the sites' sum (it can lag with λ_k = λ_jnt)
        residual = jnp.maximum(residual, jnp.linalg.norm(new.joint - site_natural(new)) / scale)
    info = dict(kl_to_previous=float(fam.kl(global_natural(new), lam)),
                kl_rounding=float(kl_rounding(fam, global_natural(new), lam)), residual=float(residual),
                participants=int(idx.shape[0]), local_iterations=int(jnp.max(local.iterations)),
                local_residual=float(jnp.max(local.residual)), rho_min=float(jnp.min(rhos)),
                rho_max=float(jnp.max(rhos)), **step)
    return new, info


def posterior_ef(clients, state, record: dict | None = None) -> EFPosterior:
    """The global :class:`~numpyro_pc.dual.expfam.EFPosterior` on the union of the shards (sites at the global
    :math:`\\lambda`; ``prior`` :math:`-\\lambda_0` for a conjugate-form prior, else the prior term at :math:`q`)."""
    data = concat_datas(clients.datas)
    num = int(data.per_example[0].shape[0])
    cfg = replace(clients.config, spec=replace(clients.config.spec, num_examples=num))
    lam = global_natural(state)
    sites = compute_sites(cfg, lam, data)
    prior = -clients.prior if clients.conjugate else sites.prior
    table = EFSiteTable(sites.grads, prior, jnp.arange(num))
    return EFPosterior(cfg, data, EFState(lam, table), clients.conjugate, None, FederatedInfo(**(record or {})))


def run_ef(model, client_data, family, algorithm="fedpc", rho=None, rounds=50, damping=None, fraction=1.0, *,
           seed=0, reference=None, keep_data=True, raise_on_failure=False, kwargs=None, data_plate=None, shared=(),
           callback=None, init="zero", admm_alpha=None, local=None, stop=None, safeguard=None, robust=None,
           privacy=None, **deprecated) -> FederatedResult:
    """Federated posterior correction of an exponential-family product posterior over client shards in one
    process (clients ``vmap``-ed); :func:`numpyro_pc.federated.run` with a dict ``family`` calls this.

    The option groups are :func:`~numpyro_pc.federated.run`'s (:mod:`numpyro_pc.federated.options`), with this
    path's defaults; the flat keywords they replace (``tol``, ``residual_tol``, ``local_iters``, ``local_tol``,
    ``expectation``, ``num_nodes``, ``num_samples``, ``draw_seed``, ``safeguard_margin``, ``max_retries``,
    ``max_share``, ``max_shift``) still work for one release with a ``FutureWarning``. Keywords after
    ``fraction`` are keyword-only.

    :param dict family: ``{latent site: family name}`` as for :func:`numpyro_pc.fit`.
    :param str algorithm: ``"fedpc"`` (``ρ`` default ``1/K``), ``"pvi"`` (``ρ = 1``, sites damped by ``damping``)
        or ``"admm"`` (FedPC's local step, the server step of :func:`~numpyro_pc.federated.ef_server.admm_server_ef`; ``ρ`` default ``1/K``).
        ``"ama"`` is refused: it is MAP with a precision fixed by the prior, and these families learn theirs.
    :param float rho: local weight ``ρ``, a floor when the safeguard (default on for FedPC and ADMM) raises each
        client's to :func:`safe_rho_ef`.
    :param safeguard: a :class:`~numpyro_pc.federated.options.Safeguard` (or ``True``/``False``/``None``):
        ``margin`` of :func:`safe_rho_ef` (default 0.3); a round that fails (a local fixed point or the global
        :math:`\\lambda` outside the domain) is repeated with the floor doubled, at most ``max_retries`` times
        (default 6; on this path whether or not the safeguard is on). The fixed point does not depend on ``ρ``.
    :param float damping: PVI site damping ``δ ∈ (0, 1]``; ``fraction``: share of clients per round (drawn with
        ``seed``); ``callback(record)`` after every round.
    :param StopRule stop: stop when ``KL(q_t ‖ q_{t−1})`` is below ``stop.tol`` (default ``1e-16`` / ``1e-8`` in
        float32), or below the KL's own rounding error (:func:`kl_rounding`, recorded per round as
        ``kl_rounding``), *and* the residual is below ``stop.residual_tol`` (default ``1e-10`` / ``1e-5``).
    :param reference: an :class:`~numpyro_pc.dual.expfam.EFPosterior` (or natural vector) to compare with.
    :param LocalSolve local: ``iters``: iterations of each local fixed point (default 200); ``tol`` its
        tolerance (default ``1e-12`` / ``1e-6``); ``expectation``, ``num_nodes`` (default 32), ``num_samples``,
        ``draw_seed``: the site rule, as ``fit``'s ``expectation``, ``num_nodes``, ``num_samples``, ``seed``.
    :param str init: ``"zero"`` or ``"prior"`` (:func:`init_ef`).
    :param float admm_alpha: ADMM's step :math:`\\alpha > 0` (default ``1/(1 + ρM)``, ``M`` clients per round,
        with the ``ρ`` given; a retry's doubled floor does not change it).
    :param privacy: a :class:`~numpyro_pc.federated.privacy.GaussianMechanism`: every site a client sends is
        :func:`~numpyro_pc.federated.ef_robust.release_ef` — its examples' terms clipped to ``clip_natural`` and noised, ``1/σ²``-zCDP per
        release as a Gaussian site, so ``history["epsilon"]`` is the same accounting
        (:meth:`~numpyro_pc.federated.privacy.GaussianMechanism.epsilon_after`). As for Gaussian posteriors:
        FedPC and PVI (not ADMM), ``releases`` must cover ``rounds`` plus the initial sites of ``init="prior"``,
        failed rounds are not retried, and the run ends on its round budget at a perturbed fixed point. A noised
        sum outside the domain is pulled back by :func:`~numpyro_pc.federated.ef_robust.retreat_ef` (``history["domain_step"]``).
    :param Robustness robust: bounded aggregation (:func:`~numpyro_pc.federated.ef_robust.bound_sites_ef`):
        ``max_share``: one client's site at most ``max_share`` times the others' together, in the Fisher metric
        (needs two clients or more; not ADMM); ``max_shift``: :math:`\\mathrm{KL}(q \\| q_{-k}) \\le` ``max_shift² / 2``
        for every client ``k`` (for a Gaussian this implies the Gaussian path's bound of ``max_shift`` standard
        deviations on the mean). ``history["clipped"]`` counts the tempered clients, ``clipped_clients`` names
        them. Where the other clients' posterior lies outside the domain the shift bound is not defined and the
        round fails (:class:`~numpyro_pc.errors.OutOfDomainError`; retried with a larger ``ρ``, except in a
        private run, which then stops as ``"diverged"``).
    :return: :class:`~numpyro_pc.federated.core.FederatedResult` with ``state`` the final
        :class:`~numpyro_pc.federated.ef_server.EFServerState` and ``sites`` its ``(K, P)`` sites; ``history`` one
        :class:`~numpyro_pc.federated.records.RoundInfo` per round: ``kl_to_previous``,
        ``residual`` (largest ``‖λ_k − λ‖ / (1 + ‖λ‖)``; ADMM: also ``‖λ_jnt − λ_0 − Σ_k η_k‖``),
        ``local_iterations``, ``local_residual``,
        ``rho_min``/``rho_max``/``rho_floor``, ``retries``, ``bytes``, ``seconds``; with a reference also
        ``kl_to_reference`` and ``error_to_reference`` (``‖λ − λ_ref‖ / ‖λ_ref‖``). ``result.posterior.record``
        stays a plain dict: ``operation`` ``"federated"``, ``algorithm``, ``rho``, ``rounds``, ``status`` and,
        with ADMM, ``admm_alpha``.
    :raises ConvergenceError: with ``raise_on_failure``, a run that diverged or ended before the tolerances.
    :raises MissingCapabilityError: ``algorithm="ama"``.
    :raises PrivacyError: ``privacy`` with a prior that depends on the data (:func:`check_prior_data_free`).
    :raises InvalidOptionError: ``privacy`` or bounded aggregation with ADMM (its server step averages the
        clients' exact local posteriors, which neither the mechanism nor the bounds cover), a mechanism with
        fewer ``releases`` than the run may send, bounds with one client.
    """
    local, stop, guard, robust = resolve_options("run_ef", deprecated, local, stop, safeguard, robust)
    local_iters = 200 if local.iters is None else local.iters
    max_retries, safeguard_margin = guard.max_retries, guard.margin
    max_share, max_shift = robust.max_share, robust.max_shift
    if guard.line_search:
        raise InvalidOptionError("Safeguard(line_search=True) searches the global step of Gaussian posteriors "
                                 "(numpyro_pc.federated.line_search); an exponential-family run takes the plain step "
                                 "with its own domain safeguard. Leave line_search unset.")
    if algorithm not in ("fedpc", "pvi", "ama", "admm"):
        raise InvalidOptionError(f"unknown algorithm {algorithm!r}; expected 'fedpc', 'pvi' or 'admm' ('ama' needs "
                                 "a precision fixed by the prior)")
    if algorithm == "pvi" and rho not in (None, 1, 1.0):
        raise InvalidOptionError(f"PVI uses ρ = 1 (damping acts on the sites); got rho={rho}")
    if admm_alpha is not None and (algorithm != "admm" or not float(admm_alpha) > 0):
        raise InvalidOptionError(f"admm_alpha is ADMM's server step, a positive number; got {admm_alpha!r} with "
                                 f"algorithm={algorithm!r}")
    clients = bind_ef_clients(model, client_data, family, kwargs, data_plate, shared, local.expectation or "auto",
                              32 if local.num_nodes is None else local.num_nodes, local.num_samples, local.draw_seed)
    if algorithm == "ama":
        require(clients.config.family, FixedPrecision, "algorithm='ama'",
                advice="AMA is MAP estimation of the mean under a precision τI fixed by the prior (paper theorem "
                       "'AMA as posterior correction'); for an exponential-family posterior use algorithm='fedpc', "
                       "'pvi' or 'admm', or fit a Gaussian with family='isotropic' for AMA.")
    num = int(clients.stack.mask.shape[0])
    rho = (1.0 / num if algorithm in ("fedpc", "admm") else 1.0) if rho is None else float(rho)
    safeguard = guard.on(algorithm)
    damping = 1.0 if damping is None else float(damping)
    if not (rho > 0 and 0 < damping <= 1 and 0 < fraction <= 1):
        raise InvalidOptionError(f"need rho > 0, damping in (0, 1] and fraction in (0, 1]; got {rho}, {damping}, "
                                 f"{fraction}")
    x64 = clients.prior.dtype == jnp.float64
    tol = (1e-16 if x64 else 1e-8) if stop.tol is None else stop.tol
    residual_tol = (1e-10 if x64 else 1e-5) if stop.residual_tol is None else stop.residual_tol
    participants = max(1, int(round(fraction * num)))
    alpha = None  # FedPC and PVI: the global λ is the sites' sum
    if algorithm == "admm":
        alpha = 1.0 / (1.0 + rho * participants) if admm_alpha is None else float(admm_alpha)
    fam = clients.config.family
    ref = None if reference is None else jnp.asarray(getattr(reference, "natural", reference))
    releases = int(rounds) + (init == "prior")
    if algorithm == "admm" and privacy is not None:
        raise InvalidOptionError("privacy is not available with algorithm='admm' (its server step needs each "
                                 "client's exact local posterior); use 'fedpc' or 'pvi'")
    if algorithm == "admm" and (max_share is not None or max_shift is not None):
        raise InvalidOptionError("bounded aggregation (max_share/max_shift) bounds the clients' sites, but ADMM's "
                                 "server step also averages their local posteriors; use algorithm='fedpc'")
    if privacy is not None:
        require(fam, SiteSum, "privacy= (the Gaussian mechanism)",
                advice="Its sensitivity bound clips each example's term of a site and sums them.")
        check_prior_data_free(clients)
        if privacy.releases < releases:
            raise InvalidOptionError(f"the privacy mechanism is calibrated for {privacy.releases} release(s) per "
                                     f"client, but rounds={rounds} with init={init!r} may send {releases}")
        max_retries = 0  # a retry is one more release
    bounds = robust_bounds(max_share, max_shift, clients.prior.dtype)
    if bounds is not None and num < 2:
        raise InvalidOptionError("bounded aggregation measures each client's site against the other clients' "
                                 "update; with one client there is none (leave max_share/max_shift unset)")
    key = jax.random.PRNGKey(seed)
    state = init_ef(clients, init, local_iters, privacy, jax.random.fold_in(key, 2**31 - 1), bounds)
    floor, history, status = rho, [], "max_rounds"
    message = clients.prior.shape[0] * clients.prior.dtype.itemsize
    per_round = (3 if algorithm == "admm" else 2) * participants * message  # ADMM also sends λ_k up
    start, total = time.perf_counter(), 0
    for t in range(1, int(rounds) + 1):
        key, sub = jax.random.split(key)
        for attempt in range(int(max_retries) + 1):
            total += per_round
            try:
                new, info = round_ef(clients, state, floor, damping, participants, sub, local.tol, local_iters,
                                     safeguard_margin if safeguard else None, alpha, privacy, bounds)
                failure = None
                break
            except (OutOfDomainError, ClientMessageError) as err:
                failure = str(err)
                floor *= 2.0
        record = dict(round=t, rho_floor=floor, retries=attempt, bytes=total, seconds=time.perf_counter() - start)
        if privacy is not None:
            record["epsilon"] = privacy.epsilon_after(t + (init == "prior"))
        if failure is not None:
            history.append(RoundInfo(**record, kl_to_previous=float("nan"), failure=failure))
            status = "diverged"
            break
        state = new
        record.update(info)
        if ref is not None:
            lam = global_natural(state)
            record.update(kl_to_reference=float(fam.kl(lam, ref)),
                          error_to_reference=float(jnp.linalg.norm(lam - ref) / jnp.linalg.norm(ref)))
        # a KL below its own float rounding is 0: the stop rule compares with the larger of the two
        if record_round(record, history, callback, max(tol, record["kl_rounding"]), residual_tol):
            status = "converged"
            break
    summary = dict(algorithm=algorithm, rho=rho, rounds=len(history), status=status)
    if alpha is not None:
        summary["admm_alpha"] = alpha
    posterior = posterior_ef(clients, state, summary) if keep_data else None
    result = FederatedResult(posterior, state, state.sites, history, status == "converged", status, algorithm, rho)
    if status != "converged":
        last = history[-1] if history else {}
        msg = (f"federated {algorithm} over an exponential-family posterior (ρ={rho:g}, damping={damping:g}) "
               f"stopped after {len(history)} round(s) ({status}): {last.get('failure') or 'rounds reached'}; "
               f"last KL to the previous round {last.get('kl_to_previous', float('nan')):.3e}, residual "
               f"{last.get('residual', float('nan')):.3e} (a residual that cycles or stalls: increase rho)")
        if raise_on_failure:
            raise ConvergenceError(msg, posterior=result, history=history)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return result
