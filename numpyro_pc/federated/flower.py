r"""Federated posterior correction across processes or machines with `Flower <https://flower.ai>`_.

The server runs a Flower strategy that only aggregates site natural parameters
(paper eq. ``global_update``); each client holds its shard and runs the local update of
paper eq. ``local_update`` (:func:`numpyro_pc.federated.core.local_update`, the same
function the in-process :func:`numpyro_pc.federated.run` ``vmap``-s). Messages are the
global Gaussian (server → clients) and each client's site ``η_k`` (and, for ADMM, its
local natural parameters) back — never data.

Round 1 is an initialisation round: every client sends the prior it derives from the
model (the server checks they agree) and its first site (at the prior; zero for the
isotropic family), matching ``init="auto"`` of :func:`~numpyro_pc.federated.run`; rounds ``2 … R+1`` are the ``R``
rounds of the algorithm. With every client taking part, the result equals the in-process
run (up to the order of a sum).

Client identity is the transport's (Flower's node id), never something a message says; the
server checks every message and can bound one client's influence
(:mod:`numpyro_pc.federated.server`, :mod:`numpyro_pc.federated.robust`).

Command line (one server, one process per client)::

    python -m numpyro_pc.federated.flower server --address 127.0.0.1:8080 --clients 3 \
        --min-clients 2 --rounds 20 --algorithm fedpc --family full --out result.npz
    python -m numpyro_pc.federated.flower client --server 127.0.0.1:8080 \
        --model mypackage.models:logistic --data shard_k.npz

``--data`` is an ``.npz`` file whose arrays ``arg0, arg1, …`` are the model's positional
arguments; ``--model`` is ``module:function``. Add ``--x64`` on every process for float64.
The server binds to loopback unless ``--address`` says otherwise; across machines pass
``--certificates CA CERT KEY`` to the server and ``--root-certificates CA`` to the clients
(TLS). A client adds ``--dp-epsilon ε --dp-releases T`` (``T`` = the server's ``--rounds``
plus one) to send differentially private sites
(:class:`~numpyro_pc.federated.privacy.GaussianMechanism`, its own setting, not the
server's). The server exits with status 1 and still writes ``--out`` (last good posterior,
history, ``failure``) when a run cannot go on. This module needs the optional extra
``numpyro-pc[federated]`` (``flwr``); it imports Flower only when a server or client is
started.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import secrets
import sys

import jax
import jax.numpy as jnp
import numpy as np

from ..capabilities import FixedPrecision, capability
from ..errors import DataShapeError, InvalidOptionError, PrivacyError, TooFewClientsError
from ..families import Gaussian, GaussianNatural
from ..merging import gaussian_prior, prior_natural
from .algorithms import check_settings
from .core import LocalConfig, bind_clients, global_state, local_update, release_site
from .privacy import GaussianMechanism
from .server import ServerLogic

__all__ = ["ServerLogic", "ClientLogic", "make_strategy", "make_client", "start_server", "start_client", "main",
           "server_app", "client_app"]  # noqa: F822 - the two apps are built on first access (module __getattr__)


def _require_flwr():
    try:
        import flwr  # noqa: F401
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("the Flower transport needs the optional extra: pip install 'numpyro-pc[federated]'") from err


def _nat(arrays):
    return GaussianNatural(jnp.asarray(arrays[0]), jnp.asarray(arrays[1]))


def _arrays(x):
    return [np.asarray(v) for v in x]


class ClientLogic:
    """What a client does each round, without any transport (stateful: it keeps ``η_k``).

    :param model: the NumPyro model.
    :param tuple args: the client's model arguments (its shard).
    :param dict kwargs: the model's keyword arguments.
    :param privacy: this client's own
        :class:`~numpyro_pc.federated.privacy.GaussianMechanism` (the server cannot switch it
        off): every site it sends is clipped and noised, and after ``privacy.releases``
        messages it refuses to send more (:class:`~numpyro_pc.errors.PrivacyError`).
    :param int seed: seed of the privacy noise (default: from the operating system).
    :ivar releases: messages sent so far.
    """

    def __init__(self, model, args, kwargs=None, privacy=None, seed=None):
        self.spec, self.stack, (self.data,) = bind_clients(model, [args], kwargs)
        self.site = None
        self.privacy = privacy
        self.releases = 0
        self.seed = secrets.randbits(31) if seed is None else int(seed)
        self._fns = {}

    def _cfg(self, config):
        n = int(self.stack.mask.sum())
        if n < int(config.get("min_examples", 1)):
            raise PrivacyError(f"this client holds {n} example(s), fewer than the run's min_examples="
                             f"{config['min_examples']}: it does not take part (its site would reveal its data)")
        family, _, _, rule = check_settings(config["algorithm"], config["family"], None if config["algorithm"] == "pvi"
                                       else config["rho"], config["damping"],
                                       None if config["expectation"] == "auto" else config["expectation"], self.spec)
        if self.privacy is not None:
            if config["algorithm"] == "admm":
                raise PrivacyError("this client adds differential-privacy noise, which the run's algorithm 'admm' "
                                   "cannot take (it needs the exact local posterior): it does not take part")
            if self.releases >= self.privacy.releases:
                raise PrivacyError(f"this client's privacy budget covers {self.privacy.releases} message(s) "
                                   f"(ε={self.privacy.epsilon:g}, δ={self.privacy.delta:g}), all sent: it stops")
        return LocalConfig(self.spec, family, rule, int(config["num_nodes"]), int(config["local_iters"]),
                           float(config["local_tol"]), safeguard=bool(config.get("safeguard", False)),
                           margin=float(config.get("safeguard_margin", 0.3)), privacy=self.privacy)

    def _key(self):
        self.releases += 1
        return jax.random.fold_in(jax.random.PRNGKey(self.seed), self.releases)

    def _ex(self):
        return tuple(x[0] for x in self.stack.per_example), self.stack.mask[0], self.stack.shared

    def initial(self, config):
        """Round 1: the prior ``(m_0, P_0)`` and this client's first site."""
        cfg = self._cfg(config)
        prior = gaussian_prior(self.spec, self.data)
        tau = cfg.family.prior_tau(prior)
        q0 = global_state(cfg.family, prior, prior_natural(cfg.family, prior, tau),
                          jax.tree.map(jnp.zeros_like, prior_natural(cfg.family, prior, tau)))
        ex, mask, shared = self._ex()
        if capability(cfg.family, FixedPrecision):  # init="auto" of the in-process run: sites start at one
            self.site = GaussianNatural(jnp.zeros_like(q0.mean), jnp.zeros((), q0.mean.dtype))
        else:
            self.site = jax.jit(release_site, static_argnums=0)(cfg, q0, ex, mask, shared, self._key())
        return _arrays(self.site) + [np.asarray(prior.mean), np.asarray(prior.precision)]

    def update(self, arrays, config):
        """One local update from the global Gaussian ``arrays = [mean, precision]``."""
        cfg = self._cfg(config)
        q_jnt = Gaussian(jnp.asarray(arrays[0]), jnp.asarray(arrays[1]))
        if cfg not in self._fns:
            self._fns[cfg] = jax.jit(local_update, static_argnums=0)
        ex, mask, shared = self._ex()
        out = self._fns[cfg](cfg, q_jnt, self.site, jnp.asarray(config["rho"], q_jnt.mean.dtype), ex, mask, shared,
                             self._key())
        damping = float(config["damping"])
        self.site = jax.tree.map(lambda o, n: o + damping * (n - o), self.site, out.site)
        # a private client reports nothing beyond its (noised) message
        metrics = {} if self.privacy is not None else {"iterations": int(out.iterations), "ok": bool(out.ok)}
        return _arrays(self.site) + _arrays(out.local), metrics


