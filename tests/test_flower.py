"""The Flower transport: a server and three client processes on 127.0.0.1 reproduce the in-process run."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import numpyro_pc as pc
from numpyro_pc import federated
from numpyro_pc.federated.flower import ClientLogic, ServerLogic

from conftest import logistic_model, make_logistic

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 4


def shards(k=3):
    # random (IID) shards: with three clients sorted by a feature, the ρ-cavity
    # λ_jnt − η_k/ρ of the logistic local problems is indefinite for every ρ < 1 tried
    X, y = make_logistic(150, 3, seed=9)
    order = np.random.default_rng(0).permutation(150)
    return [(X[i], y[i]) for i in np.array_split(order, k)]


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
    ref = federated.run(logistic_model, parts, rho=0.5, rounds=ROUNDS, tol=0.0, residual_tol=0.0, keep_data=False)
    np.testing.assert_allclose(np.asarray(server.state.mean), np.asarray(ref.state.mean), rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(np.asarray(server.state.precision), np.asarray(ref.state.precision), rtol=1e-9)
    np.testing.assert_allclose([h["kl_to_previous"] for h in server.history], ref.column("kl_to_previous"),
                               rtol=1e-6, atol=1e-14)
    assert [h["bytes"] for h in server.history] == [h["bytes"] for h in ref.history]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.filterwarnings("ignore:federated:RuntimeWarning")
def test_flower_processes_equal_the_in_process_run(x64, tmp_path):
    pytest.importorskip("flwr", reason="Flower is not installed (optional extra numpyro-pc[federated])")
    parts = shards()
    for k, (X, y) in enumerate(parts):
        np.savez(tmp_path / f"shard{k}.npz", arg0=np.asarray(X), arg1=np.asarray(y))
    address = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), JAX_PLATFORMS="cpu")
    mod = [sys.executable, "-m", "numpyro_pc.federated.flower"]
    out = tmp_path / "result.npz"
    server = subprocess.Popen(mod + ["server", "--address", address, "--clients", "3", "--rounds", str(ROUNDS),
                                     "--rho", "0.5", "--x64", "--out", str(out)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    clients = [subprocess.Popen(mod + ["client", "--server", address, "--model", "conftest:logistic_model",
                                       "--data", str(tmp_path / f"shard{k}.npz"), "--client-id", str(k), "--x64"],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for k in range(3)]
    try:
        log, _ = server.communicate(timeout=240)
        for c in clients:
            c.communicate(timeout=60)
    finally:
        for p in [server, *clients]:
            if p.poll() is None:
                p.kill()
    assert server.returncode == 0, log[-3000:]
    with np.load(out) as res:
        mean, precision, history = res["mean"], res["precision"], json.loads(str(res["history"]))
    ref = federated.run(logistic_model, parts, rho=0.5, rounds=ROUNDS, tol=0.0, residual_tol=0.0, keep_data=False)
    assert len(history) == ROUNDS
    np.testing.assert_allclose(mean, np.asarray(ref.state.mean), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(precision, np.asarray(ref.state.precision), rtol=1e-6, atol=1e-6)
    with jax.enable_x64(True):
        q = pc.Gaussian(jax.numpy.asarray(mean), jax.numpy.asarray(precision))
        assert float(pc.FullGaussian().kl(q, ref.state)) < 1e-10
