r"""The federated server's logic without any transport: admission, checks, aggregation.

:class:`ServerLogic` is what the Flower strategy (:mod:`numpyro_pc.federated.flower`)
drives; it can be driven by hand (tests, other transports). Its rules:

* **Identity comes from the transport.** Every reply is keyed by the id the transport gives
  the sender (Flower's node id); nothing in a message names a client. Round 1 admits at
  most ``num_clients`` senders; a later reply from an id that was not admitted is refused.
* **Every message is checked** (:func:`~numpyro_pc.federated.robust.validate_site`) before
  anything is stored. A refused message raises nothing to the caller: the client is
  excluded from the round (its last good site stays), and ``history[-1]["rejected"]`` names
  it with the reason (the :class:`~numpyro_pc.errors.ClientMessageError` text).
* **Partial participation.** A round needs at least ``min_clients`` valid replies; with fewer,
  :class:`~numpyro_pc.errors.TooFewClientsError` is raised and :attr:`ServerLogic.failure` says
  why. :meth:`ServerLogic.save` always writes the last good global posterior, the history
  and the reason, so a failed run leaves a partial result.
* **Replays and duplicates** are refused (:func:`refuse_replays`).
* **Bounded aggregation** with ``max_share``/``max_shift``
  (:func:`~numpyro_pc.federated.robust.aggregate_sites`); ``history[-1]["clipped_clients"]`` names the
  clients whose sites it tempered.
* **No silent success.** :meth:`ClientReport.incidents` lists every refused message and bounded site by
  client; :meth:`ClientReport.check_clients` ends a run that had any with
  :class:`~numpyro_pc.errors.SuspectClientsError` (the Flower server: exit status 3).
"""

from __future__ import annotations

import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.families.registry import Gaussian, GaussianNatural, get_family
from numpyro_pc.ops.merging import prior_natural

from ..errors import (ClientMessageError, InvalidOptionError, NonFiniteResultError, SuspectClientsError,
                      TooFewClientsError)
from ..options import is_choice
from .algorithms import ALGORITHMS
from .core import global_state, natural_nbytes
from .records import RoundInfo, round_dicts
from .robust import aggregate_sites, robust_bounds, validate_site

__all__ = ["ServerLogic", "ClientReport", "keep_majority", "refuse_replays", "describe_incidents"]


def keep_majority(good: dict, rejected: dict, key, what: str) -> list:
    """Keep in ``good`` (client id → message) the clients whose ``key(message)`` most clients share, moving
    the others to ``rejected`` with a reason that says they report ``what`` (round 1: the prior, the family).

    :return: the ids of the majority (empty when ``good`` is).
    """
    groups = {}
    for cid, message in good.items():
        groups.setdefault(key(message), []).append(cid)
    majority = max(groups.values(), key=len) if groups else []
    for cid in list(good):
        if cid not in majority:
            rejected[cid] = f"client {cid} reports {what} than the majority of clients"
            del good[cid]
    return majority


def _content(site) -> bytes:
    """A site's exact content: every leaf's dtype, shape and bytes (any pytree of arrays)."""
    leaves = [np.ascontiguousarray(np.asarray(a)) for a in jax.tree.leaves(site)]
    return b"".join(f"{a.dtype}{a.shape}".encode() + a.tobytes() for a in leaves)


