"""The Flower transport: a server and three client processes on 127.0.0.1 reproduce the in-process run."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import scipy.linalg
import pytest

import numpyro_pc as pc
from numpyro_pc import federated
from numpyro_pc.federated import ef, ef_transport
from numpyro_pc.federated.flower import ClientLogic, ServerLogic
from numpyro_pc.federated.options import Robustness, Safeguard, StopRule

from models import logistic_model
from models import gamma_poisson, misclassified
from flower_processes import _certificates, _free_port, _launch, _summary, shards  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 4


@pytest.mark.filterwarnings("ignore:federated:RuntimeWarning")
def test_server_and_client_logic_equal_the_in_process_run(x64):
    # the transport-free halves of the Flower code, driven by hand (needs no flwr)
    parts = shards()
    server = ServerLogic(len(parts), "fedpc", "full", rho=0.5, x64=True)
    clients = [ClientLogic(logistic_model, p) for p in parts]
    server.aggregate_initial({k: c.initial(server.config) for k, c in enumerate(clients)})
    for _ in range(ROUNDS):
        arrays = [np.asarray(server.state.mean), np.asarray(server.state.precision)]
        replies = {k: c.update(arrays, server.config)[0] for k, c in enumerate(clients)}
        server.aggregate(replies)
    ref = federated.run(logistic_model, parts, rho=0.5, rounds=ROUNDS, stop=StopRule(tol=0.0, residual_tol=0.0), keep_data=False,
                        safeguard=Safeguard(line_search=False))  # the Flower server takes the plain global step
    np.testing.assert_allclose(np.asarray(server.state.mean), np.asarray(ref.state.mean), rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(np.asarray(server.state.precision), np.asarray(ref.state.precision), rtol=1e-9)
    np.testing.assert_allclose([h["kl_to_previous"] for h in server.history], ref.column("kl_to_previous"),
                               rtol=1e-6, atol=1e-14)
    assert [h["bytes"] for h in server.history] == [h["bytes"] for h in ref.history]


def _registered_copy(message):
    """A valid first message that is not a replay: the site at half weight, the same prior."""
    return [0.5 * message[0], 0.5 * message[1], *[a.copy() for a in message[2:]]]


@pytest.fixture
def with_rogue(x64):
    """A factory ``(algorithm="fedpc", **ServerLogic options) → (server, honest clients)``: a float64 server with
    4 slots (3 valid replies needed), the three honest clients ``node0..2`` and a ``rogue`` registered; the
    rogue's first message is valid (client 0's site at half weight), what it sends later is the test's."""
    def make(algorithm="fedpc", **kw):
        server = ServerLogic(4, algorithm, "full", rho=0.5, x64=True, min_clients=3, **kw)
        clients = [ClientLogic(logistic_model, p) for p in shards()]
        init = {f"node{k}": c.initial(server.config) for k, c in enumerate(clients)}
        server.aggregate_initial(dict(init, rogue=_registered_copy(init["node0"])))
        return server, clients

    return make


def _round(server, clients, extra=None):
    arrays = [np.asarray(server.state.mean), np.asarray(server.state.precision)]
    replies = {f"node{k}": c.update(arrays, server.config)[0] for k, c in enumerate(clients)}
    replies.update(extra or {})
    return server.aggregate(replies)


@pytest.mark.filterwarnings("ignore:federated:RuntimeWarning")
def test_server_rejects_bad_messages_and_goes_on_with_the_others(with_rogue, tmp_path):
    server, clients = with_rogue()  # the rogue registers with a valid first message, then misbehaves
    assert sorted(server.sites) == ["node0", "node1", "node2", "rogue"]
    d = server.dim
    stored = server.sites["rogue"]
    good = _round(server, clients)
    site = [np.asarray(stored.linear), np.asarray(stored.precision)] * 2
    nan = [a.copy() for a in site]
    nan[0][0] = np.nan
    indefinite = [a.copy() for a in site]
    indefinite[1] = -np.eye(d)
    indefinite[3] = -np.eye(d)
    cases = {"NaN": nan, "not positive semi-definite": indefinite,
             "shape": [np.zeros(d + 1), np.eye(d + 1)] * 2,
             "dtype int64": [a.astype(np.int64) for a in site],
             "dtype float16": [a.astype(np.float16) for a in site],
             "expected 4 arrays": site[:3]}
    for reason, message in cases.items():
        q = _round(server, clients, {"rogue": message})
        assert np.all(np.isfinite(np.asarray(q.mean)))
        assert pc.FullGaussian().is_positive_definite(q.precision)
        rejected = server.history[-1]["rejected"]
        assert list(rejected) == ["rogue"] and reason in rejected["rogue"], (reason, rejected)
        assert server.history[-1]["participants"] == 3
        # nothing of the bad message is stored: the rogue keeps its last good site
        np.testing.assert_array_equal(np.asarray(server.sites["rogue"].linear), np.asarray(stored.linear))
    # an id the transport never admitted cannot add a site or overwrite another's
    _round(server, clients, {"stranger": site})
    assert "not admitted" in server.history[-1]["rejected"]["stranger"]
    assert sorted(server.sites) == ["node0", "node1", "node2", "rogue"]
    assert np.isfinite(good.mean).all()
    # with fewer valid replies than min_clients the round fails with a typed error; the state stays
    last = server.state
    with pytest.raises(pc.TooFewClientsError, match="min_clients=3"):
        server.aggregate({"node0": site, "rogue": nan})
    assert server.state is last and "rogue" in server.failure
    server.save(tmp_path / "partial.npz")
    with np.load(tmp_path / "partial.npz") as res:
        np.testing.assert_array_equal(res["mean"], np.asarray(last.mean))
        assert "min_clients" in json.loads(str(res["failure"]))
        assert len(json.loads(str(res["history"]))) == len(server.history)