def make_strategy(logic, connect_timeout=120.0, out=None):
    """A Flower :class:`~flwr.server.strategy.Strategy` driving a :class:`ServerLogic`.

    Client identity is the transport's (``ClientProxy.cid``, Flower's node id). Round 1 waits
    up to ``connect_timeout`` seconds for ``num_clients`` nodes; later rounds ask the admitted
    nodes that are still connected. A failed or timed-out client is left out of the round; an
    error of the logic (too few valid replies, …) is recorded in ``logic.failure`` and raised.
    With ``out`` (a path) the result is written after every round and on failure.
    """
    _require_flwr()
    from flwr.common import FitIns, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.strategy import Strategy

    def recorded(fn):
        def wrapper(*args, **kwargs):
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

        def initialize_parameters(self, client_manager):
            return ndarrays_to_parameters([])

        @recorded
        def configure_fit(self, server_round, parameters, client_manager):
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
                arrays = [np.asarray(logic.state.mean), np.asarray(logic.state.precision)]
            phase = "init" if server_round == 1 else "update"
            ins = FitIns(ndarrays_to_parameters(arrays), dict(logic.config, phase=phase))
            return [(c, ins) for c in clients]

        @recorded
        def aggregate_fit(self, server_round, results, failures):
            replies = {proxy.cid: parameters_to_ndarrays(r.parameters) for proxy, r in results}
            examples = {proxy.cid: r.num_examples for proxy, r in results}
            if server_round == 1:
                q = logic.aggregate_initial(replies, examples)
            else:
                iterations = [int(r.metrics.get("iterations", 0)) for _, r in results
                              if isinstance(r.metrics.get("iterations", 0), int)]
                q = logic.aggregate(replies, iterations, examples)
                logic.history[-1]["dropped"] = len(failures)
            return ndarrays_to_parameters([np.asarray(q.mean), np.asarray(q.precision)]), {}

        def configure_evaluate(self, server_round, parameters, client_manager):
            return []

        def aggregate_evaluate(self, server_round, results, failures):
            return None, {}

        def evaluate(self, server_round, parameters):
            return None

    return PosteriorCorrectionStrategy()