def refuse_replays(good: dict, rejected: dict, previous: dict | None = None, site=lambda m: m[:2]) -> None:
    """Move to ``rejected`` every message of ``good`` (client id → message) whose site another client also sent
    this round, or that equals another client's last accepted site in ``previous`` (client id → site): a replay or a
    duplicate, counted twice otherwise. Both copies of a message sent twice in one round are refused (the server
    cannot tell the original from the copy; two clients with the same data send the same site and are refused
    too). A client re-sending its own last site is not a replay (a converged client does), nor is a site of
    zeros (it adds nothing: the first sites of the isotropic family and of ``init="zero"``).

    :param site: the site in a message, any pytree of arrays compared bit for bit (default: a Gaussian
        message's first two arrays, ``[linear, precision]``; an exponential-family server passes its flat
        site ``(P,)``).
    """
    def empty(value) -> bool:
        return all(not np.any(np.asarray(a)) for a in jax.tree.leaves(value))

    groups: dict[bytes, list] = {}
    for cid, message in good.items():
        if not empty(site(message)):
            groups.setdefault(_content(site(message)), []).append(cid)
    seen = {_content(value): cid for cid, value in (previous or {}).items()}
    for key, cids in groups.items():
        owner = seen.get(key)
        for cid in cids:
            others = [c for c in cids if c != cid]
            if others:
                rejected[cid] = (f"client {cid} sent the same site as client(s) {', '.join(map(str, others))} this "
                                 "round: a replayed or duplicated message (both copies refused)")
            elif owner is not None and owner != cid:
                rejected[cid] = f"client {cid} sent client {owner}'s last accepted site: a replayed message"
            else:
                continue
            del good[cid]


class ClientReport:
    """What both servers (:class:`ServerLogic`, :class:`~numpyro_pc.federated.ef_transport.EFServerLogic`)
    report about their clients at the end of a run: who was refused or bounded, when and why.

    Reads ``history`` (each round's ``rejected`` and ``clipped_clients``), ``rejected_initial`` and
    ``clipped_initial`` (the registration round's).
    """

    history: list
    rejected_initial: dict
    clipped_initial: list
    #: ``{client: reason}`` of the clients that did not start: connected but failed their first message (the
    #: transport's id, the client's own error), or never connected (``"never connected (k of n)"``)
    not_started: dict

    def incidents(self) -> dict:
        """``{client id: [{"round", "action", "reason"}, …]}`` of every message refused (``"rejected"``) or site
        tempered by bounded aggregation (``"clipped"``); round 0 is the registration round, ``r`` is
        ``history[r - 1]`` (Flower's round ``r + 1``). Empty for a clean run."""
        clip = ("bounded aggregation tempered its site (more than max_share of the information, or a shift of the "
                "posterior beyond max_shift)")
        rounds = [(0, self.rejected_initial or {}, self.clipped_initial or [])]
        rounds += [(h["round"], h["rejected"] or {}, h["clipped_clients"] or []) for h in self.history]
        out: dict = {}
        for r, rejected, clipped in rounds:
            for cid, reason in rejected.items():
                out.setdefault(cid, []).append(dict(round=r, action="rejected", reason=str(reason)))
            for cid in clipped:
                out.setdefault(cid, []).append(dict(round=r, action="clipped", reason=clip))
        return out

    def check_clients(self) -> None:
        """End a run: nothing when every message was accepted and no site bounded.

        :raises SuspectClientsError: naming each client refused or bounded, the rounds and why (its
            ``clients`` is :meth:`incidents`, its ``result`` this server, which keeps the last good posterior).
        """
        found = self.incidents()
        if found:
            raise SuspectClientsError(describe_incidents(found), clients=found, result=self)


def describe_incidents(incidents: dict) -> str:
    """One line per client of :meth:`ClientReport.incidents`: what happened to its messages, in which rounds."""
    lines = []
    for cid, events in incidents.items():
        actions: dict[str, list] = {}
        for e in events:
            actions.setdefault(e["action"], []).append(e)
        lines.append(f"client {cid}: " + "; ".join(
            f"{a} in round(s) {', '.join(str(e['round']) for e in es)} (first: {es[0]['reason']})"
            for a, es in actions.items()))
    return "messages refused or bounded during the run:\n" + "\n".join(lines)


