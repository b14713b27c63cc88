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

Command line (one server, one process per client)::

    python -m numpyro_pc.federated.flower server --address 0.0.0.0:8080 --clients 3 \
        --rounds 20 --algorithm fedpc --rho 0.2 --family full --out result.npz
    python -m numpyro_pc.federated.flower client --server 10.0.0.1:8080 \
        --model mypackage.models:logistic --data shard_k.npz --client-id k

``--data`` is an ``.npz`` file whose arrays ``arg0, arg1, …`` are the model's positional
arguments; ``--model`` is ``module:function``. Add ``--x64`` on every process for float64.
This module needs the optional extra ``numpyro-pc[federated]`` (``flwr``); it imports
Flower only when a server or client is started.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from ..families import Gaussian, GaussianNatural, IsotropicGaussian, get_family
from ..merging import gaussian_prior, prior_natural
from .algorithms import _settings
from .core import LocalConfig, bind_clients, client_site, global_state, local_update, natural_nbytes

__all__ = ["ServerLogic", "ClientLogic", "make_strategy", "make_client", "start_server", "start_client", "main"]


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
    """

    def __init__(self, model, args, kwargs=None):
        self.spec, self.stack, (self.data,) = bind_clients(model, [args], kwargs)
        self.site = None
        self._fns = {}

    def _cfg(self, config):
        family, _, _, rule = _settings(config["algorithm"], config["family"], None if config["algorithm"] == "pvi"
                                       else config["rho"], config["damping"],
                                       None if config["expectation"] == "auto" else config["expectation"], self.spec)
        return LocalConfig(self.spec, family, rule, int(config["num_nodes"]), int(config["local_iters"]),
                           float(config["local_tol"]))

    def _ex(self):
        return tuple(x[0] for x in self.stack.per_example), self.stack.mask[0], self.stack.shared

    def initial(self, config):
        """Round 1: the prior ``(m_0, P_0)`` and this client's first site."""
        cfg = self._cfg(config)
        prior = gaussian_prior(self.spec, self.data)
        tau = jnp.mean(jnp.diag(prior.precision)) if isinstance(cfg.family, IsotropicGaussian) else None
        q0 = global_state(cfg.family, prior, prior_natural(cfg.family, prior, tau),
                          jax.tree.map(jnp.zeros_like, prior_natural(cfg.family, prior, tau)))
        ex, mask, shared = self._ex()
        if isinstance(cfg.family, IsotropicGaussian):  # init="auto" of the in-process run: sites start at one
            self.site = GaussianNatural(jnp.zeros_like(q0.mean), jnp.zeros((), q0.mean.dtype))
        else:
            self.site = jax.jit(client_site, static_argnums=0)(cfg, q0, ex, mask, shared)
        return _arrays(self.site) + [np.asarray(prior.mean), np.asarray(prior.precision)]

    def update(self, arrays, config):
        """One local update from the global Gaussian ``arrays = [mean, precision]``."""
        cfg = self._cfg(config)
        q_jnt = Gaussian(jnp.asarray(arrays[0]), jnp.asarray(arrays[1]))
        if cfg not in self._fns:
            self._fns[cfg] = jax.jit(local_update, static_argnums=0)
        ex, mask, shared = self._ex()
        out = self._fns[cfg](cfg, q_jnt, self.site, jnp.asarray(config["rho"], q_jnt.mean.dtype), ex, mask, shared)
        damping = float(config["damping"])
        self.site = jax.tree.map(lambda o, n: o + damping * (n - o), self.site, out.site)
        return _arrays(self.site) + _arrays(out.local), {"iterations": int(out.iterations), "ok": bool(out.ok)}