@pytest.mark.filterwarnings("ignore:federated:RuntimeWarning")
def test_replayed_and_duplicated_messages_are_refused(x64):
    # the replay: a client sending another client's message under a new id was admitted and counted twice
    parts = shards()
    server = ServerLogic(4, "fedpc", "full", rho=0.5, x64=True, min_clients=1)
    clients = [ClientLogic(logistic_model, p) for p in parts]
    init = {f"node{k}": c.initial(server.config) for k, c in enumerate(clients)}
    server.aggregate_initial(dict(init, copycat=[a.copy() for a in init["node1"]]))
    assert sorted(server.sites) == ["node0", "node2"]
    for cid in ("node1", "copycat"):
        assert "replayed or duplicated" in server.rejected_initial[cid]
    # the same message under two ids later on: both refused; another client's last accepted site: refused
    arrays = [np.asarray(server.state.mean), np.asarray(server.state.precision)]
    replies = {f"node{k}": clients[k].update(arrays, server.config)[0] for k in (0, 2)}
    last_of_node2 = [np.asarray(server.sites["node2"].linear), np.asarray(server.sites["node2"].precision)]
    server.aggregate(dict(replies, node0=last_of_node2 + replies["node0"][2:]))
    assert "node2's last accepted site" in server.history[-1]["rejected"]["node0"]
    assert server.history[-1]["participants"] == 1
    arrays = [np.asarray(server.state.mean), np.asarray(server.state.precision)]
    message = clients[2].update(arrays, server.config)[0]
    with pytest.raises(pc.TooFewClientsError, match="replayed or duplicated"):  # no valid reply is left
        server.aggregate({"node0": [a.copy() for a in message], "node2": message})
    # a client re-sending its own last site (a converged client does) is not a replay
    own = [np.asarray(server.sites["node2"].linear), np.asarray(server.sites["node2"].precision)]
    server.aggregate({"node0": clients[0].update(arrays, server.config)[0], "node2": own + message[2:]})
    assert not server.history[-1]["rejected"]
    # sites of zeros count nothing twice: the isotropic family's first sites (AMA) are all zero and all admitted
    ama = ServerLogic(3, "ama", x64=True)
    ama.aggregate_initial({k: c.initial(ama.config) for k, c in enumerate(clients)})
    assert sorted(ama.sites) == [0, 1, 2] and not ama.rejected_initial


@pytest.mark.filterwarnings("ignore:federated:RuntimeWarning")
def test_admm_server_checks_the_local_posteriors_it_averages(with_rogue):
    # ADMM's server step averages the clients' local natural parameters: an indefinite local
    # precision (with a valid site) would make the global precision indefinite and stop the run
    parts = shards()
    server, clients = with_rogue("admm")
    arrays = [np.asarray(server.state.mean), np.asarray(server.state.precision)]
    message = clients[0].update(arrays, server.config)[0]
    clients[0].site = server.sites["node0"]  # undo: the honest round below updates it again
    message[3] = -1e6 * np.eye(server.dim)
    q = _round(server, clients, {"rogue": message})
    assert "local precision is not positive semi-definite" in server.history[-1]["rejected"]["rogue"]
    assert server.history[-1]["participants"] == 3 and pc.FullGaussian().is_positive_definite(q.precision)
    # the bound on one client's share covers the sites, not ADMM's average of local posteriors: refused
    with pytest.raises(pc.errors.InvalidOptionError, match="ADMM"):
        ServerLogic(4, "admm", "full", max_share=1.0)
    with pytest.raises(pc.errors.InvalidOptionError, match="ADMM"):
        federated.run(logistic_model, parts, algorithm="admm", robust=Robustness(max_shift=3.0))
    with pytest.raises(pc.errors.InvalidOptionError, match="unknown algorithm"):
        ServerLogic(4, "fedavg")


