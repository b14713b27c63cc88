"""Leave-one-out on breast cancer: predicted parameter change of each deletion method vs exact retraining.

What is measured
----------------
Bayesian logistic regression with an intercept on scikit-learn's breast-cancer data
(569 × 30, features standardised), prior ``b, w_j ~ Normal(0, 1)`` (prior precision 1),
full Gaussian (d = 31), ``post = pc.fit(model, X, y, family="full", tol=1e-12)`` (``gh``
rule). For every example ``i`` (or a random subset, see below):

* **exact** LOO change ``Δ_i = m_{∖i} − m`` from ``post.delete([i], method="retrain")``
  (the solver run to ``tol=1e-12`` on the other 568 examples, started from ``q``). The
  package default ``tol=1e-8`` is too loose for a LOO reference: the residual is relative
  to the whole posterior, so removing a well-classified example (``ĝ_i ≈ 0``) leaves a
  residual below 1e-8 and the "retrain" returns ``q`` unchanged (``Δ_i = 0`` exactly);
  ``--tol`` changes both tolerances;
* **predicted** change from ``remove_site`` (memory-perturbation equation,
  ``m + S_{∖i}⁻¹ ĝ_i``), ``influence`` (``m + H_{∖i}⁻¹ ∇ℓ_i(m)``, Hessian at the mean) and
  ``tracin`` (``m + ∇ℓ_i(m)``).

Scores per method: the Pearson correlation between predicted and exact changes pooled over
all examples and coordinates (``n × d`` pairs); the per-coordinate correlation (over the
examples, for each of the d coordinates) summarised by its median and minimum; the median
relative error ``‖Δ̂_i − Δ_i‖ / ‖Δ_i‖``; and the median wall time per deletion.

All 569 examples are used when the measured time of one retrain (after a warm-up call),
times 569, fits in ``--budget`` seconds; otherwise a random subset of
``max(150, budget / t_retrain)`` examples (``numpy`` seed ``--seed``), and the output says so.

Fairness rules
--------------
* Same data, same process, same fitted posterior, float64 (``jax_enable_x64``).
* Compile time separate: each method is called once before timing (all deletions of one
  example have the same shapes, so one compile per method); per-deletion times are medians
  over the examples. Correlations are computed on the exact outputs, not timed.

Usage::

    python benchmarks/bench_loo.py            # all 569 examples (~6-7 min on 2 cores; influence's ~0.5 s per call dominates)
    python benchmarks/bench_loo.py --quick    # 40 random examples (~1 min)

Outputs: ``benchmarks/_out/bench_loo.json``, ``bench_loo.md``, ``bench_loo.png``
(scatter of predicted vs exact change, one panel per method).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import numpyro_pc as pc  # noqa: E402
from _common import machine_info, quiet as _quiet, write_results  # noqa: E402
from numpyro_pc.datasets import load_breast_cancer  # noqa: E402

OUT = os.path.join(HERE, "_out")
PREDICTORS = ("remove_site", "influence", "tracin")
TARGET_R = 0.99


def model(X, y=None):
    """Logistic regression with intercept, prior precision 1."""
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def change(post, i, method, tol=None):
    """``(m_{∖i} − m, wall seconds, posterior)`` for one deletion."""
    kw = dict(tol=tol) if method == "retrain" else {}
    t0 = time.perf_counter()
    out = _quiet(post.delete, [int(i)], method=method, **kw)
    jax.block_until_ready(out.state)
    dt = time.perf_counter() - t0
    return np.asarray(out.mean) - np.asarray(post.mean), dt, out


def correlations(pred, exact):
    pooled = float(np.corrcoef(pred.ravel(), exact.ravel())[0, 1])
    per = np.array([np.corrcoef(pred[:, j], exact[:, j])[0, 1] for j in range(exact.shape[1])])
    rel = np.linalg.norm(pred - exact, axis=1) / np.linalg.norm(exact, axis=1)
    return dict(pooled_r=pooled, per_coordinate_r=per.tolist(), median_coordinate_r=float(np.median(per)),
                min_coordinate_r=float(np.min(per)), median_rel_error=float(np.median(rel)),
                p90_rel_error=float(np.quantile(rel, 0.9)))


def render(res):
    info = res["machine"]
    lines = [f"Machine: {info['cpu']}, {info['cores']} cores, JAX {info['jax']} ({info['backend']}), "
             f"NumPyro {info['numpyro']}; numpyro_pc {info['numpyro_pc']}; load average at start "
             f"{', '.join(f'{x:.1f}' for x in info['loadavg'])}. Data: breast cancer N={res['N']}, d={res['d']}; "
             f"fit: {res['fit_iterations']} iterations, residual {res['fit_residual']:.1e}.", "",
             f"Examples: {res['num_examples']} of {res['N']} ({res['subset_note']}). One retrain after warm-up: "
             f"{res['t_retrain_probe']:.3f} s → all {res['N']} ≈ {res['N'] * res['t_retrain_probe']:.0f} s "
             f"(budget {res['budget_s']:.0f} s). Retrain iterations per deletion: median "
             f"{res['retrain_iterations_median']}, max {res['retrain_iterations_max']}; median ‖Δ_i‖ = "
             f"{res['median_exact_norm']:.3e}.", "",
             "| method | pooled r (n·d pairs) | per-coordinate r: median | min | median ‖Δ̂−Δ‖/‖Δ‖ | 90th pct "
             "| median s / deletion | first call s |", "|---|---|---|---|---|---|---|---|"]
    for m, r in res["methods"].items():
        lines.append(f"| {m} | {r['pooled_r']:.5f} | {r['median_coordinate_r']:.5f} | {r['min_coordinate_r']:.4f} "
                     f"| {r['median_rel_error']:.3e} | {r['p90_rel_error']:.3e} | {r['median_s']:.4f} "
                     f"| {r['first_s']:.2f} |")
    lines.append(f"| retrain (exact) | 1 | 1 | 1 | 0 | 0 | {res['retrain_median_s']:.4f} | "
                 f"{res['retrain_first_s']:.2f} |")
    return "\n".join(lines)


def plot(res, exact, preds, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(preds), figsize=(4.3 * len(preds), 4.3))
    for ax, (m, p) in zip(np.atleast_1d(axes), preds.items()):
        ax.scatter(exact.ravel(), p.ravel(), s=3, alpha=0.4)
        lo = min(exact.min(), p.min())
        hi = max(exact.max(), p.max())
        ax.plot([lo, hi], [lo, hi], color="k", lw=0.8, ls=":")
        r = res["methods"][m]
        ax.set_title(f"{m}: pooled r={r['pooled_r']:.4f}\nmedian per-coord r={r['median_coordinate_r']:.4f}",
                     fontsize=9)
        ax.set_xlabel(r"exact $m_{\setminus i} - m$ (retrain)")
        ax.set_ylabel(r"predicted $m_{\setminus i} - m$")
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"Breast cancer LOO, {res['num_examples']} examples × d={res['d']} coordinates", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 40 random examples")
    parser.add_argument("--num", type=int, default=None, help="force a random subset of this size")
    parser.add_argument("--budget", type=float, default=300.0,
                        help="seconds allowed for the retrains; all examples if 569 × t_retrain fits")
    parser.add_argument("--tol", type=float, default=1e-12,
                        help="residual tolerance of the fit and of every retrain (package default 1e-8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args(argv)
    if args.quick:
        args.num = 40
    start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - start:6.1f}s] {msg}", flush=True)  # noqa: E731
    info = machine_info()

    X, y, _ = load_breast_cancer(standardize=True)
    X, y = jnp.asarray(X), jnp.asarray(y)
    post = _quiet(pc.fit, model, X, y, family="full", tol=args.tol)
    n = int(X.shape[0])
    log(f"fit: {post.history[-1]['iteration']} iterations, residual {post.residual:.1e}")

    # warm-up (compile) every method, then probe one retrain
    first = {}
    for m in PREDICTORS + ("retrain",):
        _, first[m], _ = change(post, 0, m, args.tol)
    probes = [change(post, i, "retrain", args.tol)[1] for i in (1, 2, 3)]
    t_probe = statistics.median(probes)
    log(f"one retrain {t_probe:.3f} s → all {n}: {n * t_probe:.0f} s")
    rng = np.random.default_rng(args.seed)
    if args.num:
        idx = np.sort(rng.choice(n, size=min(args.num, n), replace=False))
        note = f"random subset of {idx.size} forced by --num/--quick (seed {args.seed})"
    elif n * t_probe <= args.budget:
        idx = np.arange(n)
        note = "all examples"
    else:
        size = int(min(n, max(150, args.budget / t_probe)))
        idx = np.sort(rng.choice(n, size=size, replace=False))
        note = (f"random subset of {size} (seed {args.seed}): {n} retrains ≈ {n * t_probe:.0f} s exceed the "
                f"{args.budget:.0f} s budget")
    log(f"using {idx.size} examples ({note})")

    exact = np.zeros((idx.size, post.dim))
    preds = {m: np.zeros_like(exact) for m in PREDICTORS}
    times = {m: [] for m in PREDICTORS + ("retrain",)}
    iters = []
    for k, i in enumerate(idx):
        exact[k], dt, out = change(post, i, "retrain", args.tol)
        times["retrain"].append(dt)
        iters.append(out.history[-1]["iteration"])
        for m in PREDICTORS:
            preds[m][k], dt, _ = change(post, i, m)
            times[m].append(dt)
        if (k + 1) % 50 == 0:
            log(f"  {k + 1}/{idx.size}")

    methods = {}
    for m in PREDICTORS:
        methods[m] = correlations(preds[m], exact)
        methods[m].update(median_s=statistics.median(times[m]), first_s=first[m])
    result = dict(machine=info, argv=sys.argv[1:], N=n, d=int(post.dim), fit_iterations=post.history[-1]["iteration"],
                  fit_residual=float(post.residual), num_examples=int(idx.size), subset_note=note,
                  examples=idx.tolist(), t_retrain_probe=t_probe, budget_s=args.budget, methods=methods,
                  retrain_median_s=statistics.median(times["retrain"]), retrain_first_s=first["retrain"],
                  retrain_iterations_median=int(np.median(iters)), retrain_iterations_max=int(np.max(iters)),
                  median_exact_norm=float(np.median(np.linalg.norm(exact, axis=1))),
                  exact_changes=exact.tolist(), predicted_changes={m: p.tolist() for m, p in preds.items()})
    rs, ri = methods["remove_site"], methods["influence"]
    result["targets"] = [
        dict(target=f"remove_site r ≥ {TARGET_R} (pooled / per-coordinate median)",
             measured=f"{rs['pooled_r']:.5f} / {rs['median_coordinate_r']:.5f}",
             met=bool(rs["pooled_r"] >= TARGET_R and rs["median_coordinate_r"] >= TARGET_R)),
        dict(target="remove_site better than influence (pooled r, per-coordinate median r, median rel. error)",
             measured=f"{rs['pooled_r']:.5f} vs {ri['pooled_r']:.5f}; {rs['median_coordinate_r']:.5f} vs "
                      f"{ri['median_coordinate_r']:.5f}; {rs['median_rel_error']:.2e} vs {ri['median_rel_error']:.2e}",
             met=bool(rs["pooled_r"] > ri["pooled_r"] and rs["median_coordinate_r"] > ri["median_coordinate_r"])),
    ]
    result["total_s"] = time.perf_counter() - start
    write_results("bench_loo", args.out, result, render(result), result["targets"],
                  lambda path: plot(result, exact, preds, path))
    print(f"\ntotal {time.perf_counter() - start:.0f}s; wrote {args.out}/bench_loo.json, bench_loo.md, bench_loo.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
