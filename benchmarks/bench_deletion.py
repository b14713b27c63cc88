"""Deleting 100 examples from a posterior fitted on a7a: every deletion method against retraining.

What is measured
----------------
Bayesian logistic regression with an intercept on LIBSVM a7a (16 100 train × 123 binary
features; 16 461 test), prior ``b, w_j ~ Normal(0, 1/√5)`` (prior precision 5), full
Gaussian (d = 124), ``post = pc.fit(model, X, y, family="full")`` (defaults: ``gh`` rule,
``tol=1e-8``). Two deletion sets of 100 examples:

* **(i) high curvature**: the 100 largest ``post.sites.curvature_trace()`` (``tr Ĥ_i``,
  the expected curvature of each site — the examples that weigh most on the precision);
* **(ii) random**: 100 ids drawn uniformly (``numpy`` seed ``--seed``).

For every method of ``post.delete(ids, method=...)`` — ``remove_site`` (memory-perturbation
equation), ``influence`` (delta method, Hessian at the mean), ``tracin`` (``m + Σ∇ℓ_j``),
``corrected`` (correction over every retained example) and ``retrain`` (the oracle; the
package's retrain starts its solver from ``q_t``) — we report:

* ``KL(q_method ‖ q_retrain)`` in float64 from eigenvalues (``bench_refine.RefGaussian``);
* the change in test accuracy of the posterior mean (after − before deletion), and the
  difference from the retrained posterior's accuracy;
* wall time (``jax.block_until_ready`` on the result).

As context we also time ``pc.fit`` from the prior on the remaining 16 000 examples (a
"cold" retrain; its KL to ``retrain`` checks that both reach the same optimum).

Fairness rules
--------------
* Same data, same process, same fitted posterior, float64 (``jax_enable_x64``).
* Compile time separate: each method is called once per deletion set as a warm-up
  (``first call`` column = compile + run), then ``--reps`` timed calls interleaved over
  methods; times are medians. ``remove_site`` and the oracle are both the package's code
  paths (``retrain`` = ``delete(method="retrain")``, jitted site computations inside).
* KL and accuracy are not timed.
* ``remove_site`` returns the new posterior (mean, precision, ids, tombstones) and defers
  copying the remaining 16 000 sites and data rows until something reads them; the row
  ``remove_site + gather`` times the same call followed by reading ``.sites`` and
  ``.data``, so both the lazy and the fully materialised cost are reported.

Usage::

    python benchmarks/bench_deletion.py            # full a7a (~3 min on 2 cores; peak RSS ~7 GB from influence)
    python benchmarks/bench_deletion.py --quick    # first 3000 examples, 2 reps (~1.5 min)

Outputs: ``benchmarks/_out/bench_deletion.json``, ``bench_deletion.md``,
``bench_deletion.png`` (bars: KL to retrain and wall time per method and set).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as in bench_continual.py: no BLAS/XLA oversubscription

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import numpyro_pc as pc  # noqa: E402
from bench_continual import model  # noqa: E402  (same model: intercept, prior precision 5)
from _common import machine_info, quiet as _quiet, write_results  # noqa: E402
from bench_refine import RefGaussian  # noqa: E402
from numpyro_pc.datasets.loaders import load_a7a  # noqa: E402

OUT = os.path.join(HERE, "_out")
METHODS = ("remove_site", "influence", "tracin", "corrected", "retrain")
TARGET_SPEEDUP = 100.0
TARGET_KL = 1e-3


def accuracy(mean, X_test, y_test):
    m = np.asarray(mean)
    return float(np.mean(((X_test @ m[1:] + m[0]) > 0) == (y_test > 0.5)))


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    jax.block_until_ready(out.state)
    return time.perf_counter() - t0, out


def _gathered(post):
    """Read the remaining sites and data (``remove_site`` defers copying them until first use)."""
    jax.block_until_ready((post.sites, post.data))
    return post


def run_set(post, ids, X, y, reps, log):
    """Warm-up, then ``reps`` interleaved timed calls of every method (and the cold refit)."""
    keep = np.setdiff1d(np.arange(X.shape[0]), ids)
    Xk, yk = jnp.asarray(X[keep]), jnp.asarray(y[keep])
    calls = {m: (lambda m=m: _quiet(post.delete, ids, method=m)) for m in METHODS}
    calls["remove_site + gather"] = lambda: _gathered(_quiet(post.delete, ids, method="remove_site"))
    calls["pc.fit from prior (cold)"] = lambda: _quiet(pc.fit, model, Xk, yk, family="full")
    first, times, results, errors = {}, {m: [] for m in calls}, {}, {}
    for m, fn in calls.items():
        try:
            first[m], results[m] = timed(fn)
        except pc.PosteriorCorrectionError as err:  # e.g. NotPositiveDefiniteError: report, retry damped
            errors[m] = f"{type(err).__name__}: {err}"
            if m in METHODS:
                calls[m] = lambda m=m: _quiet(post.delete, ids, method=m, damping=True)
                first[m], results[m] = timed(calls[m])
        log(f"  first call {m}: {first[m]:.2f} s")
    for _ in range(reps):
        for m, fn in calls.items():
            dt, results[m] = timed(fn)
            times[m].append(dt)
    return first, {m: statistics.median(t) for m, t in times.items()}, times, results, errors


def render(res):
    info = res["machine"]
    lines = [f"Machine: {info['cpu']}, {info['cores']} cores, JAX {info['jax']} ({info['backend']}), "
             f"NumPyro {info['numpyro']}, OPENBLAS_NUM_THREADS={info.get('openblas_threads')}; "
             f"numpyro_pc {info['numpyro_pc']}; load average at start "
             f"{', '.join(f'{x:.1f}' for x in info['loadavg'])}; peak RSS {res['peak_rss_mb']:.0f} MB. "
             f"Data: a7a train N={res['N']}, test {res['N_test']}, d={res['d']}; fit: {res['fit_iterations']} "
             f"iterations, residual {res['fit_residual']:.1e}, {res['fit_s']:.2f} s (incl. compile); test "
             f"accuracy before deletion {res['acc_before']:.4f}. Timed calls: median of {res['reps']} after one "
             "warm-up call.", ""]
    for set_name, s in res["sets"].items():
        lines += [f"**{set_name}** ({s['size']} examples; mean tr Ĥ_i of the set {s['mean_curvature']:.3g} vs "
                  f"{res['mean_curvature_all']:.3g} over all data; KL(retrain ‖ before) = {s['kl_retrain_to_before']:.3e}):",
                  "", "| method | KL(q ‖ q_retrain) | Δ test acc (after − before) | acc − acc(retrain) | wall s "
                  "(median) | first call s | retrain / method | note |", "|---|---|---|---|---|---|---|---|"]
        for m, r in s["methods"].items():
            lines.append(f"| {m} | {r['kl_to_retrain']:.3e} | {r['delta_acc']:+.5f} | {r['acc_minus_retrain']:+.5f} "
                         f"| {r['wall_s']:.4g} | {r['first_s']:.3g} | {r['speedup_vs_retrain']:.3g}× "
                         f"| {r.get('note', '')} |")
        lines.append("")
    return "\n".join(lines)


def plot(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    sets = list(res["sets"])
    methods = list(res["sets"][sets[0]]["methods"])
    width = 0.8 / len(sets)
    x = np.arange(len(methods))
    for k, set_name in enumerate(sets):
        ms = res["sets"][set_name]["methods"]
        kl = [max(ms[m]["kl_to_retrain"], 1e-16) for m in methods]
        wall = [ms[m]["wall_s"] for m in methods]
        axes[0].bar(x + (k - (len(sets) - 1) / 2) * width, kl, width, label=set_name)
        axes[1].bar(x + (k - (len(sets) - 1) / 2) * width, wall, width, label=set_name)
    axes[0].axhline(TARGET_KL, color="grey", ls=":", lw=1, label=f"KL {TARGET_KL:g}")
    axes[0].set_ylabel("KL(q_method ‖ q_retrain)  (clipped at 1e-16)")
    axes[1].set_ylabel("wall time, s (median, compile excluded)")
    for ax in axes:
        ax.set_yscale("log")
        ax.set_xticks(x)
        ax.set_xticklabels([m.replace(" (cold)", "\n(cold)").replace(" from prior", "\nfrom prior")
                            for m in methods], fontsize=8)
        ax.grid(True, axis="y", which="major", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Deleting 100 of {res['N']} a7a examples (full Gaussian, d={res['d']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: first 3000 examples, 2 reps")
    parser.add_argument("--n", type=int, default=None, help="use the first n training examples (default all)")
    parser.add_argument("--delete", type=int, default=100, help="examples per deletion set")
    parser.add_argument("--reps", type=int, default=3, help="timed calls per method (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.reps = 3000, 2
    start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - start:6.1f}s] {msg}", flush=True)  # noqa: E731
    info = machine_info()

    X, y = load_a7a("train")
    Xt, yt = load_a7a("test")
    if args.n:
        X, y = X[:args.n], y[:args.n]
    t0 = time.perf_counter()
    post = _quiet(pc.fit, model, jnp.asarray(X), jnp.asarray(y), family="full")
    fit_s = time.perf_counter() - t0
    log(f"fit: {post.history[-1]['iteration']} iterations, residual {post.residual:.1e}, {fit_s:.1f} s")
    acc_before = accuracy(post.mean, Xt, yt)
    curv = np.asarray(post.sites.curvature_trace())
    ids_all = np.asarray(post.ids)
    sets = {"(i) 100 largest tr Ĥ_i": ids_all[np.argsort(-curv, kind="stable")[:args.delete]],
            "(ii) 100 random": np.sort(np.random.default_rng(args.seed).choice(ids_all, args.delete, replace=False))}
    if args.delete != 100:
        sets = {k.replace("100", str(args.delete)): v for k, v in sets.items()}

    out_sets = {}
    for set_name, ids in sets.items():
        log(f"set {set_name}")
        assert np.array_equal(ids_all[ids], ids)  # ids are row numbers of X (fit gives ids 0..N-1)
        first, med, all_times, results, errors = run_set(post, ids, X, y, args.reps, log)
        ref_post = results["retrain"]
        ref = RefGaussian(ref_post.mean, ref_post.precision)
        acc_ref = accuracy(ref_post.mean, Xt, yt)
        methods = {}
        for m, r in results.items():
            methods[m] = dict(kl_to_retrain=ref.kl_from_precision(r.mean, r.precision),
                              delta_acc=accuracy(r.mean, Xt, yt) - acc_before,
                              acc_minus_retrain=accuracy(r.mean, Xt, yt) - acc_ref,
                              wall_s=med[m], times=all_times[m], first_s=first[m],
                              speedup_vs_retrain=med["retrain"] / med[m],
                              iterations=(r.history[-1]["iteration"] if r.history else None),
                              damping=(r.record or {}).get("damping") if m in METHODS else None)
            if m in errors:
                methods[m]["note"] = f"undamped call raised {errors[m][:80]}; damped α={methods[m]['damping']:.3g}"
            elif m in ("corrected", "retrain") or m.startswith("pc.fit"):
                methods[m]["note"] = f"{methods[m]['iterations']} iterations"
            log(f"  {m}: KL {methods[m]['kl_to_retrain']:.3e}, {med[m]:.4f} s")
        before = RefGaussian(post.mean, post.precision)
        out_sets[set_name] = dict(ids=ids.tolist(), size=int(ids.size), mean_curvature=float(curv[ids].mean()),
                                  kl_retrain_to_before=before.kl_from_precision(ref_post.mean, ref_post.precision),
                                  methods=methods)

    result = dict(machine=info, argv=sys.argv[1:], N=int(X.shape[0]), N_test=int(Xt.shape[0]), d=int(post.dim),
                  fit_iterations=post.history[-1]["iteration"], fit_residual=float(post.residual), fit_s=fit_s,
                  acc_before=acc_before, mean_curvature_all=float(curv.mean()), reps=args.reps, sets=out_sets,
                  peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0)
    targets = []
    for set_name, s in out_sets.items():
        sp = s["methods"]["remove_site"]["speedup_vs_retrain"]
        kl = s["methods"]["corrected"]["kl_to_retrain"]
        targets.append(dict(target=f"{set_name}: remove_site ≥ {TARGET_SPEEDUP:g}× faster than retrain",
                            measured=f"{sp:.3g}×", met=bool(sp >= TARGET_SPEEDUP)))
        sp_gather = s["methods"]["remove_site + gather"]["speedup_vs_retrain"]
        targets.append(dict(target=f"{set_name}: (same, including gathering the remaining sites and data)",
                            measured=f"{sp_gather:.3g}×", met=bool(sp_gather >= TARGET_SPEEDUP)))
        targets.append(dict(target=f"{set_name}: corrected within KL {TARGET_KL:g} of retrain",
                            measured=f"KL {kl:.2e}", met=bool(kl <= TARGET_KL)))
    result["targets"] = targets
    result["total_s"] = time.perf_counter() - start
    write_results("bench_deletion", args.out, result, render(result).rstrip("\n"), targets,
                  lambda path: plot(result, path))
    print(f"\ntotal {time.perf_counter() - start:.0f}s; wrote {args.out}/bench_deletion.json, bench_deletion.md, "
          "bench_deletion.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
