"""Federated posterior correction: rounds and bytes to reach the centralised posterior.

What is measured
----------------
Bayesian logistic regression, full-covariance Gaussian, Gauss–Hermite expectations,
float64, on three splits:

* ``bc-labels``: breast cancer (569 × 30, prior N(0, 1), intercept), six clients holding
  label-sorted shards (the issue's case);
* ``bc-sorted``: breast cancer, ten clients holding shards sorted by the first feature (the
  demo's split);
* ``a7a-dir0.1``: LIBSVM a7a (its first ``--n`` examples, 123 binary features + intercept,
  prior precision 5, the model of ``bench_continual``) over ``K ∈ {10, 100}`` clients with
  label skew: for each class, client shares drawn from Dirichlet(0.1) (every client keeps at
  least one example).

Algorithms (``numpyro_pc.federated.run``, all clients every round, sites initialised at
the prior): ``fedpc`` with its safeguard for ``ρ ∈ {default = 1/K, 0.05, 0.1, 0.2, 0.5, 1}``
(``ρ`` is the floor of each client's ``ρ_k``), ``fedpc`` without the safeguard at ``ρ = 0.2``
(what the code did before), ``pvi`` (``ρ = 1``) with damping 0.5, ``admm`` (default ``ρ``,
with the safeguard), and FedPC with the bounded aggregation (``max_share=1``,
``max_shift=3``) to measure what the robustness option costs honest clients.

Differential privacy (``--only dp``): a7a (the same first ``--n`` examples), K = 10
clients with the Dirichlet(0.1) split, FedPC (default ``ρ``) with
:class:`~numpyro_pc.federated.privacy.GaussianMechanism` at ``ε ∈ {1, 4, 16, 64}``,
``δ = 1e-5`` (and ``ε = 1e8``, noise ≈ 0: the cost of the clipping alone), clipping norms ``C_h = C_S = 1`` per example, ``DP_ROUNDS`` rounds (so
``DP_ROUNDS + 1`` releases per client, the initial site included), three noise seeds each;
scored by the KL to the centralised posterior and the test accuracy of the posterior mean
on the a7a test set (16 461 examples), against the exact FedPC run and the centralised fit.

Scores per run: the first round at which ``KL(q_t ‖ q*) ≤ 1e-6`` (``q*`` = ``pc.fit`` on the
union, ``tol=1e-10``), the bytes sent up to that round (each participating client
uploads its site and downloads the global natural parameters, float64), the final KL, the
status and the wall time of the whole run (compile included: one compile per configuration).

Usage::

    python benchmarks/bench_federated.py --quick   # a7a: 3 000 examples, 40 rounds
    python benchmarks/bench_federated.py           # a7a: all 16 100 examples (slow on 2 cores)
    python benchmarks/bench_federated.py --quick --only dp    # the privacy table only
    python benchmarks/bench_federated.py --only sweep --splits "a7a-dir0.1 K=100" \
        --methods "fedpc default,pvi δ=0.5" --stop-at-target        # full a7a, runs end at KL ≤ 1e-6

Outputs: ``benchmarks/_out/bench_federated.{json,md,png}`` (``--only dp``:
``bench_federated_dp.{json,md}``).
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
from bench_continual import model, predictive_scores  # noqa: E402  (same model as benchmarks 3 and 4)
from numpyro_pc.datasets.loaders import load_a7a, load_breast_cancer  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402

OUT = os.path.join(HERE, "_out")
TARGET_KL = 1e-6
DP_EPSILONS = (1.0, 4.0, 16.0, 64.0, 1e8)  # 1e8: noise ≈ 0, what the clipping alone costs
DP_ROUNDS = 6
DP_SEEDS = (0, 1, 2)


def bc_model(X, y=None):
    """Logistic regression with an intercept, prior N(0, 1) on every coefficient."""
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def dirichlet_split(y, num_clients, alpha, seed=0):
    """Row indices of each client with label skew: per class, shares from Dirichlet(α)."""
    rng = np.random.default_rng(seed)
    parts = [[] for _ in range(num_clients)]
    for c in np.unique(y):
        rows = rng.permutation(np.flatnonzero(y == c))
        shares = rng.dirichlet(alpha * np.ones(num_clients))
        cuts = (np.cumsum(shares)[:-1] * rows.size).astype(int)
        for k, chunk in enumerate(np.split(rows, cuts)):
            parts[k].extend(chunk.tolist())
    for k in range(num_clients):  # every client keeps at least one example
        while not parts[k]:
            donor = int(np.argmax([len(p) for p in parts]))
            parts[k].append(parts[donor].pop())
    return [np.asarray(sorted(p)) for p in parts]


def methods(num_clients):
    out = [("fedpc default", dict(algorithm="fedpc"))]
    out += [(f"fedpc ρ={r:g}", dict(algorithm="fedpc", rho=r)) for r in (0.05, 0.1, 0.2, 0.5, 1.0)]
    out += [("fedpc ρ=0.2 no safeguard", dict(algorithm="fedpc", rho=0.2, safeguard=False)),
            ("pvi δ=0.5", dict(algorithm="pvi", damping=0.5)), ("admm", dict(algorithm="admm")),
            ("fedpc bounded", dict(algorithm="fedpc",
                                       robust=pc.federated.Robustness(max_share=1.0, max_shift=3.0)))]
    return out


def splits(n):
    """``(name, model, X, y, [rows of each client])`` of the three splits."""
    X, y, _ = load_breast_cancer()
    yield "bc-labels", bc_model, X, y, np.array_split(np.argsort(y, kind="stable"), 6)
    yield "bc-sorted", bc_model, X, y, np.array_split(np.argsort(X[:, 0], kind="stable"), 10)
    X, y = load_a7a("train")
    X, y = X[:n], y[:n]
    for k in (10, 100):
        yield f"a7a-dir0.1 K={k}", model, X, y, dirichlet_split(y, k, 0.1)


class _Reached(Exception):
    """Raised by the round callback of ``--stop-at-target`` once ``KL(q_t ‖ q*) ≤ TARGET_KL``."""


def run_method(mdl, clients, rounds, central, opts, stop_at_target):
    """``(history, status)`` of one federated run; with ``stop_at_target`` it ends at the first round below the target."""
    history = []

    def callback(record):
        history.append(record)
        if stop_at_target and record["kl_to_reference"] <= TARGET_KL:
            raise _Reached

    try:
        result = quiet(pc.federated.run, mdl, clients, rounds=rounds, reference=central, keep_data=False,
                       callback=callback, **opts)
    except _Reached:
        return history, "reached 1e-6"
    return result.history, result.status


def first_round_below(history, level):
    for h in history:
        if h.get("kl_to_reference", np.inf) <= level:
            return h["round"], h["bytes"]
    return None, None


def render(res):
    lines = [f"Full Gaussian, float64; KL target {TARGET_KL:g}; max {res['rounds']} rounds; a7a: first "
             f"{res['n']} examples" + ("; each run ends at the first round with KL ≤ 1e-6 (--stop-at-target)."
                                       if res.get("stop_at_target") else "."), "",
             "| split | method | converged | rounds to KL ≤ 1e-6 | kB sent by then | rounds run | final KL | "
             "ρ_k used (max) | wall s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        reach = "—" if r["reach_round"] is None else str(r["reach_round"])
        kb = "—" if r["reach_bytes"] is None else f"{r['reach_bytes'] / 1e3:.0f}"
        lines.append(f"| {r['split']} | {r['method']} | {r['status']} | {reach} | {kb} | {r['rounds_run']} | "
                     f"{r['final_kl']:.1e} | {r['rho_max']:.2f} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def targets(res):
    out = []
    for split in sorted({r["split"] for r in res["runs"]}):
        runs = [r for r in res["runs"] if r["split"] == split]
        sweep = [r for r in runs if r["method"].startswith("fedpc") and "safeguard" not in r["method"]
                 and "bounded" not in r["method"]]
        ok = all(r["reach_round"] is not None for r in sweep)
        out.append(dict(target=f"{split}: FedPC with the safeguard reaches KL 1e-6 for every ρ and its default",
                        measured=", ".join(f"{r['method']}: {r['reach_round']}" for r in sweep), met=ok))
    return out


def plot(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    combos = sorted({r["split"] for r in res["runs"]})
    fig, axes = plt.subplots(1, len(combos), figsize=(4.2 * len(combos), 3.4), squeeze=False)
    for ax, s in zip(axes[0], combos):
        for r in res["runs"]:
            if r["split"] == s:
                ax.semilogy(np.arange(1, len(r["kl"]) + 1), np.maximum(r["kl"], 1e-16), label=r["method"])
        ax.axhline(TARGET_KL, color="k", lw=0.7, ls=":")
        ax.set_title(s)
        ax.set_xlabel("round")
    axes[0][0].set_ylabel("KL(q_t ‖ centralised)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def privacy_runs(n, log):
    """FedPC on a7a K = 10 with and without the Gaussian mechanism: KL and test accuracy."""
    X, y = load_a7a("train")
    Xt, yt = load_a7a("test")
    X, y = jnp.asarray(X[:n]), jnp.asarray(y[:n])
    rows = dirichlet_split(np.asarray(y), 10, 0.1)
    clients = [(X[r], y[r]) for r in rows]
    central = quiet(pc.fit, model, X, y, family="full", tol=1e-10)
    cov = lambda q: np.linalg.inv(np.asarray(q.precision))  # noqa: E731
    acc0, _ = predictive_scores(central.mean, cov(central.state), Xt, yt)
    runs = [dict(method="centralised (pc.fit)", epsilon=None, kl=0.0, accuracy=acc0, seconds=0.0)]
    t0 = time.perf_counter()
    exact = quiet(pc.federated.run, model, clients, rounds=DP_ROUNDS, reference=central, keep_data=False)
    runs.append(dict(method=f"fedpc, no noise, {DP_ROUNDS} rounds", epsilon=None,
                     kl=exact.history[-1]["kl_to_reference"],
                     accuracy=predictive_scores(exact.state.mean, cov(exact.state), Xt, yt)[0],
                     seconds=time.perf_counter() - t0))
    for eps in DP_EPSILONS:
        mech = pc.federated.GaussianMechanism(eps, 1e-5, releases=DP_ROUNDS + 1, clip_linear=1.0, clip_precision=1.0)
        kls, accs, t0 = [], [], time.perf_counter()
        for seed in DP_SEEDS:
            res = quiet(pc.federated.run, model, clients, rounds=DP_ROUNDS, reference=central, keep_data=False,
                        privacy=mech, seed=seed)
            kls.append(res.history[-1]["kl_to_reference"])
            accs.append(predictive_scores(res.state.mean, cov(res.state), Xt, yt)[0])
        runs.append(dict(method="fedpc + Gaussian mechanism", epsilon=eps, delta=1e-5, noise=mech.noise,
                         kl=float(np.median(kls)), kl_all=kls, accuracy=float(np.mean(accs)), accuracy_all=accs,
                         epsilon_spent=res.history[-1]["epsilon"], seconds=(time.perf_counter() - t0) / len(DP_SEEDS)))
        log(f"dp ε={eps:g}: KL {np.median(kls):.3g}, accuracy {np.mean(accs):.4f}")
    return dict(n=n, clients=10, rounds=DP_ROUNDS, seeds=list(DP_SEEDS), central_accuracy=acc0, runs=runs,
                sizes=[int(r.size) for r in rows])


def render_dp(res):
    lines = [f"a7a, first {res['n']} training examples, K = {res['clients']} clients (Dirichlet(0.1) label skew), "
             f"FedPC default ρ, {res['rounds']} rounds; test accuracy of the posterior mean on the 16 461 test "
             "examples; "
             f"DP rows: median KL and mean accuracy over seeds {res['seeds']}.", "",
             "| method | ε (δ = 1e-5) | noise σ (× clip) | KL to centralised | test accuracy | accuracy cost |",
             "|---|---|---|---|---|---|"]
    for r in res["runs"]:
        eps = "—" if r["epsilon"] is None else f"{r['epsilon']:g}"
        sd = f"{r['noise']:.2f}" if "noise" in r else "—"
        lines.append(f"| {r['method']} | {eps} | {sd} | {r['kl']:.2e} | {r['accuracy']:.4f} | "
                     f"{res['central_accuracy'] - r['accuracy']:+.4f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a7a: 3 000 examples, 40 rounds")
    parser.add_argument("--n", type=int, default=None, help="a7a: use the first n training examples (default all)")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--only", choices=["sweep", "dp"], default=None, help="run one part (default both)")
    parser.add_argument("--splits", default=None, help="comma-separated split names (prefixes) of the sweep")
    parser.add_argument("--methods", default=None, help="comma-separated method names of the sweep")
    parser.add_argument("--stop-at-target", action="store_true",
                        help="end each run at the first round with KL to the centralised posterior <= 1e-6")
    args = parser.parse_args(argv)
    if args.quick:
        args.n = args.n or 3000
        args.rounds = 40
    start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - start:6.1f}s] {msg}", flush=True)  # noqa: E731
    info = machine_info()
    command = " ".join(["python benchmarks/bench_federated.py"] + (argv or sys.argv[1:]))
    if args.only != "sweep":
        res = dict(privacy_runs(args.n or 16100, log), machine=info, command=command)
        write_results("bench_federated_dp", args.out, res, render_dp(res), [dict(
            target="DP accuracy cost measured at stated (ε, δ)", measured=", ".join(
                f"ε={r['epsilon']:g}: {res['central_accuracy'] - r['accuracy']:+.4f}" for r in res["runs"]
                if r["epsilon"] is not None), met=True)])
        if args.only == "dp":
            return
    runs = []
    # a wanted name selects the splits it names or prefixes ("bc"), but "… K=10" not "… K=100"
    keep = lambda name, wanted: wanted is None or any(  # noqa: E731
        name == w or (name.startswith(w) and not name[len(w)].isdigit()) for w in wanted.split(","))
    for name, mdl, X, y, rows in splits(args.n or 16100):
        if not keep(name, args.splits):
            continue
        X, y = jnp.asarray(X), jnp.asarray(y)
        t0 = time.perf_counter()
        central = quiet(pc.fit, mdl, X, y, family="full", tol=1e-10)
        log(f"{name}: centralised fit {time.perf_counter() - t0:.1f}s")
        clients = [(X[r], y[r]) for r in rows]
        for method, opts in methods(len(rows)):
            if args.methods is not None and method not in args.methods.split(","):
                continue
            t0 = time.perf_counter()
            history, status = run_method(mdl, clients, args.rounds, central, opts, args.stop_at_target)
            seconds = time.perf_counter() - t0
            kl = np.asarray([h.get("kl_to_reference", np.nan) for h in history])
            reach, sent = first_round_below(history, TARGET_KL)
            runs.append(dict(split=name, clients=len(rows), method=method, reach_round=reach, reach_bytes=sent,
                             final_kl=float(kl[-1]) if kl.size else float("nan"), status=status,
                             seconds=seconds, kl=kl.tolist(), rounds_run=len(history),
                             rho_max=max(h["rho_max"] for h in history), sizes=[int(r.size) for r in rows]))
            log(f"{name} {method}: reach {reach}, status {status}, {seconds:.1f}s")
            # written after every run: a run stopped by a time limit keeps the rows it finished
            res = dict(machine=info, n=int(args.n or 16100), rounds=args.rounds, runs=runs, command=command,
                       stop_at_target=args.stop_at_target)
            write_results("bench_federated", args.out, res, render(res), targets(res), lambda p: plot(res, p))


if __name__ == "__main__":
    main()