class ServerLogic(ClientReport):
    """The server's aggregation, without any transport.

    Its global step is the plain one: the same rounds as :func:`~numpyro_pc.federated.run` with
    ``safeguard=Safeguard(line_search=False)`` (the line search of :mod:`~numpyro_pc.federated.line_search`
    runs in one process only).

    :param int num_clients: clients admitted in round 1 (and expected to register).
    :param str algorithm: ``"fedpc"``, ``"pvi"``, ``"ama"`` or ``"admm"``.
    :param str family: ``"full"``, ``"diagonal"`` or ``"isotropic"``.
    :param float rho: the smallest local weight (default ``1/num_clients`` for FedPC/ADMM,
        ``1`` for PVI); clients adapt theirs upwards (the safeguard, see
        :func:`~numpyro_pc.federated.core.safe_rho`).
    :param int min_clients: valid replies a round needs (default: all ``num_clients``;
        lower it to tolerate dropouts).
    :param int min_examples: examples a client must hold to take part (its reported count;
        the client checks it too).
    :param float max_share: bounded aggregation, see :mod:`~numpyro_pc.federated.robust` (not
        with ADMM, whose server step also averages the local posteriors the bound does not cover).
    :param float max_shift: bounded aggregation, see :mod:`~numpyro_pc.federated.robust`.
    :param float max_abs: largest absolute value accepted in a message.
    :raises InvalidOptionError: an unknown algorithm, ``min_clients`` outside ``[1, num_clients]``,
        or bounded aggregation with ADMM.
    """

    def __init__(self, num_clients, algorithm="fedpc", family="full", rho=None, damping=None, expectation="auto",
                 fraction=1.0, num_nodes=64, local_iters=50, local_tol=None, x64=False, min_clients=None,
                 min_examples=1, max_share=None, max_shift=None, max_abs=1e12, safeguard=None, safeguard_margin=0.3):
        if not is_choice(algorithm, ALGORITHMS):
            raise InvalidOptionError(f"unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}")
        self.num_clients = int(num_clients)
        self.algorithm = algorithm
        self.family_name = "isotropic" if algorithm == "ama" else family
        self.family = get_family(self.family_name)
        default_rho = 1.0 / self.num_clients if algorithm in ("fedpc", "admm") else 1.0
        self.rho = 1.0 if algorithm == "pvi" else default_rho if rho is None else float(rho)
        self.damping = 1.0 if damping is None else float(damping)
        self.fraction = float(fraction)
        self.x64 = bool(x64)
        self.min_clients = self.num_clients if min_clients is None else int(min_clients)
        if not 1 <= self.min_clients <= self.num_clients:
            raise InvalidOptionError(f"min_clients must lie in [1, {self.num_clients}], got {min_clients}")
        self.min_examples = int(min_examples)
        self.max_abs = float(max_abs)
        self.dtype = np.dtype(np.float64 if x64 else np.float32)
        if algorithm == "admm" and (max_share is not None or max_shift is not None):
            raise InvalidOptionError("bounded aggregation (max_share/max_shift) bounds the clients' sites, but ADMM's "
                                     "server step also averages their local posteriors, which it does not bound; "
                                     "use algorithm='fedpc'")
        self.bounds = (max_share, max_shift)
        safeguard = algorithm in ("fedpc", "admm") if safeguard is None else bool(safeguard)
        self.config = dict(algorithm=algorithm, family=self.family_name, rho=self.rho, damping=self.damping,
                           expectation=expectation, num_nodes=int(num_nodes), local_iters=int(local_iters),
                           local_tol=float((1e-12 if x64 else 1e-6) if local_tol is None else local_tol),
                           safeguard=safeguard, safeguard_margin=float(safeguard_margin),
                           min_examples=self.min_examples)
        self.sites, self.prior, self.prior_nat, self.state = {}, None, None, None
        self.history, self.total_bytes, self.failure, self.rejected_initial = [], 0, None, {}
        self.clipped_initial, self.not_started = [], {}

    kind = "gaussian"

    def broadcast(self) -> list[np.ndarray]:
        """What the server sends the clients: the global Gaussian ``[mean, precision]``."""
        return [np.asarray(self.state.mean), np.asarray(self.state.precision)]

    def fit_config(self, cid, phase) -> dict[str, Any]:
        """The config sent to client ``cid`` (the same for every client): the run's and the ``phase``."""
        return dict(self.config, phase=phase)

    @property
    def dim(self) -> int | None:
        """Dimension of the latent vector (known after round 1)."""
        return None if self.prior is None else int(self.prior.mean.shape[0])

    def _sum(self) -> tuple[GaussianNatural, list]:
        """The bounded sum of the stored sites and the ids of the clients whose sites the bounds tempered."""
        ids = sorted(self.sites)
        eta = jax.tree.map(lambda *xs: jnp.stack(xs), *[self.sites[k] for k in ids])
        total, clipped = aggregate_sites(self.family, self.prior_nat, eta, robust_bounds(*self.bounds, self.dtype))
        return total, [cid for cid, c in zip(ids, np.asarray(clipped)) if c]

    def _check_state(self, state, what) -> None:
        if not (bool(jnp.all(jnp.isfinite(state.mean))) and bool(self.family.is_positive_definite(state.precision))):
            raise NonFiniteResultError(f"the global posterior after {what} is not finite and positive definite")

    def _screen(self, replies, examples, count) -> tuple[dict[Any, list[np.ndarray]], dict[Any, str]]:
        """Valid messages of admitted clients; the rest with their reasons."""
        good, rejected = {}, {}
        for cid in sorted(replies, key=str):
            try:
                if self.prior is not None and cid not in self.sites:
                    raise ClientMessageError(f"client {cid} was not admitted in round 1", client=cid)
                n = examples.get(cid)
                if n is not None and int(n) < self.min_examples:
                    raise ClientMessageError(f"client {cid} holds {n} example(s), fewer than min_examples="
                                             f"{self.min_examples}", client=cid)
                if self.prior is None:
                    good[cid] = self._initial_message(cid, list(replies[cid]))
                else:
                    good[cid] = validate_site(self.family, replies[cid], self.dim, self.dtype, cid, count=count,
                                              max_abs=self.max_abs, psd=(1, 3) if self.algorithm == "admm" else (1,))
            except ClientMessageError as err:
                rejected[cid] = str(err)
        last = {cid: [np.asarray(s.linear), np.asarray(s.precision)] for cid, s in (self.sites or {}).items()}
        refuse_replays(good, rejected, last)
        return good, rejected

    def _initial_message(self, cid, arrays) -> list[np.ndarray]:
        if len(arrays) != 4 or np.ndim(arrays[2]) != 1:
            raise ClientMessageError(f"client {cid}: round 1 expects [site linear, site precision, prior mean, "
                                     "prior precision]", client=cid)
        dim = int(np.shape(arrays[2])[0])
        prior = validate_site(get_family("full"), arrays[2:], dim, self.dtype, cid, count=1, max_abs=self.max_abs)
        if not bool(get_family("full").is_positive_definite(jnp.asarray(prior[1]))):
            raise ClientMessageError(f"client {cid}: the prior precision is not positive definite", client=cid)
        return validate_site(self.family, arrays[:2], dim, self.dtype, cid, count=1, max_abs=self.max_abs) + prior

    def _need(self, good, rejected, what) -> None:
        if len(good) < self.min_clients:
            self.failure = (f"{what}: {len(good)} valid repl{'y' if len(good) == 1 else 'ies'}, fewer than "
                            f"min_clients={self.min_clients}; rejected: {rejected or 'none'}")
            raise TooFewClientsError(self.failure)

    def aggregate_initial(self, replies, examples=None) -> Gaussian:
        """Round 1: admit the senders, agree on the prior, store the first sites, form ``q_jnt``.

        :param dict replies: ``{transport id: [site linear, site precision, prior mean, prior precision]}``.
        :param dict examples: ``{transport id: number of examples}`` as reported (optional).
        :raises TooFewClientsError: fewer than ``min_clients`` valid replies.
        """
        with jax.enable_x64(self.x64):
            replies = dict(sorted(replies.items(), key=lambda kv: str(kv[0]))[: self.num_clients])
            good, rejected = self._screen(replies, examples or {}, 1)
            # the prior most clients report wins; the others are refused
            majority = keep_majority(good, rejected, lambda arrays: (arrays[2].tobytes(), arrays[3].tobytes(),
                                                                      arrays[2].shape), "another prior")
            self._need(good, rejected, "round 1")
            first = good[majority[0]]
            self.prior = Gaussian(jnp.asarray(first[2]), jnp.asarray(first[3]))
            tau = self.family.prior_tau(self.prior)
            self.prior_nat = prior_natural(self.family, self.prior, tau)
            self.sites = {cid: GaussianNatural(jnp.asarray(a[0]), jnp.asarray(a[1])) for cid, a in good.items()}
            eta_sum, self.clipped_initial = self._sum()
            self.state = global_state(self.family, self.prior, self.prior_nat, eta_sum)
            self._check_state(self.state, "round 1")
            self.rejected_initial = rejected
        return self.state

    def aggregate(self, replies, iterations=(), examples=None) -> Gaussian:
        """One round from the participating clients' ``[site linear, site precision, local linear, local precision]``.

        Invalid or unknown senders are excluded (recorded in ``history[-1]["rejected"]``).

        :raises TooFewClientsError: fewer than ``min_clients`` valid replies (nothing is changed).
        """
        with jax.enable_x64(self.x64):
            good, rejected = self._screen(replies, examples or {}, 2)
            self._need(good, rejected, f"round {len(self.history) + 1}")
            old, saved = self.state, dict(self.sites)
            lam_old = self.family.natural(old)
            for cid, arrays in good.items():
                self.sites[cid] = GaussianNatural(jnp.asarray(arrays[0]), jnp.asarray(arrays[1]))
            locals_ = [GaussianNatural(jnp.asarray(a[2]), jnp.asarray(a[3])) for a in good.values()]
            eta_sum, clipped = self._sum()
            new = global_state(self.family, self.prior, self.prior_nat, eta_sum)
            if self.algorithm == "admm":
                alpha = 1.0 / (1.0 + self.rho * len(good))
                lam_loc = jax.tree.map(lambda *xs: sum(xs) / len(xs), *locals_)
                new = self.family.from_natural(jax.tree.map(lambda a, b: alpha * a + (1.0 - alpha) * b,
                                                            self.family.natural(new), lam_loc))
            try:
                self._check_state(new, f"round {len(self.history) + 1}")
            except NonFiniteResultError:
                self.sites = saved
                raise
            flat = lambda lam: jnp.concatenate([jnp.ravel(lam.linear), jnp.ravel(lam.precision)])  # noqa: E731
            residual = max(float(jnp.linalg.norm(flat(lam) - flat(lam_old))) for lam in locals_) / float(
                jnp.linalg.norm(flat(lam_old)))
            message = natural_nbytes(self.family, self.dim, old.mean.dtype)
            up = message * (2 if self.algorithm == "admm" else 1)
            sent = len(replies)
            self.total_bytes += sent * (up + message)
            self.history.append(RoundInfo(round=len(self.history) + 1, kl_to_previous=float(self.family.kl(new, old)),
                                     residual=residual, participants=len(good), local_iterations=max(iterations)
                                     if iterations else 0, bytes_up=sent * up, bytes_down=sent * message,
                                     bytes=self.total_bytes, rejected=rejected, clipped=len(clipped),
                                     clipped_clients=clipped))
            self.state = new
        return new

    def save(self, path) -> None:
        """Write the last good global Gaussian, the history, the config, the failure reason and the clients refused or
        bounded (``incidents``: :meth:`~ClientReport.incidents`) and those that did not start (``not_started``:
        ``{client: reason}``) (``.npz``)."""
        mean = np.asarray(self.state.mean) if self.state is not None else np.zeros(0)
        precision = np.asarray(self.state.precision) if self.state is not None else np.zeros(0)
        np.savez(path, mean=mean, precision=precision, history=json.dumps(round_dicts(self.history), default=str),
                 config=json.dumps(self.config), failure=json.dumps(self.failure),
                 incidents=json.dumps(self.incidents(), default=str),
                 not_started=json.dumps(self.not_started, default=str))
