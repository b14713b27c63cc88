#!/usr/bin/env python
"""The figure at the top of ``docs/gp.md``: the one-line stream against GPJax's batch SGPR on a UCI set.

One UCI regression set (default concrete), the protocol of ``benchmarks/bench_gp_uci.py`` (90/10
split, seed 0, standardised, ARD RBF, M inducing inputs, float64): ``StreamingSparseGP`` with the
library defaults over 10 iid batches and over 10 batches sorted along the first principal
component, and GPJax's ``CollapsedVariationalGaussian`` fitted by ``gpx.fit_lbfgs`` (500 iterations,
inducing inputs optimised) on all training rows. Left: test NLPD after each batch. Right: the
predictive mean ± 2 sd of the iid stream and of the batch fit on every test row (sorted by the
batch mean), with the observed targets.

Regenerate (about 2 minutes on 2 cores)::

    python scripts/gp_stream_figure.py                        # docs/_static/gp_stream_vs_batch.png
    python scripts/gp_stream_figure.py --dataset yacht --M 32 --out /tmp/fig.png

Reads ``$NUMPYRO_PC_DATA`` (default ``../shared/data``).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import gpjax as gpx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
os.environ.setdefault("NUMPYRO_PC_DATA", os.path.join(os.path.dirname(ROOT), "shared", "data"))

from bench_gp_uci import batches_of, metrics, split  # noqa: E402

from numpyro_pc.gp import StreamingSparseGP  # noqa: E402

FIGURE = os.path.join(ROOT, "docs", "_static", "gp_stream_vs_batch.png")


def batch_sgpr(X: np.ndarray, y: np.ndarray, M: int, iters: int, seed: int) -> tuple:
    """GPJax batch SGPR fitted with ``fit_lbfgs`` on all rows; ``predict(Xt) -> (mean, var of y)``."""
    Z = X[np.random.default_rng(seed).choice(len(y), M, replace=False)]
    prior = gpx.gps.Prior(mean_function=gpx.mean_functions.Zero(),
                          kernel=gpx.kernels.RBF(lengthscale=jnp.ones(X.shape[1]), variance=1.0))
    q0 = gpx.variational_families.CollapsedVariationalGaussian(
        model=prior * gpx.likelihoods.Gaussian(obs_stddev=jnp.sqrt(0.1)), inducing_inputs=jnp.asarray(Z))
    D = gpx.Dataset(X=jnp.asarray(X), y=jnp.asarray(y)[:, None])
    q, _ = gpx.fit_lbfgs(model=q0, objective=lambda m, d: -gpx.objectives.collapsed_elbo(m, d), train_data=D,
                         max_iters=iters)

    def predict(Xt):
        dist = q.predict(jnp.asarray(Xt), D)
        noise = float(gpx.parameters.val(q.model.likelihood.obs_stddev)) ** 2
        return np.asarray(dist.mean).ravel(), np.diag(np.asarray(dist.covariance_matrix)) + noise

    return predict


def curves(dataset: str, M: int, num_batches: int, seed: int, iters: int) -> dict:
    """NLPD after each batch for the iid and PC1-sorted streams, the batch fit's NLPD and predictions."""
    X, y, Xt, yt = split(dataset, seed)
    out = dict(dataset=dataset, M=M, n=len(y), d=X.shape[1], yt=yt)
    for order in ("iid", "pc1"):
        sgp = StreamingSparseGP(gpx.kernels.RBF(lengthscale=jnp.ones(X.shape[1]), variance=1.0), M,
                                noise_variance=0.1, seed=seed)
        out[order] = []
        for idx in batches_of(X, num_batches, order, seed)[0]:
            sgp = sgp.update(X[idx], y[idx])        # the one-line stream: sgp = sgp.update(X_batch, y_batch)
            out[order].append(metrics(*sgp.predict_y(Xt), yt)["nlpd"])
        if order == "iid":
            out["stream_pred"] = sgp.predict_y(Xt)
    out["batch_pred"] = batch_sgpr(X, y, M, iters, seed)(Xt)
    out["batch"] = metrics(*out["batch_pred"], yt)["nlpd"]
    return out


def plot(c: dict, path: str) -> None:
    """Two panels: NLPD against batches seen, and test predictions of the stream and of the batch fit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw=dict(width_ratios=[1, 1.6]))
    b = np.arange(1, len(c["iid"]) + 1)
    ax0.plot(b, c["iid"], "C0o-", label="stream, iid batches")
    ax0.plot(b, c["pc1"], "C1s-", label="stream, batches sorted along PC1")
    ax0.axhline(c["batch"], color="k", ls=":", label="GPJax batch SGPR (all rows)")
    ax0.set_xlabel("batches seen")
    ax0.set_ylabel("test NLPD (standardised y)")
    ax0.set_title(f"UCI {c['dataset']} ({c['n']} × {c['d']}), M = {c['M']}", fontsize=9)
    ax0.legend(fontsize=8)
    order = np.argsort(c["batch_pred"][0])
    i = np.arange(len(order))
    for (mu, var), colour, name in ((c["batch_pred"], "k", "batch SGPR"), (c["stream_pred"], "C0", "stream (iid)")):
        mu, sd = mu[order], np.sqrt(var[order])
        ax1.fill_between(i, mu - 2 * sd, mu + 2 * sd, color=colour, alpha=0.12, step="mid")
        ax1.plot(i, mu, color=colour, lw=1.2, label=f"{name}: mean ± 2 sd")
    ax1.plot(i, c["yt"][order], ".", color="C3", ms=3, label="observed")
    ax1.set_xlabel("test rows, sorted by the batch fit's mean")
    ax1.set_ylabel("y (standardised)")
    ax1.set_title(f"after the last batch: NLPD stream {c['iid'][-1]:.3f}, batch {c['batch']:.3f}", fontsize=9)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    """Parse the options, compute the curves, write the figure."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default="concrete")
    ap.add_argument("--M", type=int, default=64)
    ap.add_argument("--batches", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline-iters", type=int, default=500)
    ap.add_argument("--out", default=FIGURE)
    args = ap.parse_args(argv)
    c = curves(args.dataset, args.M, args.batches, args.seed, args.baseline_iters)
    print(f"{args.dataset}: iid {np.round(c['iid'], 3)}\n pc1 {np.round(c['pc1'], 3)}\n batch {c['batch']:.3f}")
    plot(c, args.out)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
