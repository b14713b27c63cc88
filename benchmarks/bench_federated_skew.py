"""FedPC on skewed splits nobody tuned for: convergence for every ρ, full and diagonal families.

What is measured
----------------
Bayesian logistic regression (intercept, Gauss–Hermite expectations, float64) on three data sets:

* ``bc``: breast cancer (569 × 30, standardised, prior N(0, 1));
* ``a7a``: LIBSVM a7a, its first ``--n`` training examples (123 binary features, prior precision 5,
  the model of ``bench_continual``);
* ``wine``: UCI wine-quality-red (1 599 × 11, standardised), label "quality ≥ 6", prior N(0, 1).

Splits: ``labels K`` — the examples sorted by label and cut into ``K ∈ {2, 6, 10}`` shards (clients
holding one class only); ``pc1 K=10`` — sorted along the first principal component of X and cut into
ten shards (feature skew). Families: full and diagonal.

Methods (``numpyro_pc.federated.run``, every client every round, at most ``--rounds`` rounds): FedPC
with its defaults (the safeguarded ``ρ_k`` and the line search of
:mod:`numpyro_pc.federated.line_search`) for ``ρ ∈ {1/K (default), 0.05, 0.1, 0.2, 0.5, 1}``; FedPC
without the line search (``Safeguard(line_search=False)``, what the code did before) at the default
``ρ``; damped PVI (δ = 0.5); ADMM (default ``ρ``).

Scores per run: whether the stop rule was met, the first round with ``KL(q_t ‖ q*) ≤ 1e-8``
(``q*`` = ``pc.fit`` on the union with the same family, ``tol=1e-12``), the bytes sent up to it
(sites, global parameters, and the line search's objective values and extra candidates), the
final KL, and the wall time (compile included).

Usage::

    python benchmarks/bench_federated_skew.py --quick      # a7a: 2 000 examples; rounds <= 300
    python benchmarks/bench_federated_skew.py --data bc --families diagonal

Outputs: ``benchmarks/_out/bench_federated_skew.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import numpyro_pc as pc  # noqa: E402
from _common import machine_info, quiet, write_results  # noqa: E402
from bench_continual import model as a7a_model  # noqa: E402
from bench_federated import bc_model  # noqa: E402
from numpyro_pc.datasets.loaders import load_a7a, load_breast_cancer, load_uci  # noqa: E402

OUT = os.path.join(HERE, "_out")
TARGET_KL = 1e-8
RHOS = (0.05, 0.1, 0.2, 0.5, 1.0)


def datasets(n):
    """``(name, model, X, y)`` of the three data sets."""
    X, y, _ = load_breast_cancer()
    yield "bc", bc_model, X, y
    X, y = load_a7a("train")
    yield "a7a", a7a_model, X[:n], y[:n]
    X, quality = load_uci("wine-quality-red")
    X = (X - X.mean(0)) / X.std(0)
    yield "wine", bc_model, X, (quality >= 6).astype(float)


def splits(X, y):
    """``(name, [rows of each client])``: label-sorted with 2, 6 and 10 clients, PC1-sorted with 10."""
    by_label = np.argsort(y, kind="stable")
    for k in (2, 6, 10):
        yield f"labels K={k}", np.array_split(by_label, k)
    centred = X - X.mean(0)
    pc1 = np.linalg.svd(centred, full_matrices=False)[2][0]
    yield "pc1 K=10", np.array_split(np.argsort(centred @ pc1, kind="stable"), 10)


def methods():
    out = [("fedpc default", dict(algorithm="fedpc"))]
    out += [(f"fedpc ρ={r:g}", dict(algorithm="fedpc", rho=r)) for r in RHOS]
    out += [("fedpc no line search", dict(algorithm="fedpc", safeguard=pc.federated.Safeguard(line_search=False))),
            ("pvi δ=0.5", dict(algorithm="pvi", damping=0.5)), ("admm", dict(algorithm="admm"))]
    return out


def one_run(mdl, clients, family, rounds, central, opts):
    t0 = time.perf_counter()
    result = quiet(pc.federated.run, mdl, clients, family=family, rounds=rounds, reference=central,
                   keep_data=False, **opts)
    seconds = time.perf_counter() - t0
    kl = [h.kl_to_reference for h in result.history if h.kl_to_reference is not None]
    reach = next((h for h in result.history if h.kl_to_reference is not None and h.kl_to_reference <= TARGET_KL),
                 None)
    kinds = [h.step_kind for h in result.history if h.step_kind is not None]
    return dict(status=result.status, rounds_run=len(result.history), final_kl=kl[-1] if kl else float("nan"),
                reach_round=None if reach is None else reach.round, reach_bytes=None if reach is None else reach.bytes,
                seconds=seconds, kl=kl, anderson=kinds.count("anderson"), damped=sum(
                    1 for h in result.history if h.step is not None and h.step < 1.0))


def render(res):
    lines = [f"Logistic regression, float64, Gauss–Hermite; KL target {TARGET_KL:g} to `pc.fit` on the union "
             f"(same family); at most {res['rounds']} rounds; a7a: first {res['n']} examples.", "",
             "| data | split | family | method | status | rounds to KL ≤ 1e-8 | kB by then | rounds run | final KL "
             "| Anderson / damped rounds | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        reach = "—" if r["reach_round"] is None else str(r["reach_round"])
        kb = "—" if r["reach_bytes"] is None else f"{r['reach_bytes'] / 1e3:.0f}"
        lines.append(f"| {r['data']} | {r['split']} | {r['family']} | {r['method']} | {r['status']} | {reach} | {kb} | "
                     f"{r['rounds_run']} | {r['final_kl']:.1e} | {r['anderson']} / {r['damped']} | "
                     f"{r['seconds']:.1f} |")
    return "\n".join(lines)


def targets(res):
    out = []
    for family in sorted({r["family"] for r in res["runs"]}):
        sweep = [r for r in res["runs"] if r["family"] == family and r["method"].startswith("fedpc")
                 and "line search" not in r["method"]]
        missed = [f"{r['data']} {r['split']} {r['method']}" for r in sweep
                  if r["reach_round"] is None or r["status"] != "converged"]
        out.append(dict(target=f"{family}: FedPC, defaults and every ρ, converges and reaches KL ≤ 1e-8 on every split",
                        measured=f"{len(sweep) - len(missed)}/{len(sweep)}" + (f"; missed: {', '.join(missed)}"
                                                                               if missed else ""), met=not missed))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a7a: 2 000 examples")
    parser.add_argument("--n", type=int, default=None, help="a7a: the first n training examples (default all)")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--data", default="bc,a7a,wine", help="comma-separated data sets")
    parser.add_argument("--families", default="full,diagonal")
    parser.add_argument("--methods", default=None, help="comma-separated method names (default all)")
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args(argv)
    n = args.n or (2000 if args.quick else 16100)
    wanted = set(args.data.split(","))
    chosen = None if args.methods is None else set(args.methods.split(","))
    runs = []
    for name, mdl, X, y in datasets(n):
        if name not in wanted:
            continue
        X, y = np.asarray(X, float), np.asarray(y, float)
        for family in args.families.split(","):
            central = quiet(pc.fit, mdl, X, y, family=family, tol=1e-12, max_iters=5000)
            for split, rows in splits(X, y):
                clients = [(X[r], y[r]) for r in rows]
                for method, opts in methods():
                    if chosen is not None and method not in chosen:
                        continue
                    run = one_run(mdl, clients, family, args.rounds, central, opts)
                    run.update(data=name, split=split, family=family, method=method)
                    runs.append(run)
                    print(f"{name} {split} {family} {method}: {run['status']} after {run['rounds_run']}, "
                          f"KL {run['final_kl']:.2e}, reach {run['reach_round']}, {run['seconds']:.1f} s", flush=True)
    res = dict(n=n, rounds=args.rounds, runs=runs, machine=machine_info())
    write_results("bench_federated_skew", args.out, res, render(res), targets(res))


if __name__ == "__main__":
    main()
