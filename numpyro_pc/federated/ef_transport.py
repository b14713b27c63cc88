r"""Exponential-family federated runs across processes: the two halves without any transport.

:class:`EFClientLogic` and :class:`EFServerLogic` are what the Flower apps
(:mod:`numpyro_pc.federated.flower`) drive when the run's ``family`` is a ``{latent site: family
name}`` dict (Beta, Gamma, Dirichlet, Gaussian blocks, discrete factors and their products;
:mod:`numpyro_pc.federated.ef`); they can be driven by hand (tests, other transports). Each
step is the one of the in-process :func:`~numpyro_pc.federated.ef.run_ef`, so with every client
taking part the result is the in-process one up to rounding:

* **client** — the local update :func:`~numpyro_pc.federated.ef.local_update_ef` from the global
  :math:`\lambda` the server sent, with the safeguard :func:`~numpyro_pc.federated.ef.safe_rho_ef`
  and PVI damping; a private client (its own
  :class:`~numpyro_pc.federated.privacy.GaussianMechanism`) sends
  :func:`~numpyro_pc.federated.ef_robust.release_ef` instead. The message is the flat
  natural-parameter site :math:`\eta_k` ``(P,)`` (ADMM: also the local :math:`\lambda_k`) — never data.
* **server** — :func:`~numpyro_pc.federated.ef_server.aggregate_ef` (each message checked by
  :func:`~numpyro_pc.federated.ef_server.validate_ef_message`: dtype, shape, finite, below
  ``max_abs``, the global :math:`\lambda` with it inside the family's domain), then ADMM's
  :func:`~numpyro_pc.federated.ef_server.admm_server_ef` or, with bounds or private messages,
  :func:`~numpyro_pc.federated.ef_server.server_step_ef` (bounded aggregation, the retreat into the domain).

**Round 1** registers the clients: each sends its first site (zero for ``init="zero"``, the
default as in :func:`~numpyro_pc.federated.ef.run_ef`; its site at :math:`\lambda_0` for
``init="prior"``), the prior :math:`\lambda_0` it derives from the model, and the description
of its family (factor names and shapes, :func:`describe_family`: the server holds no model and
no data, and builds the family from it, :func:`family_from_description`). The description must
name the server's ``family``; the prior and description most clients report win, the other
clients are refused. A non-conjugate prior's correction travels with the first admitted client
(in the order of the transport's ids), as with client 0 in process.
"""

from __future__ import annotations

import json
import secrets
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.families.product import ProductFamily
from numpyro_pc.protocols.capabilities import FixedPrecision, SiteSum, require

from ..errors import ClientMessageError, InvalidOptionError, OutOfDomainError, PrivacyError, TooFewClientsError
from .ef import EFLocalResult, bind_ef_clients, check_prior_data_free, kl_rounding, local_update_ef, safe_rho_ef
from .ef_clients import EFClients
from .ef_describe import describe_family, family_from_description, family_json, is_ef_family, parse_family  # noqa: F401
from .ef_robust import release_ef
from .ef_server import EFServerState, admm_server_ef, aggregate_ef, global_natural, server_step_ef, site_natural
from .records import RoundInfo, round_dicts
from .robust import robust_bounds
from .server import ClientReport, keep_majority, refuse_replays

__all__ = ["EFClientLogic", "EFServerLogic", "is_ef_family", "parse_family", "describe_family",
           "family_from_description"]

ALGORITHMS_EF = ("fedpc", "pvi", "admm")


def _config_opt(config, key, cast) -> Any:
    value = config.get(key)
    return None if value in (None, "", "none", -1) else cast(value)


@partial(jax.jit, static_argnames=("cfg", "max_iters"))
def _local(cfg, max_iters, lam, eta, rho, margin, ex, mask, shared, weight, prior, tol) -> tuple[EFLocalResult, jax.Array]:
    """One client's part of :func:`~numpyro_pc.federated.ef.client_round_ef` (the same functions, not ``vmap``-ed)."""
    rho_k = jnp.where(margin >= 0, safe_rho_ef(cfg.family, lam, eta, rho, margin), rho)
    return local_update_ef(cfg, lam, eta, rho_k, ex, mask, shared, weight, prior, tol, max_iters), rho_k


