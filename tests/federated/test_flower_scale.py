"""Flower the way Flower users run it (issue 28 item 3): --min-clients from the first round, TLS failures as typed
errors with the fix, and the package's ServerApp/ClientApp on Flower's simulation engine."""

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

import numpyro_pc as pc
from numpyro_pc import federated
from numpyro_pc.families.registry import Gaussian, get_family
from numpyro_pc.federated.flower import ServerLogic
from numpyro_pc.federated.options import Safeguard, StopRule
from numpyro_pc.federated.transport import read_certificate, transport_error

from flower_processes import ROOT, _certificates, _free_port, _launch, _summary, shards
from models import logistic_model

ROUNDS = 3


def in_process(parts, rounds=ROUNDS):
    """The oracle: the in-process run on ``parts`` with the Flower server's plain global step."""
    return federated.run(logistic_model, parts, rho=0.5, rounds=rounds, stop=StopRule(tol=0.0, residual_tol=0.0),
                         keep_data=False, safeguard=Safeguard(line_search=False))


def assert_same_posterior(mean, precision, ref):
    kl = float(get_family("full").kl(Gaussian(np.asarray(mean), np.asarray(precision)), ref.state))
    assert kl <= 1e-8, kl
    np.testing.assert_allclose(mean, np.asarray(ref.state.mean), rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(precision, np.asarray(ref.state.precision), rtol=1e-8, atol=1e-10)


class FakeRpcError(Exception):
    """What gRPC raises: ``code()`` (a status with a ``name``) and ``details()``."""

    def __init__(self, code, details):
        super().__init__(details)
        self._code, self._details = SimpleNamespace(name=code), details

    def code(self):
        return self._code

    def details(self):
        return self._details


def test_transport_failures_are_typed_errors_that_name_the_fix(tmp_path):
    # gRPC's own reports (copied from clients run against a TLS server on 127.0.0.1)
    address = "127.0.0.1:8080"
    wrong_ca = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:8080: Tls handshake failed "
                "(TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:"
                "CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate: OK")
    err = transport_error(FakeRpcError("UNAVAILABLE", wrong_ca), address, tls=True)
    assert isinstance(err, pc.TransportSecurityError) and isinstance(err, pc.PosteriorCorrectionError)
    assert "not signed by the CA" in str(err) and "--root-certificates" in str(err) and err.address == address
    no_ca = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:8080: Socket closed"
    err = transport_error(FakeRpcError("UNAVAILABLE", no_ca), address, tls=False)
    assert isinstance(err, pc.TransportSecurityError) and "expects TLS" in str(err) and "--root-certificates" in str(err)
    err = transport_error(FakeRpcError("UNAUTHENTICATED", "node is not known"), address, tls=True)
    assert isinstance(err, pc.TransportSecurityError) and "credentials" in str(err)
    err = transport_error(FakeRpcError("UNAVAILABLE", "Peer name localhost is not in peer certificate"), "localhost:1",
                          tls=True)
    assert isinstance(err, pc.TransportSecurityError) and "subjectAltName" in str(err)
    # not a security failure: nothing listens, or the server went away mid-run
    refused = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:8080: Connection refused"
    err = transport_error(FakeRpcError("UNAVAILABLE", refused), address, tls=False)
    assert type(err) is pc.TransportError and "start the server first" in str(err) and refused in err.details
    err = transport_error(FakeRpcError("UNAVAILABLE", "Stream removed"), address, tls=True)
    assert type(err) is pc.TransportError and "lost during the run" in str(err)
    # certificate files
    with pytest.raises(pc.TransportSecurityError, match="--root-certificates: cannot read"):
        read_certificate(str(tmp_path / "missing.crt"), "--root-certificates")
    (tmp_path / "bad.crt").write_text("not a certificate")
    with pytest.raises(pc.TransportSecurityError, match="holds no PEM block"):
        read_certificate(str(tmp_path / "bad.crt"), "--certificates (CA)")


class Manager:
    """A Flower client manager holding the connected clients ``cids`` (all that the strategy calls)."""

    def __init__(self, cids):
        self.proxies = {cid: SimpleNamespace(cid=cid) for cid in cids}

    def wait_for(self, num_clients, timeout):
        return len(self.proxies) >= num_clients

    def num_available(self):
        return len(self.proxies)

    def sample(self, num_clients, min_num_clients=None):
        return list(self.proxies.values())[:num_clients]

    def all(self):
        return self.proxies


