"""Helpers of the Flower tests that start processes: shards, free ports, throw-away TLS certificates, a server
with one process per client (tests/federated/test_flower.py, test_flower_scale.py)."""

import os
import shutil
import socket
import subprocess
import sys
import json
from pathlib import Path

import numpy as np
import pytest

from models import make_logistic

ROOT = Path(__file__).resolve().parents[1]


def shards(k=3):
    # random (IID) shards: with three clients sorted by a feature, the ρ-cavity
    # λ_jnt − η_k/ρ of the logistic local problems is indefinite for every ρ < 1 tried
    X, y = make_logistic(150, 3, seed=9)
    order = np.random.default_rng(0).permutation(150)
    return [(X[i], y[i]) for i in np.array_split(order, k)]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _certificates(tmp_path):
    """A throw-away CA and a server certificate for 127.0.0.1 (openssl), as paths ``(ca, cert, key)``."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the test certificates")
    ca, cert, key = (str(tmp_path / n) for n in ("ca.crt", "server.pem", "server.key"))
    run = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True, timeout=60)  # noqa: E731
    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
        "-keyout", str(tmp_path / "ca.key"), "-out", ca)
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", key,
        "-out", str(tmp_path / "server.csr"))
    (tmp_path / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("openssl", "x509", "-req", "-in", str(tmp_path / "server.csr"), "-CA", ca, "-CAkey", str(tmp_path / "ca.key"),
        "-CAcreateserial", "-days", "1", "-extfile", str(tmp_path / "san.ext"), "-out", cert)
    return ca, cert, key


def _launch(tmp_path, parts, server_args, roles, tls=False, model="models:logistic_model", codes=None):
    """A server and one process per shard; ``roles[k]`` is "honest", "nan" or "crash-init"/"crash-update".

    With ``tls`` the server gets a certificate for 127.0.0.1 and the clients its CA (``--certificates`` /
    ``--root-certificates``): the clients can only connect over TLS. ``codes`` (a list) receives the clients'
    exit statuses.
    """
    server_tls, client_tls = [], []
    if tls:
        ca, cert, key = _certificates(tmp_path)
        server_tls, client_tls = ["--certificates", ca, cert, key], ["--root-certificates", ca]
    for k, part in enumerate(parts):
        np.savez(tmp_path / f"shard{k}.npz", **{f"arg{i}": np.asarray(a) for i, a in enumerate(part)})
    address = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), JAX_PLATFORMS="cpu")
    out = tmp_path / "result.npz"
    server = subprocess.Popen([sys.executable, "-m", "numpyro_pc.federated.flower", "server", "--address", address,
                               "--x64", "--out", str(out), "--connect-timeout", "60", "--round-timeout", "60",
                               *server_args, *server_tls], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    clients = []
    for k, role in enumerate(roles):
        cmd = ([sys.executable, "-m", "numpyro_pc.federated.flower", "client"] if role == "honest" else
               [sys.executable, str(ROOT / "tests" / "flower_rogue.py"), role])
        clients.append(subprocess.Popen(cmd + ["--server", address, "--model", model, "--data",
                                               str(tmp_path / f"shard{k % len(parts)}.npz"), "--x64",
                                               "--max-wait", "20", *client_tls],
                                        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        log, _ = server.communicate(timeout=150)
        for c in clients:
            logs.append(c.communicate(timeout=30)[0])
        if codes is not None:
            codes.extend(c.returncode for c in clients)
    finally:
        for p in [server, *clients]:
            if p.poll() is None:
                p.kill()
    # the server's log, then each client's tail (shown when an assertion fails)
    return server.returncode, log + "".join(f"\n--- client {k}:\n{c[-800:]}" for k, c in enumerate(logs)), out


def _summary(log):
    """The server's one-line JSON summary in its log."""
    lines = [line for line in log.splitlines() if line.startswith('{"status"')]
    assert len(lines) == 1, log[-6000:]
    return json.loads(lines[0])