@partial(jax.jit, static_argnames=("cfg", "privacy"))
def _release(cfg, privacy, lam, ex, mask, shared, weight, prior, key) -> jax.Array:
    return release_ef(cfg, lam, ex, mask, shared, weight, prior, privacy, key)


class EFClientLogic:
    """What an exponential-family client does each round, without any transport (stateful: it keeps ``η_k``).

    The shard is bound to the model at the first message, with the ``family`` and site rule the server's
    config names (:func:`~numpyro_pc.federated.ef.bind_ef_clients` on this one shard).

    :param model: the NumPyro model.
    :param tuple args: the client's model arguments (its shard).
    :param dict kwargs: the model's keyword arguments.
    :param privacy: this client's own :class:`~numpyro_pc.federated.privacy.GaussianMechanism` (the server
        cannot switch it off): every site it sends is :func:`~numpyro_pc.federated.ef_robust.release_ef`, and
        after ``privacy.releases`` messages it refuses to send more (:class:`~numpyro_pc.errors.PrivacyError`).
    :param int seed: seed of the privacy noise (default: from the operating system).
    :ivar releases: private messages sent so far.
    """

    kind = "ef"

    def __init__(self, model, args, kwargs=None, privacy=None, seed=None):
        self.model, self.args, self.kwargs = model, tuple(args), dict(kwargs or {})
        self.clients, self._bound, self._checked = None, None, None
        self.site = None
        self.privacy = privacy
        self.releases = 0
        self.seed = secrets.randbits(31) if seed is None else int(seed)

    @property
    def num_examples(self) -> int:
        """Examples of this client's shard (known once bound)."""
        return 0 if self.clients is None else int(self.clients.stack.mask.sum())

    def _bind(self, config) -> EFClients:
        key = (family_json(config["family"]), str(config.get("expectation", "auto")), int(config.get("num_nodes", 32)),
               _config_opt(config, "num_samples", int), int(config.get("draw_seed", 0)))
        if self._bound != key:
            self.clients = bind_ef_clients(self.model, [self.args], parse_family(config["family"]), self.kwargs,
                                           expectation=key[1], num_nodes=key[2], num_samples=key[3], seed=key[4])
            self._bound = key
        n = self.num_examples
        if n < int(config.get("min_examples", 1)):
            raise PrivacyError(f"this client holds {n} example(s), fewer than the run's min_examples="
                               f"{config['min_examples']}: it does not take part (its site would reveal its data)")
        if self.privacy is not None:
            if config["algorithm"] == "admm":
                raise PrivacyError("this client adds differential-privacy noise, which the run's algorithm 'admm' "
                                   "cannot take (it needs the exact local posterior): it does not take part")
            require(self.clients.config.family, SiteSum, "privacy= (the Gaussian mechanism)")
            if self._checked != key:  # the prior λ_0 this client sends must not hold any of its rows
                check_prior_data_free(self.clients)
                self._checked = key
            if self.releases >= self.privacy.releases:
                raise PrivacyError(f"this client's privacy budget covers {self.privacy.releases} message(s) "
                                   f"(ε={self.privacy.epsilon:g}, δ={self.privacy.delta:g}), all sent: it stops")
        return self.clients

    def _key(self) -> jax.Array:
        self.releases += 1
        return jax.random.fold_in(jax.random.PRNGKey(self.seed), self.releases)

    def _ex(self) -> tuple[tuple[jax.Array, ...], jax.Array, tuple]:
        stack = self.clients.stack
        return tuple(x[0] for x in stack.per_example), stack.mask[0], stack.shared

    def _weight(self, config) -> jax.Array:
        dtype = self.clients.prior.dtype
        return jnp.asarray(0.0 if self.clients.conjugate else float(config.get("prior_weight", 0.0)), dtype)

    def _tol(self, config) -> jax.Array:
        dtype = self.clients.prior.dtype
        tol = _config_opt(config, "local_tol", float)
        return jnp.asarray((1e-12 if dtype == jnp.float64 else 1e-6) if tol is None else tol, dtype)

    def initial(self, config) -> list:
        """Round 1: ``[first site (P,), prior λ_0 (P,), family description (uint8 bytes of JSON)]``."""
        clients = self._bind(config)
        prior = clients.prior
        site = jnp.zeros_like(prior)
        if config.get("init", "zero") == "prior":  # ρ → ∞: the site at λ_0 (private: the first release)
            ex, mask, shared = self._ex()
            weight = self._weight(config)
            if self.privacy is not None:
                site = _release(clients.config, self.privacy, prior, ex, mask, shared, weight, prior, self._key())
            else:
                out, _ = _local(clients.config, int(config.get("local_iters", 200)), prior, site,
                                jnp.asarray(1e30, prior.dtype), jnp.asarray(-1.0, prior.dtype), ex, mask, shared,
                                weight, prior, self._tol(config))
                site = out.site
        elif config.get("init", "zero") != "zero":
            raise InvalidOptionError(f"unknown init {config.get('init')!r}; expected 'zero' or 'prior'")
        self.site = site
        text = describe_family(clients.config.family).encode()
        return [np.asarray(site), np.asarray(prior), np.frombuffer(text, dtype=np.uint8).copy()]

    def update(self, arrays, config) -> tuple:
        """One local update from the global natural parameters ``arrays = [λ]``.

        :return: ``([site] (ADMM: [site, local λ_k]), metrics)``; a private client reports no metrics.
        :raises OutOfDomainError: the local fixed point left the family's domain or is not finite (the
            client sends nothing this round; the server leaves it out).
        """
        clients = self._bind(config)
        prior, cfg = clients.prior, clients.config
        lam = jnp.asarray(arrays[0], prior.dtype)
        if lam.shape != prior.shape:
            raise ClientMessageError(f"expected the server's natural parameters of shape {prior.shape}, found "
                                     f"shape {lam.shape}")
        ex, mask, shared = self._ex()
        eta, weight = self.site, self._weight(config)
        rho = jnp.asarray(float(config["rho"]), prior.dtype)
        margin = jnp.asarray(float(config.get("safeguard_margin", 0.3)) if config.get("safeguard", False) else -1.0,
                             prior.dtype)
        if self.privacy is not None:
            rho_k = jnp.where(margin >= 0, safe_rho_ef(cfg.family, lam, eta, rho, margin), rho)
            new = _release(cfg, self.privacy, lam, ex, mask, shared, weight, prior, self._key())
            local, metrics = lam + (new - eta) / rho_k, {}
        else:
            out, rho_k = _local(cfg, int(config.get("local_iters", 200)), lam, eta, rho, margin, ex, mask, shared,
                                weight, prior, self._tol(config))
            if not bool(out.ok):
                raise OutOfDomainError(f"this client's local update left the family's domain or lost finiteness "
                                       f"(rho={float(rho_k):g}); it sends nothing this round")
            new, local = out.site, out.local
            scale = 1.0 + float(jnp.linalg.norm(lam))
            metrics = {"iterations": int(out.iterations), "ok": True, "rho": float(rho_k),
                       "residual": float(jnp.linalg.norm(local - lam)) / scale,
                       "local_residual": float(out.residual)}
        damping = float(config["damping"])
        self.site = eta + damping * (new - eta)
        arrays = [np.asarray(self.site)]
        if config["algorithm"] == "admm":
            arrays.append(np.asarray(local))
        return arrays, metrics

    def state_arrays(self) -> list:
        """What a rebuilt client needs to go on (a Flower ``Context.state``): its site, releases and seed."""
        return [np.asarray(self.site), np.asarray([self.releases, self.seed])]

    def restore(self, arrays) -> None:
        """Take back :meth:`state_arrays`."""
        self.site = jnp.asarray(arrays[0])
        self.releases, self.seed = (int(v) for v in arrays[1])


