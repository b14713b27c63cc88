"""Boosting training from a checkpoint (``pc.boost``, paper §4.2) against ``pc.fit`` from the prior.

What is measured
----------------
Bayesian logistic regression with an intercept on LIBSVM a7a (16 100 train × 123 binary
features), prior precision 5 (``bench_continual.model``), full Gaussian (d = 124), float64.
The target is ``pc.fit(model, X, y, family="full")`` with its defaults (``gh`` rule,
``tol=1e-8``, MAP/Laplace start). Three checkpoints boost the same fit:

* **same data**: ``pc.fit`` on the same rows stopped at ``tol=1e-4``;
* **subset**: ``pc.fit`` on the first half of the rows (default tolerance);
* **neighbouring model**: ``pc.fit`` of the model without the most frequent feature (d = 123; a
  rare feature would leave the new coordinate at its prior, which the start already is), read
  through ``mapping={"w": np.delete(np.arange(123), j)}``; the new coordinate starts from the prior.

For each we report the solver's iterations, the warm wall time of ``pc.boost`` and of ``pc.fit``
(and, as a second reference without the MAP/Laplace search, of ``pc.fit(..., init="prior")``)
(each called once to compile, then ``--reps`` timed calls, median, ``jax.block_until_ready`` on
the mean), their ratio, and ``KL(q_boost ‖ q_fit)`` (both reach the same fixed point). The time to
fit the checkpoint itself is not part of a boost: the checkpoint is what was already stored.

Fairness rules
--------------
* Same data, same process, float64, same options for ``boost`` and ``fit``; ratios from one run.
* ``pc.fit``'s time includes its MAP/Laplace search (L-BFGS and the Laplace Hessian), which
  ``pc.boost`` replaces by the checkpoint; both use the package's own code paths.

Usage::

    python benchmarks/bench_boost.py            # full a7a
    python benchmarks/bench_boost.py --quick    # first 1000 examples, 1 rep (< 1 min)

Outputs: ``benchmarks/_out/bench_boost.json``, ``bench_boost.md``.
"""

from __future__ import annotations

import argparse
import os
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
from bench_continual import model  # noqa: E402  (intercept, prior precision 5)
from _common import machine_info, quiet, write_results  # noqa: E402
from numpyro_pc.datasets.loaders import load_a7a  # noqa: E402
from numpyro_pc.solvers.start import default_start  # noqa: E402

OUT = os.path.join(HERE, "_out")
TARGET_SPEEDUP = 1.0  # from the same-data checkpoint, boosting must beat the fit from the prior
TARGET_KL = 1e-8


def _timed(call, reps) -> tuple[object, float, float]:
    """``(result, first call seconds, median warm seconds)``."""
    start = time.perf_counter()
    result = call()
    jax.block_until_ready(result.state.mean)
    first = time.perf_counter() - start
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        result = call()
        jax.block_until_ready(result.state.mean)
        times.append(time.perf_counter() - start)
    return result, first, statistics.median(times)


