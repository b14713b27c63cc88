"""The merging and federated section of ``python -m numpyro_pc demo``."""

from __future__ import annotations

import time
import warnings

import numpy as np

from numpyro_pc.demos.plotting import save_figure
from numpyro_pc.federated.algorithms import run
from numpyro_pc.federated.options import Safeguard
from numpyro_pc.ops import merging
from numpyro_pc.posterior import fit

__all__ = ["demo_merging_federated"]


def demo_merging_federated(model, X, y, out, plt, fast=False, joint=None, num_clients=10) -> dict:
    """Merge posteriors fitted on two halves of the data; run 10 non-IID clients to the joint posterior.

    :param model: the demo's NumPyro model.
    :param X: features; :param y: labels (float64 arrays).
    :param out: output folder (``merging_federated.png`` is written there).
    :param plt: ``matplotlib.pyplot``.
    :param bool fast: fewer algorithms.
    :param joint: the full-data posterior (fitted here when ``None``).
    :return: ``dict(merge=[(method, KL)], federated=[(name, rounds, KL, kB, status)],
        label_skew=[(global step, rounds, KL, status)], plot=path)``.
    """
    if joint is None:
        joint = fit(model, X, y, family="full")
    perm = np.random.default_rng(0).permutation(X.shape[0])
    halves = np.array_split(perm, 2)
    t0 = time.perf_counter()
    posts = [fit(model, X[h], y[h], family="full") for h in halves]
    fit_seconds = time.perf_counter() - t0
    print(f"\nMerging: two posteriors fitted on random halves ({fit_seconds:.1f} s), merged against the joint fit")
    merge_rows = []
    print(f"{'method':16s} {'KL(merged ‖ joint)':>19s}")
    for method in merging.METHODS:
        kl = max(float(merging.merge(None, posts, method=method).kl(joint)), 0.0)
        merge_rows.append((method, kl))
        print(f"{method:16s} {kl:19.3e}")

    order = np.argsort(np.asarray(X[:, 0]))  # non-IID: client k holds the k-th range of the first feature
    clients = [(X[i], y[i]) for i in np.array_split(order, num_clients)]
    # ρ = 0.5 is the floor that diverged here before the safeguard (the report)
    algorithms = [("fedpc", dict(algorithm="fedpc")), ("fedpc ρ=0.5", dict(algorithm="fedpc", rho=0.5)),
                  ("pvi", dict(algorithm="pvi"))]
    if not fast:
        algorithms += [("pvi δ=0.5", dict(algorithm="pvi", damping=0.5)),
                       ("fedpc ρ=0.05", dict(algorithm="fedpc", rho=0.05)), ("admm", dict(algorithm="admm"))]
    print(f"\nFederated: {num_clients} clients with shards sorted by the first feature, full Gaussian")
    print("(FedPC's safeguard raises a client's ρ_k above the floor ρ (default 1/K) where its cavity "
          "λ_jnt − η_k/ρ would make the local problem non-convex)")
    print(f"{'algorithm':12s} {'rounds':>6s} {'KL to joint':>12s} {'kB sent':>8s} {'time [s]':>9s} status")
    fed_rows, curves = [], {}
    for name, opts in algorithms:
        t0 = time.perf_counter()
        with warnings.catch_warnings():  # a run that ends on the round budget warns; the table says it
            warnings.simplefilter("ignore", RuntimeWarning)
            result = run(model, clients, family="full", rounds=40, reference=joint, keep_data=False,
                                   **opts)
        seconds = time.perf_counter() - t0
        kl = result.column("kl_to_reference")
        curves[name] = kl
        fed_rows.append((name, result.rounds, float(kl[-1]), result.history[-1]["bytes"] / 1e3, result.status))
        print(f"{name:12s} {result.rounds:6d} {kl[-1]:12.3e} {result.history[-1]['bytes'] / 1e3:8.1f} {seconds:9.2f} "
              f"{result.status}")

    skew_rows = _label_skew_diagonal(model, X, y, fast)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    ax = axes[0]
    ax.bar([r[0] for r in merge_rows], [max(r[1], 1e-16) for r in merge_rows], color="tab:green")
    ax.set_yscale("log")
    ax.set_ylabel("KL(merged ‖ joint)")
    ax.set_title("Merging two half-data posteriors")
    ax = axes[1]
    for name, kl in curves.items():
        ax.semilogy(np.arange(1, kl.size + 1), np.maximum(kl, 1e-17), "o-", ms=3, label=name)
    ax.set_xlabel("round")
    ax.set_ylabel("KL(global ‖ joint)")
    ax.set_title(f"{num_clients} non-IID clients")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = save_figure(fig, out, "merging_federated.png")
    return dict(merge=merge_rows, federated=fed_rows, label_skew=skew_rows, plot=str(path))


def _label_skew_diagonal(model, X, y, fast) -> list[tuple[str, int, float, str]]:
    """FedPC with the diagonal family on six label-sorted shards (some clients hold one class only): with the
    line search of the global step (the default) and, outside fast mode, without it (the plain rounds)."""
    order = np.argsort(np.asarray(y), kind="stable")
    clients = [(X[i], y[i]) for i in np.array_split(order, 6)]
    joint = fit(model, X, y, family="diagonal", tol=1e-12, max_iters=2000)
    runs = [("line search (default)", {})]
    if not fast:
        runs.append(("plain rounds", dict(safeguard=Safeguard(line_search=False))))
    print("\nFederated: 6 clients holding label-sorted shards (two with class 0 only, three with class 1 only), "
          "diagonal Gaussian")
    print(f"{'global step':22s} {'rounds':>6s} {'KL to joint':>12s} status")
    rows = []
    for name, opts in runs:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the plain run ends on its round budget
            result = run(model, clients, family="diagonal", rounds=150 if name != "plain rounds" else 60,
                         reference=joint, keep_data=False, **opts)
        kl = float(result.history[-1]["kl_to_reference"])
        rows.append((name, result.rounds, kl, result.status))
        print(f"{name:22s} {result.rounds:6d} {kl:12.3e} {result.status}")
    return rows
