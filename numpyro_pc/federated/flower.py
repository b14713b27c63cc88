r"""Federated posterior correction across processes or machines with `Flower <https://flower.ai>`_.

The server runs a Flower strategy that only aggregates site natural parameters
(paper eq. ``global_update``); each client holds its shard and runs the local update of
paper eq. ``local_update`` (:func:`numpyro_pc.federated.core.local_update`, the same
function the in-process :func:`numpyro_pc.federated.run` ``vmap``-s). Messages are the
global Gaussian (server → clients) and each client's site ``η_k`` (and, for ADMM, its
local natural parameters) back — never data.

The server's ``family`` chooses the kind of posterior: a Gaussian family's name, or an
exponential-family product ``{latent site: family name}`` (``--family p=beta,rate=gamma`` or
JSON), whose messages are the flat natural-parameter vectors :math:`\lambda` and ``η_k`` and
whose steps are those of :func:`~numpyro_pc.federated.ef.run_ef`
(:mod:`numpyro_pc.federated.ef_transport`). Clients take the kind from the server's first
message (:class:`~numpyro_pc.federated.logic.ClientByFamily`).

Round 1 is an initialisation round: every client sends the prior it derives from the
model (the server checks they agree) and its first site (at the prior; zero for the
isotropic family), matching ``init="auto"`` of :func:`~numpyro_pc.federated.run`; rounds ``2 … R+1`` are the ``R``
rounds of the algorithm. With every client taking part, the result equals the in-process
run (up to the order of a sum). For a product family round 1 registers the clients (first
site, zero by default, prior and family description; the server's ``--init zero|prior``),
rounds ``2 … R+1`` are ``run_ef``'s ``R`` rounds; a server started with ``--private`` pulls
a noised sum back into the domain instead of refusing it, and a private client clips each
example's term to ``--dp-clip-natural`` (``--dp-releases`` = ``--rounds``, plus one with
``--init prior``).

Client identity is the transport's (Flower's node id), never something a message says; the
server checks every message and can bound one client's influence
(:mod:`numpyro_pc.federated.server`, :mod:`numpyro_pc.federated.robust`).

Command line (one server, one process per client)::

    python -m numpyro_pc.federated.flower server --address 127.0.0.1:8080 --clients 3 \
        --min-clients 2 --rounds 20 --algorithm fedpc --family full --out result.npz
    python -m numpyro_pc.federated.flower client --server 127.0.0.1:8080 \
        --model mypackage.models:logistic --data shard_k.npz
    python -m numpyro_pc.federated.flower server --clients 3 --family p=beta --rounds 20 --out ef.npz

``--data`` is an ``.npz`` file whose arrays ``arg0, arg1, …`` are the model's positional
arguments; ``--model`` is ``module:function``. Add ``--x64`` on every process for float64.
The server binds to loopback unless ``--address`` says otherwise; across machines pass
``--certificates CA CERT KEY`` to the server and ``--root-certificates CA`` to the clients
(TLS). A client adds ``--dp-epsilon ε --dp-releases T`` (``T`` = the server's ``--rounds``
plus one) to send differentially private sites
(:class:`~numpyro_pc.federated.privacy.GaussianMechanism`, its own setting, not the
server's). The server exits with status 1 and still writes ``--out`` (last good posterior,
history, ``failure``) when a run cannot go on, and with status 3 when it ran its rounds but refused or
bounded some client's message (``incidents`` in ``--out`` and ``suspect_clients`` in the summary name
them; see :func:`main`). This module needs the optional extra
``numpyro-pc[federated]`` (``flwr``); it imports Flower only when a server or client is
started.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import DataShapeError, InvalidOptionError, TooFewClientsError
from .ef_transport import EFClientLogic, EFServerLogic
from .logic import ClientByFamily, ClientLogic, server_logic
from .privacy import GaussianMechanism
from .records import round_dicts
from .server import ServerLogic, describe_incidents

if TYPE_CHECKING:
    from flwr.client import Client, NumPyClient
    from flwr.clientapp import ClientApp
    from flwr.common import EvaluateIns, FitIns, Parameters
    from flwr.server import ServerAppComponents
    from flwr.server.client_proxy import ClientProxy
    from flwr.server.strategy import Strategy
    from flwr.serverapp import ServerApp

__all__ = ["ServerLogic", "ClientLogic", "EFServerLogic", "EFClientLogic", "ClientByFamily", "server_logic",
           "make_strategy", "make_client", "start_server", "start_client", "main",
           "server_app", "client_app"]  # noqa: F822 - the two apps are built on first access (module __getattr__)


def _require_flwr() -> None:
    try:
        import flwr  # noqa: F401
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("the Flower transport needs the optional extra: pip install 'numpyro-pc[federated]'") from err


def make_strategy(logic, connect_timeout=120.0, out=None, rounds=None) -> Strategy:
    """A Flower :class:`~flwr.server.strategy.Strategy` driving a :class:`ServerLogic` or an
    :class:`~numpyro_pc.federated.ef_transport.EFServerLogic` (:func:`~numpyro_pc.federated.logic.server_logic`).

    Client identity is the transport's (``ClientProxy.cid``, Flower's node id). Round 1 waits
    up to ``connect_timeout`` seconds for ``num_clients`` nodes; later rounds ask the admitted
    nodes that are still connected. A failed or timed-out client is left out of the round; an
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

    class PosteriorCorrectionStrategy(Strategy):
        """Aggregates site natural parameters; round 1 initialises, later rounds update."""

        def initialize_parameters(self, client_manager) -> Parameters:
            return ndarrays_to_parameters([])

        @recorded
        def configure_fit(self, server_round, parameters, client_manager) -> list[tuple[ClientProxy, FitIns]]:
            if server_round == 1:
                if not client_manager.wait_for(logic.num_clients, timeout=int(connect_timeout)):
                    logic.failure = (f"only {client_manager.num_available()} of {logic.num_clients} clients "
                                     f"connected within {connect_timeout:g} s")
                    raise TooFewClientsError(logic.failure)
                clients = client_manager.sample(num_clients=logic.num_clients)
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
                logic.aggregate_initial(replies, examples)
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
        def get_parameters(self, config) -> list[np.ndarray]:
            return []

        def fit(self, parameters, config) -> tuple[list[np.ndarray], int, dict[str, Any]]:
            with contextlib.nullcontext() if x64 is None else jax.enable_x64(x64):
                client = logic.for_config(config) if isinstance(logic, ClientByFamily) else logic
                if client.site is None and state is not None and _STATE_KEY in state:
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


