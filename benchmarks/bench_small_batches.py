"""Latency of streaming updates with small batches: examples arriving a few at a time.

What is measured
----------------
Bayesian logistic regression with an intercept on scikit-learn's breast-cancer data (569 ×
30, standardised; prior precision 1, full Gaussian, d = 31; the demo's model). The first 50
examples are fitted with ``pc.fit``; the remaining 519 arrive in batches of 1–20 examples
(sizes drawn with ``numpy`` seed ``--seed``), so every update has a new total and most have
a new batch size. For ``correction="none"`` (VCL) and ``"exact"`` we report per update:

* wall time (median, 90th percentile, maximum; the first update is reported separately —
  it compiles the buckets the stream starts in);
* XLA compilations (counted with ``jax.monitoring``; a compiled program is reused when
  shapes recur, so this counts shapes the update had not seen before).

Against it: refitting ``pc.fit`` from the prior on all data seen so far after every batch
(what a user without updates would do), timed over the same stream; ``--refit-every``
thins that loop for speed (its per-batch time is what is compared). Final KL of each
stream to the batch posterior fitted on all 569 examples is reported as a check (``exact``
must be at solver tolerance; ``none`` is VCL's approximation error).

Fairness rules
--------------
* Same data, same process, float64 (``jax_enable_x64``), one BLAS thread by default.
* Every method pays its own compilations inside the timed region: that is the point of
  this benchmark (a stream keeps producing new sizes).

Usage::

    python benchmarks/bench_small_batches.py            # full stream (~1–2 min on 2 cores)
    python benchmarks/bench_small_batches.py --quick    # first 200 examples (~30 s)

Outputs: ``benchmarks/_out/bench_small_batches.json``, ``.md`` and ``.png`` (per-update
time and compilations along the stream).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as in bench_continual.py: no BLAS/XLA oversubscription

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import numpyro_pc as pc  # noqa: E402
from _common import machine_info, quiet, write_results  # noqa: E402
from numpyro_pc.datasets.loaders import load_breast_cancer  # noqa: E402
from numpyro_pc.ops.diagnostics import count_compilations  # noqa: E402

OUT = os.path.join(HERE, "_out")
POLICIES = ("none", "exact")


def demo_model(X, y=None):
    """The demo's model: intercept and weights with prior precision 1, Bernoulli logits."""
    import numpyro
    import numpyro.distributions as dist

    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def stream(X, y, first, sizes, policy, counter):
    post = pc.fit(demo_model, X[:first], y[:first], family="full")
    jax.block_until_ready(post.state)
    times, compiles, start = [], [], first
    for size in sizes:
        before, t0 = counter.count, time.perf_counter()
        post = quiet(post.update, X[start:start + size], y[start:start + size], correction=policy)
        jax.block_until_ready(post.state)
        times.append(time.perf_counter() - t0)
        compiles.append(counter.count - before)
        start += size
    return post, np.array(times), np.array(compiles)


def refits(X, y, first, sizes, every, counter):
    ends = first + np.cumsum(sizes)
    times, compiles = [], []
    for end in ends[::every]:
        before, t0 = counter.count, time.perf_counter()
        post = quiet(pc.fit, demo_model, X[:end], y[:end], family="full")
        jax.block_until_ready(post.state)
        times.append(time.perf_counter() - t0)
        compiles.append(counter.count - before)
    return np.array(times), np.array(compiles)


