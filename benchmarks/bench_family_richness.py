"""Richer families need smaller corrections (paper sec. 3): measured on a7a.

What is measured
----------------
The paper argues that the error of an uncorrected update (``correction="none"``, VCL) comes
from the stale sites of past examples, and that the staleness shrinks as the family gets
richer: a family that represents the posterior's curvature better moves less when new data
arrive, so past sites computed at the old posterior stay closer to what they would be at the
new one. For each family the training set is streamed in ``--batches`` batches:

* ``pc.fit`` on the first batch, then ``post.update(X_t, y_t, correction="none")``;
* before every update, :func:`numpyro_pc.correction_magnitude` (the Fisher-metric norm of
  the difference between each retained example's stored site and its site at the new VCL
  posterior; the correction an exact update would make), summed over the examples;
* after every update, ``KL(q_none ‖ q_batch)`` where ``q_batch`` is ``pc.fit`` of the same
  family on all data so far (the batch posterior the exact update reaches);
* after every update, the error of the surrogate the update kept for the past examples:
  ``Σ_past (ℓ_i − ℓ̂_i)`` between the old and the new mean (:func:`surrogate_error`), the
  paper's correction term in nats, one scale for every family;
* for a model with many posterior modes (the network), also ``KL(q_none ‖ q_near)`` where
  ``q_near`` is the same batch fit started from the VCL chain's mean (``init=mean``): the
  fixed point of the chain's own basin, the one a correction from the chain reaches. The
  default fit starts from 0 and may settle in another mode (a permutation of the hidden
  units, say), whose distance to the chain is no correction error.

Reported per family: the mean correction magnitude per retained example over the stream,
the final and largest KL to the batch fit, and the final mean error in the metric of the
full-family batch posterior, ``½ δmᵀ S_full δm`` with ``δm`` the VCL mean minus the batch mean
of the same family (one scale for every family: each family's KL weighs the mean error by
its own precision). Families: ``isotropic`` (mean only, fixed
precision), ``diagonal``, ``lowrank:r`` (when the low-rank family is registered) and ``full``.

Model
-----
``a7a``: Bayesian logistic regression on LIBSVM a7a (16 100 × 123 binary features plus an
  intercept, d = 124, prior precision 5 as in ``bench_continual.py``), file order.

``digits``: a one-hidden-layer tanh network (16 units, biases; d = 1 210) classifying
  scikit-learn's digits (1 797 images, pixels / 16, N(0, 1) priors) with Laplace–GGN sites
  (``expectation="delta"``, ``curvature="ggn"``), file order. The mean equation is the
  network's MAP problem; Newton–CG steps (:mod:`numpyro_pc.solvers.newton_polish`) finish it (plain
  Gauss–Newton steps stalled near a relative residual of 1e-6).

Usage::

    python benchmarks/bench_family_richness.py                       # a7a, 10 batches
    python benchmarks/bench_family_richness.py --quick               # 4 000 a7a examples
    python benchmarks/bench_family_richness.py --families isotropic,diagonal,lowrank:10,full
    python benchmarks/bench_family_richness.py --models digits --batches 5
    python benchmarks/bench_family_richness.py --models digits --batches 5 --hidden 80 \
        --families isotropic,lowrank:10 --no-full-metric                 # d = 6 010

Outputs: ``benchmarks/_out/bench_family_richness.{json,md,png}`` (``bench_family_richness_h80.*`` with
``--hidden 80``).
"""

from __future__ import annotations

import argparse
import os
from functools import partial
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import numpyro_pc as pc  # noqa: E402
from _common import machine_info, quiet, write_results  # noqa: E402
from bench_continual import model as logistic  # noqa: E402  (the same a7a model)
from numpyro_pc.datasets.loaders import load_a7a  # noqa: E402
from numpyro_pc.model.likelihood import bind_model, losses, prior_loss  # noqa: E402