def _opt(cfg, key, cast=float) -> Any:
    value = cfg.get(key)
    return None if value in (None, "", "none") else cast(value)


def _server_fn(context) -> ServerAppComponents:
    """``ServerApp`` components from the run config (``pyproject.toml`` ``[tool.flwr.app.config]``)."""
    from flwr.server import ServerAppComponents, ServerConfig

    cfg = dict(context.run_config)
    logic = server_logic(int(cfg["num-clients"]), str(cfg.get("algorithm", "fedpc")), str(cfg.get("family", "full")),
                         rho=_opt(cfg, "rho"), damping=_opt(cfg, "damping"),
                         expectation=str(cfg.get("expectation", "auto")), fraction=float(cfg.get("fraction", 1.0)),
                         x64=bool(cfg.get("x64", True)), min_clients=_opt(cfg, "min-clients", int),
                         min_examples=int(cfg.get("min-examples", 1)), max_share=_opt(cfg, "max-share"),
                         max_shift=_opt(cfg, "max-shift"), private=bool(cfg.get("private", False)) or None,
                         init=_opt(cfg, "init", str))
    strategy = make_strategy(logic, float(cfg.get("connect-timeout", 120.0)), out=_opt(cfg, "out", str),
                             rounds=int(cfg.get("rounds", 20)))
    return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=int(cfg.get("rounds", 20)) + 1,
                                                                      round_timeout=float(cfg.get("round-timeout",
                                                                                                  120.0))))


def _privacy(cfg) -> GaussianMechanism | None:
    """The client's :class:`GaussianMechanism` from its own settings (``dp-epsilon`` … or ``None``)."""
    if _opt(cfg, "dp-epsilon") is None:
        return None
    return GaussianMechanism(float(cfg["dp-epsilon"]), float(cfg.get("dp-delta", 1e-5)), int(cfg["dp-releases"]),
                             float(cfg.get("dp-clip-linear", 1.0)), float(cfg.get("dp-clip-precision", 1.0)),
                             float(cfg.get("dp-clip-natural", 1.0)))


def _client_fn(context) -> Client:
    """A client from the run config's ``model`` and the node config's ``data`` (``.npz`` path).

    The node config (the SuperNode's own, not the server's) may also set the client's
    differential privacy: ``dp-epsilon``, ``dp-delta``, ``dp-releases``, ``dp-clip-linear``,
    ``dp-clip-precision`` (see :mod:`numpyro_pc.federated.privacy`).
    """
    x64 = bool(context.run_config.get("x64", True))
    node = dict(context.node_config)
    with jax.enable_x64(x64):
        logic = ClientByFamily(_load_model(str(context.run_config["model"])), _load_args(str(node["data"])),
                               json.loads(str(context.run_config.get("model-kwargs", "{}"))), privacy=_privacy(node))
    return make_client(logic, x64=x64, state=context.state).to_client()


