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
iterations per batch are reported. Times are wall-clock and **include compilation**: JAX is
warmed up once (backend start-up, a trivial program) so that no method pays the process's
one-time costs, then every timed run starts from cleared compilation caches
(``jax.clear_caches()``; no persistent cache: ``benchmarks/_common.py`` turns the package's off), so each
run compiles everything it uses, as a fresh process would. ``--repeats`` rounds run every
method in turn (interleaved, so load drift on a shared machine hits all of them alike) and
the tables give medians; XLA compile seconds (``jax.monitoring``) are reported beside.

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
from numpyro_pc.datasets.loaders import load_uci  # noqa: E402
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


class CompileClock:
    """Sums XLA ``backend_compile`` seconds (``jax.monitoring``) while a run is timed."""

    seconds = 0.0

    @classmethod
    def listen(cls, event, duration, **kwargs):
        if "backend_compile" in event:
            cls.seconds += duration


jax.monitoring.register_event_duration_secs_listener(CompileClock.listen)


def cold(fn):
    """``fn()`` from cleared compilation caches: ``(result, wall seconds, XLA compile seconds)``."""
    jax.clear_caches()
    CompileClock.seconds = 0.0
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0, CompileClock.seconds


def stream(X, y, B, M, memory_size, seed=1):
    sgp = StreamingSparseGP(gpx.kernels.RBF(lengthscale=jnp.ones(X.shape[1]), variance=1.0), M, noise_variance=0.1,
                            memory_size=memory_size, seed=seed)
    for idx in np.array_split(np.random.default_rng(seed).permutation(len(y)), B):
        sgp = sgp.update(X[idx], y[idx])
    return sgp


def _median_run(runs):
    t = [r[1] for r in runs]
    c = [r[2] for r in runs]
    return dict(total_s=float(np.median(t)), compile_s=float(np.median(c)), total_s_runs=t, compile_s_runs=c)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--datasets", default=",".join(DATASETS))
    ap.add_argument("--batches", default="1,2,5,10,20")
    ap.add_argument("--M", type=int, default=64)
    ap.add_argument("--n-train", type=int, default=10000, help="subsample the training split (0: all rows)")
    ap.add_argument("--n-test", type=int, default=2000)
    ap.add_argument("--baseline-iters", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved cold runs per method (medians reported)")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    info = machine_info()
    res = dict(machine=info, args=vars(args), sets={})
    jax.jit(lambda a: a + 1)(jnp.ones(3)).block_until_ready()       # JAX start-up, paid by no method
    Bs = [int(b) for b in args.batches.split(",")]
    for name in args.datasets.split(","):
        X, y, Xt, yt = data(name, args.n_train, args.n_test)
        Z = X[np.random.default_rng(0).choice(len(y), args.M, replace=False)]
        runs = {("gpjax", 0): []}
        runs.update({(m, B): [] for B in Bs for m in ("corrected", "bui")})
        fits = {}
        for _ in range(args.repeats):
            for key in runs:
                method, B = key
                if method == "gpjax":
                    (fit, _), t, c = cold(lambda: gpjax_sgpr(X, y, Z, args.baseline_iters)[::2])
                else:
                    fit, t, c = cold(lambda: stream(X, y, B, args.M, None if method == "corrected" else 0))
                runs[key].append((fit, t, c))
                fits[key] = fit
                print(f"  {name} {method:9s} B={B:2d} {t:.1f} s (compile {c:.1f} s)", flush=True)
        mu, var = gpjax_predict(fits["gpjax", 0], gpx.Dataset(X=jnp.asarray(X), y=jnp.asarray(y)[:, None]), Xt)
        out = dict(n_train=len(y), n_test=len(yt), dim=X.shape[1],
                   gpjax=dict(**_median_run(runs["gpjax", 0]), **metrics(mu, var, yt)), bui={}, corrected={})
        for (method, B), rs in runs.items():
            if method == "gpjax":
                continue
            sgp = fits[method, B]
            mu, var = sgp.predict_y(Xt)
            out[method][B] = r = dict(B=B, **_median_run(rs), seconds=[h["seconds"] for h in sgp.history],
                                      iterations=[h["iterations"] for h in sgp.history],
                                      evaluations=[h["evaluations"] for h in sgp.history], **metrics(mu, var, yt))
            print(f"  {method:9s} B={B:2d} nlpd {r['nlpd']:.3f} rmse {r['rmse']:.3f} {r['total_s']:.1f} s "
                  f"its {r['iterations']}", flush=True)
        print(f"{name}: GPJax {out['gpjax']}", flush=True)
        res["sets"][name] = out
    table, targets = render(res)
    return write_results("bench_gp_stream", args.out, res, table, targets, plot_fn=lambda p: plot(res, p))


def render(res):
    info = res["machine"]
    a = res["args"]
    lines = [f"Machine: {info['cpu']}, {info['cores']} cores (shared with other jobs), JAX {info['jax']} "
             f"({info['backend']}); load average at start {', '.join(f'{x:.1f}' for x in info['loadavg'])}; "
             f"numpyro_pc {info['numpyro_pc']}. M = {a['M']}, float64; times are medians of {a['repeats']} "
             "interleaved cold runs and include compilation (XLA compile seconds beside).", "",
             "| data (n train × d) | method | B | test NLPD | RMSE | total s | compile s | its / batch (median, max) |",
             "|---|---|---|---|---|---|---|---|"]
    targets = []
    for name, s in res["sets"].items():
        g = s["gpjax"]
        tag = f"{name} ({s['n_train']} × {s['dim']})"
        lines.append(f"| {tag} | GPJax fit_lbfgs ({a['baseline_iters']} its) | all | {g['nlpd']:.3f} | "
                     f"{g['rmse']:.3f} | {g['total_s']:.1f} | {g['compile_s']:.1f} | – |")
        for method in ("bui", "corrected"):
            for B, r in s[method].items():
                its = r["iterations"]
                lines.append(f"| {tag} | {method} | {B} | {r['nlpd']:.3f} | {r['rmse']:.3f} | {r['total_s']:.1f} | "
                             f"{r['compile_s']:.1f} | {int(np.median(its))}, {max(its)} |")
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
