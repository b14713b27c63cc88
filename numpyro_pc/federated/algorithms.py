r"""Federated posterior correction in one process: FedPC, PVI, AMA and ADMM.

All four share the double loop of paper eqs. ``global_update``/``local_update``
(see :mod:`numpyro_pc.federated.core`); they differ in the local weight ``ρ``, the
family and the server step:

``"fedpc"``
    federated posterior correction with the floor ``ρ`` given (default ``1/K``; ``ρ ∈ (0, 2/K)``
    is the safe range of the quadratic case, paper §3.4 after Tseng 1991) and the safeguard
    below;
``"pvi"``
    partitioned variational inference (Ashman et al. 2022): ``ρ = 1`` and the site
    update damped, ``η_k ← (1 − δ) η_k + δ λ̂_k(q_k)`` with ``δ = damping``;
``"ama"``
    the alternating minimisation algorithm: the isotropic family with the delta rule
    (paper theorem "AMA as posterior correction"), MAP estimation;
``"admm"``
    FedPC locally with the ADMM-style server step of paper eq. ``admm``,
    ``λ_jnt ← α (λ_0 + Σ_k η_k) + (1 − α) · mean_k λ_k`` with ``α = 1/(1 + ρK)`` — the
    product ``Π_k q_k`` is taken as a geometric mean so that the fixed point stays the
    joint posterior (the unnormalised product would carry ``K`` times the precision).

Clients are stacked on a leading axis and ``vmap``-ed, padded to the largest shard or, with
``stacking.BUCKET_BASE = 2`` (opt-in), by buckets of similar shard sizes
(:func:`~numpyro_pc.federated.stacking.bucket_clients`: each client padded to less than twice its rows); with ``fraction < 1`` a random subset of fixed size takes part in each round (gathered and
scattered from one stack padded to the largest shard, so shapes never change). Rounds are a host loop around one jitted round function; it stops when the KL
between successive global posteriors and the local-correction residual fall below the
tolerances.

For the isotropic family the fixed precision ``τ`` is the prior's (mean of the diagonal
of ``P_0``), the scaling of the paper's AMA in which ``ρ ∈ (0, 2/K)`` is the safe range.

**Where PVI without damping fails.** With the isotropic family on a quadratic loss (linear
regression, MAP) and an isotropic prior of precision ``τ``, write ``A`` for a client's
Hessian (equal shards, scalar view). One round maps the summed site error ``G`` to
``A (1 − ρK) / (A + ρτ) · G``: for ``ρ = 1`` and ``K = 10`` clients the error is multiplied
by about ``−9`` per round once ``A ≫ τ`` — PVI diverges, and site damping only slows the
growth — while FedPC with ``ρ < 2/K`` contracts (``ρ = 1/K`` solves the equal-shard case in
one round). The test suite and ``notebooks/06_federated.ipynb`` show this case.

**Non-quadratic losses: the safeguard.** The local problem's curvature in the mean is
``P_jnt + (E_q[∇²ℓ_k] − S_k)/ρ`` (``S_k`` the client's site precision); when a client's
curvature falls away from its last site (logistic regression with label-sorted shards) a
small ``ρ`` makes it unbounded and, without a safeguard, the run diverges in round 1–2.
With ``safeguard=True`` (the default for FedPC and ADMM) each client uses
``ρ_k = max(ρ, (1 + margin) λ_max(P_jnt⁻¹ S_k))`` in every round
(:func:`~numpyro_pc.federated.core.safe_rho`): for a convex loss its local problem is then
strongly convex whatever ``q``, and ``ρ_k < 1 + margin`` because ``P_jnt ⪰ S_k``. A round that
still fails (a non-convex loss) is repeated with the floor ``ρ`` doubled. The fixed point of
the double loop (``λ_k = λ_jnt``, ``η_k = λ̂_k(q_jnt)``) does not involve ``ρ``, so any
``ρ_k`` keeps it at the joint posterior; ``ρ`` becomes a floor the user need not tune
(``benchmarks/RESULTS.md``: every ``ρ`` from 0.05 to 1 converges on the label-skewed splits).
"""

from __future__ import annotations

