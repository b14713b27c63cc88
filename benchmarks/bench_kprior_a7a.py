"""How much function-space memory a logistic regression needs (issue 31 item 3; the K-prior paper's tasks).

a7a (16 100 training examples, 123 binary features; test accuracy on its 16 461 test examples),
logistic regression with an intercept and prior precision 5 (the model of ``bench_continual.py``).
Two adaptations, each against the batch fit of the data it should end with:

- **add data**: fit the first 90 % of the rows, keep a memory of ``M`` of them
  (``keep_memory(M, selection)``), then ``update`` with the last 10 % and ``correction="kprior"``;
- **remove data**: fit every row, keep a memory of ``M``, then remove a random 10 % of the rows
  with ``delete(method="corrected")``, which recomputes the memory's sites (the deleted rows' data
  goes with them). For a GLM the K-prior's prediction matching of a memory equals the
  correction by its true losses (``tests/ops/test_kprior.py``, to 1e-10), so this is the K-prior
  removal of the same memory;
- **change the regulariser**: fit every row with prior precision 5, keep a memory of ``M``, then
  ``change_prior(prior_precision=NEW_PRECISION, correction="kprior")``: the old prior's site is
  divided out, the new prior enters live and the memory is matched in function space, against
  the batch fit under the new prior.

For each family (isotropic: the K-prior proper; full: posterior correction with memory), each
selection rule (``random``, ``residual``) and memory sizes from none to every row: test accuracy,
the gap to the batch fit's accuracy in points, KL to the batch fit and wall time. Reported: the
smallest memory within 0.1 point of the batch fit's accuracy. ``--quick``: the first 4 000 rows.

    python benchmarks/bench_kprior_a7a.py [--quick] [--families isotropic,full]
"""

import argparse
import os
import sys
import time
import warnings

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import numpyro_pc as pc  # noqa: E402
from _common import machine_info, write_results  # noqa: E402
from bench_continual import model  # noqa: E402  (a7a logistic regression, prior precision 5)
from numpyro_pc.datasets.loaders import load_a7a  # noqa: E402

OUT = os.path.join(HERE, "_out")
TOL_POINTS = 0.1
NEW_PRECISION = 0.5  # the changed regulariser: ten times weaker than the fitted one
TASKS = ("add", "remove", "prior")


