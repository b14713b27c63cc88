"""The Flower strategy and client around the package's federated logic (:mod:`numpyro_pc.federated.flower`).

:func:`make_strategy` is the server side: a Flower ``Strategy`` that only aggregates what the
:class:`~numpyro_pc.federated.server.ServerLogic` (or its exponential-family twin) decides, with
``--min-clients`` honoured from the first round; :func:`make_client` wraps a client's logic as a
Flower ``NumPyClient``. Both serve the command line (:mod:`numpyro_pc.federated.flower`) and the
Flower apps (:mod:`numpyro_pc.federated.flower_apps`), which is why they live below both. Flower
itself is imported only when one is built.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import DataShapeError, InvalidOptionError, PosteriorCorrectionError, TooFewClientsError
from .logic import ClientByFamily

if TYPE_CHECKING:
    from flwr.client import NumPyClient
    from flwr.common import EvaluateIns, FitIns, Parameters
    from flwr.server.client_proxy import ClientProxy
    from flwr.server.strategy import Strategy

__all__ = ["make_strategy", "make_client"]


def _require_flwr() -> None:
    try:
        import flwr  # noqa: F401
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("the Flower transport needs the optional extra: pip install 'numpyro-pc[federated]'") from err


def make_strategy(logic, connect_timeout=120.0, out=None, rounds=None) -> Strategy:
    """A Flower :class:`~flwr.server.strategy.Strategy` driving a :class:`ServerLogic` or an
    :class:`~numpyro_pc.federated.ef_transport.EFServerLogic` (:func:`~numpyro_pc.federated.logic.server_logic`).

    Client identity is the transport's (``ClientProxy.cid``, Flower's node id). Round 1 waits
    up to ``connect_timeout`` seconds for ``num_clients`` nodes and goes on with those connected when they
    are at least ``min_clients``; a client that never connected, sent no reply or reported an error to its
    first message (bad data, too few examples: :class:`~numpyro_pc.errors.PosteriorCorrectionError`) is
    named in ``logic.not_started`` with its reason and left out. Later rounds ask the admitted nodes that
    are still connected. A failed or timed-out client is left out of the round; an
    error of the logic (too few valid replies, …) is recorded in ``logic.failure`` and raised.
    With ``out`` (a path) the result is written after every round and on failure. With ``rounds`` (the
    algorithm's rounds, as the ``ServerApp`` runs them) the last round ends with
    :meth:`~numpyro_pc.federated.server.ClientReport.check_clients`: a run that refused or bounded a
    client's message raises :class:`~numpyro_pc.errors.SuspectClientsError` (after writing ``out``), which
    Flower turns into the ``ServerApp``'s non-zero exit code.
    """
    _require_flwr()
    from flwr.common import FitIns, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.strategy import Strategy

    def recorded(fn) -> Callable[..., Any]:
        def wrapper(*args, **kwargs) -> Any:
            try:
                value = fn(*args, **kwargs)
            except Exception as err:
                logic.failure = logic.failure or f"{type(err).__name__}: {err}"
                if out:
                    logic.save(out)
                raise
            if out and logic.state is not None:
                logic.save(out)
            return value
        return wrapper

    asked: set = set()  # the clients sent the first message

    class PosteriorCorrectionStrategy(Strategy):
        """Aggregates site natural parameters; round 1 initialises, later rounds update."""

        def initialize_parameters(self, client_manager) -> Parameters:
            return ndarrays_to_parameters([])

        @recorded
        def configure_fit(self, server_round, parameters, client_manager) -> list[tuple[ClientProxy, FitIns]]:
            if server_round == 1:
                clients = _first_round_clients(logic, client_manager, connect_timeout)
                asked.update(c.cid for c in clients)
                arrays = []
            else:
                alive = [p for cid, p in sorted(client_manager.all().items()) if cid in logic.sites]
                wanted = max(logic.min_clients, round(logic.fraction * logic.num_clients))
                if len(alive) < logic.min_clients:
                    logic.failure = (f"round {server_round - 1}: {len(alive)} admitted client(s) still connected, "
                                     f"fewer than min_clients={logic.min_clients}")
                    raise TooFewClientsError(logic.failure)
                order = np.random.default_rng(server_round).permutation(len(alive))[:wanted]
                clients = [alive[i] for i in sorted(order)]
                arrays = logic.broadcast()
            phase = "init" if server_round == 1 else "update"
            parameters = ndarrays_to_parameters(arrays)
            return [(c, FitIns(parameters, logic.fit_config(c.cid, phase))) for c in clients]

        def aggregate_fit(self, server_round, results, failures) -> tuple[Parameters, dict[str, Any]]:
            value = self._aggregate(server_round, results, failures)
            if rounds is not None and server_round == int(rounds) + 1:
                logic.check_clients()
            return value

        @recorded
        def _aggregate(self, server_round, results, failures) -> tuple[Parameters, dict[str, Any]]:
            replies = {proxy.cid: parameters_to_ndarrays(r.parameters) for proxy, r in results}
            examples = {proxy.cid: r.num_examples for proxy, r in results}
            if server_round == 1:
                started = _record_not_started(logic, asked, results)
                logic.aggregate_initial({cid: a for cid, a in replies.items() if cid in started}, examples)
            else:
                iterations = [int(r.metrics.get("iterations", 0)) for _, r in results
                              if isinstance(r.metrics.get("iterations", 0), int)]
                kw = {}
                if logic.kind == "ef":
                    kw["residuals"] = [r.metrics["residual"] for _, r in results if "residual" in r.metrics]
                logic.aggregate(replies, iterations, examples, **kw)
                logic.history[-1] = logic.history[-1].replace(dropped=len(failures))
            return ndarrays_to_parameters(logic.broadcast()), {}

        def configure_evaluate(self, server_round, parameters, client_manager) -> list[tuple[ClientProxy, EvaluateIns]]:
            return []

        def aggregate_evaluate(self, server_round, results, failures) -> tuple[None, dict[str, Any]]:
            return None, {}

        def evaluate(self, server_round, parameters) -> None:
            return None

    return PosteriorCorrectionStrategy()


def _first_round_clients(logic, client_manager, connect_timeout) -> list:
    """The clients of round 1: all ``num_clients`` when they connect within ``connect_timeout`` seconds, else the
    ones connected by then when they are at least ``min_clients`` (the others go to ``logic.not_started``).

    :raises TooFewClientsError: fewer than ``min_clients`` connected.
    """
    wanted = logic.num_clients
    if not client_manager.wait_for(wanted, timeout=int(connect_timeout)):
        available = client_manager.num_available()
        if available < logic.min_clients:
            logic.failure = (f"only {available} of {wanted} clients connected within {connect_timeout:g} s, fewer "
                             f"than min_clients={logic.min_clients}")
            raise TooFewClientsError(logic.failure)
        for k in range(available + 1, wanted + 1):
            _not_started(logic, f"unconnected-{k}", f"never connected: {available} of {wanted} clients connected "
                                                    f"within {connect_timeout:g} s")
        wanted = available
    return client_manager.sample(num_clients=wanted, min_num_clients=logic.min_clients)


def _not_started(logic, cid, reason) -> None:
    logic.not_started[cid] = reason
    print(f"numpyro_pc: client {cid} did not start: {reason}", file=sys.stderr, flush=True)


def _record_not_started(logic, asked, results) -> set:
    """Round 1: the clients that sent a first message; the others go to ``logic.not_started`` with their reason
    (the error a client reports, or no reply at all)."""
    started = set()
    for proxy, res in results:
        if "error" in res.metrics:
            _not_started(logic, proxy.cid, str(res.metrics["error"]))
        else:
            started.add(proxy.cid)
    for cid in sorted(asked - started - set(logic.not_started)):
        _not_started(logic, cid, "sent no reply to its first message (it failed or lost the connection: see its "
                                 "own log)")
    return started


def make_client(logic, x64=None, state=None) -> NumPyClient:
    """A Flower ``NumPyClient`` around a :class:`ClientLogic`, an
    :class:`~numpyro_pc.federated.ef_transport.EFClientLogic` or a :class:`ClientByFamily` (it sends no identity:
    the transport gives it).

    :param bool x64: compute in float64 (``None``: as the caller's scope).
    :param state: a Flower ``RecordDict`` (``Context.state``) keeping the client's site between
        messages where the ``ClientApp`` is rebuilt for each one.
    """
    _require_flwr()
    from flwr.client import NumPyClient

    class PosteriorCorrectionClient(NumPyClient):
        #: the package error that kept this client from starting (its first message), reported to the server
        start_error: PosteriorCorrectionError | None = None

        def get_parameters(self, config) -> list[np.ndarray]:
            return []

        def fit(self, parameters, config) -> tuple[list[np.ndarray], int, dict[str, Any]]:
            try:
                return self._fit(parameters, config)
            except PosteriorCorrectionError as err:  # bad data, too few examples, …: the server hears why
                if config.get("phase") != "init":
                    raise
                self.start_error = err
                return [], 0, {"error": f"{type(err).__name__}: {err}"}

        def _fit(self, parameters, config) -> tuple[list[np.ndarray], int, dict[str, Any]]:
            with contextlib.nullcontext() if x64 is None else jax.enable_x64(x64):
                client = logic.for_config(config) if isinstance(logic, ClientByFamily) else logic
                if state is not None and _STATE_KEY in state:  # the state is the truth: a cached client may be stale
                    client.restore(state[_STATE_KEY].to_numpy_ndarrays())
                if config["phase"] == "init":
                    arrays, metrics = client.initial(config), {}
                else:
                    arrays, metrics = client.update(parameters, config)
                if state is not None:
                    from flwr.app import ArrayRecord

                    state[_STATE_KEY] = ArrayRecord(client.state_arrays())
            return arrays, client.num_examples, metrics

    return PosteriorCorrectionClient()


_STATE_KEY = "numpyro_pc_site"


def _load_model(path) -> Callable[..., Any]:
    module, _, name = path.partition(":")
    if not name:
        raise InvalidOptionError(f"--model must look like 'module:function', got {path!r}")
    return getattr(importlib.import_module(module), name)


def _load_args(path) -> tuple[jax.Array, ...]:
    with np.load(path) as npz:
        keys = sorted((k for k in npz.files if k.startswith("arg")), key=lambda k: int(k[3:]))
        if not keys:
            raise DataShapeError(f"{path} holds no arrays named arg0, arg1, …")
        return tuple(jnp.asarray(npz[k]) for k in keys)