def make_client(logic, x64=None, state=None):
    """A Flower ``NumPyClient`` around a :class:`ClientLogic` (it sends no identity: the transport gives it).

    :param bool x64: compute in float64 (``None``: as the caller's scope).
    :param state: a Flower ``RecordDict`` (``Context.state``) keeping the client's site between
        messages where the ``ClientApp`` is rebuilt for each one.
    """
    _require_flwr()
    from flwr.client import NumPyClient

    class PosteriorCorrectionClient(NumPyClient):
        def get_parameters(self, config):
            return []

        def fit(self, parameters, config):
            with contextlib.nullcontext() if x64 is None else jax.enable_x64(x64):
                if logic.site is None and state is not None and _STATE_KEY in state:
                    site = state[_STATE_KEY].to_numpy_ndarrays()
                    logic.site, (logic.releases, logic.seed) = _nat(site[:2]), (int(v) for v in site[2])
                if config["phase"] == "init":
                    arrays, metrics = logic.initial(config), {}
                else:
                    arrays, metrics = logic.update(parameters, config)
                if state is not None:
                    from flwr.app import ArrayRecord

                    state[_STATE_KEY] = ArrayRecord(_arrays(logic.site) + [np.asarray([logic.releases, logic.seed])])
            return arrays, int(logic.stack.mask.sum()), metrics

    return PosteriorCorrectionClient()


_STATE_KEY = "numpyro_pc_site"


def _opt(cfg, key, cast=float):
    value = cfg.get(key)
    return None if value in (None, "", "none") else cast(value)


def _server_fn(context):
    """``ServerApp`` components from the run config (``pyproject.toml`` ``[tool.flwr.app.config]``)."""
    from flwr.server import ServerAppComponents, ServerConfig

    cfg = dict(context.run_config)
    logic = ServerLogic(int(cfg["num-clients"]), str(cfg.get("algorithm", "fedpc")), str(cfg.get("family", "full")),
                        _opt(cfg, "rho"), _opt(cfg, "damping"), str(cfg.get("expectation", "auto")),
                        float(cfg.get("fraction", 1.0)), x64=bool(cfg.get("x64", True)),
                        min_clients=_opt(cfg, "min-clients", int), min_examples=int(cfg.get("min-examples", 1)),
                        max_share=_opt(cfg, "max-share"), max_shift=_opt(cfg, "max-shift"))
    strategy = make_strategy(logic, float(cfg.get("connect-timeout", 120.0)), out=_opt(cfg, "out", str))
    return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=int(cfg.get("rounds", 20)) + 1,
                                                                      round_timeout=float(cfg.get("round-timeout",
                                                                                                  120.0))))


def _privacy(cfg):
    """The client's :class:`GaussianMechanism` from its own settings (``dp-epsilon`` … or ``None``)."""
    if _opt(cfg, "dp-epsilon") is None:
        return None
    return GaussianMechanism(float(cfg["dp-epsilon"]), float(cfg.get("dp-delta", 1e-5)), int(cfg["dp-releases"]),
                             float(cfg.get("dp-clip-linear", 1.0)), float(cfg.get("dp-clip-precision", 1.0)))