import math
import time
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.dual.build import build_posterior
from numpyro_pc.families.registry import GaussianFamily, Gaussian, GaussianNatural, get_family
from numpyro_pc.ops.merging import gaussian_prior, prior_natural
from numpyro_pc.protocols.capabilities import FixedPrecision, SiteSum, capability, require
from numpyro_pc.protocols.records import FederatedInfo
from numpyro_pc.sites.expectations import ExpectationRule

from ..errors import ConvergenceError, InvalidOptionError, MissingCapabilityError
from ..options import is_choice
from ..posterior import DualPosterior
from .core import (
    FederatedResult,
    LocalConfig,
    bind_shards,
    check_rule,
    concat_datas,
    global_state,
    joint_spec,
    local_update,
    natural_nbytes,
    record_round,
    release_site,
)
from .ef import run_ef
from .options import resolve_options
from .privacy import check_gaussian_prior_data_free
from .line_search import search_init, search_step
from .records import RoundInfo
from .robust import BOUNDS_NEED_SUM, aggregate_sites, robust_bounds
from .stacking import bucket_clients, map_buckets

__all__ = ["ALGORITHMS", "FederatedResult", "run"]

ALGORITHMS = ("fedpc", "pvi", "ama", "admm")

#: why the Gaussian mechanism needs :class:`~numpyro_pc.protocols.capabilities.SiteSum` (both families' paths)
PRIVACY_NEEDS_SUM = ("Its sensitivity bound clips each example's term of a site and sums them, so a client's "
                     "message must be the sum of its examples' terms in the family's parameters. Use family='full', "
                     "'diagonal' or 'isotropic', or an exponential-family dict.")


def refuse_ama(family) -> None:
    """Refuse ``algorithm="ama"`` for a family without :class:`~numpyro_pc.protocols.capabilities.FixedPrecision`.

    AMA is MAP estimation of the mean under a precision ``τI`` fixed by the prior (paper theorem "AMA as
    posterior correction"): the isotropic family with the delta rule. A family that learns its precision
    from its sites' curvature has no such fixed precision.

    :raises MissingCapabilityError: naming the family and, in mathematical terms, why it lacks it.
    """
    if capability(family, FixedPrecision) is not None:
        return
    name = getattr(family, "name", type(family).__name__)
    why = getattr(family, "lacks", {}).get(FixedPrecision) or ("its precision is learned: every site adds its "
                                                               "curvature to the prior's")
    raise MissingCapabilityError(f"algorithm='ama' needs {FixedPrecision.needs} (AMA is MAP estimation of the mean "
                                 f"under a precision τI the prior fixes, the isotropic family with the delta rule); "
                                 f"the {name} family lacks it: {why}. Use family='isotropic' for AMA, or "
                                 "algorithm='fedpc' to keep this family.")


