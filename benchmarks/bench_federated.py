"""Federated posterior correction on a7a: rounds and bytes to reach the centralised posterior.

What is measured
----------------
Bayesian logistic regression with an intercept on LIBSVM a7a (123 binary features, prior
precision 5 on every coefficient, as in ``bench_continual``), full-covariance Gaussian
(d = 124), Gauss–Hermite expectations, float64. The training set (or its first ``--n``
examples) is split over ``K ∈ {10, 100}`` clients, either IID (a random permutation cut
into equal shards) or with label skew: for each class, client shares drawn from
Dirichlet(0.3) (every client keeps at least one example).

Algorithms (``numpyro_pc.federated.run``, all clients every round, sites initialised at
the prior): ``fedpc`` for a sweep of ``ρ``, ``pvi`` (``ρ = 1``) with damping 0.5,
``admm`` (``ρ = 0.5``) and ``ama`` (the isotropic family with the delta rule: MAP, measured
against the centralised isotropic MAP instead, so its KL is ``τ/2 ‖m − m*‖²``).

Scores per run: the first round at which ``KL(q_t ‖ q*) ≤ 1e-6`` (``q*`` = ``pc.fit`` on the
union, ``tol=1e-10``), the bytes sent up to that round (each participating client
uploads its site and downloads the global natural parameters, float64), the final KL and
the wall time of the whole run (compile included: one compile per configuration).

Usage::

    python benchmarks/bench_federated.py --quick   # 3 000 examples, K = 10 and 100, short sweep
    python benchmarks/bench_federated.py           # all 16 100 examples (slow on 2 cores)

Outputs: ``benchmarks/_out/bench_federated.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import numpyro_pc as pc  # noqa: E402
from _common import machine_info, quiet, write_results  # noqa: E402
from bench_continual import model  # noqa: E402  (same model as benchmarks 3 and 4)
from numpyro_pc.datasets import load_a7a  # noqa: E402

OUT = os.path.join(HERE, "_out")
TARGET_KL = 1e-6


def split(y, num_clients, kind, seed=0):
    """Row indices of each client: ``"iid"`` or ``"dirichlet"`` (label skew, α = 0.3)."""
    rng = np.random.default_rng(seed)
    n = y.shape[0]
    if kind == "iid":
        return np.array_split(rng.permutation(n), num_clients)
    parts = [[] for _ in range(num_clients)]
    for c in np.unique(y):
        rows = rng.permutation(np.flatnonzero(y == c))
        shares = rng.dirichlet(0.3 * np.ones(num_clients))
        cuts = (np.cumsum(shares)[:-1] * rows.size).astype(int)
        for k, chunk in enumerate(np.split(rows, cuts)):
            parts[k].extend(chunk.tolist())
    for k in range(num_clients):  # every client keeps at least one example
        while not parts[k]:
            donor = int(np.argmax([len(p) for p in parts]))
            parts[k].append(parts[donor].pop())
    return [np.asarray(sorted(p)) for p in parts]


def methods(num_clients, quick):
    rhos = [0.2, 0.5] if quick else [0.1, 0.2, 0.3, 0.5]
    if num_clients >= 100:
        rhos = [r for r in rhos] + ([] if quick else [0.05])
    out = [(f"fedpc ρ={r:g}", dict(algorithm="fedpc", rho=r)) for r in rhos]
    out += [("pvi δ=0.5", dict(algorithm="pvi", damping=0.5)), ("admm ρ=0.5", dict(algorithm="admm", rho=0.5)),
            (f"ama ρ={1 / num_clients:g}", dict(algorithm="ama", rho=1.0 / num_clients))]
    return out


def first_round_below(history, level):
    for h in history:
        if h.get("kl_to_reference", np.inf) <= level:
            return h["round"], h["bytes"]
    return None, None


def render(res):
    lines = [f"a7a, N = {res['n']}, d = {res['d']}, full Gaussian (ama: isotropic MAP), float64; KL target "
             f"{TARGET_KL:g}; max {res['rounds']} rounds.", "",
             "| clients | split | method | rounds to KL ≤ 1e-6 | MB sent by then | final KL | status | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        reach = "—" if r["reach_round"] is None else str(r["reach_round"])
        mb = "—" if r["reach_bytes"] is None else f"{r['reach_bytes'] / 1e6:.2f}"
        lines.append(f"| {r['clients']} | {r['split']} | {r['method']} | {reach} | {mb} | {r['final_kl']:.1e} | "
                     f"{r['status']} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def targets(res):
    out = []
    for k in sorted({r["clients"] for r in res["runs"]}):
        runs = [r for r in res["runs"] if r["clients"] == k and r["split"] == "dirichlet"]
        fed = [r["reach_round"] for r in runs if r["method"].startswith("fedpc") and r["reach_round"] is not None]
        pvi = [r["reach_round"] for r in runs if r["method"].startswith("pvi")]
        best = min(fed) if fed else None
        pvi_r = pvi[0] if pvi else None
        met = best is not None and (pvi_r is None or best < pvi_r)
        out.append(dict(target=f"fedpc reaches KL 1e-6 in fewer rounds than damped PVI (K={k}, Dirichlet 0.3)",
                        measured=f"fedpc best {best} vs pvi δ=0.5 {pvi_r}", met=met))
    return out


def plot(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    combos = sorted({(r["clients"], r["split"]) for r in res["runs"]})
    fig, axes = plt.subplots(1, len(combos), figsize=(4.2 * len(combos), 3.4), squeeze=False)
    for ax, (k, s) in zip(axes[0], combos):
        for r in res["runs"]:
            if (r["clients"], r["split"]) == (k, s):
                ax.semilogy(np.arange(1, len(r["kl"]) + 1), np.maximum(r["kl"], 1e-16), label=r["method"])
        ax.axhline(TARGET_KL, color="k", lw=0.7, ls=":")
        ax.set_title(f"K={k}, {s}")
        ax.set_xlabel("round")
    axes[0][0].set_ylabel("KL(q_t ‖ centralised)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 000 examples and a short ρ sweep")
    parser.add_argument("--n", type=int, default=None, help="use the first n training examples (default all)")
    parser.add_argument("--clients", default="10,100")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args(argv)
    if args.quick and args.n is None:
        args.n = 3000
    start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - start:6.1f}s] {msg}", flush=True)  # noqa: E731
    info = machine_info()
    X, y = load_a7a("train")
    if args.n:
        X, y = X[:args.n], y[:args.n]
    X, y = jnp.asarray(X), jnp.asarray(y)
    central = quiet(pc.fit, model, X, y, family="full", tol=1e-10)
    central_iso = quiet(pc.fit, model, X, y, family="isotropic", tol=1e-12)
    log(f"centralised posteriors fitted (N={X.shape[0]}, d={central.dim})")
    runs = []
    for k in [int(c) for c in args.clients.split(",")]:
        for kind in ("iid", "dirichlet"):
            rows = split(np.asarray(y), k, kind)
            clients = [(X[r], y[r]) for r in rows]
            for name, opts in methods(k, args.quick):
                ref = central_iso if opts["algorithm"] == "ama" else central
                t0 = time.perf_counter()
                result = quiet(pc.federated.run, model, clients, rounds=args.rounds, reference=ref, keep_data=False,
                               **opts)
                seconds = time.perf_counter() - t0
                kl = result.column("kl_to_reference")
                reach, sent = first_round_below(result.history, TARGET_KL)
                runs.append(dict(clients=k, split=kind, method=name, reach_round=reach, reach_bytes=sent,
                                 final_kl=float(kl[-1]) if kl.size else float("nan"), status=result.status,
                                 seconds=seconds, kl=kl.tolist(), rounds_run=result.rounds,
                                 sizes=[int(r.size) for r in rows]))
                log(f"K={k} {kind} {name}: reach {reach}, status {result.status}, {seconds:.1f}s")
    res = dict(machine=info, n=int(X.shape[0]), d=int(central.dim), rounds=args.rounds, runs=runs,
               command=" ".join(["python benchmarks/bench_federated.py"] + (argv or sys.argv[1:])))
    write_results("bench_federated", args.out, res, render(res), targets(res), lambda p: plot(res, p))


if __name__ == "__main__":
    main()