def _client_fn(context):
    """A client from the run config's ``model`` and the node config's ``data`` (``.npz`` path).

    The node config (the SuperNode's own, not the server's) may also set the client's
    differential privacy: ``dp-epsilon``, ``dp-delta``, ``dp-releases``, ``dp-clip-linear``,
    ``dp-clip-precision`` (see :mod:`numpyro_pc.federated.privacy`).
    """
    x64 = bool(context.run_config.get("x64", True))
    node = dict(context.node_config)
    with jax.enable_x64(x64):
        logic = ClientLogic(_load_model(str(context.run_config["model"])), _load_args(str(node["data"])),
                            json.loads(str(context.run_config.get("model-kwargs", "{}"))), privacy=_privacy(node))
    return make_client(logic, x64=x64, state=context.state).to_client()


def __getattr__(name):
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


def _read(path):
    with open(path, "rb") as fh:
        return fh.read()


def start_server(address, logic, rounds, round_timeout=120.0, connect_timeout=120.0, certificates=None):
    """Run the Flower server for ``rounds`` algorithm rounds (plus the initial round).

    :param tuple certificates: ``(CA certificate, server certificate, server key)`` as bytes or
        paths, for TLS (default: none, plain gRPC — loopback or a trusted network only).
    :param float round_timeout: seconds a round waits for its clients; the late ones are
        left out of the round.
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
    return logic


def start_client(address, logic, root_certificates=None, max_wait_time=60.0):
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


def _load_model(path):
    module, _, name = path.partition(":")
    if not name:
        raise InvalidOptionError(f"--model must look like 'module:function', got {path!r}")
    return getattr(importlib.import_module(module), name)


def _load_args(path):
    with np.load(path) as npz:
        keys = sorted((k for k in npz.files if k.startswith("arg")), key=lambda k: int(k[3:]))
        if not keys:
            raise DataShapeError(f"{path} holds no arrays named arg0, arg1, …")
        return tuple(jnp.asarray(npz[k]) for k in keys)


def _parser():
    parser = argparse.ArgumentParser(prog="python -m numpyro_pc.federated.flower")
    sub = parser.add_subparsers(dest="role", required=True)
    srv = sub.add_parser("server", help="aggregate the clients' sites")
    srv.add_argument("--address", default="127.0.0.1:8080", help="bind address (default loopback only)")
    srv.add_argument("--clients", type=int, required=True)
    srv.add_argument("--min-clients", type=int, default=None, help="valid replies a round needs (default all)")
    srv.add_argument("--min-examples", type=int, default=1, help="examples a client must hold to take part")
    srv.add_argument("--rounds", type=int, default=20)
    srv.add_argument("--algorithm", default="fedpc", choices=["fedpc", "pvi", "ama", "admm"])
    srv.add_argument("--family", default="full")
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
    for p in (srv, cli):
        p.add_argument("--x64", action="store_true", help="compute in float64")
    return parser


def _serve(args):
    logic = ServerLogic(args.clients, args.algorithm, args.family, args.rho, args.damping, args.expectation,
                        args.fraction, x64=args.x64, min_clients=args.min_clients, min_examples=args.min_examples,
                        max_share=args.max_share, max_shift=args.max_shift)
    code = 0
    try:
        start_server(args.address, logic, args.rounds, args.round_timeout, args.connect_timeout, args.certificates)
    except BaseException as err:  # noqa: BLE001 - any error ends the run with a partial result
        logic.failure = logic.failure or f"{type(err).__name__}: {err}"
    if logic.failure is not None:
        code = 1
    if args.out:
        logic.save(args.out)
    last = logic.history[-1] if logic.history else {}
    print(json.dumps({"rounds": len(logic.history), "last": last, "failure": logic.failure}, default=str),
          flush=True)
    return code


def main(argv=None):
    """Command-line entry point: ``server`` or ``client`` (see the module docstring).

    The server exits with status ``0`` after its rounds, ``1`` after any error (too few
    valid clients, a client that never connected, …), writing ``--out`` in both cases.
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
                                        args.dp_clip_precision)
        logic = ClientLogic(_load_model(args.model), _load_args(args.data), json.loads(args.kwargs), privacy)
        start_client(args.server, logic, args.root_certificates, args.max_wait)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # gRPC threads left by an aborted Flower run must not keep the process alive