class EFServerLogic(ClientReport):
    """The server's aggregation of exponential-family sites, without any transport.

    Its rules are :class:`~numpyro_pc.federated.server.ServerLogic`'s: identity is the transport's, every
    message is checked before anything is stored (a refused client is left out of the round and named in
    ``history[-1]["rejected"]``), replays and duplicates are refused
    (:func:`~numpyro_pc.federated.server.refuse_replays`), a round needs ``min_clients`` valid replies
    (:class:`~numpyro_pc.errors.TooFewClientsError`, :attr:`failure`), :meth:`save` writes the last good state.

    :param int num_clients: clients admitted in round 1.
    :param family: ``{latent site: family name}`` (a dict, its JSON text or ``"p=beta,r=gamma"``).
    :param str algorithm: ``"fedpc"``, ``"pvi"`` or ``"admm"``; ``"ama"`` is refused
        (:class:`~numpyro_pc.errors.MissingCapabilityError`: these families learn their precision).
    :param float rho: the local weight (default ``1/num_clients`` for FedPC/ADMM, ``1`` for PVI), a floor
        with the safeguard (default on for FedPC and ADMM).
    :param float admm_alpha: ADMM's server step (default ``1/(1 + ρM)``, ``M`` the clients asked per round).
    :param str init: ``"zero"`` or ``"prior"`` (:func:`~numpyro_pc.federated.ef.init_ef`).
    :param bool private: the clients send differentially private sites: their sum may leave the domain and is
        pulled back by :func:`~numpyro_pc.federated.ef_robust.retreat_ef` instead of refused.
    :param float max_share, max_shift: bounded aggregation
        (:func:`~numpyro_pc.federated.ef_robust.bound_sites_ef`); not with ADMM.
    :param float max_abs: largest absolute value accepted in a message.
    :raises InvalidOptionError: an unknown algorithm, ``min_clients`` outside ``[1, num_clients]``, PVI with
        ``ρ ≠ 1``, bounds with ADMM or one client, privacy with ADMM.
    :raises MissingCapabilityError: ``algorithm="ama"``.
    """

    kind = "ef"

    def __init__(self, num_clients, family, algorithm="fedpc", rho=None, damping=None, expectation="auto",
                 fraction=1.0, num_nodes=32, num_samples=None, draw_seed=0, local_iters=200, local_tol=None,
                 x64=False, min_clients=None, min_examples=1, max_share=None, max_shift=None, max_abs=1e12,
                 safeguard=None, safeguard_margin=0.3, init="zero", private=False, admm_alpha=None):
        family = parse_family(family)
        if not isinstance(family, dict):
            raise InvalidOptionError(f"EFServerLogic needs a {{latent site: family name}} family; got {family!r} "
                                     "(a Gaussian family: use ServerLogic)")
        if algorithm == "ama":
            require(ProductFamily(()), FixedPrecision, "algorithm='ama'",
                    advice="AMA is MAP estimation of the mean under a precision fixed by the prior; use "
                           "algorithm='fedpc', 'pvi' or 'admm'.")
        if algorithm not in ALGORITHMS_EF:
            raise InvalidOptionError(f"unknown algorithm {algorithm!r}; expected one of {ALGORITHMS_EF}")
        if algorithm == "pvi" and rho not in (None, 1, 1.0):
            raise InvalidOptionError(f"PVI uses ρ = 1 (damping acts on the sites); got rho={rho}")
        if init not in ("zero", "prior"):
            raise InvalidOptionError(f"unknown init {init!r}; expected 'zero' or 'prior'")
        self.num_clients = int(num_clients)
        self.min_clients = self.num_clients if min_clients is None else int(min_clients)
        if not 1 <= self.min_clients <= self.num_clients:
            raise InvalidOptionError(f"min_clients must lie in [1, {self.num_clients}], got {min_clients}")
        if algorithm == "admm" and (max_share is not None or max_shift is not None or private):
            raise InvalidOptionError("ADMM's server step averages the clients' exact local posteriors, which neither "
                                     "bounded aggregation (max_share/max_shift) nor privacy covers; use "
                                     "algorithm='fedpc'")
        if (max_share is not None or max_shift is not None) and self.num_clients < 2:
            raise InvalidOptionError("bounded aggregation measures each client's site against the other clients' "
                                     "update; with one client there is none (leave max_share/max_shift unset)")
        self.algorithm, self.family_names = algorithm, family
        self.rho = 1.0 if algorithm == "pvi" else (1.0 / self.num_clients if algorithm in ("fedpc", "admm") else 1.0
                                                   ) if rho is None else float(rho)
        self.damping = 1.0 if damping is None else float(damping)
        if not (self.rho > 0 and 0 < self.damping <= 1 and 0 < float(fraction) <= 1):
            raise InvalidOptionError(f"need rho > 0, damping in (0, 1] and fraction in (0, 1]; got {self.rho}, "
                                     f"{self.damping}, {fraction}")
        self.fraction = float(fraction)
        self.x64 = bool(x64)
        self.dtype = np.dtype(np.float64 if x64 else np.float32)
        self.min_examples, self.max_abs, self.private = int(min_examples), float(max_abs), bool(private)
        self.bounds = robust_bounds(max_share, max_shift, self.dtype)
        participants = max(self.min_clients, round(self.fraction * self.num_clients))
        self.alpha = None
        if algorithm == "admm":
            self.alpha = 1.0 / (1.0 + self.rho * participants) if admm_alpha is None else float(admm_alpha)
        safeguard = algorithm in ("fedpc", "admm") if safeguard is None else bool(safeguard)
        self.config = dict(algorithm=algorithm, family=family_json(family), rho=self.rho, damping=self.damping,
                           expectation=str(expectation), num_nodes=int(num_nodes),
                           num_samples=-1 if num_samples is None else int(num_samples), draw_seed=int(draw_seed),
                           local_iters=int(local_iters), local_tol=-1 if local_tol is None else float(local_tol),
                           safeguard=safeguard, safeguard_margin=float(safeguard_margin),
                           min_examples=self.min_examples, init=init)
        self.family, self.ids, self.state, self.description = None, [], None, None
        self.history, self.total_bytes, self.failure, self.rejected_initial = [], 0, None, {}
        self.clipped_initial, self.not_started = [], {}

    @property
    def sites(self) -> dict:
        """``{transport id: site (P,)}`` of the admitted clients."""
        return {} if self.state is None else {cid: self.state.sites[k] for k, cid in enumerate(self.ids)}

    @property
    def natural(self) -> jax.Array | None:
        """The global posterior's natural parameters :math:`\\lambda` (``None`` before round 1)."""
        return None if self.state is None else global_natural(self.state)

    def broadcast(self) -> list:
        """What the server sends the clients: ``[λ]``."""
        return [np.asarray(self.natural)]

    def fit_config(self, cid, phase) -> dict:
        """The config sent to client ``cid``: the run's, the phase and whether it carries a non-conjugate
        prior's correction (the first admitted client)."""
        return dict(self.config, phase=phase, prior_weight=1.0 if self.ids and cid == self.ids[0] else 0.0)

    def _array(self, cid, arr, size, what) -> np.ndarray:
        arr = np.asarray(arr)
        if arr.dtype != self.dtype:
            raise ClientMessageError(f"client {cid}: expected {what} of dtype {self.dtype}, found {arr.dtype}",
                                     client=cid)
        if arr.shape != (size,):
            raise ClientMessageError(f"client {cid}: expected {what} of shape ({size},), found shape {arr.shape}",
                                     client=cid)
        if not np.all(np.isfinite(arr)) or (arr.size and np.max(np.abs(arr)) > self.max_abs):
            raise ClientMessageError(f"client {cid}: expected {what} with finite values below {self.max_abs:g}, "
                                     "found NaN, infinite or larger ones", client=cid)
        return arr

    def _initial_message(self, cid, arrays) -> tuple[np.ndarray, np.ndarray, bytes, ProductFamily]:
        if len(arrays) != 3 or np.asarray(arrays[2]).dtype != np.uint8:
            raise ClientMessageError(f"client {cid}: round 1 expects 3 arrays [site, prior natural parameters, "
                                     f"family description], found {len(arrays)}", client=cid)
        text = np.asarray(arrays[2]).tobytes()
        try:
            family = family_from_description(text.decode())
        except (ClientMessageError, UnicodeDecodeError) as err:
            raise ClientMessageError(f"client {cid}: {err}", client=cid) from err
        names = {f.site: type(f).family_name for f in family.factors}
        wanted = {k: str(v).lower() for k, v in self.family_names.items()}
        aliases = {"lognormal": "normal", "mvn": "full"}
        if names != {k: aliases.get(v, v) for k, v in wanted.items()}:
            raise ClientMessageError(f"client {cid}: expected the family {wanted}, found {names}", client=cid)
        prior = self._array(cid, arrays[1], family.size, "the prior's natural parameters")
        if not bool(family.in_domain(jnp.asarray(prior))):
            raise ClientMessageError(f"client {cid}: expected a prior inside the family's domain, found "
                                     f"{family.describe(jnp.asarray(prior))}", client=cid)
        return self._array(cid, arrays[0], family.size, "a site"), prior, text, family

    def _need(self, good, rejected, what) -> None:
        if len(good) < self.min_clients:
            self.failure = (f"{what}: {len(good)} valid repl{'y' if len(good) == 1 else 'ies'}, fewer than "
                            f"min_clients={self.min_clients}; rejected: {rejected or 'none'}")
            raise TooFewClientsError(self.failure)

    def _examples(self, cid, examples, rejected) -> bool:
        n = examples.get(cid)
        if n is not None and int(n) < self.min_examples:
            rejected[cid] = f"client {cid} holds {n} example(s), fewer than min_examples={self.min_examples}"
            return False
        return True

    def aggregate_initial(self, replies, examples=None) -> EFServerState:
        """Round 1: admit the senders, agree on the prior and the family, store the first sites.

        :param dict replies: ``{transport id: [site, prior λ_0, family description]}``.
        :raises TooFewClientsError: fewer than ``min_clients`` valid replies.
        :raises OutOfDomainError: the first sites together leave the domain (``init="prior"``, not private).
        """
        with jax.enable_x64(self.x64):
            replies = dict(sorted(replies.items(), key=lambda kv: str(kv[0]))[: self.num_clients])
            good, rejected, examples = {}, {}, examples or {}
            for cid, arrays in replies.items():
                if self._examples(cid, examples, rejected):
                    try:
                        good[cid] = self._initial_message(cid, list(arrays))
                    except ClientMessageError as err:
                        rejected[cid] = str(err)
            refuse_replays(good, rejected, site=lambda message: message[0])
            keep_majority(good, rejected, lambda message: (message[1].tobytes(), message[2]),
                          "another prior or family")
            self._need(good, rejected, "round 1")
            ids = sorted(good, key=str)
            _, prior, text, family = good[ids[0]]
            state = EFServerState(jnp.asarray(prior), jnp.zeros((len(ids), family.size), self.dtype))
            state, bad = aggregate_ef(family, state, {k: good[cid][0] for k, cid in enumerate(ids)}, strict=False,
                                      max_abs=self.max_abs, domain=not self.private)
            for k in bad:
                rejected[ids[k]] = bad[k].replace(f"client {k}:", f"client {ids[k]}:", 1)
            if bad:  # a refused first site: that client is not admitted
                keep = [k for k in range(len(ids)) if k not in bad]
                state, ids = state._replace(sites=state.sites[np.asarray(keep, dtype=np.int64)]), [ids[k] for k in keep]
                self._need(ids, rejected, "round 1")
            if self.private or self.bounds is not None:
                state, info = server_step_ef(family, state, state.prior, self.bounds, self.private)
                self.clipped_initial = [ids[k] for k in info["clipped_clients"]]
            self.family, self.ids, self.state, self.description = family, ids, state, text.decode()
            self.rejected_initial = rejected
        return self.state

    def aggregate(self, replies, iterations=(), examples=None, residuals=()) -> EFServerState:
        """One round from the participating clients' ``[site]`` (ADMM: ``[site, local λ_k]``).

        Invalid or unknown senders are excluded (recorded in ``history[-1]["rejected"]``).

        :param residuals: the clients' reported ``‖λ_k − λ‖ / (1 + ‖λ‖)`` (private clients report none).
        :raises TooFewClientsError: fewer than ``min_clients`` valid replies (nothing is changed).
        :raises OutOfDomainError: the accepted sites together leave the domain (not private; nothing is changed).
        """
        with jax.enable_x64(self.x64):
            size, count = self.family.size, 2 if self.algorithm == "admm" else 1
            arrived, locals_, rejected = {}, {}, {}
            for cid in sorted(replies, key=str):
                arrays = list(replies[cid])
                try:
                    if cid not in self.ids:
                        raise ClientMessageError(f"client {cid} was not admitted in round 1", client=cid)
                    if not self._examples(cid, examples or {}, rejected):
                        continue
                    if len(arrays) != count:
                        raise ClientMessageError(f"client {cid}: expected {count} array(s), found {len(arrays)}",
                                                 client=cid)
                    if count == 2:
                        local = self._array(cid, arrays[1], size, "a local posterior")
                        if not bool(self.family.in_domain(jnp.asarray(local))):
                            raise ClientMessageError(f"client {cid}: expected a local posterior inside the "
                                                     "family's domain", client=cid)
                        locals_[cid] = local
                    arrived[cid] = arrays[0]
                except ClientMessageError as err:
                    rejected[cid] = str(err)
            refuse_replays(arrived, rejected, {c: np.asarray(v) for c, v in self.sites.items()}, site=lambda m: m)
            messages = {self.ids.index(cid): site for cid, site in arrived.items()}
            locals_ = {cid: local for cid, local in locals_.items() if cid in arrived}
            old, lam = self.state, global_natural(self.state)
            new, bad = aggregate_ef(self.family, old, messages, strict=False, max_abs=self.max_abs,
                                    domain=not self.private)
            for k, reason in bad.items():  # the reason names the server's index: say the transport's id
                rejected[self.ids[k]] = reason.replace(f"client {k}:", f"client {self.ids[k]}:", 1)
                locals_.pop(self.ids[k], None)
            good = [self.ids[k] for k in messages if k not in bad]
            self._need(good, rejected, f"round {len(self.history) + 1}")
            step = {}
            if self.algorithm == "admm":
                new = admm_server_ef(self.family, new, np.stack([locals_[c] for c in good]), self.alpha)
            elif self.bounds is not None or self.private:
                new, step = server_step_ef(self.family, new, lam, self.bounds, self.private)
                step["clipped_clients"] = [self.ids[k] for k in step["clipped_clients"]]
            lam_new, scale = global_natural(new), 1.0 + float(jnp.linalg.norm(lam))
            residual = max([float(r) for r in residuals] or [float("nan")])
            if self.algorithm == "admm":
                residual = max(max(float(jnp.linalg.norm(jnp.asarray(v) - lam)) for v in locals_.values()),
                               float(jnp.linalg.norm(new.joint - site_natural(new)))) / scale
            message = size * self.dtype.itemsize
            up, sent = message * count, len(replies)
            self.total_bytes += sent * (up + message)
            self.history.append(RoundInfo(round=len(self.history) + 1, kl_to_previous=float(self.family.kl(lam_new, lam)),
                                     kl_rounding=float(kl_rounding(self.family, lam_new, lam)), residual=residual,
                                     participants=len(good), local_iterations=max(iterations) if iterations else 0,
                                     bytes_up=sent * up, bytes_down=sent * message, bytes=self.total_bytes,
                                     rejected=rejected, **step))
            self.state = new
        return new

    def save(self, path) -> None:
        """Write the last good global natural parameters ``natural``, the ``prior``, the clients' ``sites`` (in the
        order of ``clients``), the ``family`` description, the history, the config, the failure reason and the
        ``incidents`` (:meth:`~numpyro_pc.federated.server.ClientReport.incidents`) and ``not_started`` (``.npz``)."""
        empty = np.zeros(0)
        np.savez(path, natural=empty if self.state is None else np.asarray(self.natural),
                 prior=empty if self.state is None else np.asarray(self.state.prior),
                 sites=empty if self.state is None else np.asarray(self.state.sites),
                 clients=json.dumps([str(c) for c in self.ids]), family=json.dumps(self.description),
                 incidents=json.dumps(self.incidents(), default=str), not_started=json.dumps(self.not_started, default=str),
                 history=json.dumps(round_dicts(self.history), default=str), config=json.dumps(self.config),
                 failure=json.dumps(self.failure))
