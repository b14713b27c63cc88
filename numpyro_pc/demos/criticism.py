"""The ``criticism`` section of the demo: all-N leave-one-out from the sites, ``az.compare``, exact refits."""

from __future__ import annotations

import time

import arviz as az
import jax
import numpy as np

import numpyro_pc as pc
from numpyro_pc.demos.models import logistic_model
from numpyro_pc.demos.plotting import save_figure

__all__ = ["demo_criticism"]


def demo_criticism(post, X, y, out, plt, fit_seconds) -> dict:
    """All-N leave-one-out of the refined posterior against a 10-feature model, ``az.compare``, exact refits
    of the flagged examples; writes ``criticism.png``."""

    t0 = time.perf_counter()
    loo_all = pc.loo(post)
    seconds = time.perf_counter() - t0
    small = pc.fit(logistic_model, X[:, :10], y, family="full")
    loo_small = pc.loo(small)
    table = az.compare({"30 features": loo_all, "first 10 features": loo_small})
    t0 = time.perf_counter()
    refined = pc.loo(post, method="corrected", where=loo_all.flagged)
    refit_seconds = time.perf_counter() - t0
    print("\nmodel criticism without refits: all-N leave-one-out from the sites")
    print(f"  pc.loo, {loo_all.pointwise.size} examples at once: elpd_loo {loo_all.elpd_loo:.2f} ± {loo_all.se:.2f}, "
          f"p_loo {loo_all.p_loo:.2f}, {seconds:.2f} s (one pc.fit: {fit_seconds:.2f} s)")
    print(f"  {int(loo_all.flagged.sum())} example(s) with k̂ > {float(loo_all['good_k']):.1f}; exact refits of those: "
          f"elpd_loo {refined.elpd_loo:.2f} ({refit_seconds:.2f} s)")
    print("  az.compare:")
    print("    " + table[["rank", "elpd_loo", "elpd_diff", "dse"]].to_string().replace("\n", "\n    "))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    diff = loo_all.pointwise - loo_small.pointwise
    axes[0].scatter(np.arange(diff.size), diff, s=8, c=np.where(loo_all.flagged, "tab:red", "tab:blue"))
    axes[0].axhline(0.0, color="grey", lw=0.8)
    axes[0].set_xlabel("example")
    axes[0].set_ylabel("elpd_i(30 features) − elpd_i(10 features)")
    axes[0].set_title("pointwise LOO difference (red: k̂ > 0.7)", fontsize=9)
    axes[1].scatter(loo_all.pointwise, loo_all.khat, s=8, c=np.where(loo_all.flagged, "tab:red", "tab:blue"))
    axes[1].axhline(float(loo_all["good_k"]), color="grey", lw=0.8, ls="--")
    axes[1].set_xlabel("elpd_i (30 features, site removal)")
    axes[1].set_ylabel("k̂_i")
    axes[1].set_title(f"reliability per example; exact refits of the {int(loo_all.flagged.sum())} red ones move "
                      f"elpd_loo by {refined.elpd_loo - loo_all.elpd_loo:+.2f}", fontsize=9)
    fig.tight_layout()
    path = save_figure(fig, out, "criticism.png")
    jax.block_until_ready(loo_all.pointwise)
    return dict(elpd_loo=float(loo_all.elpd_loo), se=float(loo_all.se), seconds=seconds, fit_seconds=fit_seconds,
                flagged=int(loo_all.flagged.sum()), refitted_elpd=float(refined.elpd_loo),
                best=str(table.index[0]), plot=str(path))
