"""Reproduction of Bui, Nguyen & Turner (2017): the 1-D toy stream and banana classification.

What is measured
----------------
**Toy regression** (``bui2017/reg_toy``, 150 points, batches ordered by input as in the
reference's ``iid=False`` runs, 3 batches, M = 10, RBF initialised at variance 1.0,
lengthscale 0.8, noise 1e-3, keep 70 % of the old Z + new inputs): predictive mean ± 2 sd
and the inducing inputs after each batch, for VFE and Power-EP α = 0.5, beside batch
SGPR (the same code with one batch = Titsias' SGPR). Hyperparameters, noise and Z are
learned at every batch (L-BFGS, ≤ ``--iters`` iterations); the noise by Bui's original
update (``noise_memory=False``: from the current batch only; ``memory_size=0``: no
correction memory; ``ftol=0``: L-BFGS runs to ``gtol`` or the iteration cap as in the reference). Output: one PNG panel row per
method, plus the final test-free summary (bound, hyperparameters).

**Banana** (400 train / 4,900 test, M = 30, 3 batches, keep 80 % of the old Z; Bernoulli
probit; RBF initialised at variance 1, lengthscale 1): test error after each batch for
batches sorted by the first input and for iid batches (random order, ``numpy`` seed
``--seed``), for Bui's uncollapsed update and for the posterior-corrected variant with a
memory of all past examples (``memory_size = 400``) and of 40 examples; batch SVGP is the
same uncollapsed bound with all 400 points in one batch. Reference numbers (Bui et al.
2017 / DESIGN §2): sorted ≈ 0.28 / 0.15 / 0.10, iid ≈ 0.12 / 0.10 / 0.10, batch 0.10.

Usage::

    python benchmarks/bench_gp_bui.py            # both experiments (~3-5 min on 2 shared cores)
    python benchmarks/bench_gp_bui.py --quick    # fewer optimiser iterations

Outputs: ``benchmarks/_out/bench_gp_bui.{json,md}``, ``bench_gp_bui.png`` (toy panels),
``bench_gp_bui_banana.png`` (classification maps after the last batch).
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
import gpjax as gpx  # noqa: E402

from _common import machine_info, write_results  # noqa: E402
from numpyro_pc.datasets.loaders import load_banana, load_bui2017_toy  # noqa: E402
from numpyro_pc.gp import StreamingSparseGP  # noqa: E402

OUT = os.path.join(HERE, "_out")
REF = dict(sorted=[0.28, 0.15, 0.10], iid=[0.12, 0.10, 0.10], batch=0.10)


def toy(iters, seed):
    X, y = load_bui2017_toy()
    order = np.argsort(X[:, 0])
    X, y = X[order], y[order]
    grid = np.linspace(X.min() - 0.5, X.max() + 0.5, 300)[:, None]
    out = {}
    for name, alpha in (("VFE", 0.0), ("Power-EP α=0.5", 0.5)):
        sgp = StreamingSparseGP(gpx.kernels.RBF(lengthscale=0.8, variance=1.0), 10, noise_variance=1e-3, alpha=alpha,
                                keep_fraction=0.7, max_iters=iters, seed=seed, noise_memory=False,
                                memory_size=0, ftol=0.0)
        panels = []
        for idx in np.array_split(np.arange(150), 3):
            sgp = sgp.update(X[idx], y[idx])
            mu, var = sgp.predict_y(grid)
            panels.append(dict(seen=int(idx[-1]) + 1, mu=mu, sd=np.sqrt(var), Z=np.asarray(sgp.state.Z)[:, 0],
                               Zmu=sgp.predict(np.asarray(sgp.state.Z))[0]))
        batch = StreamingSparseGP(gpx.kernels.RBF(lengthscale=0.8, variance=1.0), 10, noise_variance=1e-3,
                                  alpha=alpha, max_iters=3 * iters, seed=seed, ftol=0.0).update(X, y)
        mu, var = batch.predict_y(grid)
        panels.append(dict(seen=150, mu=mu, sd=np.sqrt(var), Z=np.asarray(batch.state.Z)[:, 0],
                           Zmu=batch.predict(np.asarray(batch.state.Z))[0]))
        out[name] = dict(panels=panels, summary=sgp.summary(), batch_summary=batch.summary())
    return X, y, grid, out


def banana(iters, seed):
    X, y = load_banana("train")
    Xt, yt = load_banana("test")
    orders = dict(sorted=np.argsort(X[:, 0]), iid=np.random.default_rng(seed).permutation(len(y)))
    res = {}
    models = {}
    for order_name, order in orders.items():
        for method, mem in (("Bui uncollapsed", 0), ("corrected, memory 40", 40), ("corrected, memory all", 400)):
            t0 = time.perf_counter()
            sgp = StreamingSparseGP(gpx.kernels.RBF(), 30, likelihood=gpx.likelihoods.Bernoulli(), keep_fraction=0.8,
                                    memory_size=mem, max_iters=iters, seed=seed)
            errs = []
            for idx in np.array_split(order, 3):
                sgp = sgp.update(X[idx], y[idx])
                p, _ = sgp.predict_y(Xt)
                errs.append(float(np.mean((p > 0.5) != yt)))
            res[f"{order_name} / {method}"] = dict(errors=errs, seconds=time.perf_counter() - t0)
            models[f"{order_name} / {method}"] = sgp
    sgp = StreamingSparseGP(gpx.kernels.RBF(), 30, likelihood=gpx.likelihoods.Bernoulli(), max_iters=3 * iters,
                            seed=seed).update(X, y)
    p, _ = sgp.predict_y(Xt)
    res["batch SVGP (one batch)"] = dict(errors=[float(np.mean((p > 0.5) != yt))])
    models["batch SVGP (one batch)"] = sgp
    return res, models, (X, y)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.iters = 60
    info = machine_info()
    X, y, grid, toy_res = toy(args.iters, args.seed)
    ban, models, (Xb, yb) = banana(args.iters, args.seed)
    os.makedirs(args.out, exist_ok=True)
    plot_banana(models, Xb, yb, os.path.join(args.out, "bench_gp_bui_banana.png"))
    res = dict(machine=info, iters=args.iters, seed=args.seed, reference=REF, banana=ban,
               toy={k: dict(summary=v["summary"], batch_summary=v["batch_summary"]) for k, v in toy_res.items()})
    table, targets = render(res)
    return write_results("bench_gp_bui", args.out, res, table, targets,
                         plot_fn=lambda p: plot_toy(X, y, grid, toy_res, p))


def render(res):
    info = res["machine"]
    lines = [f"Machine: {info['cpu']}, {info['cores']} cores, JAX {info['jax']} ({info['backend']}); numpyro_pc "
             f"{info['numpyro_pc']}; load average at start {', '.join(f'{x:.1f}' for x in info['loadavg'])}. "
             f"L-BFGS ≤ {res['iters']} iterations per batch; seed {res['seed']}.", "",
             "Toy regression (ordered batches), learned hyperparameters after the last batch:", "",
             "| method | bounds per batch | lengthscale | variance | noise |", "|---|---|---|---|---|"]
    for name, t in res["toy"].items():
        hp = t["summary"]["hyperparameters"][-1]
        lines.append(f"| {name} | {', '.join(f'{b:.2f}' for b in t['summary']['bound'])} | "
                     f"{hp['kernel.lengthscale']:.3f} | {hp['kernel.variance']:.3f} | {hp['noise']:.2e} |")
        hb = t["batch_summary"]["hyperparameters"][-1]
        lines.append(f"| {name}, batch | {t['batch_summary']['bound'][0]:.2f} | {hb['kernel.lengthscale']:.3f} | "
                     f"{hb['kernel.variance']:.3f} | {hb['noise']:.2e} |")
    lines += ["", "Banana test error after each batch (reference: sorted 0.28 / 0.15 / 0.10, iid 0.12 / 0.10 / 0.10, "
              "batch 0.10):", "", "| order / method | batch 1 | batch 2 | batch 3 | seconds |", "|---|---|---|---|---|"]
    for k, v in res["banana"].items():
        e = v["errors"] + [None] * (3 - len(v["errors"]))
        lines.append(f"| {k} | " + " | ".join("–" if x is None else f"{x:.3f}" for x in e)
                     + f" | {v.get('seconds', float('nan')):.1f} |")
    targets = []
    for order in ("sorted", "iid"):
        errs = res["banana"][f"{order} / Bui uncollapsed"]["errors"]
        dev = max(abs(a - b) for a, b in zip(errs, REF[order]))
        targets.append(dict(target=f"{order}: Bui uncollapsed within ±0.02 of the reference per batch",
                            measured=f"{' / '.join(f'{e:.3f}' for e in errs)} (max dev {dev:.3f})", met=dev <= 0.02))
        for mem in ("40", "all"):
            c = res["banana"][f"{order} / corrected, memory {mem}"]["errors"][-1]
            targets.append(dict(target=f"{order}: corrected (memory {mem}) final error ≤ Bui's",
                                measured=f"{c:.3f} vs {errs[-1]:.3f}", met=c <= errs[-1]))
    b = res["banana"]["batch SVGP (one batch)"]["errors"][0]
    targets.append(dict(target="batch SVGP within ±0.02 of 0.10", measured=f"{b:.3f}", met=abs(b - 0.10) <= 0.02))
    return "\n".join(lines), targets


def plot_toy(X, y, grid, toy_res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(toy_res), 4, figsize=(15, 3.2 * len(toy_res)), sharey=True)
    for row, (name, t) in zip(axes, toy_res.items()):
        for j, (ax, p) in enumerate(zip(row, t["panels"])):
            ax.plot(X[:, 0], y, ".", color="0.75", ms=3)
            ax.plot(X[:p["seen"], 0], y[:p["seen"]], "k.", ms=3)
            ax.plot(grid[:, 0], p["mu"], "C0")
            ax.fill_between(grid[:, 0], p["mu"] - 2 * p["sd"], p["mu"] + 2 * p["sd"], color="C0", alpha=0.2)
            ax.plot(p["Z"], p["Zmu"], "o", color="C3", ms=4)
            ax.set_title(f"{name}: " + (f"after batch {j + 1}" if j < 3 else "batch SGPR"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_banana(models, X, y, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = np.linspace(-3, 3, 80)
    G = np.stack(np.meshgrid(g, g), -1).reshape(-1, 2)
    keys = ["sorted / Bui uncollapsed", "sorted / corrected, memory all", "iid / Bui uncollapsed",
            "batch SVGP (one batch)"]
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 4))
    for ax, k in zip(axes, keys):
        p, _ = models[k].predict_y(G)
        ax.contourf(g, g, p.reshape(80, 80), levels=20, cmap="RdBu_r", alpha=0.6)
        ax.contour(g, g, p.reshape(80, 80), levels=[0.5], colors="k")
        ax.scatter(X[:, 0], X[:, 1], c=y, s=4, cmap="RdBu_r", edgecolors="none")
        Z = np.asarray(models[k].state.Z)
        ax.plot(Z[:, 0], Z[:, 1], "k^", ms=4)
        ax.set_title(k, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
