"""The ``streaming`` section of the demo: drifting batches under every correction policy, a deletion
with every method, then a change of the prior with each correction."""

from __future__ import annotations

import time
import warnings

import numpy as np

import numpyro_pc as pc
from numpyro_pc.demos.models import logistic_model
from numpyro_pc.demos.plotting import save_figure

__all__ = ["STREAM_POLICIES", "COMPARED_DELETE_METHODS", "demo_streaming"]


STREAM_POLICIES = (("none", {}), ("prior", {}), ("memory", dict(memory=0.1)), ("weighted", dict(memory=0.1)),
                   ("stochastic", dict(batch_fraction=0.1)), ("kprior", dict(memory=0.1, selection="residual")),
                   ("exact", {}))
COMPARED_DELETE_METHODS = ("tracin", "influence", "remove_site", "corrected", "retrain")


def demo_streaming(X, y, out, plt, fast, num_batches=5) -> dict:
    """Stream the data in non-IID batches with every correction policy, then delete a group."""
    order = np.argsort(np.asarray(X[:, 0]))  # sorted by the first feature: a drifting stream
    Xs, ys = X[order], y[order]
    parts = np.array_split(np.arange(Xs.shape[0]), num_batches)
    print(f"\nStreaming: {num_batches} batches sorted by 'mean radius', full Gaussian")
    t0 = time.perf_counter()
    first = pc.fit(logistic_model, Xs[parts[0]], ys[parts[0]], family="full")
    first_seconds = time.perf_counter() - t0
    kl_curves, rows, finals = {}, [], {}
    batches = [pc.fit(logistic_model, Xs[np.concatenate(parts[: k + 1])], ys[np.concatenate(parts[: k + 1])],
                      family="full") for k in range(1, num_batches)]  # the oracle after each batch
    fallbacks = {}
    for name, options in STREAM_POLICIES:
        post, kls, seconds = first, [], first_seconds
        for k, part in enumerate(parts[1:], start=1):
            opts = dict(options)
            if "memory" in opts and name != "kprior":  # the K-prior's memory is a fraction of each new batch
                opts["memory"] = max(1, int(opts["memory"] * post.num_retained))
            t0 = time.perf_counter()
            with warnings.catch_warnings():  # a fallback is reported under the table, with its batch
                warnings.filterwarnings("ignore", "weighted correction failed", RuntimeWarning)
                post = post.update(Xs[part], ys[part], correction=name, **opts)
            seconds += time.perf_counter() - t0
            if post.record.fallback:
                fallbacks.setdefault(name, []).append((k + 1, post.record.fallback))
            kls.append(max(float(post.kl(batches[k - 1])), 1e-16))
        kl_curves[name] = kls
        finals[name] = post
        label = name + (" (10 %)" if name in ("memory", "weighted", "kprior") else "") + (" *" if name in fallbacks else "")
        rows.append((label, kls[-1], seconds))
    print(f"{'policy':18s} {'KL to batch posterior':>22s} {'time [s]':>9s}")
    for label, kl, seconds in rows:
        print(f"{label:18s} {kl:22.3e} {seconds:9.2f}")
    print(f"kprior: the first batch and 10 % of each later one (by residual) kept as a function-space memory "
          f"({finals['kprior'].num_retained} of {finals['kprior'].num_examples} examples), matched by their "
          "predictions without their labels; for a GLM that equals replaying them (docs/continual.md)")
    final_kl = {name: kls[-1] for name, kls in kl_curves.items()}
    for name, events in fallbacks.items():
        reason = events[0][1].split(";")[0]
        worse = (f"; it ends further from the batch posterior than no correction ({final_kl[name]:.2g} against "
                 f"{final_kl['none']:.2g})" if final_kl[name] > final_kl["none"] else "")
        print(f"* {name}: at batch(es) {', '.join(str(b) for b, _ in events)} {reason} (the update kept the "
              f"unweighted memory){worse}. Scaling a 10 % memory's corrections by n/m ≈ 10 estimates the "
              "correction of all retained sites with ten times the memory's sampling error, too much on a "
              "drifting stream whose corrections differ widely; that is why 'memory' is the default and "
              "'weighted' is opt-in.")

    exact = finals["exact"]
    curvature = np.asarray(exact.sites.curvature_trace())
    gone = np.asarray(exact.ids)[np.argsort(-curvature)[:20]]
    print(f"\nDeleting the 20 examples of largest site curvature (full data, {exact.num_examples} examples)")
    deleted = {}
    for method in COMPARED_DELETE_METHODS:
        t0 = time.perf_counter()
        deleted[method] = exact.delete(gone, method=method, damping=True)
        deleted[method + "_seconds"] = time.perf_counter() - t0
    print(f"{'method':12s} {'KL to retrain':>14s} {'time [s]':>9s}")
    del_rows = []
    for method in COMPARED_DELETE_METHODS:
        kl = max(float(deleted[method].kl(deleted["retrain"])), 0.0)
        del_rows.append((method, kl, deleted[method + "_seconds"]))
        print(f"{method:12s} {kl:14.3e} {deleted[method + '_seconds']:9.2f}")

    prior_rows = _change_prior(exact)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    ax = axes[0]
    for name, kls in kl_curves.items():
        ax.semilogy(range(2, num_batches + 1), kls, "o-", label=name)
    ax.set_xlabel("batches seen")
    ax.set_ylabel("KL(streamed ‖ batch posterior)")
    ax.set_title("Streaming with correction policies")
    ax.legend(fontsize=8)
    ax = axes[1]
    names = [r[0] for r in del_rows[:-1]]
    ax.bar(names, [max(r[1], 1e-16) for r in del_rows[:-1]], color="tab:purple")
    ax.set_yscale("log")
    ax.set_ylabel("KL(method ‖ retrain)")
    ax.set_title("Deleting 20 high-curvature examples")
    fig.tight_layout()
    path = save_figure(fig, out, "streaming.png")
    return dict(stream=rows, delete=del_rows, prior_change=prior_rows, plot=str(path), fallbacks=fallbacks)


def _change_prior(post, scale=0.3) -> list:
    """Move ``post`` to a tighter prior (Normal scale 1 → ``scale``) with each correction, against the refit."""
    print(f"\nChanging the prior: Normal(0, 1) → Normal(0, {scale}) on every coefficient ({post.num_examples} examples)")
    t0 = time.perf_counter()
    X, y = post.data.per_example
    refit = pc.fit(logistic_model, X, y, prior_scale=scale, family="full")
    refit_seconds = time.perf_counter() - t0
    rows = []
    print(f"{'correction':28s} {'KL to refit':>12s} {'time [s]':>9s}")
    for label, keep, options in (("prior (no data corrected)", None, dict(correction="prior")),
                                 ("kprior, 10 % by residual", 0.1, dict(correction="kprior")),
                                 ("exact", None, {})):
        start = post if keep is None else post.keep_memory(int(keep * post.num_retained), selection="residual")
        t0 = time.perf_counter()
        changed = start.change_prior(prior_scale=scale, **options)
        seconds = time.perf_counter() - t0
        rows.append((label, max(float(changed.kl(refit)), 0.0), seconds))
        print(f"{label:28s} {rows[-1][1]:12.3e} {seconds:9.2f}")
    print(f"{'refit with pc.fit':28s} {'':>12s} {refit_seconds:9.2f}")
    print("(each first call compiles for the new prior; the stale sites of a tighter prior are far from the refit's, "
          "so only the exact change reaches it here)")
    return rows