def test_clients_below_min_examples_do_not_take_part(x64):
    # a one-example client's round-1 site reveals its (x, y): such clients are refused on both sides
    X, y = shards()[0]
    server = ServerLogic(2, "fedpc", "full", x64=True, min_clients=1, min_examples=5)
    tiny = ClientLogic(logistic_model, (X[:1], y[:1]))
    with pytest.raises(pc.PrivacyError, match="min_examples=5"):
        tiny.initial(server.config)
    honest = ClientLogic(logistic_model, (X, y))
    message = honest.initial(server.config)
    server.aggregate_initial({"a": message, "b": [a.copy() for a in message]}, examples={"a": X.shape[0], "b": 1})
    assert sorted(server.sites) == ["a"] and "min_examples=5" in server.rejected_initial["b"]


def test_command_line_binds_and_connects_to_loopback_by_default():
    from numpyro_pc.federated import flower

    assert flower._parser().parse_args(["server", "--clients", "2"]).address == "127.0.0.1:8080"
    args = flower._parser().parse_args(["client", "--model", "m:f", "--data", "d.npz"])
    assert args.server == "127.0.0.1:8080" and args.root_certificates is None and args.dp_epsilon is None


def test_client_message_error_names_the_client():
    from numpyro_pc.federated.robust import validate_site

    with pytest.raises(pc.ClientMessageError, match="client 7") as err:
        validate_site(pc.FullGaussian(), [np.zeros(2), np.full((2, 2), np.inf)], 2, np.float64, 7)
    assert err.value.client == 7 and isinstance(err.value, pc.PosteriorCorrectionError)


@pytest.mark.filterwarnings("ignore:federated:RuntimeWarning")
def test_bounded_aggregation_limits_a_rogue_client(with_rogue):
    share, shift = 1.0, 2.0
    results = {}
    for bounded in (False, True):
        kw = dict(max_share=share, max_shift=shift) if bounded else {}
        server, clients = with_rogue(**kw)
        d = server.dim
        target = np.full(d, 50.0)
        huge = [1e9 * target, 1e9 * np.eye(d)] * 2  # precision 1e9·I pulling the mean to the target
        q = _round(server, clients, {"rogue": huge})
        # the posterior without the rogue's site (the honest sites as the server holds them)
        honest = {k: v for k, v in server.sites.items() if k != "rogue"}
        lam = jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), server.prior_nat, *honest.values())
        results[bounded] = (q, lam)
    q, _ = results[False]
    np.testing.assert_allclose(np.asarray(q.mean), 50.0, rtol=1e-6)  # unbounded: the rogue owns the mean
    q, lam = results[True]
    rest_mean = np.linalg.solve(np.asarray(lam.precision), np.asarray(lam.linear))
    diff = np.asarray(q.mean) - rest_mean
    assert np.sqrt(diff @ np.asarray(lam.precision) @ diff) <= shift * (1 + 1e-9)
    # P ⪯ (1 + γ) P_{-k}: the rogue sharpens the posterior by at most 1 + γ in any direction
    top = scipy.linalg.eigh(np.asarray(q.precision), np.asarray(lam.precision), eigvals_only=True).max()
    assert top <= 1 + share + 1e-9
    assert server.history[-1]["clipped"] == 1 and server.history[-1]["clipped_clients"] == ["rogue"]


@pytest.mark.filterwarnings("ignore:federated:RuntimeWarning")
def test_a_rogue_with_a_huge_linear_part_is_bounded_alone(with_rogue):
    # issue 28 item 2: a linear part of 1e11 with an honest precision used to clip every client and move the mean
    # to ~3e9; now only the rogue is clipped and the mean stays within c (1 + 2γ) / (1 + γ) honest sds
    share, shift = 1.0, 2.0
    server, clients = with_rogue(max_share=share, max_shift=shift)
    own = server.sites["rogue"]
    for r in range(2):
        q = _round(server, clients, {"rogue": [np.full(server.dim, 1e11), np.asarray(own.precision)] * 2})
        assert server.history[-1]["clipped_clients"] == ["rogue"], r
        honest = [v for k, v in server.sites.items() if k != "rogue"]
        lam = jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), server.prior_nat, *honest)
        P = np.asarray(lam.precision)
        diff = np.asarray(q.mean) - np.linalg.solve(P, np.asarray(lam.linear))
        assert np.sqrt(diff @ P @ diff) <= shift * (1 + 2 * share) / (1 + share) * (1 + 1e-9), r
        assert scipy.linalg.eigh(np.asarray(q.precision), P, eigvals_only=True).max() <= 1 + share + 1e-9


