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
run (up to the order of a sum). ``--min-clients`` holds from round 1: a client that never connects within
``--connect-timeout``, or whose first message fails (bad data, too few examples; it reports its error), is
named in ``not_started`` and the run goes on when at least ``--min-clients`` started. For a product family round 1 registers the clients (first
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
(TLS); a TLS or authentication failure is a :class:`~numpyro_pc.errors.TransportSecurityError` whose message
names the fix (:mod:`numpyro_pc.federated.transport`). A client adds ``--dp-epsilon ε --dp-releases T`` (``T`` = the server's ``--rounds``
plus one) to send differentially private sites
(:class:`~numpyro_pc.federated.privacy.GaussianMechanism`, its own setting, not the
server's). The server exits with status 1 and still writes ``--out`` (last good posterior,
history, ``failure``) when a run cannot go on, and with status 3 when it ran its rounds but refused or
bounded some client's message (``incidents`` in ``--out`` and ``suspect_clients`` in the summary name
them; see :func:`main`). This module needs the optional extra
``numpyro-pc[federated]`` (``flwr``); it imports Flower only when a server or client is
started. The ``ServerApp``/``ClientApp`` (``server_app``, ``client_app``) and Flower's simulation engine are in
:mod:`numpyro_pc.federated.flower_apps`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any

import jax

from ..errors import InvalidOptionError, PosteriorCorrectionError, TransportError
from .ef_transport import EFClientLogic, EFServerLogic
from .logic import ClientByFamily, ClientLogic, server_logic
from .privacy import GaussianMechanism
from .records import round_dicts
from .flower_strategy import _load_args, _load_model, _require_flwr, make_client, make_strategy
from .server import ServerLogic, describe_incidents
from .transport import read_certificate, transport_error

if TYPE_CHECKING:
    pass

__all__ = ["ServerLogic", "ClientLogic", "EFServerLogic", "EFClientLogic", "ClientByFamily", "server_logic",
           "make_strategy", "make_client", "start_server", "start_client", "main",
           "server_app", "client_app"]  # noqa: F822 - the two apps are built on first access (module __getattr__)


def __getattr__(name) -> Any:
    """``server_app`` and ``client_app`` (Flower apps for ``flwr run``, a SuperLink–SuperNode deployment or
    :func:`~numpyro_pc.federated.flower_apps.simulate`), built on first access by
    :mod:`numpyro_pc.federated.flower_apps`."""
    if name in ("server_app", "client_app", "_server_fn", "_client_fn"):
        from . import flower_apps

        return getattr(flower_apps, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    :raises TransportSecurityError: a certificate or key file that cannot be read or holds no PEM block.
    :raises: whatever stopped the run; ``logic.failure`` then holds the reason and
        ``logic.state`` the last good posterior.
    """
    _require_flwr()
    import flwr

    if certificates is not None:
        certificates = tuple(c if isinstance(c, bytes) else read_certificate(c, f"--certificates ({what})")
                             for c, what in zip(certificates, ("CA", "CERT", "KEY")))
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
    :raises TransportSecurityError: TLS or authentication failed (no CA, another CA, a certificate that does not
        name the server's address, an unreadable CA file); the message names the fix.
    :raises TransportError: no server answered within ``max_wait_time``, or the connection was lost.
    :raises PosteriorCorrectionError: the client could not start (its data, its settings): the error it
        reported to the server in its first reply, raised again once the run is over.
    """
    _require_flwr()
    import flwr

    if root_certificates is not None and not isinstance(root_certificates, bytes):
        root_certificates = read_certificate(root_certificates, "--root-certificates")
    client = make_client(logic)
    try:
        flwr.client.start_client(server_address=address, client=client.to_client(),
                                 root_certificates=root_certificates, insecure=root_certificates is None,
                                 max_wait_time=float(max_wait_time))
    except Exception as err:
        if type(err).__module__.split(".")[0] != "grpc":
            raise
        raise transport_error(err, address, tls=root_certificates is not None) from err
    if client.start_error is not None:
        raise client.start_error


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
                      "suspect_clients": incidents, "not_started": logic.not_started}, default=str), flush=True)
    return code


def main(argv=None) -> int:
    """Command-line entry point: ``server`` or ``client`` (see the module docstring).

    The server exits with status ``0`` after its rounds when every message was accepted and no site bounded,
    ``1`` after any error (too few valid clients, a client that never connected, …) and ``3`` after its rounds
    when it refused a client's message (the checks, a replay) or bounded a site (``--max-share``,
    ``--max-shift``): the result is then the server's last good one, but not the plain aggregate of every
    client's own site. It writes ``--out`` in every case (``incidents``: per client, the round, ``rejected``
    or ``clipped`` and why) and prints one JSON line: ``status`` (``"ok"``, ``"failed"``, ``"suspect"``),
    ``rounds``, ``last`` (the last round's record), ``failure``, ``suspect_clients`` (the incidents) and
    ``not_started`` (``{client: reason}``: the clients that never connected or failed their first message; with
    ``--min-clients`` below ``--clients`` the run goes on without them, and ``--out`` names them too);
    a status 3 run also prints the incidents, one line per client, on standard error. A client that
    merely drops out or does not start is not an incident (``dropped`` in the history, ``not_started``).

    A client exits with ``0`` after the run, ``1`` when it could not start (its error, also reported to the
    server) and ``2`` on a transport failure (:class:`~numpyro_pc.errors.TransportError`,
    :class:`~numpyro_pc.errors.TransportSecurityError`: no server, lost connection, TLS), printing one line
    that names the fix instead of a gRPC traceback.
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
        try:
            start_client(args.server, logic, args.root_certificates, args.max_wait)
        except PosteriorCorrectionError as err:  # one line with the fix, not a gRPC traceback
            print(f"numpyro_pc client: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            return 2 if isinstance(err, TransportError) else 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # gRPC threads left by an aborted Flower run must not keep the process alive
