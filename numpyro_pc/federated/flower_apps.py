r"""The package's Flower apps: one ``ServerApp`` and one ``ClientApp`` for every way Flower runs them.

``numpyro_pc.federated.flower:server_app`` and ``numpyro_pc.federated.flower:client_app`` (built here on first
access) run the algorithm of :mod:`numpyro_pc.federated.flower` (the same strategy and client as the
``python -m numpyro_pc.federated.flower`` processes) under

* Flower's **simulation engine** (:func:`simulate`, ``flwr.simulation.run_simulation``, or ``flwr run`` on a
  local simulation federation): every client is a virtual node; its shard is partition ``partition-id`` of
  ``num-partitions`` (:func:`partition_rows`) of the run config's ``data`` file. Needs Flower's simulation
  extra (``ray``), which ``numpyro-pc[federated]`` installs;
* a **deployment** (``flower-superlink``, one ``flower-supernode`` per client, ``flwr run``): a SuperNode's
  ``--node-config data="shard.npz"`` names its own shard.

The run config (``[tool.flwr.app.config]`` of the app's ``pyproject.toml``, see ``examples/flower_app/``):

* server: ``num-clients`` (required), ``rounds`` (20), ``algorithm`` (``fedpc``), ``family`` (``full``), ``rho``,
  ``damping``, ``expectation``, ``fraction``, ``min-clients``, ``min-examples``, ``max-share``, ``max-shift``,
  ``private``, ``init``, ``x64`` (true), ``out`` (a ``.npz`` written after every round), ``connect-timeout``
  and ``round-timeout`` (seconds);
* clients: ``model`` (``module:function``), ``model-kwargs`` (JSON), ``data`` (the whole data set, partitioned
  by ``partition-id``/``num-partitions`` in simulation: a ``.npz`` with arrays ``arg0, arg1, …`` or a
  ``module:function`` returning the model's arguments) and
  ``partition-seed`` (0: the rows are shuffled with it before the split; ``-1``: contiguous blocks).

A node's own config may set its ``data`` (deployment) and its differential privacy (``dp-epsilon``,
``dp-delta``, ``dp-releases``, ``dp-clip-linear``, ``dp-clip-precision``, ``dp-clip-natural``).
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from ..errors import DataShapeError, InvalidOptionError
from .flower_strategy import _load_args, _load_model, _require_flwr, make_client, make_strategy
from .logic import ClientByFamily, server_logic
from .privacy import GaussianMechanism

if TYPE_CHECKING:
    from flwr.client import Client
    from flwr.server import ServerAppComponents

__all__ = ["partition_rows", "partition", "simulate", "server_app", "client_app"]  # noqa: F822 - module __getattr__


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


def partition_rows(num_rows, num_partitions, seed=0) -> list[np.ndarray]:
    """The rows of each of ``num_partitions`` shards of ``num_rows`` examples: a permutation by
    ``numpy.random.default_rng(seed)`` (``seed = -1``: none) cut into blocks whose sizes differ by at most one
    (``numpy.array_split``). The in-process run that a simulation is compared with takes the same rows.

    :raises InvalidOptionError: ``num_partitions`` outside ``[1, num_rows]``.
    """
    num_rows, num_partitions = int(num_rows), int(num_partitions)
    if not 1 <= num_partitions <= num_rows:
        raise InvalidOptionError(f"num-partitions must lie in [1, {num_rows}] (the data's rows), got {num_partitions}")
    order = np.arange(num_rows) if int(seed) == -1 else np.random.default_rng(int(seed)).permutation(num_rows)
    return np.array_split(order, num_partitions)


def partition(args, partition_id, num_partitions, seed=0) -> tuple:
    """Shard ``partition_id`` of the model arguments ``args`` (:func:`partition_rows` of their leading axis).

    :raises DataShapeError: arguments with different numbers of rows.
    :raises InvalidOptionError: ``partition_id`` outside ``[0, num_partitions)``.
    """
    sizes = {int(np.shape(a)[0]) for a in args}
    if len(sizes) != 1:
        raise DataShapeError(f"the data's arrays have {sorted(sizes)} rows; a partition needs one number of rows")
    if not 0 <= int(partition_id) < int(num_partitions):
        raise InvalidOptionError(f"partition-id must lie in [0, {num_partitions}), got {partition_id}")
    rows = partition_rows(sizes.pop(), num_partitions, seed)[int(partition_id)]
    return tuple(np.asarray(a)[rows] for a in args)


@functools.lru_cache(maxsize=4)
def _whole_data(source) -> tuple:
    """The run config's ``data``, read once per process (a simulation's workers serve many clients): a ``.npz``
    path (arrays ``arg0, arg1, …``) or ``module:function`` returning the tuple of model arguments."""
    if not source.endswith(".npz") and ":" in source:
        return tuple(np.asarray(a) for a in _load_model(source)())
    return tuple(np.asarray(a) for a in _load_args(source))


#: a process's clients by (run, node): a ClientApp is rebuilt for every message, the bound model need not be
_CLIENTS: dict = {}


def _client_logic(context) -> ClientByFamily:
    run, node = dict(context.run_config), dict(context.node_config)
    key = (getattr(context, "run_id", None), getattr(context, "node_id", None))
    if key[1] is not None and key in _CLIENTS:
        return _CLIENTS[key]
    if "data" in node:  # a deployment: the SuperNode's own shard
        args = _load_args(str(node["data"]))
    elif "data" in run and "partition-id" in node:  # simulation: a partition of the whole data set
        args = partition(_whole_data(str(run["data"])), int(node["partition-id"]), int(node["num-partitions"]),
                         int(run.get("partition-seed", 0)))
    else:
        raise InvalidOptionError("a client needs its data: a node config 'data' (a .npz shard) or, in simulation, "
                                 "the run config's 'data' (the whole data set, split by partition-id)")
    logic = ClientByFamily(_load_model(str(run["model"])), args, json.loads(str(run.get("model-kwargs", "{}"))),
                           privacy=_privacy(node))
    if key[1] is not None:
        if len(_CLIENTS) > 4096:
            _CLIENTS.clear()
        _CLIENTS[key] = logic
    return logic


def _client_fn(context) -> Client:
    """A client from the run config's ``model`` and its data: the node config's ``data`` (``.npz`` path) or, in
    simulation, partition ``partition-id`` of the run config's ``data``.

    The node config (the SuperNode's own, not the server's) may also set the client's
    differential privacy: ``dp-epsilon``, ``dp-delta``, ``dp-releases``, ``dp-clip-linear``,
    ``dp-clip-precision`` (see :mod:`numpyro_pc.federated.privacy`).
    """
    x64 = bool(context.run_config.get("x64", True))
    with jax.enable_x64(x64):
        logic = _client_logic(context)
    return make_client(logic, x64=x64, state=context.state).to_client()


def simulate(run_config, num_clients, backend_config=None, verbose=False) -> None:
    """Run the package's ``ServerApp`` and ``ClientApp`` on Flower's simulation engine
    (``flwr.simulation.run_simulation``), one virtual node per client.

    :param dict run_config: the run config (module docstring): ``model``, ``data`` (the whole data set),
        ``rounds``, ``out``, … ``num-clients`` defaults to ``num_clients``.
    :param int num_clients: virtual nodes (``num-partitions``; each takes partition ``partition-id``).
    :param dict backend_config: Flower's backend config (default: one CPU per virtual client,
        ``{"client_resources": {"num_cpus": 1}}``; the engine runs as many at once as there are CPUs).
    :raises ImportError: Flower's simulation engine (``ray``) is not installed.
    """
    _require_flwr()
    try:
        import ray  # noqa: F401
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("Flower's simulation engine needs ray: pip install 'numpyro-pc[federated]' "
                          "(or 'flwr[simulation]')") from err
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    config = dict({"num-clients": int(num_clients)}, **run_config)
    backend = {"client_resources": {"num_cpus": 1}} if backend_config is None else dict(backend_config)
    backend["init_args"] = dict({"include_dashboard": False, "log_to_driver": verbose}, **backend.get("init_args", {}))
    # run_simulation takes no run config: the apps get it bound (picklable, for the engine's workers)
    run_simulation(ServerApp(server_fn=functools.partial(_with_config, _server_fn, config)),
                   ClientApp(client_fn=functools.partial(_with_config, _client_fn, config)),
                   num_supernodes=int(num_clients), backend_config=backend, verbose_logging=verbose)


def _with_config(fn, config, context) -> Any:
    """``fn`` on a copy of ``context`` whose run config is ``config`` under the context's own (the same ``state``:
    what the client keeps there persists)."""
    from flwr.app import Context

    return fn(Context(context.run_id, context.node_id, context.node_config, context.state,
                      dict(config, **dict(context.run_config))))


def __getattr__(name) -> Any:
    """``server_app`` and ``client_app``: Flower apps for ``flwr run`` / SuperLink–SuperNode / simulation."""
    if name == "server_app":
        _require_flwr()
        from flwr.serverapp import ServerApp

        return ServerApp(server_fn=_server_fn)
    if name == "client_app":
        _require_flwr()
        from flwr.clientapp import ClientApp

        return ClientApp(client_fn=_client_fn)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