@pytest.mark.filterwarnings("ignore:federated:RuntimeWarning")
def test_a_run_that_refused_or_bounded_a_message_ends_with_an_error_naming_the_client(with_rogue, tmp_path):
    # issue 28: a poisoned run (a site that passes the checks: finite, below max_abs, PSD, but pulling the mean
    # far away with a huge precision) must not end as a silent success; an honest run must end cleanly
    server, clients = with_rogue()
    own = [np.asarray(server.sites["rogue"].linear), np.asarray(server.sites["rogue"].precision)] * 2
    _round(server, clients, {"rogue": own})  # re-sending its own site is honest
    assert server.incidents() == {} and server.check_clients() is None
    server, clients = with_rogue(max_share=1.0, max_shift=2.0)
    poison = [1e9 * np.full(server.dim, 50.0), 1e9 * np.eye(server.dim)] * 2
    _round(server, clients, {"rogue": poison})
    _round(server, clients, {"rogue": [np.full_like(a, np.nan) for a in poison]})
    with pytest.raises(pc.SuspectClientsError, match="rogue") as err:
        server.check_clients()
    # the stored poisoned site (the rogue's last accepted one) is bounded again in round 2, when its NaN is refused
    assert list(err.value.clients) == ["rogue"] and err.value.result is server
    events = err.value.clients["rogue"]
    assert [(e["round"], e["action"]) for e in events] == [(1, "clipped"), (2, "rejected"), (2, "clipped")]
    assert "NaN" in events[1]["reason"] and "max_shift" in events[0]["reason"]
    assert "clipped in round(s) 1, 2" in str(err.value) and "rejected in round(s) 2" in str(err.value)
    assert server.failure is None  # the run itself did not fail: its result is the bounded one
    server.save(tmp_path / "result.npz")
    with np.load(tmp_path / "result.npz") as res:
        assert json.loads(str(res["incidents"])) == err.value.clients


@pytest.mark.filterwarnings("ignore:federated:RuntimeWarning")
def test_server_app_ends_a_run_that_refused_a_message_with_a_typed_error(x64, tmp_path):
    # what the ServerApp runs: after the last round a refused client raises (Flower exits non-zero), `out` names it
    pytest.importorskip("flwr", reason="Flower is not installed (optional extra numpyro-pc[federated])")
    from types import SimpleNamespace

    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

    from numpyro_pc.federated import flower

    logic = ServerLogic(3, "fedpc", "full", rho=0.5, x64=True, min_clients=2)
    strategy = flower.make_strategy(logic, out=str(tmp_path / "result.npz"), rounds=1)
    clients = [ClientLogic(logistic_model, p) for p in shards(2)]

    def results(messages):
        return [(SimpleNamespace(cid=cid), FitRes(Status(Code.OK, ""), ndarrays_to_parameters(m), 50, {}))
                for cid, m in messages.items()]

    init = {f"node{k}": c.initial(logic.config) for k, c in enumerate(clients)}
    strategy.aggregate_fit(1, results(dict(init, rogue=[np.full_like(a, np.nan) for a in init["node0"]])), [])
    arrays = [np.asarray(logic.state.mean), np.asarray(logic.state.precision)]
    update = {f"node{k}": c.update(arrays, logic.config)[0] for k, c in enumerate(clients)}
    with pytest.raises(pc.SuspectClientsError, match="client rogue: rejected in round"):
        strategy.aggregate_fit(2, results(update), [])
    assert logic.failure is None and len(logic.history) == 1
    with np.load(tmp_path / "result.npz") as res:
        assert list(json.loads(str(res["incidents"]))) == ["rogue"]
        np.testing.assert_array_equal(res["mean"], np.asarray(logic.state.mean))  # the last round is written


@pytest.mark.filterwarnings("ignore:federated:RuntimeWarning")
def test_flower_apps_keep_the_site_in_the_context_state(x64, tmp_path):
    pytest.importorskip("flwr", reason="Flower is not installed (optional extra numpyro-pc[federated])")
    from flwr.app import Context, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp

    from numpyro_pc.federated import flower

    assert isinstance(flower.server_app, ServerApp) and isinstance(flower.client_app, ClientApp)
    X, y = shards()[0]
    np.savez(tmp_path / "shard.npz", arg0=np.asarray(X), arg1=np.asarray(y))
    run_config = {"model": "models:logistic_model", "num-clients": 1, "rounds": 2, "x64": True, "rho": 0.5}
    components = flower._server_fn(Context(0, 0, {}, RecordDict(), run_config))
    assert components.config.num_rounds == 3
    logic = ServerLogic(1, "fedpc", "full", rho=0.5, x64=True)
    state = RecordDict()

    def fresh():  # a ClientApp is rebuilt for every message: the site must come back from the state
        context = Context(0, 7, {"data": str(tmp_path / "shard.npz")}, state, run_config)
        return flower._client_fn(context)

    init = fresh().fit(flower_fit_ins([], dict(logic.config, phase="init")))
    logic.aggregate_initial({7: flower_arrays(init)})
    arrays = [np.asarray(logic.state.mean), np.asarray(logic.state.precision)]
    res = fresh().fit(flower_fit_ins(arrays, dict(logic.config, phase="update")))
    reference = ClientLogic(logistic_model, (X, y))
    reference.initial(logic.config)
    expected = reference.update(arrays, logic.config)[0]
    for a, b in zip(flower_arrays(res), expected):
        np.testing.assert_allclose(a, b, rtol=1e-12)