@pytest.mark.slow  # 10 s on 2 cores (three clients' local solves compiled)
@pytest.mark.filterwarnings("ignore:federated:RuntimeWarning")
def test_the_first_round_goes_on_with_min_clients_and_names_the_clients_that_did_not_start(x64, tmp_path):
    # issue 28: a client whose data has a NaN, and one that never connects, used to end the run with "only 2 of 3
    # clients connected"; with --min-clients 2 the run goes on with the others, and equals their in-process run
    pytest.importorskip("flwr", reason="Flower is not installed (optional extra numpyro-pc[federated])")
    from flwr.common import Code, FitIns, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays

    from numpyro_pc.federated import flower

    parts = shards(3)
    X, y = (np.array(a) for a in parts[2])
    X[0, 0] = np.nan
    clients = {f"node{k}": flower.make_client(flower.ClientByFamily(logistic_model, p))
               for k, p in enumerate([*parts[:2], (X, y)])}
    logic = ServerLogic(4, "fedpc", "full", rho=0.5, x64=True, min_clients=2)
    strategy = flower.make_strategy(logic, connect_timeout=0, out=str(tmp_path / "result.npz"), rounds=ROUNDS)
    manager = Manager(list(clients))  # the fourth client never connects
    parameters = ndarrays_to_parameters([])
    for r in range(1, ROUNDS + 2):
        asked = strategy.configure_fit(r, parameters, manager)
        results = []
        for proxy, ins in asked:
            arrays, n, metrics = clients[proxy.cid].fit(parameters_to_ndarrays(ins.parameters), ins.config)
            results.append((proxy, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), n, metrics)))
        parameters = strategy.aggregate_fit(r, results, [])[0]
        assert isinstance(FitIns(parameters, {}), FitIns)
    assert sorted(logic.not_started) == ["node2", "unconnected-4"]
    assert "NonFiniteDataError" in logic.not_started["node2"] and "never connected" in logic.not_started["unconnected-4"]
    assert isinstance(clients["node2"].start_error, pc.NonFiniteDataError)
    assert sorted(logic.sites) == ["node0", "node1"] and logic.incidents() == {}
    with np.load(tmp_path / "result.npz") as res:
        assert json.loads(str(res["not_started"])) == logic.not_started
        assert_same_posterior(res["mean"], res["precision"], in_process(parts[:2]))
    # fewer than min_clients connected: the run cannot start, and says so
    strict = ServerLogic(3, "fedpc", "full", x64=True, min_clients=2)
    with pytest.raises(pc.TooFewClientsError, match="only 1 of 3 clients connected .* fewer than min_clients=2"):
        flower.make_strategy(strict, connect_timeout=0).configure_fit(1, parameters, Manager(["a"]))


@pytest.mark.slow  # 44 s on 2 cores, loaded (a server and three client processes, a 15 s connect timeout)
@pytest.mark.filterwarnings("ignore:federated:RuntimeWarning")
def test_flower_processes_go_on_when_a_client_cannot_start(x64, tmp_path):
    # the case with real processes: --clients 4 --min-clients 2, one client's data file has a NaN and a
    # fourth never starts; the server ends with status 0 naming both, the honest clients finish (no "Stream
    # removed"), the NaN client exits 1 with its error, and the result is the honest clients' in-process run
    pytest.importorskip("flwr", reason="Flower is not installed (optional extra numpyro-pc[federated])")
    parts = shards(3)
    X, y = (np.array(a) for a in parts[2])
    X[0, 0] = np.nan
    codes = []
    code, log, out = _launch(tmp_path, [*parts[:2], (X, y)], ["--clients", "4", "--min-clients", "2", "--rounds",
                                                              str(ROUNDS), "--rho", "0.5", "--connect-timeout", "15"],
                             ["honest"] * 3, codes=codes)
    assert code == 0, log[-6000:]
    summary = _summary(log)
    assert summary["status"] == "ok" and summary["failure"] is None and len(summary["not_started"]) == 2
    reasons = sorted(summary["not_started"].values())
    assert "NonFiniteDataError" in reasons[0] and "never connected: 3 of 4" in reasons[1], reasons
    assert codes == [0, 0, 1], log[-6000:]
    assert "numpyro_pc client: NonFiniteDataError" in log and "Stream removed" not in log
    with np.load(out) as res:
        assert json.loads(str(res["not_started"])) == summary["not_started"]
        assert [h["participants"] for h in json.loads(str(res["history"]))] == [2] * ROUNDS
        assert_same_posterior(res["mean"], res["precision"], in_process(parts[:2]))