class ServerLogic:
    """The server's aggregation, without any transport.

    Keeps the latest site of every client (clients that skip a round keep theirs) and forms
    ``λ_jnt = λ_0 + Σ_k η_k`` (or the ADMM mix of paper eq. ``admm``).
    """

    def __init__(self, num_clients, algorithm="fedpc", family="full", rho=None, damping=None, expectation="auto",
                 fraction=1.0, num_nodes=64, local_iters=50, local_tol=None, x64=False):
        self.num_clients = int(num_clients)
        self.algorithm = algorithm
        self.family_name = "isotropic" if algorithm == "ama" else family
        self.family = get_family(self.family_name)
        self.rho = 1.0 if (rho is None or algorithm == "pvi") else float(rho)
        self.damping = 1.0 if damping is None else float(damping)
        self.fraction = float(fraction)
        self.x64 = bool(x64)
        self.config = dict(algorithm=algorithm, family=self.family_name, rho=self.rho, damping=self.damping,
                           expectation=expectation, num_nodes=int(num_nodes), local_iters=int(local_iters),
                           local_tol=float((1e-12 if x64 else 1e-6) if local_tol is None else local_tol))
        self.sites, self.prior, self.prior_nat, self.state = {}, None, None, None
        self.history, self.total_bytes = [], 0

    def _global(self):
        eta_sum = jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *[self.sites[k] for k in sorted(self.sites)])
        return global_state(self.family, self.prior, self.prior_nat, eta_sum)

    def aggregate_initial(self, replies):
        """Round 1: check the clients' priors agree, store their sites, form ``q_jnt``."""
        with jax.enable_x64(self.x64):
            for cid, arrays in sorted(replies.items()):
                prior = Gaussian(jnp.asarray(arrays[2]), jnp.asarray(arrays[3]))
                if self.prior is None:
                    self.prior = prior
                elif not (np.allclose(prior.mean, self.prior.mean) and np.allclose(prior.precision,
                                                                                   self.prior.precision)):
                    raise ValueError(f"client {cid} reports another prior than client {min(replies)}; "
                                     "every client must run the same model")
                self.sites[cid] = _nat(arrays[:2])
            tau = jnp.mean(jnp.diag(self.prior.precision)) if isinstance(self.family, IsotropicGaussian) else None
            self.prior_nat = prior_natural(self.family, self.prior, tau)
            self.state = self._global()
        return self.state

    def aggregate(self, replies, iterations=()):
        """One round: new sites (and local posteriors) from the participating clients."""
        with jax.enable_x64(self.x64):
            old = self.state
            lam_old = self.family.natural(old)
            locals_ = []
            for cid, arrays in sorted(replies.items()):
                self.sites[cid] = _nat(arrays[:2])
                locals_.append(_nat(arrays[2:4]))
            new = self._global()
            if self.algorithm == "admm":
                alpha = 1.0 / (1.0 + self.rho * len(replies))
                lam_loc = jax.tree.map(lambda *xs: sum(xs) / len(xs), *locals_)
                new = self.family.from_natural(jax.tree.map(lambda a, b: alpha * a + (1.0 - alpha) * b,
                                                            self.family.natural(new), lam_loc))
            flat = lambda lam: jnp.concatenate([jnp.ravel(lam.linear), jnp.ravel(lam.precision)])  # noqa: E731
            residual = max(float(jnp.linalg.norm(flat(l) - flat(lam_old))) for l in locals_) / float(
                jnp.linalg.norm(flat(lam_old)))
            message = natural_nbytes(self.family, old.mean.shape[0], old.mean.dtype)
            up = message * (2 if self.algorithm == "admm" else 1)
            self.total_bytes += len(replies) * (up + message)
            self.history.append(dict(round=len(self.history) + 1, kl_to_previous=float(self.family.kl(new, old)),
                                     residual=residual, participants=len(replies),
                                     local_iterations=max(iterations) if iterations else 0,
                                     bytes_up=len(replies) * up, bytes_down=len(replies) * message,
                                     bytes=self.total_bytes))
            self.state = new
        return new

    def save(self, path):
        """Write the global Gaussian and the history to an ``.npz`` file."""
        np.savez(path, mean=np.asarray(self.state.mean), precision=np.asarray(self.state.precision),
                 history=json.dumps(self.history), config=json.dumps(self.config))


def make_strategy(logic):
    """A Flower :class:`~flwr.server.strategy.Strategy` driving a :class:`ServerLogic`."""
    _require_flwr()
    from flwr.common import FitIns, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.strategy import Strategy

    class PosteriorCorrectionStrategy(Strategy):
        """Aggregates site natural parameters; round 1 initialises, later rounds update."""

        def initialize_parameters(self, client_manager):
            return ndarrays_to_parameters([])

        def configure_fit(self, server_round, parameters, client_manager):
            phase = "init" if server_round == 1 else "update"
            wanted = logic.num_clients if phase == "init" else max(1, round(logic.fraction * logic.num_clients))
            clients = client_manager.sample(num_clients=wanted, min_num_clients=logic.num_clients)
            arrays = [] if phase == "init" else [np.asarray(logic.state.mean), np.asarray(logic.state.precision)]
            ins = FitIns(ndarrays_to_parameters(arrays), dict(logic.config, phase=phase))
            return [(c, ins) for c in clients]

        def aggregate_fit(self, server_round, results, failures):
            if failures:
                raise RuntimeError(f"{len(failures)} client(s) failed in round {server_round}: {failures[:1]}")
            replies = {int(r.metrics["client_id"]): parameters_to_ndarrays(r.parameters) for _, r in results}
            if server_round == 1:
                q = logic.aggregate_initial(replies)
            else:
                bad = [int(r.metrics["client_id"]) for _, r in results if not r.metrics.get("ok", True)]
                if bad:
                    raise RuntimeError(f"the local update of client(s) {bad} lost positive definiteness in round "
                                       f"{server_round - 1}; use a larger rho")
                q = logic.aggregate(replies, [int(r.metrics["iterations"]) for _, r in results])
            return ndarrays_to_parameters([np.asarray(q.mean), np.asarray(q.precision)]), {}

        def configure_evaluate(self, server_round, parameters, client_manager):
            return []

        def aggregate_evaluate(self, server_round, results, failures):
            return None, {}

        def evaluate(self, server_round, parameters):
            return None

    return PosteriorCorrectionStrategy()