def test_strategy_writes_the_partial_result_when_a_round_fails(tmp_path):
    # what the ServerApp runs: an error in a round is recorded, written to `out`, and raised
    # (Flower then ends the ServerApp with a non-zero exit code)
    pytest.importorskip("flwr", reason="Flower is not installed (optional extra numpyro-pc[federated])")
    from numpyro_pc.federated import flower

    logic = ServerLogic(2, "fedpc", "full", x64=True)
    strategy = flower.make_strategy(logic, out=str(tmp_path / "partial.npz"))
    with pytest.raises(pc.TooFewClientsError, match="min_clients=2"):
        strategy.aggregate_fit(1, [], [RuntimeError("client lost")])
    with np.load(tmp_path / "partial.npz") as res:
        assert "min_clients=2" in json.loads(str(res["failure"])) and res["mean"].size == 0


def flower_fit_ins(arrays, config):
    from flwr.common import FitIns, ndarrays_to_parameters

    return FitIns(ndarrays_to_parameters(arrays), config)


def flower_arrays(fit_res):
    from flwr.common import parameters_to_ndarrays

    return parameters_to_ndarrays(fit_res.parameters)


def _wait_for_port(port, timeout, process, log):
    """Wait until ``process`` listens on 127.0.0.1:``port`` (at most ``timeout`` seconds; fail if it exits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the process exited with status {process.returncode}: {log.read_text()[-3000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    pytest.fail(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


@pytest.mark.filterwarnings("ignore:federated:RuntimeWarning")
def test_flower_processes_over_tls_leave_out_a_rogue_and_a_client_killed_mid_run(x64, tmp_path):
    pytest.importorskip("flwr", reason="Flower is not installed (optional extra numpyro-pc[federated])")
    parts = shards(4)
    # client 2 sends NaN sites (refused in round 1, never admitted); client 3 (its own shard: a copy of another
    # client's data would be refused as a duplicate) is honest in round 1, then dies in its first update: the run
    # goes on with the two others (min-clients 2) and ends with status 3, naming the refused client (a client
    # that drops out is not named)
    code, log, out = _launch(tmp_path, parts, ["--clients", "4", "--min-clients", "2", "--rounds", str(ROUNDS),
                                               "--rho", "0.5"], ["honest", "honest", "nan", "crash-update"], tls=True)
    assert code == 3, log[-6000:]
    summary = _summary(log)
    assert summary["status"] == "suspect" and summary["failure"] is None
    (rogue, events), = summary["suspect_clients"].items()
    assert [(e["round"], e["action"]) for e in events] == [(0, "rejected")] and "NaN" in events[0]["reason"]
    with np.load(out) as res:
        mean, precision, history = res["mean"], res["precision"], json.loads(str(res["history"]))
        assert json.loads(str(res["incidents"])) == summary["suspect_clients"]
    assert len(history) == ROUNDS and all(h["participants"] == 2 for h in history)
    # the same by hand: the killed client keeps its round-1 site, the honest two update every round
    server = ServerLogic(4, "fedpc", "full", rho=0.5, x64=True, min_clients=2)
    honest = [ClientLogic(logistic_model, p) for p in parts[:2]]
    killed = ClientLogic(logistic_model, parts[3])
    server.aggregate_initial(dict({f"node{k}": c.initial(server.config) for k, c in enumerate(honest)},
                                  killed=killed.initial(server.config)))
    for _ in range(ROUNDS):
        _round(server, honest)
    np.testing.assert_allclose(mean, np.asarray(server.state.mean), rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(precision, np.asarray(server.state.precision), rtol=1e-8, atol=1e-10)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:federated:RuntimeWarning")
def test_flower_server_exits_3_naming_a_client_whose_sites_were_bounded(x64, tmp_path):
    # issue 28: a rogue whose sites pass every check (finite, below max_abs, PSD) but would own the mean is
    # bounded every round (--max-share/--max-shift); the run ends with status 3 and names it, and only it
    pytest.importorskip("flwr", reason="Flower is not installed (optional extra numpyro-pc[federated])")
    rounds = 2
    code, log, out = _launch(tmp_path, shards(4), ["--clients", "4", "--min-clients", "3", "--rounds", str(rounds),
                                                   "--rho", "0.5", "--max-share", "1", "--max-shift", "2"],
                             ["honest", "honest", "honest", "pull"])
    assert code == 3, log[-6000:]
    summary = _summary(log)
    assert summary["status"] == "suspect" and summary["failure"] is None
    (rogue, events), = summary["suspect_clients"].items()
    assert [(e["round"], e["action"]) for e in events] == [(r, "clipped") for r in range(1, rounds + 1)]
    assert f"client {rogue}: clipped in round(s) 1, 2" in log
    with np.load(out) as res:
        history = json.loads(str(res["history"]))
        assert np.all(np.abs(res["mean"]) < 10)  # the bound held: the mean is not pulled to 5e10 / 1e9 = 50
    assert [h["clipped_clients"] for h in history] == [[rogue]] * rounds


def test_flower_server_exits_with_a_partial_result_when_too_few_clients_remain(x64, tmp_path):
    pytest.importorskip("flwr", reason="Flower is not installed (optional extra numpyro-pc[federated])")
    parts = shards(2)
    code, log, out = _launch(tmp_path, parts, ["--clients", "2", "--rounds", str(ROUNDS), "--rho", "0.5"],
                             ["honest", "crash-update"])
    assert code == 1, log[-6000:]
    with np.load(out) as res:
        failure = json.loads(str(res["failure"]))
        assert res["mean"].shape == (4,) and np.all(np.isfinite(res["mean"]))  # the last good posterior
    assert "min_clients=2" in failure, failure
    assert _summary(log)["status"] == "failed"


APP_TOML = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "pcfedtest"
version = "1.0.0"
description = "numpyro_pc federated test app"
license = "MIT"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "numpyro-pc"

[tool.flwr.app.components]
serverapp = "numpyro_pc.federated.flower:server_app"
clientapp = "numpyro_pc.federated.flower:client_app"

[tool.flwr.app.config]
num-clients = 2
rounds = 1
rho = 0.5
model = "models:logistic_model"
x64 = true
out = "{out}"
connect-timeout = 300.0
round-timeout = 300.0
"""


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:federated:RuntimeWarning")
def test_flower_apps_run_with_flwr_run_on_a_superlink_and_two_supernodes(x64, tmp_path):
    # Flower's own deployment on 127.0.0.1: flower-superlink, two flower-supernode (shards via --node-config)
    # and `flwr run`; every ClientApp message starts a fresh process, so this takes minutes on a loaded machine
    pytest.importorskip("flwr", reason="Flower is not installed (optional extra numpyro-pc[federated])")
    bindir = Path(sys.executable).parent
    if not (bindir / "flower-superlink").exists():
        pytest.skip("the flower-superlink / flower-supernode executables are not installed")
    parts = shards(2)
    for k, (X, y) in enumerate(parts):
        np.savez(tmp_path / f"shard{k}.npz", arg0=np.asarray(X), arg1=np.asarray(y))
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "pyproject.toml").write_text(APP_TOML.format(out=tmp_path / "result.npz"))
    link = _free_port()
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "config.toml").write_text(
        f'[superlink]\ndefault = "loc"\n\n[superlink.loc]\naddress = "127.0.0.1:{link}"\ninsecure = true\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), JAX_PLATFORMS="cpu",
               FLWR_HOME=str(tmp_path / "home"), PATH=os.pathsep.join([str(bindir), os.environ.get("PATH", "")]))
    spawn = lambda cmd, name: subprocess.Popen(  # noqa: E731
        cmd, env=env, stdout=open(tmp_path / f"{name}.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    procs = [spawn([str(bindir / "flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(link)],
                   "superlink")]
    try:
        _wait_for_port(link, 120, procs[0], tmp_path / "superlink.log")
        for k in range(2):
            procs.append(spawn([str(bindir / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{link}",
                                "--port", str(_free_port()), "--node-config", f'data="{tmp_path / f"shard{k}.npz"}"'],
                               f"supernode{k}"))
        run = subprocess.run([str(bindir / "flwr"), "run", str(tmp_path / "app"), "loc", "--stream"], env=env,
                             capture_output=True, text=True, timeout=480)
    finally:
        for p in procs:  # each process group: the SuperNodes' ClientApp processes go with them
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
    assert "Run finished" in run.stdout, run.stdout[-4000:] + run.stderr[-2000:]
    with np.load(tmp_path / "result.npz") as res:
        assert json.loads(str(res["failure"])) is None
        ref = federated.run(logistic_model, parts, rho=0.5, rounds=1, stop=StopRule(tol=0.0, residual_tol=0.0), keep_data=False,
                        safeguard=Safeguard(line_search=False))  # the Flower server takes the plain global step
        np.testing.assert_allclose(res["mean"], np.asarray(ref.state.mean), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(res["precision"], np.asarray(ref.state.precision), rtol=1e-9)


# ---------------------------------------------------------------- exponential-family posteriors
def _ef_shards():
    # the misclassified Beta–Bernoulli model: non-conjugate, so the sites move with λ and every round counts
    from models import _data

    y = _data(4, n=40)["bern"]
    return [(np.asarray(p),) for p in np.split(y, [4, 12, 22])]


def _ef_by_hand(server, clients, rounds):
    from numpyro_pc.federated.ef_transport import EFClientLogic

    logic = [EFClientLogic(misclassified, p) for p in clients]
    server.aggregate_initial({k: c.initial(server.fit_config(k, "init")) for k, c in enumerate(logic)})
    for _ in range(rounds):
        out = {k: c.update(server.broadcast(), server.fit_config(k, "update")) for k, c in enumerate(logic)}
        server.aggregate({k: o[0] for k, o in out.items()}, residuals=[o[1]["residual"] for o in out.values()])
    return logic


@pytest.mark.filterwarnings("ignore:federated:RuntimeWarning")
@pytest.mark.parametrize("algorithm", ["fedpc", "admm"])
def test_ef_server_and_client_logic_equal_the_in_process_run(x64, algorithm):
    from numpyro_pc.federated.ef import run_ef
    from numpyro_pc.federated.ef_transport import EFServerLogic

    parts = _ef_shards()
    server = EFServerLogic(len(parts), {"p": "beta"}, algorithm, x64=True)
    _ef_by_hand(server, parts, ROUNDS)
    ref = run_ef(misclassified, parts, {"p": "beta"}, algorithm, rounds=ROUNDS, stop=StopRule(tol=0.0, residual_tol=0.0),
                 keep_data=False)
    assert ref.rounds == ROUNDS and ref.history[0]["kl_to_previous"] > 1e-3  # the rounds move the posterior
    fam = server.family
    kl = float(fam.kl(server.natural, ef.global_natural(ref.state)))
    print(f"{algorithm}: KL(Flower logic ‖ run_ef) = {kl:.2e}")
    assert kl < 1e-12
    np.testing.assert_allclose(np.asarray(server.natural), np.asarray(ef.global_natural(ref.state)), rtol=1e-10)
    np.testing.assert_allclose([h["kl_to_previous"] for h in server.history], ref.column("kl_to_previous"),
                               rtol=1e-6, atol=1e-14)
    np.testing.assert_allclose([h["residual"] for h in server.history], ref.column("residual"), rtol=1e-6,
                               atol=1e-14)


@pytest.mark.filterwarnings("ignore:federated:RuntimeWarning")
def test_ef_server_refuses_bad_messages_and_goes_on(x64, tmp_path):
    from numpyro_pc.federated.ef_transport import EFClientLogic, EFServerLogic

    parts = _ef_shards()[1:]
    server = EFServerLogic(5, "p=beta", x64=True, min_clients=3)
    clients = [EFClientLogic(misclassified, p) for p in parts]
    init = {f"node{k}": c.initial(server.fit_config(f"node{k}", "init")) for k, c in enumerate(clients)}
    # a client reporting another family (a Gamma) is not admitted
    other = EFClientLogic(gamma_poisson, (np.ones(5),)).initial(dict(server.config, family='{"rate": "gamma"}'))
    server.aggregate_initial(dict(init, rogue=[a.copy() for a in init["node0"]], stranger=other))
    assert server.ids == ["node0", "node1", "node2", "rogue"]
    assert "expected the family" in server.rejected_initial["stranger"]
    size = server.family.size
    stored = np.asarray(server.sites["rogue"])

    def round_with(message):
        replies = {f"node{k}": c.update(server.broadcast(), server.config)[0] for k, c in enumerate(clients)}
        return server.aggregate(dict(replies, rogue=message))

    out_of_domain = np.asarray([-1e3, 0.0])  # a Beta concentration far below zero
    cases = {"shape": [np.zeros(size + 1)], "finite": [np.full(size, np.nan)], "dtype": [np.zeros(size, np.float32)],
             "domain": [out_of_domain], "1 array(s), found 2": [np.zeros(size)] * 2}
    for reason, message in cases.items():
        lam = round_with(message)
        assert server.family.in_domain(ef.global_natural(lam))
        rejected = server.history[-1]["rejected"]
        assert list(rejected) == ["rogue"] and reason in rejected["rogue"], (reason, rejected)
        assert server.history[-1]["participants"] == 3
        np.testing.assert_array_equal(np.asarray(server.sites["rogue"]), stored)  # nothing of it is stored
    with pytest.raises(pc.TooFewClientsError, match="min_clients=3"):
        server.aggregate({"node0": [np.zeros(size)], "rogue": [np.full(size, np.nan)], "unknown": [np.zeros(size)]})
    assert "not admitted" in server.failure
    server.save(tmp_path / "partial.npz")
    with np.load(tmp_path / "partial.npz") as res:
        np.testing.assert_array_equal(res["natural"], np.asarray(server.natural))
        assert json.loads(str(res["clients"])) == server.ids and len(json.loads(str(res["history"]))) == 5
    with pytest.raises(pc.errors.MissingCapabilityError, match="FixedPrecision|precision"):
        EFServerLogic(2, {"p": "beta"}, "ama")
    # a client's family description is untrusted text: whatever breaks in it refuses that client, typed
    # (an overflowing shape raised OverflowError, a deep nesting RecursionError: both ended the server)
    for text in ('[{"family": "beta", "site": "p", "shape": [1e400]}]', "[" * 5000 + "]" * 5000,
                 '[{"family": "beta", "site": "p", "shape": [-1]}]', "x" * 70000, 3):
        with pytest.raises(pc.ClientMessageError, match="family description"):
            ef_transport.family_from_description(text)


@pytest.mark.filterwarnings("ignore:federated:RuntimeWarning")
def test_ef_server_refuses_replayed_and_duplicated_sites(x64):
    # the Gaussian server's rule (refuse_replays) on exponential-family sites; init="prior": first sites not zero
    from numpyro_pc.federated.ef_transport import EFClientLogic, EFServerLogic

    parts = _ef_shards()[1:]
    server = EFServerLogic(4, "p=beta", x64=True, min_clients=1, init="prior")
    clients = [EFClientLogic(misclassified, p) for p in parts]
    init = {f"node{k}": c.initial(server.fit_config(f"node{k}", "init")) for k, c in enumerate(clients)}
    server.aggregate_initial(dict(init, copycat=[a.copy() for a in init["node1"]]))
    assert server.ids == ["node0", "node2"]
    for cid in ("node1", "copycat"):
        assert "replayed or duplicated" in server.rejected_initial[cid]

    def update(k):
        return clients[k].update(server.broadcast(), server.fit_config(f"node{k}", "update"))[0]

    # another client's last accepted site: refused, the round goes on with the other
    last_of_node2 = np.asarray(server.sites["node2"]).copy()
    server.aggregate({"node0": [last_of_node2], "node2": update(2)})
    assert "node2's last accepted site" in server.history[-1]["rejected"]["node0"]
    assert server.history[-1]["participants"] == 1
    np.testing.assert_array_equal(np.asarray(server.sites["node0"]), init["node0"][0])  # nothing of it stored
    # the same site under two ids in one round: both refused, no valid reply left
    message = update(2)
    with pytest.raises(pc.TooFewClientsError, match="replayed or duplicated"):
        server.aggregate({"node0": [message[0].copy()], "node2": message})
    # a client re-sending its own last site is not a replay
    server.aggregate({"node0": update(0), "node2": [np.asarray(server.sites["node2"]).copy()]})
    assert not server.history[-1]["rejected"] and server.history[-1]["participants"] == 2
    with pytest.raises(pc.SuspectClientsError, match="client node0: rejected in round"):
        server.check_clients()


@pytest.mark.filterwarnings("ignore:federated:RuntimeWarning")
def test_flower_processes_carry_exponential_family_sites(x64, tmp_path):
    pytest.importorskip("flwr", reason="Flower is not installed (optional extra numpyro-pc[federated])")
    from numpyro_pc.federated.ef import run_ef

    parts = _ef_shards()[1:]
    code, log, out = _launch(tmp_path, parts, ["--clients", "3", "--rounds", str(ROUNDS), "--family", "p=beta"],
                             ["honest"] * 3, model="models:misclassified")
    assert code == 0, log[-6000:]
    ref = run_ef(misclassified, parts, {"p": "beta"}, rounds=ROUNDS, stop=StopRule(tol=0.0, residual_tol=0.0), keep_data=False)
    with np.load(out) as res:
        natural, history = res["natural"], json.loads(str(res["history"]))
        fam = ef_transport.family_from_description(json.loads(str(res["family"])))
    kl = float(fam.kl(jax.numpy.asarray(natural), ef.global_natural(ref.state)))
    print(f"KL(Flower processes ‖ run_ef) = {kl:.2e}")
    assert len(history) == ROUNDS and all(h["participants"] == 3 for h in history) and kl < 1e-12
    np.testing.assert_allclose(natural, np.asarray(ef.global_natural(ref.state)), rtol=1e-10)
