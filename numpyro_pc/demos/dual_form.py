"""The ``dual_form`` section of the demo: SVI, the dual form at its guide, refinement, ``pc.fit``."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import jax
import numpy as np
import optax
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoMultivariateNormal

import numpyro_pc as pc
from numpyro_pc.demos.models import logistic_model
from numpyro_pc.demos.plotting import save_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["demo_dual_form", "plot_dual_form"]


def demo_dual_form(X, y, names, out, plt, fast, svi_steps, seed) -> dict:
    """SVI, the dual form at its guide, refinement and ``pc.fit``; prints the table and the KLs."""
    steps = svi_steps or (500 if fast else 3000)
    timings = {}
    guide = AutoMultivariateNormal(logistic_model)
    svi = SVI(logistic_model, guide, optax.adam(0.01), Trace_ELBO())
    t0 = time.perf_counter()
    res = svi.run(jax.random.PRNGKey(seed), steps, X, y, progress_bar=False)
    jax.block_until_ready(res.params)
    timings["svi"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    raw = pc.dual_form(logistic_model, guide, res.params, X, y, refine=False)
    timings["dual_form"] = time.perf_counter() - t0
    before = raw.residual

    t0 = time.perf_counter()
    post = raw.refine(progress=not fast)
    timings["refine"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    scratch = pc.fit(logistic_model, X, y, family="full")
    timings["fit"] = time.perf_counter() - t0

    kl_svi = float(raw.kl(post))
    kl_fit = float(scratch.kl(post))
    rows = [
        ("SVI (Adam, AutoMultivariateNormal)", f"{steps} steps", timings["svi"]),
        ("dual_form: sites at the SVI guide", f"residual {before:.2e}", timings["dual_form"]),
        ("refine: natural-gradient steps", f"residual {post.residual:.2e} in {len(post.history) - 1} it.",
         timings["refine"]),
        ("pc.fit (MAP/Laplace start, no SVI)", f"residual {scratch.residual:.2e}", timings["fit"]),
    ]
    print()
    print(f"{'step':40s} {'result':32s} {'time [s]':>9s}")
    for name, result, seconds in rows:
        print(f"{name:40s} {result:32s} {seconds:9.2f}")
    print()
    print(f"KL(SVI guide ‖ refined posterior)     = {kl_svi:.3e}")
    print(f"KL(pc.fit ‖ refined posterior)         = {kl_fit:.3e}")
    path = save_figure(plot_dual_form(post, raw, X, y, names, plt), out, "dual_form.png")
    return dict(residual_before=before, residual_after=post.residual, kl_svi=kl_svi, kl_fit=kl_fit, timings=timings,
                iterations=len(post.history) - 1, plot=str(path), _post=post, _scratch=scratch)


def plot_dual_form(post, raw, X, y, names, plt) -> Figure:

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    margin = np.asarray(X @ post.mean[1:] + post.mean[0])
    beta = np.asarray(post.sites.curv.lam[:, 0, 0])  # the logistic model's factorised sites: Λ_i = p_i(1 − p_i)
    ax = axes[0]
    for label, colour in [(0, "tab:red"), (1, "tab:blue")]:
        sel = np.asarray(y) == label
        ax.scatter(np.abs(margin[sel]), beta[sel], s=10, alpha=0.7, c=colour,
                   label=["malignant", "benign"][label])
    ax.set_yscale("log")
    ax.set_xlabel("distance to the decision boundary |xᵢᵀm + b|")
    ax.set_ylabel("site curvature βᵢ = E_q[σ'(fᵢ)]")
    ax.set_title("Per-example site curvature")
    ax.legend()

    ax = axes[1]
    order = np.argsort(-np.abs(np.asarray(post.mean[1:])))[:8] + 1
    sd_post = np.sqrt(np.diag(np.asarray(post.covariance)))
    sd_raw = np.sqrt(np.diag(np.asarray(raw.covariance)))
    for k, idx in enumerate(order):
        grid = np.linspace(-4, 4, 200)
        for mean, sd, style in [(post.mean[idx], sd_post[idx], "-"), (raw.mean[idx], sd_raw[idx], ":")]:
            dens = np.exp(-0.5 * grid**2) / (sd * np.sqrt(2 * np.pi))
            ax.plot(float(mean) + sd * grid, dens / dens.max() * 0.8 + k, style, c=f"C{k}")
    ax.set_yticks(range(len(order)))
    ax.set_yticklabels([names[i - 1] for i in order], fontsize=8)
    ax.set_xlabel("coefficient (unconstrained)")
    ax.set_title("Posterior marginals: refined (—) vs SVI (⋯)")

    ax = axes[2]
    hist = post.history
    ax.semilogy([h["iteration"] for h in hist], [h["residual_mean"] for h in hist], "o-", label="Σĝᵢ = 0")
    ax.semilogy([h["iteration"] for h in hist], [max(h["residual_precision"], 1e-17) for h in hist], "s-",
                label="S = ΣĤᵢ")
    ax.axhline(1e-8, c="grey", ls="--", lw=1, label="tolerance")
    ax.set_xlabel("refinement iteration")
    ax.set_ylabel("relative residual")
    ax.set_title("Dual-form residual during refine")
    ax.legend()
    fig.tight_layout()
    return fig