def check_settings(algorithm, family, rho, damping, expectation, spec, num_clients=1) -> tuple[GaussianFamily, float, float, str]:
    if not is_choice(algorithm, ALGORITHMS):
        raise InvalidOptionError(f"unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    if algorithm == "ama":
        if family is not None:
            refuse_ama(get_family(family))
        family, expectation = "isotropic", "delta"
    family = get_family("full" if family is None else family)
    if algorithm == "pvi":
        if rho not in (None, 1, 1.0):
            raise InvalidOptionError(f"PVI uses ρ = 1 (damping acts on the sites); got rho={rho}. "
                                     "Use algorithm='fedpc'.")
        rho = 1.0
    rho = (1.0 / num_clients if algorithm in ("fedpc", "admm") else 1.0) if rho is None else float(rho)
    if not rho > 0:
        raise InvalidOptionError(f"rho must be positive, got {rho}")
    damping = 1.0 if damping is None else float(damping)
    if not 0 < damping <= 1:
        raise InvalidOptionError(f"damping must lie in (0, 1], got {damping}")
    if expectation is None:
        glm = spec.num_params == 1 and spec.affine
        expectation = "gh" if glm and not capability(family, FixedPrecision) else "delta"
    check_rule(spec, expectation)
    return family, rho, damping, expectation


@partial(jax.jit, static_argnames=("cfg", "algorithm", "num_clients", "num_participants"))
def _round(cfg, algorithm, num_clients, num_participants, prior, prior_nat, eta, q_jnt, stack, rho, damping,
           alpha, key, bounds) -> tuple[GaussianNatural, Gaussian, dict[str, jax.Array]]:
    family = cfg.family
    keys = jax.random.split(jax.random.fold_in(key, 1), num_participants)  # the clients' noise (privacy)
    if num_participants == num_clients:
        idx = jnp.arange(num_clients)
    else:
        idx = jax.random.choice(key, num_clients, (num_participants,), replace=False)
    pick = lambda x: x[idx]  # noqa: E731
    shared = stack.stacks[0].shared  # stack: the clients' Buckets (one bucket when some clients sit out)
    one = lambda e, k, ex, mk: local_update(cfg, q_jnt, e, rho, ex, mk, shared, k)  # noqa: E731
    if num_participants == num_clients:
        local = map_buckets(one, stack, (eta, keys))
    else:
        padded = stack.stacks[0]
        local = jax.vmap(one)(jax.tree.map(pick, eta), keys, jax.tree.map(pick, padded.per_example),
                              padded.mask[idx])
    old = jax.tree.map(pick, eta)
    new = jax.tree.map(lambda o, n: o + damping * (n - o), old, local.site)
    eta = jax.tree.map(lambda e, n: e.at[idx].set(n), eta, new)
    eta_sum, scaled = aggregate_sites(family, prior_nat, eta, bounds)
    q_new = global_state(family, prior, prior_nat, eta_sum)
    if algorithm == "admm":
        lam_fed = family.natural(q_new)
        lam_loc = jax.tree.map(lambda x: jnp.mean(x, 0), local.local)
        mixed = jax.tree.map(lambda a, b: alpha * a + (1.0 - alpha) * b, lam_fed, lam_loc)
        q_new = family.from_natural(mixed)
    lam_old = family.natural(q_jnt)
    flat = lambda lam: jnp.concatenate([jnp.ravel(lam.linear), jnp.ravel(lam.precision)])  # noqa: E731
    ref = jnp.linalg.norm(flat(lam_old))
    residual = jnp.max(jax.vmap(lambda lin, prec: jnp.linalg.norm(flat(GaussianNatural(lin, prec)) - flat(lam_old)))(
        local.local.linear, local.local.precision)) / ref
    if algorithm == "admm":  # λ_jnt must also reach the sites' sum: with λ_k = λ_jnt it can still lag behind it
        residual = jnp.maximum(residual, jnp.linalg.norm(flat(family.natural(q_new)) - flat(lam_fed)) / ref)
    ok = jnp.all(local.ok) & jnp.all(jnp.isfinite(q_new.mean)) & family.is_positive_definite(q_new.precision)
    kl = family.kl(q_new, q_jnt)
    return eta, q_new, dict(kl_to_previous=kl, residual=residual, local_iterations=jnp.max(local.iterations), ok=ok,
                            rho_min=jnp.min(local.rho), rho_max=jnp.max(local.rho), clipped=scaled)


@partial(jax.jit, static_argnames=("cfg",))
def _initial_sites(cfg, q, stack, key) -> GaussianNatural:
    keys = jax.random.split(key, stack.num_clients)
    shared = stack.stacks[0].shared
    return map_buckets(lambda k, ex, mk: release_site(cfg, q, ex, mk, shared, k), stack, (keys,))


def run(model, client_data, family=None, algorithm="fedpc", rho=None, rounds=50, damping=None, fraction=1.0, *,
        seed=0, reference=None, keep_data=True, admm_alpha=None, raise_on_failure=False, kwargs=None,
        data_plate=None, shared=(), callback=None, init="auto", local=None, stop=None, safeguard=None, robust=None,
        privacy=None, **deprecated) -> FederatedResult:
    """Run a federated algorithm over client shards in one process.

    The options of the local solve, the stop rule, the safeguard and bounded aggregation come in groups
    (:mod:`numpyro_pc.federated.options`): ``local=LocalSolve(...)``, ``stop=StopRule(...)``,
    ``safeguard=Safeguard(...)`` and ``robust=Robustness(...)``. The flat keywords they replace
    (``expectation``, ``tol``, ``residual_tol``, ``local_iters``, ``local_tol``, ``num_nodes``,
    ``safeguard_margin``, ``max_retries``, ``max_share``, ``max_shift``) still work for one release with a
    ``FutureWarning``; one given together with its group is refused. Keywords after ``fraction`` are
    keyword-only.

    :param model: the NumPyro model (one data plate, global latents, a prior that is
        Gaussian on the unconstrained latents).
    :param client_data: one tuple of model arguments per client, e.g. ``[(X1, y1), ...]``.
    :param family: ``"full"`` (default), ``"diagonal"`` or ``"isotropic"``; or a dict
        ``{latent site: family name}`` for an exponential-family product posterior, run by
        :func:`numpyro_pc.federated.ef.run_ef` (``"fedpc"``, ``"pvi"`` or ``"admm"``; ``"ama"``
        and the Gaussian expectation rules are refused; ``privacy``, ``max_share`` and ``max_shift``
        in the family's natural parameters, see :func:`~numpyro_pc.federated.ef_robust.bound_sites_ef` and
        :func:`~numpyro_pc.federated.ef_robust.release_ef`).
    :param str algorithm: ``"fedpc"``, ``"pvi"``, ``"ama"`` or ``"admm"``.
    :param float rho: local weight ``ρ``: with the safeguard, the smallest weight a client
        uses (default ``1/K``, the middle of the quadratic case's safe range ``(0, 2/K)``;
        PVI forces 1).
    :param int rounds: maximum number of rounds.
    :param float damping: PVI-style site damping ``δ ∈ (0, 1]`` (default ``1``: none).
    :param float fraction: share of clients taking part in each round.
    :param int seed: seed of the client sampling.
    :param reference: a posterior (or :class:`~numpyro_pc.families.registry.Gaussian`) to report
        ``kl_to_reference = KL(q_t ‖ reference)`` against each round.
    :param bool keep_data: build ``result.posterior`` on the union of the shards.
    :param float admm_alpha: override of ``α`` in the ADMM server step.
    :param bool raise_on_failure: raise :class:`~numpyro_pc.errors.ConvergenceError`
        (carrying the result as ``err.posterior``) when the run diverges or ends before the
        tolerances; otherwise warn.
    :param callback: called as ``callback(info)`` after every round, ``info`` the round's
        :class:`~numpyro_pc.federated.records.RoundInfo`.
    :param str init: first guess of the sites: ``"prior"`` (each client's site at the prior,
        so the first global posterior is one natural-gradient step from the prior),
        ``"zero"`` (sites equal to one, as in PVI; the first local step then starts from the
        prior and, for a small ``ρ``, weights the client's loss by ``1/ρ``) or ``"auto"``:
        ``"zero"`` for the isotropic family (whose step from the prior is a plain gradient
        step of size ``1/τ`` and can land where a logistic loss saturates), else ``"prior"``.
    :param LocalSolve local: the clients' local solve (:class:`~numpyro_pc.federated.options.LocalSolve`:
        ``iters`` default 50 Newton iterations, ``tol`` default ``1e-12`` / ``1e-6`` in float32, ``expectation``
        ``"gh"`` (default for GLMs) or ``"delta"``, ``num_nodes`` Gauss–Hermite nodes, default 64).
    :param StopRule stop: stop when ``KL(q_t ‖ q_{t−1})`` is below ``stop.tol`` (default ``1e-14`` in
        float64, ``1e-8`` in float32) *and* the residual is below ``stop.residual_tol`` (default ``1e-7`` /
        ``1e-4``) (:class:`~numpyro_pc.federated.options.StopRule`).
    :param safeguard: a :class:`~numpyro_pc.federated.options.Safeguard`, or ``True``/``False``/``None`` for
        ``Safeguard(enabled=...)``: adapt each client's ``ρ_k ≥ ρ`` every round so that its local
        problem is convex (:func:`~numpyro_pc.federated.core.safe_rho`,
        ``ρ_k = max(ρ, (1 + margin) λ_max(P_jnt⁻¹ S_k))``), and retry a round that still fails with the floor
        ``ρ`` doubled (at most ``max_retries`` times). Default: on for ``"fedpc"`` and ``"admm"``, off for
        ``"pvi"`` (``ρ = 1`` by definition) and ``"ama"``. The fixed point does not depend on ``ρ``, so it
        stays the joint posterior.
    :param Robustness robust: bounded aggregation (:mod:`~numpyro_pc.federated.robust`,
        :class:`~numpyro_pc.federated.options.Robustness`): one client's site may raise the global precision
        by at most the factor ``1 + max_share`` over the others', and move the global mean by at most
        ``max_shift`` standard deviations of the others' posterior (default: no bound; not with ADMM).
    :param privacy: a :class:`~numpyro_pc.federated.privacy.GaussianMechanism`: every site a
        client sends is clipped per example and noised to the mechanism's ``(ε, δ)``
        (FedPC, PVI and AMA; not ADMM, whose server step needs the exact local posteriors).
        Its ``releases`` must cover ``rounds`` plus the initial sites of ``init="prior"``;
        failed rounds are not retried (a retry is one more release). The run then ends on
        its round budget rather than on the tolerances, and its fixed point is perturbed
        (``history`` records ``epsilon``, the privacy loss spent so far).
    :return: :class:`FederatedResult`; ``history`` holds one
        :class:`~numpyro_pc.federated.records.RoundInfo` per round, with ``rho_min``/``rho_max`` (the
        weights the clients used), ``rho_floor``, ``clipped`` (how many clients were bounded that round)
        and ``clipped_clients`` (which).
    """
    local, stop, guard, robust = resolve_options("run", deprecated, local, stop, safeguard, robust)
    if isinstance(family, dict):
        if local.expectation in ("gh", "delta"):
            raise InvalidOptionError(f"expectation {local.expectation!r} is a rule of Gaussian posteriors' sites, not "
                                     "of an exponential-family family dict (see numpyro_pc.fit's expectation options)")
        return run_ef(model, client_data, family, algorithm=algorithm, rho=rho, rounds=rounds, damping=damping,
                      fraction=fraction, seed=seed, reference=reference, keep_data=keep_data,
                      raise_on_failure=raise_on_failure, kwargs=kwargs, data_plate=data_plate, shared=shared,
                      callback=callback, init="zero" if init == "auto" else init, admm_alpha=admm_alpha,
                      privacy=privacy, local=local, stop=stop, safeguard=guard, robust=robust)
    if local.num_samples is not None or local.draw_seed != 0:
        raise InvalidOptionError("LocalSolve.num_samples and draw_seed set the Monte Carlo draws of an "
                                 "exponential-family run (a dict family); a Gaussian family's local solve takes "
                                 f"none (got num_samples={local.num_samples!r}, draw_seed={local.draw_seed!r})")
    num_nodes = 64 if local.num_nodes is None else local.num_nodes
    local_iters = 50 if local.iters is None else local.iters
    max_retries, max_share, max_shift = guard.max_retries, robust.max_share, robust.max_shift
    spec, datas = bind_shards(model, client_data, kwargs, data_plate, shared)
    family, rho, damping, rule = check_settings(algorithm, family, rho, damping, local.expectation, spec, len(datas))
    safeguard = guard.on(algorithm)
    num_clients = len(datas)
    if not 0 < fraction <= 1:
        raise InvalidOptionError(f"fraction must lie in (0, 1], got {fraction}")
    num_participants = max(1, int(round(fraction * num_clients)))
    # clients by shard size (stacking.BUCKET_BASE); a random subset of clients (fraction < 1) is drawn inside
    # the compiled round, so then they share one bucket padded to the largest shard
    stack = bucket_clients(datas, None if num_participants == num_clients else math.inf)
    dtype = stack.dtype
    x64 = dtype == jnp.float64
    tol = (1e-14 if x64 else 1e-8) if stop.tol is None else stop.tol
    residual_tol = (1e-7 if x64 else 1e-4) if stop.residual_tol is None else stop.residual_tol
    local_tol = (1e-12 if x64 else 1e-6) if local.tol is None else local.tol
    if init == "auto":
        init = "zero" if capability(family, FixedPrecision) else "prior"
    if init not in ("prior", "zero"):
        raise InvalidOptionError(f"unknown init {init!r}; expected 'prior', 'zero' or 'auto'")
    releases = int(rounds) + (init == "prior")
    if privacy is not None:
        require(family, SiteSum, "privacy= (the Gaussian mechanism)", advice=PRIVACY_NEEDS_SUM)
        if algorithm == "admm":
            raise InvalidOptionError("privacy is not available with algorithm='admm' (its server step needs each "
                                     "client's exact local posterior); use 'fedpc' or 'pvi'")
        if privacy.releases < releases:
            raise InvalidOptionError(f"the privacy mechanism is calibrated for {privacy.releases} release(s) per "
                                     f"client, but rounds={rounds} with init={init!r} may send {releases}")
        check_gaussian_prior_data_free(spec, datas)
        max_retries = 0
    cfg = LocalConfig(spec, family, rule, int(num_nodes), int(local_iters), local_tol, safeguard=safeguard,
                      margin=guard.margin, privacy=privacy)
    if algorithm == "admm" and (max_share is not None or max_shift is not None):
        raise InvalidOptionError("bounded aggregation (max_share/max_shift) bounds the clients' sites, but ADMM's "
                                 "server step also averages their local posteriors; use algorithm='fedpc'")
    bounds = robust_bounds(max_share, max_shift, dtype)
    if bounds is not None:
        require(family, SiteSum, "bounded aggregation (max_share/max_shift)", advice=BOUNDS_NEED_SUM)
    prior = gaussian_prior(spec, datas[0])
    # the isotropic family takes the prior's precision as its fixed τ: the AMA scaling in
    # which ρ ∈ (0, 2/K) is the safe range (paper §3.4)
    prior_nat = prior_natural(family, prior, family.prior_tau(prior))
    q = global_state(family, prior, prior_nat, jax.tree.map(jnp.zeros_like, prior_nat))
    key = jax.random.PRNGKey(seed)
    if init == "zero":
        eta = jax.tree.map(lambda x: jnp.zeros((num_clients,) + jnp.shape(x), dtype), prior_nat)
    else:
        eta = _initial_sites(cfg, q, stack, jax.random.fold_in(key, 2**31 - 1))
        q = global_state(family, prior, prior_nat, aggregate_sites(family, prior_nat, eta, bounds)[0])
        family.check_positive_definite(q.precision, what="initial global precision")
    alpha = 1.0 / (1.0 + rho * num_participants) if admm_alpha is None else float(admm_alpha)
    ref_state = getattr(reference, "state", reference)
    message = natural_nbytes(family, spec.latent.dim, dtype)
    up = message * (2 if algorithm == "admm" else 1)
    history: list[RoundInfo] = []
    total_bytes, status = 0, "max_rounds"
    searching = guard.searches(algorithm, privacy is not None, bounds is not None, num_participants < num_clients)
    search = search_init(cfg, prior, prior_nat, eta, q, stack, bounds) if searching else None
    # each candidate: the clients download it and report their term of J and their site there
    report = jnp.dtype(dtype).itemsize + message
    first_report = num_clients * report  # the first global posterior's, counted with round 1
    start = time.perf_counter()
    floor = rho
    for t in range(1, int(rounds) + 1):
        key, sub = jax.random.split(key)
        for attempt in range(int(max_retries) + 1 if safeguard else 1):
            eta_new, q_new, diag = _round(cfg, algorithm, num_clients, num_participants, prior, prior_nat, eta, q,
                                          stack, jnp.asarray(floor, dtype), jnp.asarray(damping, dtype),
                                          jnp.asarray(alpha, dtype), sub, bounds)
            total_bytes += num_participants * (up + message)
            good = bool(diag["ok"]) and math.isfinite(float(diag["kl_to_previous"]))
            if good or attempt == max_retries:
                break
            floor *= 2.0  # the safeguard's second line: a failed round is repeated with a larger ρ
        record = dict(round=t, kl_to_previous=float(diag["kl_to_previous"]), residual=float(diag["residual"]),
                      participants=num_participants, local_iterations=int(diag["local_iterations"]),
                      bytes_up=num_participants * up, bytes_down=num_participants * message, bytes=total_bytes,
                      seconds=time.perf_counter() - start, rho_min=float(diag["rho_min"]),
                      rho_max=float(diag["rho_max"]), rho_floor=floor, retries=attempt, clipped=int(np.sum(diag["clipped"])),
                      clipped_clients=np.flatnonzero(np.asarray(diag["clipped"])).tolist())
        if privacy is not None:
            record["epsilon"] = privacy.epsilon_after(t + (init == "prior"))
        if search is not None and good:
            found, search = search_step(cfg, prior, prior_nat, eta, eta_new, q, stack, bounds, search)
            # the accepted candidate's download is the next round's broadcast
            extra_up = num_clients * found.trials * report + (first_report if t == 1 else 0)
            extra_down = num_clients * (found.trials - 1) * message
            total_bytes += extra_up + extra_down
            record.update(step=found.step, step_trials=found.trials, step_kind=found.kind, bytes=total_bytes,
                          bytes_up=record["bytes_up"] + extra_up, bytes_down=record["bytes_down"] + extra_down)
            if found.candidate is None:  # neither J nor the residual can be lowered: stationary to rounding
                record.update(kl_to_previous=0.0, objective=float(search.current.objective),
                              natural_residual=float(search.current.residual),
                              clipped=int(np.sum(search.current.clipped)),
                              clipped_clients=np.flatnonzero(np.asarray(search.current.clipped)).tolist())
                converged = record_round(record, history, callback, tol, residual_tol)
                status = "converged" if converged else "stagnated"
                break
            eta_new, q_new = found.candidate.eta, found.candidate.q
            record.update(kl_to_previous=float(found.candidate.kl), objective=float(found.candidate.objective),
                          natural_residual=float(found.candidate.residual),
                          clipped=int(np.sum(found.candidate.clipped)),
                          clipped_clients=np.flatnonzero(np.asarray(found.candidate.clipped)).tolist())
        if not good:
            record["kl_to_previous"] = float("nan")
            history.append(RoundInfo(**record))
            status = "diverged"
            break
        eta, q = eta_new, q_new
        if ref_state is not None:
            # an isotropic reference may carry another fixed τ: compare the means at ours
            ref = Gaussian(ref_state.mean, q.precision) if capability(family, FixedPrecision) else ref_state
            record["kl_to_reference"] = float(family.kl(q, ref))
        if record_round(record, history, callback, tol, residual_tol):
            status = "converged"
            break
    posterior = None
    if keep_data:
        data = concat_datas(datas)
        posterior = build_posterior(joint_spec(spec, data.per_example[0].shape[0]), data, family, q,
                                    ExpectationRule(kind=rule, num_nodes=int(num_nodes)), "hessian", "auto", None, None,
                                    False, None, 0, False, True, cls=DualPosterior)
        posterior = posterior.evolve(record=FederatedInfo(
            algorithm=algorithm, rho=float(rho), rounds=len(history), status=status,
            admm_alpha=float(alpha) if algorithm == "admm" else None))
    result = FederatedResult(posterior, q, eta, history, status == "converged", status, algorithm, rho)
    if status != "converged":
        why = {"diverged": "a local update or the global posterior lost finiteness or positive definiteness (for "
                           "losses growing slower than quadratically, e.g. logistic, the local problem is unbounded "
                           "once the ρ-cavity λ_jnt − η_k/ρ is indefinite: increase ρ)",
               "stagnated": "no candidate of the line search (the Anderson step, the round's proposal damped down "
                            "to β = 1/16, the natural-gradient step damped down to 2⁻²⁰) lowered the joint "
                            "objective J beyond its rounding, or near the fixed point the residual, while the "
                            "residual is above stop.residual_tol (J is stationary to float rounding: loosen "
                            "stop.residual_tol; in float32, run in float64; or take the plain step with "
                            "safeguard=Safeguard(line_search=False))"}.get(status,
                                                                              f"rounds={rounds} reached before the "
                                                                              "tolerances")
        msg = (f"federated {algorithm} (ρ={rho:g}, damping={damping:g}) stopped after {len(history)} round(s): {why}; "
               f"last KL to the previous round {history[-1]['kl_to_previous']:.3e}, residual "
               f"{history[-1]['residual']:.3e}.")
        if raise_on_failure:
            raise ConvergenceError(msg, posterior=result, history=history)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return result
