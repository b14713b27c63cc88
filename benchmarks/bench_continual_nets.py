"""Continual learning of a network on split digits (issue 31 item 2): VCL, EWC, K-priors, exact, joint.

scikit-learn's digits (1 797 images, 8 × 8) split into five tasks of two classes each,
(0, 1), (2, 3), …, (8, 9), single-head (one ten-way softmax); 70 % of each task trains, 30 %
tests. The network: one hidden tanh layer of ``--hidden`` units with biases, N(0, 1) priors,
Laplace–GGN sites (``expectation="delta", curvature="ggn"``); 32 units give d = 2 410.

Methods (each a stream over the five tasks, every update from the previous posterior):

- ``fine-tune``: ``pc.fit`` on the new task alone, started at the previous mean (no prior but p0);
- ``VCL isotropic`` (L2 to the old mean) and ``EWC diagonal`` (online EWC): ``correction="none"``;
  also VCL with the low-rank (r = 10) and full families, for the surrogate error below;
- ``K-prior M``: the isotropic family, ``correction="kprior"``, ``M`` examples per task kept by
  largest residual (M = 10, 50, 200);
- ``PC-memory diagonal 200``: the diagonal family with the same function-space memory;
- ``exact diagonal``: ``correction="exact"`` (every example kept, the batch posterior of the family);
- ``joint``: ``pc.fit`` on every task so far (the upper bound), diagonal family.

Reported after each task: test accuracy on every task seen (argmax of the logits at the
posterior mean); after the last: average accuracy, forgetting per task (best accuracy the task
ever had minus its final one), examples held, wall time. For the VCL streams also the surrogate
error of ``bench_family_richness.py`` — ``|Σ_past (ℓ_i − ℓ̂_i)|`` per past example between the old
and new mean, the paper's correction term in nats on one scale for every family. Plot: accuracy
on each task over time, per method. Solves that miss their tolerance (a network's multimodal
posterior) are kept and counted (``unconverged``).

``--quick``: 8 hidden units (d = 610), 60 training images per task, K-prior M ∈ {10, 50}; < 2 min.

    python benchmarks/bench_continual_nets.py [--quick] [--hidden 32] [--methods "K-prior 200,joint"]
"""

import argparse
import os
import sys
import time
import warnings
from functools import partial

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import numpyro_pc as pc  # noqa: E402
from _common import machine_info, write_results  # noqa: E402
from bench_family_richness import network, surrogate_error  # noqa: E402

OUT = os.path.join(HERE, "_out")
FIT = dict(expectation="delta", curvature="ggn", raise_on_failure=False)
TASKS = ((0, 1), (2, 3), (4, 5), (6, 7), (8, 9))


