"""Streaming sparse GP on iid streams: accuracy and time against the number of batches.

What is measured
----------------
For each UCI set (protein-tertiary-structure 45,730 × 9, power-plant 9,568 × 4,
concrete 1,030 × 8): a random 90/10 split (``numpy`` seed 0; ``--n-train`` subsamples the
training split, ``--n-test`` the test split), inputs and target standardised with the
training statistics, ARD RBF (lengthscales 1, variance 1), noise 0.1, M = ``--M``
inducing inputs, float64. The training split is streamed in B = 1, 2, 5, 10, 20 iid
batches (random order, seed 1), each run from scratch:

* **Bui**: ``StreamingSparseGP(..., memory_size=0)``: Bui et al.'s collapsed update
  (hyperparameters, noise and Z learned at every batch; noise pooled over batches by
  ``noise_memory``, the library default);
* **corrected**: the library default, ``memory_size=None`` (a memory of past rows whose
  exact likelihood replaces their sites in the old term, ``numpyro_pc.gp.corrected``);
* **GPJax**: batch SGPR (``CollapsedVariationalGaussian`` + ``collapsed_elbo``) fitted with
  ``gpx.fit_lbfgs`` (DESIGN §6) on all training rows (all data seen at the end of every
  stream), ``--baseline-iters`` iterations, the same M, Z initialised at random training rows.

Both streams use L-BFGS with the library's stopping rule (``ftol``/``gtol``, ≤ ``max_iters``);
iterations per batch are reported. Times are wall-clock and include compilation (a fresh
process per dataset, no persistent cache: ``jax_compilation_cache_dir`` unset).

Usage::

    python benchmarks/bench_gp_stream.py                       # all three sets, protein subsampled to 10,000
    python benchmarks/bench_gp_stream.py --n-train 0           # protein in full (slow on 2 cores)
    python benchmarks/bench_gp_stream.py --datasets concrete --batches 1,10

Outputs: ``benchmarks/_out/bench_gp_stream.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import gpjax as gpx  # noqa: E402

from _common import machine_info, write_results  # noqa: E402
from bench_gp_power import gpjax_predict, gpjax_sgpr, metrics  # noqa: E402
from numpyro_pc.datasets import load_uci  # noqa: E402
from numpyro_pc.gp import StreamingSparseGP  # noqa: E402

OUT = os.path.join(HERE, "_out")
DATASETS = ("protein-tertiary-structure", "power-plant", "concrete")


def data(name, n_train, n_test, seed=0):
    X, y = load_uci(name)
    perm = np.random.default_rng(seed).permutation(len(y))
    n_tr = int(0.9 * len(y))
    tr, te = perm[:n_tr], perm[n_tr:]
    if n_train and n_train < len(tr):
        tr = tr[:n_train]
    if n_test and n_test < len(te):
        te = te[:n_test]
    mx, sx, my, sy = X[tr].mean(0), X[tr].std(0), y[tr].mean(), y[tr].std()
    return (X[tr] - mx) / sx, (y[tr] - my) / sy, (X[te] - mx) / sx, (y[te] - my) / sy


def stream(X, y, Xt, yt, B, M, memory_size, seed=1):
    sgp = StreamingSparseGP(gpx.kernels.RBF(lengthscale=jnp.ones(X.shape[1]), variance=1.0), M, noise_variance=0.1,
                            memory_size=memory_size, seed=seed)
    t0 = time.perf_counter()
    for idx in np.array_split(np.random.default_rng(seed).permutation(len(y)), B):
        sgp = sgp.update(X[idx], y[idx])
    total = time.perf_counter() - t0
    mu, var = sgp.predict_y(Xt)
    return dict(B=B, total_s=total, seconds=[h["seconds"] for h in sgp.history],
                iterations=[h["iterations"] for h in sgp.history], **metrics(mu, var, yt))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--datasets", default=",".join(DATASETS))
    ap.add_argument("--batches", default="1,2,5,10,20")
    ap.add_argument("--M", type=int, default=64)
    ap.add_argument("--n-train", type=int, default=10000, help="subsample the training split (0: all rows)")
    ap.add_argument("--n-test", type=int, default=2000)
    ap.add_argument("--baseline-iters", type=int, default=500)
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    info = machine_info()
    res = dict(machine=info, args=vars(args), sets={})
    for name in args.datasets.split(","):
        X, y, Xt, yt = data(name, args.n_train, args.n_test)
        Z = X[np.random.default_rng(0).choice(len(y), args.M, replace=False)]
        q, D, t = gpjax_sgpr(X, y, Z, args.baseline_iters)
        mu, var = gpjax_predict(q, D, Xt)
        out = dict(n_train=len(y), n_test=len(yt), dim=X.shape[1], gpjax=dict(total_s=t, **metrics(mu, var, yt)),
                   bui={}, corrected={})
        print(f"{name}: GPJax {out['gpjax']}", flush=True)
        for B in [int(b) for b in args.batches.split(",")]:
            for method, mem in (("corrected", None), ("bui", 0)):
                out[method][B] = r = stream(X, y, Xt, yt, B, args.M, mem)
                print(f"  {method:9s} B={B:2d} nlpd {r['nlpd']:.3f} rmse {r['rmse']:.3f} {r['total_s']:.1f} s "
                      f"its {r['iterations']}", flush=True)
        res["sets"][name] = out
    table, targets = render(res)
    return write_results("bench_gp_stream", args.out, res, table, targets, plot_fn=lambda p: plot(res, p))


def render(res):
    info = res["machine"]
    a = res["args"]
    lines = [f"Machine: {info['cpu']}, {info['cores']} cores (shared with other jobs), JAX {info['jax']} "
             f"({info['backend']}); load average at start {', '.join(f'{x:.1f}' for x in info['loadavg'])}; "
             f"numpyro_pc {info['numpyro_pc']}. M = {a['M']}, float64, times include compilation.", "",
             "| data (n train × d) | method | B | test NLPD | RMSE | total s | s / batch | its / batch (median, max) |",
             "|---|---|---|---|---|---|---|---|"]
    targets = []
    for name, s in res["sets"].items():
        g = s["gpjax"]
        tag = f"{name} ({s['n_train']} × {s['dim']})"
        lines.append(f"| {tag} | GPJax fit_lbfgs ({a['baseline_iters']} its) | all | {g['nlpd']:.3f} | "
                     f"{g['rmse']:.3f} | {g['total_s']:.1f} | – | – |")
        for method in ("bui", "corrected"):
            for B, r in s[method].items():
                its = r["iterations"]
                lines.append(f"| {tag} | {method} | {B} | {r['nlpd']:.3f} | {r['rmse']:.3f} | {r['total_s']:.1f} | "
                             f"{r['total_s'] / int(B):.2f} | {int(np.median(its))}, {max(its)} |")
        c = s["corrected"]
        Bs = sorted(int(b) for b in c)
        if 1 in Bs and 10 in Bs:
            d1 = c[10]["nlpd"] - c[1]["nlpd"]
            dg = c[10]["nlpd"] - g["nlpd"]
            db = s["bui"][10]["nlpd"] - s["bui"][1]["nlpd"]
            targets += [dict(target=f"{name}: 10 batches within 0.05 nats of 1 batch (corrected)",
                             measured=f"{d1:+.3f} (Bui: {db:+.3f})", met=d1 <= 0.05),
                        dict(target=f"{name}: 10 batches within 0.1 nats of GPJax batch SGPR",
                             measured=f"{dg:+.3f}", met=dg <= 0.1),
                        dict(target=f"{name}: 1-batch fit ≤ 1.5× GPJax fit_lbfgs (incl. compile)",
                             measured=f"{c[1]['total_s'] / g['total_s']:.2f}×", met=c[1]["total_s"] <= 1.5 * g["total_s"]),
                        dict(target=f"{name}: 10-batch stream ≤ 2× one GPJax fit",
                             measured=f"{c[10]['total_s'] / g['total_s']:.2f}×",
                             met=c[10]["total_s"] <= 2 * g["total_s"])]
    return "\n".join(lines), targets


def plot(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = res["sets"]
    fig, axes = plt.subplots(1, len(sets), figsize=(4.5 * len(sets), 3.5), squeeze=False)
    for ax, (name, s) in zip(axes[0], sets.items()):
        for method, style in (("bui", "C1o-"), ("corrected", "C0o-")):
            Bs = sorted(int(b) for b in s[method])
            ax.plot(Bs, [s[method][B]["nlpd"] for B in Bs], style, label=method)
        ax.axhline(s["gpjax"]["nlpd"], color="k", ls=":", label="GPJax batch SGPR")
        ax.set_xscale("log")
        ax.set_xlabel("number of batches")
        ax.set_ylabel("test NLPD")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