@pytest.mark.slow  # 52 s on 2 cores, loaded (a TLS server, an honest client and two clients it refuses)
def test_clients_without_the_servers_ca_get_a_typed_error_with_the_fix(tmp_path):
    pytest.importorskip("flwr", reason="Flower is not installed (optional extra numpyro-pc[federated])")
    ca, cert, key = _certificates(tmp_path)
    (tmp_path / "other").mkdir()
    other_ca = _certificates(tmp_path / "other")[0]
    X, y = shards(1)[0]
    np.savez(tmp_path / "shard.npz", arg0=np.asarray(X), arg1=np.asarray(y))
    address = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), JAX_PLATFORMS="cpu")
    flower = [sys.executable, "-m", "numpyro_pc.federated.flower"]
    server = subprocess.Popen([*flower, "server", "--address", address, "--clients", "1", "--rounds", "1",
                               "--connect-timeout", "120", "--certificates", ca, cert, key], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client = [*flower, "client", "--server", address, "--model", "models:logistic_model", "--data",
              str(tmp_path / "shard.npz"), "--max-wait", "30"]
    try:
        time.sleep(3)
        for extra, expected in (([], "expects TLS"), (["--root-certificates", other_ca], "not signed by the CA")):
            bad = subprocess.run(client + extra, env=env, capture_output=True, text=True, timeout=120)
            assert bad.returncode == 2, bad.stderr[-3000:]
            line = [ln for ln in bad.stderr.splitlines() if ln.startswith("numpyro_pc client:")]
            assert len(line) == 1 and "TransportSecurityError" in line[0] and expected in line[0], bad.stderr[-3000:]
            assert "--root-certificates" in line[0] and "Traceback" not in bad.stderr
        good = subprocess.run(client + ["--root-certificates", ca], env=env, capture_output=True, text=True,
                              timeout=120)
        assert good.returncode == 0, good.stderr[-3000:]
        log, _ = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
    assert _summary(log)["status"] == "ok"


@pytest.mark.slow  # 104 s on 2 cores while a benchmark ran (Ray starts, its workers compile the local update)
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
def test_simulation_engine_runs_the_package_apps_and_equals_the_in_process_run(x64, tmp_path):
    # five virtual clients, two rounds, through flwr.simulation.run_simulation with the package's ServerApp and
    # ClientApp; each client takes partition partition-id of the run config's data
    pytest.importorskip("flwr", reason="Flower is not installed (optional extra numpyro-pc[federated])")
    pytest.importorskip("ray", reason="Flower's simulation engine (ray) is not installed")
    from numpyro_pc.federated.flower_apps import partition, simulate

    X, y = (np.concatenate(c) for c in zip(*shards(1)))
    np.savez(tmp_path / "all.npz", arg0=np.asarray(X), arg1=np.asarray(y))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    simulate({"model": "models:logistic_model", "data": str(tmp_path / "all.npz"), "rounds": 2, "rho": 0.5,
              "x64": True, "out": str(tmp_path / "out.npz")}, 5)
    with np.load(tmp_path / "out.npz") as res:
        assert json.loads(str(res["failure"])) is None and json.loads(str(res["not_started"])) == {}
        assert [h["participants"] for h in json.loads(str(res["history"]))] == [5, 5]
        assert_same_posterior(res["mean"], res["precision"], in_process([partition((X, y), k, 5) for k in range(5)],
                                                                         rounds=2))


def test_partitions_cover_the_rows_once(x64):
    from numpyro_pc.federated.flower_apps import partition, partition_rows

    rows = partition_rows(103, 10, seed=3)
    assert sorted(np.concatenate(rows).tolist()) == list(range(103)) and {len(r) for r in rows} == {10, 11}
    assert np.array_equal(np.concatenate(partition_rows(7, 3, seed=-1)), np.arange(7))
    X = np.arange(20.0).reshape(10, 2)
    part = partition((X, X[:, 0]), 1, 3, seed=-1)
    np.testing.assert_array_equal(part[1], [8.0, 10.0, 12.0])
    with pytest.raises(pc.errors.InvalidOptionError, match="partition-id"):
        partition((X,), 3, 3)
    with pytest.raises(pc.errors.DataShapeError, match="rows"):
        partition((X, X[:5]), 0, 2)