def summary(times, compiles):
    steady = times[1:]
    return dict(first_s=float(times[0]), median_s=float(np.median(steady)), p90_s=float(np.percentile(steady, 90)),
                max_s=float(np.max(steady)), total_s=float(np.sum(times)), compiles_per_update=float(np.mean(compiles)),
                compiles_after_first=int(np.sum(compiles[1:])), updates=int(times.size))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="stream only the first 200 examples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--refit-every", type=int, default=3, help="time the refit after every k-th batch")
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args()
    X, y, _ = load_breast_cancer()
    order = np.random.default_rng(args.seed).permutation(X.shape[0])
    X, y = X[order], y[order]
    n = 200 if args.quick else X.shape[0]
    first, rng = 50, np.random.default_rng(args.seed + 1)
    sizes = []
    while first + sum(sizes) < n:
        sizes.append(int(min(rng.integers(1, 21), n - first - sum(sizes))))
    info = machine_info()
    result = dict(machine=info, N=n, first=first, sizes=sizes, policies={})
    with count_compilations() as counter:
        batch = pc.fit(demo_model, X[:n], y[:n], family="full", tol=1e-12)
        for policy in POLICIES:
            post, times, compiles = stream(X, y, first, sizes, policy, counter)
            result["policies"][policy] = dict(summary(times, compiles), kl_to_batch=float(post.kl(batch)),
                                              times=times, compiles=compiles)
            print(f"{policy}: median {np.median(times[1:]) * 1e3:.1f} ms/update, "
                  f"{np.mean(compiles):.2f} compilations/update", flush=True)
        times, compiles = refits(X, y, first, sizes, args.refit_every, counter)
        result["refit"] = dict(summary(times, compiles), times=times, compiles=compiles)

    refit = result["refit"]
    lines = [f"Machine: {info['cpu']}, {info['cores']} cores, JAX {info['jax']} ({info['backend']}), "
             f"OPENBLAS_NUM_THREADS={info['openblas_threads']}; numpyro_pc {info['numpyro_pc']}; load average "
             f"at start {', '.join(f'{x:.1f}' for x in info['loadavg'])}. Breast cancer, N={n} (first {first} "
             f"fitted, then {len(sizes)} batches of 1–20), full Gaussian d=31, float64.", "",
             "| method | first update s | median s/update | p90 s | max s | compilations/update "
             "(after the first) | KL to batch | refit / method (median) |", "|---|---|---|---|---|---|---|---|"]
    for policy, r in result["policies"].items():
        lines.append(f"| update(correction={policy!r}) | {r['first_s']:.3f} | {r['median_s']:.4f} | {r['p90_s']:.4f} "
                     f"| {r['max_s']:.3f} | {r['compiles_after_first'] / max(r['updates'] - 1, 1):.2f} | "
                     f"{r['kl_to_batch']:.2e} | {refit['median_s'] / r['median_s']:.1f}× |")
    lines.append(f"| pc.fit from the prior on all data so far (every {args.refit_every}th batch) | "
                 f"{refit['first_s']:.3f} | {refit['median_s']:.4f} | {refit['p90_s']:.4f} | {refit['max_s']:.3f} | "
                 f"{refit['compiles_after_first'] / max(refit['updates'] - 1, 1):.2f} | — | 1.0× |")
    exact = result["policies"]["exact"]
    targets = [dict(target="exact update faster per batch than refitting (median)",
                    measured=f"{refit['median_s'] / exact['median_s']:.1f}×", met=exact["median_s"] < refit["median_s"]),
               dict(target="exact stream ends at the batch posterior (KL < 1e-10)",
                    measured=f"{exact['kl_to_batch']:.1e}", met=exact["kl_to_batch"] < 1e-10)]

    def plot(path):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax_t, ax_c) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
        for policy, r in result["policies"].items():
            ax_t.plot(np.arange(1, r["updates"] + 1), np.asarray(r["times"]) * 1e3, ".-", lw=0.8, label=policy)
            ax_c.plot(np.arange(1, r["updates"] + 1), r["compiles"], ".", label=policy)
        ax_t.plot(1 + np.arange(0, len(sizes), args.refit_every), np.asarray(refit["times"]) * 1e3, "k.-", lw=0.8,
                  label="refit with pc.fit")
        ax_t.set_yscale("log")
        ax_t.set_ylabel("wall time per batch (ms)")
        ax_t.legend()
        ax_c.set_ylabel("XLA compilations")
        ax_c.set_xlabel("batch")
        fig.suptitle("Small-batch stream, breast cancer (batches of 1–20 examples)")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    write_results("bench_small_batches", args.out, result, "\n".join(lines), targets, plot)


if __name__ == "__main__":
    main()