def __getattr__(name) -> ServerApp | ClientApp:
    """``server_app`` and ``client_app``: Flower apps for ``flwr run`` / SuperLink–SuperNode, built on access."""
    if name == "server_app":
        _require_flwr()
        from flwr.serverapp import ServerApp

        return ServerApp(server_fn=_server_fn)
    if name == "client_app":
        _require_flwr()
        from flwr.clientapp import ClientApp

        return ClientApp(client_fn=_client_fn)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _read(path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def start_server(address, logic, rounds, round_timeout=120.0, connect_timeout=120.0, certificates=None,
                 strict=True) -> ServerLogic | EFServerLogic:
    """Run the Flower server for ``rounds`` algorithm rounds (plus the initial round).

    :param tuple certificates: ``(CA certificate, server certificate, server key)`` as bytes or
        paths, for TLS (default: none, plain gRPC — loopback or a trusted network only).
    :param float round_timeout: seconds a round waits for its clients; the late ones are
        left out of the round.
    :param bool strict: end a run that refused or bounded a client's message with
        :class:`~numpyro_pc.errors.SuspectClientsError` (``False``: return; ``logic.incidents()`` says who).
    :raises SuspectClientsError: (``strict``) after all rounds, naming the clients whose messages were
        refused or whose sites were bounded, the rounds and why; ``err.result`` is ``logic``.
    :raises: whatever stopped the run; ``logic.failure`` then holds the reason and
        ``logic.state`` the last good posterior.
    """
    _require_flwr()
    import flwr

    if certificates is not None:
        certificates = tuple(c if isinstance(c, bytes) else _read(c) for c in certificates)
    flwr.server.start_server(server_address=address, strategy=make_strategy(logic, connect_timeout),
                             config=flwr.server.ServerConfig(num_rounds=int(rounds) + 1,
                                                             round_timeout=float(round_timeout)),
                             certificates=certificates)
    if strict:
        logic.check_clients()
    return logic


def start_client(address, logic, root_certificates=None, max_wait_time=60.0) -> None:
    """Connect a client to the server and serve until the run ends.

    :param root_certificates: the CA certificate (bytes or path) for TLS; without it the
        connection is plain gRPC (``insecure``), meant for loopback or a trusted network.
    :param float max_wait_time: seconds the client keeps retrying an unreachable server.
    """
    _require_flwr()
    import flwr

    if root_certificates is not None and not isinstance(root_certificates, bytes):
        root_certificates = _read(root_certificates)
    flwr.client.start_client(server_address=address, client=make_client(logic).to_client(),
                             root_certificates=root_certificates, insecure=root_certificates is None,
                             max_wait_time=float(max_wait_time))


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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m numpyro_pc.federated.flower")
    sub = parser.add_subparsers(dest="role", required=True)
    srv = sub.add_parser("server", help="aggregate the clients' sites")
    srv.add_argument("--address", default="127.0.0.1:8080", help="bind address (default loopback only)")
    srv.add_argument("--clients", type=int, required=True)
    srv.add_argument("--min-clients", type=int, default=None, help="valid replies a round needs (default all)")
    srv.add_argument("--min-examples", type=int, default=1, help="examples a client must hold to take part")
    srv.add_argument("--rounds", type=int, default=20)
    srv.add_argument("--algorithm", default="fedpc", choices=["fedpc", "pvi", "ama", "admm"])
    srv.add_argument("--family", default="full", help="a Gaussian family (full, diagonal, isotropic) or an "
                     "exponential-family product: site=name pairs, e.g. p=beta,rate=gamma (or JSON)")
    srv.add_argument("--init", default=None, choices=["zero", "prior"], help="exponential family: first sites")
    srv.add_argument("--private", action="store_true", help="exponential family: the clients send private sites "
                     "(a sum outside the domain is pulled back, not refused)")
    srv.add_argument("--rho", type=float, default=None)
    srv.add_argument("--damping", type=float, default=None)
    srv.add_argument("--expectation", default="auto")
    srv.add_argument("--fraction", type=float, default=1.0)
    srv.add_argument("--max-share", type=float, default=None, help="bounded aggregation: precision share")
    srv.add_argument("--max-shift", type=float, default=None, help="bounded aggregation: mean shift (sd)")
    srv.add_argument("--round-timeout", type=float, default=120.0)
    srv.add_argument("--connect-timeout", type=float, default=120.0)
    srv.add_argument("--certificates", nargs=3, metavar=("CA", "CERT", "KEY"), default=None,
                     help="TLS: CA certificate, server certificate and server key files")
    srv.add_argument("--out", default=None, help="write the result (.npz), also on failure")
    cli = sub.add_parser("client", help="hold a shard and run local updates")
    cli.add_argument("--server", default="127.0.0.1:8080")
    cli.add_argument("--model", required=True, help="module:function of the NumPyro model")
    cli.add_argument("--data", required=True, help=".npz with arrays arg0, arg1, …")
    cli.add_argument("--kwargs", default="{}", help="JSON keyword arguments of the model")
    cli.add_argument("--root-certificates", default=None, help="TLS: the CA certificate file")
    cli.add_argument("--max-wait", type=float, default=60.0, help="seconds to retry an unreachable server")
    cli.add_argument("--dp-epsilon", type=float, default=None, help="differential privacy: ε of all messages")
    cli.add_argument("--dp-delta", type=float, default=1e-5, help="differential privacy: δ")
    cli.add_argument("--dp-releases", type=int, default=None, help="differential privacy: messages the budget covers")
    cli.add_argument("--dp-clip-linear", type=float, default=1.0, help="per-example clipping norm (linear part)")
    cli.add_argument("--dp-clip-precision", type=float, default=1.0, help="per-example clipping norm (precision)")
    cli.add_argument("--dp-clip-natural", type=float, default=1.0,
                     help="per-example clipping norm of an exponential-family site term")
    for p in (srv, cli):
        p.add_argument("--x64", action="store_true", help="compute in float64")
    return parser


def _serve(args) -> int:
    logic = server_logic(args.clients, args.algorithm, args.family, rho=args.rho, damping=args.damping,
                         expectation=args.expectation, fraction=args.fraction, x64=args.x64,
                         min_clients=args.min_clients, min_examples=args.min_examples, max_share=args.max_share,
                         max_shift=args.max_shift, init=args.init, private=args.private or None)
    try:
        start_server(args.address, logic, args.rounds, args.round_timeout, args.connect_timeout, args.certificates,
                     strict=False)
    except BaseException as err:  # noqa: BLE001 - any error ends the run with a partial result
        logic.failure = logic.failure or f"{type(err).__name__}: {err}"
    incidents = logic.incidents()
    code, status = (1, "failed") if logic.failure is not None else (3, "suspect") if incidents else (0, "ok")
    if args.out:
        logic.save(args.out)
    if incidents:
        print(describe_incidents(incidents), file=sys.stderr, flush=True)
    last = round_dicts(logic.history[-1:])[0] if logic.history else {}
    print(json.dumps({"status": status, "rounds": len(logic.history), "last": last, "failure": logic.failure,
                      "suspect_clients": incidents}, default=str), flush=True)
    return code


def main(argv=None) -> int:
    """Command-line entry point: ``server`` or ``client`` (see the module docstring).

    The server exits with status ``0`` after its rounds when every message was accepted and no site bounded,
    ``1`` after any error (too few valid clients, a client that never connected, …) and ``3`` after its rounds
    when it refused a client's message (the checks, a replay) or bounded a site (``--max-share``,
    ``--max-shift``): the result is then the server's last good one, but not the plain aggregate of every
    client's own site. It writes ``--out`` in every case (``incidents``: per client, the round, ``rejected``
    or ``clipped`` and why) and prints one JSON line: ``status`` (``"ok"``, ``"failed"``, ``"suspect"``),
    ``rounds``, ``last`` (the last round's record), ``failure`` and ``suspect_clients`` (the incidents);
    a status 3 run also prints the incidents, one line per client, on standard error. A client that
    merely drops out is not an incident (``dropped`` in the history).
    """
    args = _parser().parse_args(argv)
    with jax.enable_x64(args.x64):
        if args.role == "server":
            return _serve(args)
        privacy = None
        if args.dp_epsilon is not None:
            if args.dp_releases is None:
                raise InvalidOptionError("--dp-epsilon needs --dp-releases (the server's --rounds plus one)")
            privacy = GaussianMechanism(args.dp_epsilon, args.dp_delta, args.dp_releases, args.dp_clip_linear,
                                        args.dp_clip_precision, args.dp_clip_natural)
        logic = ClientByFamily(_load_model(args.model), _load_args(args.data), json.loads(args.kwargs), privacy)
        start_client(args.server, logic, args.root_certificates, args.max_wait)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # gRPC threads left by an aborted Flower run must not keep the process alive