OUT = os.path.join(HERE, "_out")
def load(name, quick, hidden=16):
    """``(model, X, y, fit options)`` of a benchmark model (``hidden`` units for the network)."""
    if name == "a7a":
        X, y = load_a7a("train")
        if quick:
            X, y = X[:4000], y[:4000]
        return logistic, jnp.asarray(X, jnp.float64), jnp.asarray(y, jnp.float64), {}
    if name == "digits":
        from sklearn.datasets import load_digits

        digits = load_digits()
        X, y = digits.data / 16.0, digits.target
        if quick:
            X, y = X[:600], y[:600]
        return partial(network, hidden=hidden), jnp.asarray(X), jnp.asarray(y), dict(expectation="delta",
                                                                                    curvature="ggn")
    raise SystemExit(f"unknown model {name!r}")


MULTIMODAL = {"digits"}  # models whose batch fit may land in another mode than the VCL chain


def network(X, y=None, hidden=16):
    """One hidden tanh layer with biases, softmax over ten classes, N(0, 1) priors."""
    import numpyro
    import numpyro.distributions as dist

    w1 = numpyro.sample("w1", dist.Normal(0.0, 1.0).expand([X.shape[1], hidden]).to_event(2))
    b1 = numpyro.sample("b1", dist.Normal(0.0, 1.0).expand([hidden]).to_event(1))
    w2 = numpyro.sample("w2", dist.Normal(0.0, 1.0).expand([hidden, 10]).to_event(2))
    b2 = numpyro.sample("b2", dist.Normal(0.0, 1.0).expand([10]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Categorical(logits=jnp.tanh(X @ w1 + b1) @ w2 + b2), obs=y)


def family_options(spec):
    """``"lowrank:10"`` → ``dict(family="lowrank", rank=10)``; other names pass through."""
    name, _, rank = spec.partition(":")
    return dict(family=name, rank=int(rank)) if rank else dict(family=name)


def full_references(model, X, y, batches, fit_opts):
    """Mean and precision of the full-family batch fit on batches ``1..t``, for every ``t ≥ 2``."""
    parts = np.array_split(np.arange(X.shape[0]), batches)
    refs = []
    for t in range(1, batches):
        seen = np.concatenate(parts[: t + 1])
        post = quiet(pc.fit, model, X[seen], y[seen], family="full", **fit_opts)
        refs.append((np.asarray(post.mean), np.asarray(post.precision)))
    return refs


def surrogate_error(model, X_past, y_past, old, new):
    """How far the VCL update misjudges the past examples' loss: the change of their negative log
    likelihood from the old mean to the new one, minus the change the update assumed (nats).

    An uncorrected update keeps the old posterior as the past examples' stand-in, so their
    surrogate loss is ``−log q_old(z) − ℓ_0(z)`` up to a constant, whose change is
    ``½ δᵀ S_old δ − (ℓ_0(m_new) − ℓ_0(m_old))`` (``∇ log q_old`` vanishes at ``m_old``). The
    difference is ``Σ_past (ℓ_i − ℓ̂_i)`` between the two means: the paper's correction term
    itself, on one scale for every family (the correction magnitude uses each family's metric).
    """
    spec, bound = bind_model(model, (X_past, y_past))
    step = new.mean - old.mean
    true = jnp.sum(losses(spec, new.mean, bound)) - jnp.sum(losses(spec, old.mean, bound))
    assumed = 0.5 * step @ old.precision @ step - (prior_loss(spec, new.mean, bound) - prior_loss(spec, old.mean, bound))
    return float(true - assumed)


def stream(model, X, y, batches, fit_opts, fam_opts, refs, nearest=False):
    """VCL over the batches: the correction magnitude before each update; after it, the KL to the batch
    fit of the same family (and, with ``nearest``, to the batch fit started at the chain's mean) and the
    mean error in the full-family batch posterior's metric."""
    parts = np.array_split(np.arange(X.shape[0]), batches)
    opts = {**fit_opts, **fam_opts}
    start = time.perf_counter()
    post = quiet(pc.fit, model, X[parts[0]], y[parts[0]], **opts)
    rows = []
    for t in range(1, batches):
        rows_t = parts[t]
        magnitude = quiet(pc.correction_magnitude, post, X[rows_t], y[rows_t])  # warns: VCL chains are stale
        old, post = post, quiet(post.update, X[rows_t], y[rows_t], correction="none")
        past = np.concatenate(parts[:t])
        surrogate = surrogate_error(model, X[past], y[past], old, post)
        seen = np.concatenate(parts[: t + 1])
        batch = quiet(pc.fit, model, X[seen], y[seen], **opts)
        error = np.asarray(post.mean - batch.mean)
        row = dict(batch=t + 1, retained=int(magnitude["ids"].size), magnitude=magnitude["total"],
                   per_example=magnitude["total"] / magnitude["ids"].size, kl=float(post.kl(batch)),
                   mean_error=float("nan") if refs is None else 0.5 * float(error @ refs[t - 1][1] @ error),
                   surrogate_error=surrogate, surrogate_per_example=abs(surrogate) / past.size)
        if nearest:
            near = quiet(pc.fit, model, X[seen], y[seen], init=np.asarray(post.mean), **opts)
            row.update(kl_nearest=float(post.kl(near)), nearest_to_batch=float(near.kl(batch)),
                       objective_gap=float(near.history[-1]["objective"] - batch.history[-1]["objective"]))
        rows.append(row)
    return dict(steps=rows, seconds=time.perf_counter() - start, dim=int(post.dim))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="a7a")
    parser.add_argument("--families", default="isotropic,diagonal,lowrank:1,lowrank:10,lowrank:50,full")
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--hidden", type=int, default=16, help="hidden units of the digits network")
    parser.add_argument("--no-full-metric", action="store_true",
                        help="skip the full-family batch fits behind the ½ δmᵀ S_full δm column (large d)")
    args = parser.parse_args(argv)
    result = dict(machine=machine_info(), batches=args.batches, quick=args.quick, hidden=args.hidden, runs={})
    lines = ["| model | d | family | correction per example (mean over updates) | final KL to batch | max KL | "
             "final ½ δmᵀ S_full δm | final KL to the nearest batch fit (max) | "
             "|Σ_past (ℓ_i − ℓ̂_i)| per past example (mean over updates) | s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name in args.models.split(","):
        model, X, y, fit_opts = load(name, args.quick, args.hidden)
        refs = None if args.no_full_metric else full_references(model, X, y, args.batches, fit_opts)
        for fam in args.families.split(","):
            run = stream(model, X, y, args.batches, fit_opts, family_options(fam), refs, name in MULTIMODAL)
            result["runs"][f"{name}/{fam}"] = run
            per = np.mean([s["per_example"] for s in run["steps"]])
            kls = [s["kl"] for s in run["steps"]]
            near = [s["kl_nearest"] for s in run["steps"] if "kl_nearest" in s]
            near = f"{near[-1]:.3e} ({max(near):.3e})" if near else "= KL to batch (one fixed point)"
            lines.append(f"| {name} | {run['dim']} | {fam} | {per:.3e} | {kls[-1]:.3e} | {max(kls):.3e} | "
                         f"{run['steps'][-1]['mean_error']:.3e} | {near} | "
                         f"{np.mean([s['surrogate_per_example'] for s in run['steps']]):.3e} | {run['seconds']:.1f} |")
            print(lines[-1], flush=True)

    def plot(path):
        import matplotlib.pyplot as plt

        models = args.models.split(",")
        fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models), 7), squeeze=False)
        for j, name in enumerate(models):
            for fam in args.families.split(","):
                steps = result["runs"][f"{name}/{fam}"]["steps"]
                t = [s["batch"] for s in steps]
                axes[0, j].semilogy(t, [s["per_example"] for s in steps], "o-", label=fam)
                line, = axes[1, j].semilogy(t, [max(s["kl"], 1e-16) for s in steps], "o-", label=fam)
                if "kl_nearest" in steps[0]:
                    axes[1, j].semilogy(t, [max(s["kl_nearest"], 1e-16) for s in steps], "x--", color=line.get_color())
            axes[0, j].set_title(f"{name}: correction per retained example")
            axes[1, j].set_title(f"{name}: KL(VCL ‖ batch fit)" + (" (dashed: fit from the VCL mean)"
                                                                   if name in MULTIMODAL else ""))
            axes[1, j].set_xlabel("batch")
            axes[0, j].legend()
        fig.tight_layout()
        fig.savefig(path, dpi=110)

    name = "bench_family_richness" + ("" if args.hidden == 16 else f"_h{args.hidden}")
    write_results(name, OUT, result, "\n".join(lines), [], plot)


if __name__ == "__main__":
    main()
