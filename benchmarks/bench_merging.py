"""Split-Digits: merging task posteriors fitted on disjoint class pairs of scikit-learn's digits.

What is measured
----------------
Softmax regression on scikit-learn's ``load_digits`` (1 797 images 8×8; 2×2 average
pooling to 16 features scaled to [0, 1]; 70 / 30 stratified train/test split, seed 0),
weights ``W (16 × 10)`` and biases ``b (10)`` with ``Normal(0, 1)`` priors (d = 170), delta
expectations (Laplace-type sites), float64. Task ``j`` holds the training images of the
class pair ``(2j, 2j+1)``; each task posterior is ``pc.fit`` from the prior on its own
pair only (the shared base is the prior, ``pc.merge(None, ...)``).

For ``t = 2 … 5`` tasks, every method of :func:`numpyro_pc.merge` (``α_i = 1``) is scored
against the joint posterior ``pc.fit`` on the union of the ``t`` tasks' data:
``KL(merged ‖ joint)`` and the test accuracy of the merged mean (argmax of the logits over
the ``2t`` classes seen so far, on test images of those classes). Two families: ``full``
(where Bayesian arithmetic, the precision twin and the Hessian merge coincide for the delta
rule — an identity) and ``diagonal`` (mean-field: the Hessian merge uses the full task
Hessians, Bayesian arithmetic only their diagonals).

Usage::

    python benchmarks/bench_merging.py --quick   # t ∈ {2, 5}, diagonal family only
    python benchmarks/bench_merging.py           # t = 2..5, both families

Outputs: ``benchmarks/_out/bench_merging.{json,md,png}``.
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
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import numpyro_pc as pc  # noqa: E402
from _common import machine_info, quiet, write_results  # noqa: E402

OUT = os.path.join(HERE, "_out")
NUM_CLASSES = 10


def model(X, y=None):
    """Softmax regression with standard normal priors."""
    W = numpyro.sample("W", dist.Normal(0.0, 1.0).expand([X.shape[1], NUM_CLASSES]).to_event(2))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0).expand([NUM_CLASSES]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Categorical(logits=X @ W + b), obs=y)


def load():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = digits.images.reshape(-1, 4, 2, 4, 2).mean(axis=(2, 4)).reshape(-1, 16) / 16.0
    return train_test_split(images, digits.target, test_size=0.3, stratify=digits.target, random_state=0)


def accuracy(post, X, y, classes):
    d = X.shape[1]
    mean = np.asarray(post.mean)
    W, b = mean[:d * NUM_CLASSES].reshape(d, NUM_CLASSES), mean[d * NUM_CLASSES:]
    logits = (X @ W + b)[:, classes]
    return float(np.mean(np.asarray(classes)[np.argmax(logits, 1)] == y))


def render(res):
    lines = [f"Split-Digits, {res['n_train']} train / {res['n_test']} test images, softmax regression d = {res['d']}, "
             "delta rule, float64, α_i = 1.", "",
             "| family | tasks | method | KL(merged ‖ joint) | test acc. merged | test acc. joint |",
             "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['family']} | {r['tasks']} | {r['method']} | {r['kl']:.3e} | {r['acc']:.3f} | "
                     f"{r['acc_joint']:.3f} |")
    return "\n".join(lines)


def targets(res):
    out = []
    for fam in sorted({r["family"] for r in res["rows"]}):
        rows = [r for r in res["rows"] if r["family"] == fam]
        kl = lambda m: [r["kl"] for r in rows if r["method"] == m]  # noqa: E731
        h, ba, ta = kl("hessian"), kl("bayesian"), kl("task_arithmetic")
        met = all(a <= b * (1 + 1e-9) + 1e-12 and b <= c for a, b, c in zip(h, ba, ta))
        out.append(dict(target=f"KL order hessian ≤ bayesian ≤ task_arithmetic for every t ({fam})",
                        measured="; ".join(f"{a:.2e} / {b:.2e} / {c:.2e}" for a, b, c in zip(h, ba, ta)), met=met))
    return out


def plot(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = sorted({r["family"] for r in res["rows"]})
    fig, axes = plt.subplots(1, 2 * len(fams), figsize=(4.2 * 2 * len(fams), 3.3), squeeze=False)
    for j, fam in enumerate(fams):
        for m in pc.merging.METHODS:
            rows = [r for r in res["rows"] if r["family"] == fam and r["method"] == m]
            axes[0][2 * j].semilogy([r["tasks"] for r in rows], [max(r["kl"], 1e-16) for r in rows], "o-", label=m)
            axes[0][2 * j + 1].plot([r["tasks"] for r in rows], [r["acc"] for r in rows], "o-", label=m)
        rows = [r for r in res["rows"] if r["family"] == fam and r["method"] == "bayesian"]
        axes[0][2 * j + 1].plot([r["tasks"] for r in rows], [r["acc_joint"] for r in rows], "k--", label="joint")
        axes[0][2 * j].set_title(f"{fam}: KL(merged ‖ joint)")
        axes[0][2 * j + 1].set_title(f"{fam}: test accuracy")
        for ax in axes[0][2 * j:2 * j + 2]:
            ax.set_xlabel("tasks merged")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="t ∈ {2, 5}, diagonal family only")
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - start:6.1f}s] {msg}", flush=True)  # noqa: E731
    info = machine_info()
    Xtr, Xte, ytr, yte = load()
    families = ["diagonal"] if args.quick else ["full", "diagonal"]
    counts = [2, 5] if args.quick else [2, 3, 4, 5]
    rows = []
    for fam in families:
        tasks = []
        for j in range(5):
            sel = np.isin(ytr, [2 * j, 2 * j + 1])
            tasks.append(quiet(pc.fit, model, jnp.asarray(Xtr[sel]), jnp.asarray(ytr[sel]), family=fam,
                               expectation="delta", tol=1e-10))
        log(f"{fam}: 5 task posteriors fitted")
        for t in counts:
            classes = list(range(2 * t))
            sel, test = np.isin(ytr, classes), np.isin(yte, classes)
            joint = quiet(pc.fit, model, jnp.asarray(Xtr[sel]), jnp.asarray(ytr[sel]), family=fam,
                          expectation="delta", tol=1e-10)
            acc_joint = accuracy(joint, Xte[test], yte[test], classes)
            for m in pc.merging.METHODS:
                merged = pc.merge(None, tasks[:t], method=m)
                rows.append(dict(family=fam, tasks=t, method=m, kl=float(merged.kl(joint)),
                                 acc=accuracy(merged, Xte[test], yte[test], classes), acc_joint=acc_joint))
            log(f"{fam}: t={t} done")
    res = dict(machine=info, n_train=int(Xtr.shape[0]), n_test=int(Xte.shape[0]), d=17 * NUM_CLASSES - NUM_CLASSES,
               rows=rows, command=" ".join(["python benchmarks/bench_merging.py"] + (argv or sys.argv[1:])))
    res["d"] = int(tasks[0].dim)
    write_results("bench_merging", args.out, res, render(res), targets(res), lambda p: plot(res, p))


if __name__ == "__main__":
    main()
