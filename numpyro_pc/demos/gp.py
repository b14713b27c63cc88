"""Demo section: a streaming sparse GP on a synthetic 1-D stream (called by ``numpyro_pc demo``)."""

from __future__ import annotations

import time

import numpy as np

from numpyro_pc.demos.plotting import save_figure
from numpyro_pc.gp.model import StreamingSparseGP
from numpyro_pc.gp.usage import enable_compilation_cache

__all__ = ["demo_streaming_gp"]


def demo_streaming_gp(out, plt, fast=False, seed=0) -> dict:
    """Stream a noisy sine, ordered by input, in 4 batches through :class:`StreamingSparseGP`.

    Prints per batch the bound, learned lengthscale and noise, the KL from the previous
    ``q(u)``, the L-BFGS iterations and the time; writes ``streaming_gp.png`` (predictive
    band, inducing inputs and the batch after each batch, :meth:`StreamingSparseGP.plot`).
    JAX's persistent compilation cache is turned on
    (:func:`~numpyro_pc.gp.usage.enable_compilation_cache`; ``NUMPYRO_PC_JAX_CACHE=0`` turns it off), so a
    second run compiles nothing.

    :param out: output folder.
    :param plt: ``matplotlib.pyplot`` (Agg backend already selected by the caller).
    :param bool fast: Adam with 100 steps per batch (compiles faster than L-BFGS) instead of L-BFGS.
    :return: dict with the per-batch summary and the plot path.
    """
    import os

    import gpjax as gpx

    if os.environ.get("NUMPYRO_PC_JAX_CACHE") != "0":
        print(f"JAX compilation cache: {enable_compilation_cache()}")

    rng = np.random.default_rng(seed)
    X = np.sort(rng.uniform(0, 10, 200))[:, None]
    y = np.sin(X[:, 0]) + 0.3 * np.cos(3 * X[:, 0]) + 0.15 * rng.normal(size=200)
    grid = np.linspace(-0.5, 10.5, 200)[:, None]
    sgp = StreamingSparseGP(gpx.kernels.RBF(lengthscale=1.0, variance=1.0), 12, noise_variance=0.1,
                            optimizer="adam" if fast else "lbfgs", learning_rate=0.05,
                            max_iters=100 if fast else 150, seed=seed)
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.2), sharey=True)
    print("\nStreaming sparse GP (Bui et al. 2017, collapsed VFE): noisy sine, 4 batches ordered by x, M = 12")
    print(f"{'batch':>5s} {'bound':>10s} {'lengthscale':>12s} {'noise':>9s} {'KL(q_t‖q_t-1)':>14s} {'its':>5s} "
          f"{'time [s]':>9s}")
    for b, (ax, idx) in enumerate(zip(axes, np.array_split(np.arange(200), 4))):
        t0 = time.perf_counter()
        sgp = sgp.update(X[idx], y[idx])
        seconds = time.perf_counter() - t0
        h = sgp.history[-1]
        kl = "–" if h["kl_to_previous"] is None else f"{h['kl_to_previous']:.2f}"
        print(f"{b:5d} {h['bound']:10.2f} {h['hyperparameters']['kernel.lengthscale']:12.3f} "
              f"{h['hyperparameters']['noise']:9.4f} {kl:>14s} {h['iterations']:5d} {seconds:9.2f}")
        ax.plot(X[:, 0], y, ".", color="0.8", ms=3)
        sgp.plot(X[idx], y[idx], ax=ax, grid=grid)
    fig.tight_layout()
    path = save_figure(fig, out, "streaming_gp.png", dpi=110)
    return dict(summary=sgp.summary(), plot=str(path))