def run(X, y, reps) -> dict:
    fit_call = lambda: quiet(pc.fit, model, X, y, family="full")  # noqa: E731
    fitted, fit_first, fit_warm = _timed(fit_call, reps)
    prior_call = lambda: quiet(pc.fit, model, X, y, family="full", init="prior")  # noqa: E731
    from_prior, _, prior_warm = _timed(prior_call, reps)
    spec, data = pc.bind_model(model, (X, y), {})
    start_seconds = []
    for _ in range(reps + 1):  # the fit's MAP/Laplace start alone, warm
        start = time.perf_counter()
        jax.block_until_ready(default_start(spec, data, fitted.family, None, X.dtype).start.mean)
        start_seconds.append(time.perf_counter() - start)
    half = X.shape[0] // 2
    dropped = int(np.argmax(np.asarray(jnp.sum(X != 0, axis=0))))
    kept = np.delete(np.arange(X.shape[1]), dropped)
    checkpoints = {
        "same data (tol 1e-4)": (lambda: quiet(pc.fit, model, X, y, family="full", tol=1e-4), None),
        "subset (first half of the rows)": (lambda: quiet(pc.fit, model, X[:half], y[:half], family="full"), None),
        "neighbouring model (one feature fewer)": (lambda: quiet(pc.fit, model, X[:, kept], y, family="full"),
                                                   {"w": kept}),
    }
    rows = []
    for name, (make, mapping) in checkpoints.items():
        start = time.perf_counter()
        checkpoint = make()
        jax.block_until_ready(checkpoint.state.mean)
        checkpoint_seconds = time.perf_counter() - start
        boosted, first, warm = _timed(lambda: quiet(pc.boost, model, X, y, checkpoint=checkpoint, mapping=mapping),
                                      reps)
        rows.append(dict(case=name, iterations=int(boosted.record["iterations"]),
                         fit_iterations=int(fitted.record["iterations"]), boost_seconds=warm, boost_first_call=first,
                         fit_seconds=fit_warm, speedup=fit_warm / warm, kl_to_fit=float(boosted.kl(fitted)),
                         start_residual=float(boosted.record["start_residual"]),
                         start=boosted.record["start"]["kind"], checkpoint_seconds=checkpoint_seconds))
        print(f"{name}: {rows[-1]['iterations']} iterations, {warm:.3f} s (fit {fit_warm:.3f} s)", flush=True)
    return dict(n=int(X.shape[0]), d=int(X.shape[1]) + 1, fit_first_call=fit_first, fit_seconds=fit_warm,
                fit_iterations=int(fitted.record["iterations"]), fit_start_iterations=fitted.record["start"]["iterations"],
                fit_start_seconds=statistics.median(start_seconds[1:]), dropped_feature=dropped,
                prior_iterations=int(from_prior.record["iterations"]), prior_seconds=prior_warm,
                prior_kl_to_fit=float(from_prior.kl(fitted)),
                rows=rows)


def render(result) -> str:
    lines = [f"a7a, n = {result['n']}, d = {result['d']}, full family, float64, tol 1e-8 (pc.fit defaults); "
             f"pc.fit from the prior: {result['fit_iterations']} iterations after an L-BFGS MAP search of "
             f"{result['fit_start_iterations']} iterations, {result['fit_seconds']:.3f} s warm, of which "
             f"{result['fit_start_seconds']:.3f} s is the MAP/Laplace start (timed alone); "
             f"pc.fit(init=\"prior\") (no MAP search): {result['prior_iterations']} iterations, "
             f"{result['prior_seconds']:.3f} s warm.", "",
             "| checkpoint | boost iterations | fit iterations | boost s (warm) | fit s (warm) | fit / boost | "
             "fit(init=prior) / boost | KL(boost ‖ fit) | start residual |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['case']} | {r['iterations']} | {r['fit_iterations']} | {r['boost_seconds']:.3f} | "
                     f"{r['fit_seconds']:.3f} | {r['speedup']:.2f}× | {result['prior_seconds'] / r['boost_seconds']:.2f}× | "
                     f"{r['kl_to_fit']:.1e} | {r['start_residual']:.1e} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: first 1000 examples, 1 rep")
    parser.add_argument("--n", type=int, default=None, help="use the first n training examples (default all)")
    parser.add_argument("--reps", type=int, default=3, help="timed warm calls per method (median)")
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args(argv)
    n, reps = (1000, 1) if args.quick else (args.n, args.reps)
    info = machine_info()
    X, y = load_a7a("train")
    if n is not None:
        X, y = X[:n], y[:n]
    result = run(jnp.asarray(X), jnp.asarray(y), reps)
    result.update(machine=info, quick=bool(args.quick), reps=reps)
    same = result["rows"][0]
    targets = [dict(target=f"same-data checkpoint: fit / boost > {TARGET_SPEEDUP:g}×", measured=f"{same['speedup']:.2f}×",
                    met=same["speedup"] > TARGET_SPEEDUP),
               dict(target=f"every boost reaches the fit: KL < {TARGET_KL:g}",
                    measured=f"max {max(r['kl_to_fit'] for r in result['rows']):.1e}",
                    met=all(r["kl_to_fit"] < TARGET_KL for r in result["rows"]))]
    write_results("bench_boost" + ("_quick" if args.quick else ""), args.out, result, render(result), targets)


if __name__ == "__main__":
    main()