def make_client(logic, client_id):
    """A Flower ``NumPyClient`` around a :class:`ClientLogic`."""
    _require_flwr()
    from flwr.client import NumPyClient

    class PosteriorCorrectionClient(NumPyClient):
        def get_parameters(self, config):
            return []

        def fit(self, parameters, config):
            if config["phase"] == "init":
                arrays, metrics = logic.initial(config), {}
            else:
                arrays, metrics = logic.update(parameters, config)
            return arrays, int(logic.stack.mask.sum()), dict(metrics, client_id=int(client_id))

    return PosteriorCorrectionClient()


def start_server(address, logic, rounds):
    """Run the Flower server for ``rounds`` algorithm rounds (plus the initial round)."""
    _require_flwr()
    import flwr

    flwr.server.start_server(server_address=address, strategy=make_strategy(logic),
                             config=flwr.server.ServerConfig(num_rounds=int(rounds) + 1))
    return logic


def start_client(address, logic, client_id):
    """Connect a client to the server and serve until the run ends."""
    _require_flwr()
    import flwr

    flwr.client.start_client(server_address=address, client=make_client(logic, client_id).to_client(),
                             insecure=True)


def _load_model(path):
    module, _, name = path.partition(":")
    if not name:
        raise ValueError(f"--model must look like 'module:function', got {path!r}")
    return getattr(importlib.import_module(module), name)


def _load_args(path):
    with np.load(path) as npz:
        keys = sorted((k for k in npz.files if k.startswith("arg")), key=lambda k: int(k[3:]))
        if not keys:
            raise ValueError(f"{path} holds no arrays named arg0, arg1, …")
        return tuple(jnp.asarray(npz[k]) for k in keys)


def main(argv=None):
    """Command-line entry point: ``server`` or ``client`` (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m numpyro_pc.federated.flower")
    sub = parser.add_subparsers(dest="role", required=True)
    srv = sub.add_parser("server", help="aggregate the clients' sites")
    srv.add_argument("--address", default="0.0.0.0:8080")
    srv.add_argument("--clients", type=int, required=True)
    srv.add_argument("--rounds", type=int, default=20)
    srv.add_argument("--algorithm", default="fedpc", choices=["fedpc", "pvi", "ama", "admm"])
    srv.add_argument("--family", default="full")
    srv.add_argument("--rho", type=float, default=None)
    srv.add_argument("--damping", type=float, default=None)
    srv.add_argument("--expectation", default="auto")
    srv.add_argument("--fraction", type=float, default=1.0)
    srv.add_argument("--out", default=None, help="write the result (.npz)")
    cli = sub.add_parser("client", help="hold a shard and run local updates")
    cli.add_argument("--server", default="127.0.0.1:8080")
    cli.add_argument("--model", required=True, help="module:function of the NumPyro model")
    cli.add_argument("--data", required=True, help=".npz with arrays arg0, arg1, …")
    cli.add_argument("--kwargs", default="{}", help="JSON keyword arguments of the model")
    cli.add_argument("--client-id", type=int, required=True)
    for p in (srv, cli):
        p.add_argument("--x64", action="store_true", help="compute in float64")
    args = parser.parse_args(argv)
    with jax.enable_x64(args.x64):
        if args.role == "server":
            logic = ServerLogic(args.clients, args.algorithm, args.family, args.rho, args.damping, args.expectation,
                                args.fraction, x64=args.x64)
            start_server(args.address, logic, args.rounds)
            if args.out:
                logic.save(args.out)
            last = logic.history[-1] if logic.history else {}
            print(json.dumps({"rounds": len(logic.history), "last": last}))
        else:
            logic = ClientLogic(_load_model(args.model), _load_args(args.data), json.loads(args.kwargs))
            start_client(args.server, logic, args.client_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