def split_digits(quick, seed=0):
    """Five two-class tasks: ``[(X_train, y_train, X_test, y_test)]`` (pixels scaled to [0, 1])."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    X, y = digits.data / 16.0, digits.target
    rng = np.random.default_rng(seed)
    tasks = []
    for classes in TASKS:
        rows = rng.permutation(np.flatnonzero(np.isin(y, classes)))
        cut = int(0.7 * rows.size)
        train, test = rows[:cut], rows[cut:]
        if quick:
            train = train[:60]
        tasks.append((X[train], y[train], X[test], y[test]))
    return tasks


def accuracy(post, X, y):
    v = post.spec.latent.unravel(post.state.mean)
    logits = np.tanh(X @ np.asarray(v["w1"]) + np.asarray(v["b1"])) @ np.asarray(v["w2"]) + np.asarray(v["b2"])
    return float(np.mean(np.argmax(logits, axis=1) == y))


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def _fit(model, X, y, family, init=None, rank=None):
    extra = {} if rank is None else dict(rank=rank)
    return _quiet(pc.fit, model, X, y, family=family, init=init, **FIT, **extra)


def methods(quick):
    """``name -> step(model, post, task, history) -> posterior``; ``post`` is ``None`` on the first task."""
    def vcl(family, rank=None):
        def step(model, post, X, y, seen):
            if post is None:  # VCL needs no data: nothing is held
                return _fit(model, X, y, family, rank=rank).keep_memory(0)
            return _quiet(post.update, X, y, correction="none", keep="none", raise_on_failure=False)
        return step

    def kprior(family, size):
        def step(model, post, X, y, seen):
            if post is None:
                return _fit(model, X, y, family).keep_memory(size, selection="residual")
            return _quiet(post.update, X, y, correction="kprior", memory=size, selection="residual",
                          raise_on_failure=False)
        return step

    def exact(model, post, X, y, seen):
        if post is None:
            return _fit(model, X, y, "diagonal")
        return _quiet(post.update, X, y, correction="exact", raise_on_failure=False)

    def fine_tune(model, post, X, y, seen):
        return _fit(model, X, y, "diagonal", init=None if post is None else np.asarray(post.state.mean))

    def joint(model, post, X, y, seen):
        Xs, ys = seen
        return _fit(model, Xs, ys, "diagonal", init=None if post is None else np.asarray(post.state.mean))

    table = {"fine-tune": fine_tune, "VCL isotropic": vcl("isotropic"), "EWC diagonal": vcl("diagonal"),
             "VCL low-rank 10": vcl("lowrank", 10), "VCL full": vcl("full")}
    for size in ((10, 50) if quick else (10, 50, 200)):
        table[f"K-prior {size}"] = kprior("isotropic", size)
    table["PC-memory diagonal " + ("50" if quick else "200")] = kprior("diagonal", 50 if quick else 200)
    table["exact diagonal"] = exact
    table["joint"] = joint
    return table


SURROGATE = ("VCL isotropic", "EWC diagonal", "VCL low-rank 10", "VCL full")


def run(name, step, model, tasks):
    """One stream: accuracy on every task after each task, surrogate errors, time, memory, unconverged solves."""
    start = time.perf_counter()
    post, acc, surrogate, unconverged = None, [], [], 0
    for t, (X, y, _, _) in enumerate(tasks):
        seen = (np.concatenate([tk[0] for tk in tasks[:t + 1]]), np.concatenate([tk[1] for tk in tasks[:t + 1]]))
        old, post = post, step(model, post, X, y, seen)
        unconverged += int(post.residual > 1e-6)
        if name in SURROGATE and old is not None:
            past_X = np.concatenate([tk[0] for tk in tasks[:t]])
            past_y = np.concatenate([tk[1] for tk in tasks[:t]])
            surrogate.append(abs(surrogate_error(model, past_X, past_y, old, post)) / past_y.size)
        acc.append([accuracy(post, tk[2], tk[3]) if k <= t else float("nan") for k, tk in enumerate(tasks)])
        print(f"  {name}: task {t + 1}: " + " ".join(f"{a:.2f}" for a in acc[-1][:t + 1]), flush=True)
    acc = np.array(acc)
    final = acc[-1]
    forgetting = [float(np.nanmax(acc[:, k]) - final[k]) for k in range(len(tasks) - 1)]
    return dict(accuracy=acc.tolist(), average=float(np.mean(final)), forgetting=forgetting,
                held=int(post.num_retained), seconds=time.perf_counter() - start, unconverged=unconverged,
                surrogate=surrogate, dim=int(post.dim))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--hidden", type=int, default=None, help="hidden units (default 32; 8 with --quick)")
    parser.add_argument("--methods", default=None, help="comma-separated method names (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    hidden = args.hidden or (8 if args.quick else 32)
    model = partial(network, hidden=hidden)
    tasks = split_digits(args.quick, args.seed)
    table = methods(args.quick)
    chosen = list(table) if args.methods is None else [m.strip() for m in args.methods.split(",")]
    result = dict(machine=machine_info(), quick=args.quick, hidden=hidden, runs={})
    for name in chosen:
        result["runs"][name] = run(name, table[name], model, tasks)
    d = next(iter(result["runs"].values()))["dim"]
    lines = [f"Split digits, 5 tasks × 2 classes, single head, tanh MLP with {hidden} hidden units (d = {d}).", "",
             "| method | average accuracy after task 5 | forgetting per task (1–4) | examples held | "
             "surrogate error per past example (nats, mean over updates) | unconverged solves | s |",
             "|---|---|---|---|---|---|---|"]
    for name, r in result["runs"].items():
        sur = f"{np.mean(r['surrogate']):.3e}" if r["surrogate"] else "—"
        lines.append(f"| {name} | {r['average']:.3f} | " + " / ".join(f"{f:.2f}" for f in r["forgetting"])
                     + f" | {r['held']} | {sur} | {r['unconverged']} | {r['seconds']:.0f} |")
    runs = result["runs"]
    targets = []
    best_k = max((n for n in runs if n.startswith("K-prior")), key=lambda n: int(n.split()[-1]), default=None)
    if best_k and "joint" in runs:
        gap = runs["joint"]["average"] - runs[best_k]["average"]
        targets.append(dict(target=f"{best_k} within 2 points of joint training",
                            measured=f"{100 * gap:.1f} points below", met=bool(gap <= 0.02)))
        for other in ("EWC diagonal", "VCL isotropic"):
            if other in runs:
                targets.append(dict(target=f"{best_k} above {other}",
                                    measured=f"{runs[best_k]['average']:.3f} vs {runs[other]['average']:.3f}",
                                    met=bool(runs[best_k]["average"] > runs[other]["average"])))
    order = [n for n in SURROGATE if n in runs and runs[n]["surrogate"]]
    if len(order) > 1:
        values = [np.mean(runs[n]["surrogate"]) for n in order]
        targets.append(dict(target="surrogate error falls with a richer family (" + " > ".join(order) + ")",
                            measured=" > ".join(f"{v:.3e}" for v in values),
                            met=bool(all(a > b for a, b in zip(values, values[1:])))))

    def plot(path):
        import matplotlib.pyplot as plt

        names = list(runs)
        cols = min(4, len(names))
        rows = int(np.ceil(len(names) / cols))
        fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.8 * rows), squeeze=False, sharey=True)
        for ax, name in zip(axes.flat, names):
            acc = np.array(runs[name]["accuracy"])
            for k in range(acc.shape[1]):
                ax.plot(np.arange(1, acc.shape[0] + 1), acc[:, k], "o-", ms=3, label=f"task {k + 1}")
            ax.set_title(f"{name} (avg {runs[name]['average']:.2f})", fontsize=9)
            ax.set_ylim(-0.02, 1.02)
            ax.set_xticks(range(1, acc.shape[0] + 1))
        for ax in axes.flat[len(names):]:
            ax.axis("off")
        axes[0, 0].legend(fontsize=7)
        fig.supxlabel("tasks trained")
        fig.supylabel("test accuracy")
        fig.tight_layout()
        fig.savefig(path, dpi=110)

    write_results("bench_continual_nets" + ("_quick" if args.quick else ""), OUT, result, "\n".join(lines), targets,
                  plot)


if __name__ == "__main__":
    main()