def regularised(X, y=None, prior_precision=5.0):
    """``bench_continual.model`` with its prior precision as an argument (the regulariser to change)."""
    scale = 1.0 / jnp.sqrt(prior_precision)
    b = numpyro.sample("b", dist.Normal(0.0, scale))
    w = numpyro.sample("w", dist.Normal(0.0, scale).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def accuracy(post, X, y):
    v = post.spec.latent.unravel(post.state.mean)
    return 100.0 * float(np.mean(((X @ np.asarray(v["w"]) + float(v["b"])) > 0) == (y > 0.5)))


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return fn(*args, **kwargs)


def sweep(task, family, selection, sizes, base, batch, adapt, X_test, y_test):
    target = accuracy(batch, X_test, y_test)
    rows = []
    for size in sizes:
        start = time.perf_counter()
        post = adapt(base.keep_memory(size, selection=selection, seed=0))
        seconds = time.perf_counter() - start
        acc = accuracy(post, X_test, y_test)
        rows.append(dict(task=task, family=family, selection=selection, memory=int(size), accuracy=acc,
                         gap=target - acc, kl=float(post.kl(batch)), seconds=seconds))
        print(f"  {task:6s} {family:9s} {selection:8s} M={size:6d}: accuracy {acc:.2f} (batch {target:.2f}), "
              f"KL {rows[-1]['kl']:.2e}, {seconds:.1f} s", flush=True)
    return target, rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--families", default="isotropic,full")
    parser.add_argument("--selections", default="random,residual")
    parser.add_argument("--tasks", default=",".join(TASKS), help="which of add, remove, prior to run")
    parser.add_argument("--new-precision", type=float, default=NEW_PRECISION, help="the changed prior precision")
    args = parser.parse_args(argv)
    X, y = load_a7a("train")
    X_test, y_test = load_a7a("test")
    if args.quick:
        X, y = X[:4000], y[:4000]
    n = X.shape[0]
    cut = int(0.9 * n)
    gone = np.sort(np.random.default_rng(1).choice(n, n // 10, replace=False))
    kept = np.setdiff1d(np.arange(n), gone)
    sizes = [0, 30, 100, 300, 1000, 3000, cut]
    sizes = sorted({s for s in sizes if s <= cut})
    tasks = [t for t in TASKS if t in args.tasks.split(",")]
    delta = args.new_precision
    result = dict(machine=machine_info(), quick=args.quick, n=n, rows=[], targets={}, new_precision=delta)
    for family in args.families.split(","):
        fit = lambda Xs, ys: _quiet(pc.fit, model, Xs, ys, family=family)  # noqa: E731
        if "add" in tasks or "remove" in tasks:
            first, everything, without = fit(X[:cut], y[:cut]), fit(X, y), fit(X[kept], y[kept])
        if "prior" in tasks:
            before = _quiet(pc.fit, regularised, X, y, family=family)
            after = _quiet(pc.fit, regularised, X, y, prior_precision=delta, family=family)
        for selection in args.selections.split(","):
            if "add" in tasks:
                target, rows = sweep("add", family, selection, sizes, first, everything,
                                     lambda p: _quiet(p.update, X[cut:], y[cut:], correction="kprior"), X_test, y_test)
                result["targets"][f"add/{family}"] = target
                result["rows"] += rows
            if "remove" in tasks:
                target, rows = sweep("remove", family, selection, [s for s in sizes if s < n] + [n], everything,
                                     without, lambda p: _quiet(p.delete, gone, method="corrected"), X_test, y_test)
                result["targets"][f"remove/{family}"] = target
                result["rows"] += rows
            if "prior" in tasks:
                target, rows = sweep("prior", family, selection, [s for s in sizes if s < n] + [n], before, after,
                                     lambda p: _quiet(p.change_prior, prior_precision=delta, correction="kprior"),
                                     X_test, y_test)
                result["targets"][f"prior/{family}"] = target
                result["rows"] += rows
    lines = [f"a7a, logistic regression (d = 124), {n} training rows; test accuracy in % on 16 461 test rows; "
             f"prior: precision 5 → {delta}.", "",
             "| task | family | selection | batch fit accuracy | accuracy with memory M = " +
             " / ".join(str(s) for s in sizes) + f" (remove, prior: and {n}) | smallest M within 0.1 point | "
             "KL to batch at that M | smallest M with KL ≤ 1e-2 |",
             "|---|---|---|---|---|---|---|---|"]
    targets = []
    for task in tasks:
        for family in args.families.split(","):
            for selection in args.selections.split(","):
                rows = [r for r in result["rows"] if (r["task"], r["family"], r["selection"]) == (task, family, selection)]
                enough = [r for r in rows if abs(r["gap"]) <= TOL_POINTS]  # above the batch fit is not reaching it either
                first_ok = enough[0] if enough else None
                lines.append(f"| {task} | {family} | {selection} | {result['targets'][f'{task}/{family}']:.2f} | "
                             + " / ".join(f"{r['accuracy']:.2f}" for r in rows) + " | "
                             + (f"{first_ok['memory']} ({100 * first_ok['memory'] / n:.1f} %)" if first_ok else "none")
                             + " | " + (f"{first_ok['kl']:.1e}" if first_ok else "—") + " | "
                             + next((f"{r['memory']} ({100 * r['memory'] / n:.1f} %)" for r in rows if r["kl"] <= 1e-2),
                                    "none") + " |")
                if family == "isotropic" and first_ok is not None:
                    targets.append(dict(target=f"K-prior ({task}, {selection}): a small memory (≤ 10 % of the data) "
                                               "reaches the batch fit's accuracy within 0.1 point",
                                        measured=f"M = {first_ok['memory']} ({100 * first_ok['memory'] / n:.1f} %)",
                                        met=bool(first_ok["memory"] <= 0.1 * n)))

    def plot(path):
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.8), sharey=True, squeeze=False)
        for ax, task in zip(axes[0], tasks):
            for family in args.families.split(","):
                for selection in args.selections.split(","):
                    rows = [r for r in result["rows"]
                            if (r["task"], r["family"], r["selection"]) == (task, family, selection)]
                    ax.plot([max(r["memory"], 1) for r in rows], [max(abs(r["gap"]), 1e-3) for r in rows], "o-",
                            label=f"{family}, {selection}")
            ax.axhline(TOL_POINTS, color="k", lw=0.8, ls="--")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("memory size M (0 drawn at 1)")
            ax.set_title({"add": "add data", "remove": "remove data", "prior": "change the regulariser"}[task]
                         + ": accuracy gap to the batch fit")
        axes[0][0].set_ylabel("|points from the batch fit| (floored at 1e-3)")
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)

    name = "bench_kprior_a7a" + ("" if tasks == list(TASKS) else "_" + "_".join(tasks))
    name += "" if delta == NEW_PRECISION else f"_precision{delta:g}"
    write_results(name + ("_quick" if args.quick else ""), OUT, result, "\n".join(lines), targets, plot)


if __name__ == "__main__":
    main()
