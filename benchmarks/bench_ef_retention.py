"""Bounded data retention of exponential-family posteriors: ``update(keep=...)`` against keeping every row.

What is measured
----------------
A stream of ``B`` batches (default 40) of ``n`` rows (default 250), synthetic, seed 0, each added
with ``post.update(batch, correction="exact")`` in float64 to a posterior first fitted on one
batch, under three retention policies: ``keep="all"`` (what a user must do without this
option: every row kept and every site recomputed at every update), a reservoir of ``R`` rows
(default 500, ``seed`` per batch) and ``keep="none"`` (every earlier site frozen). Two models:

* ``beta_bernoulli``: ``p ~ Beta(2, 3)``, ``y ~ Bernoulli(p)`` (conjugate: frozen sites are
  exact, every policy must end at the closed-form posterior);
* ``misclassified``: ``p ~ Beta(2, 3)``, ``y ~ Bernoulli(0.1 + 0.8 p)`` (sites that depend on
  ``q``: a frozen site is the one its batch saw, and the error of freezing shows as a KL to the
  ``keep="all"`` posterior).

Reported per model and policy: wall seconds of the last 10 updates (warm: the stream is run
twice and the second pass timed, so no update compiles), the rows held at the end, and
KL(q_policy ‖ q_all) (a value of order ±1e-11 is the rounding of two equal posteriors' KL) (and, for the conjugate model, the largest relative
error of the Beta parameters against the closed form).

Usage::

    python benchmarks/bench_ef_retention.py --quick   # 12 batches of 250
    python benchmarks/bench_ef_retention.py           # 40 batches of 250
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpyro_pc as pc  # noqa: E402

from _common import machine_info, write_results  # noqa: E402

A0, B0 = 2.0, 3.0


def beta_bernoulli(y=None):
    p = numpyro.sample("p", dist.Beta(A0, B0))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Bernoulli(probs=p), obs=y)


def misclassified(y=None):
    p = numpyro.sample("p", dist.Beta(A0, B0))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Bernoulli(probs=0.1 + 0.8 * p), obs=y)


def stream(model, batches, keep):
    """The posterior after every batch, and each update's wall seconds."""
    post = pc.fit(model, y=jnp.asarray(batches[0]), family={"p": "beta"})
    seconds = []
    for k, batch in enumerate(batches[1:]):
        start = time.perf_counter()
        post = post.update(y=jnp.asarray(batch), correction="exact", keep=keep, seed=k)
        float(post.residual)  # the update's result read back: the work is done
        seconds.append(time.perf_counter() - start)
    return post, seconds


def beta_args(post):
    (_, args), = post.family.describe(post.natural).values()
    return np.array([float(v) for v in args.values()])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batches", type=int, default=None)
    parser.add_argument("--rows", type=int, default=250)
    parser.add_argument("--reservoir", type=int, default=500)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "_out"))
    args = parser.parse_args(argv)
    num_batches = args.batches or (12 if args.quick else 40)
    jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(0)
    y = rng.binomial(1, 0.3, size=num_batches * args.rows).astype(float)
    batches = np.split(y, num_batches)
    policies = [("all", "all"), (f"reservoir {args.reservoir}", args.reservoir), ("none", "none")]
    result = dict(machine=machine_info(), batches=num_batches, rows=args.rows, reservoir=args.reservoir, table=[])
    for name, model in (("beta_bernoulli", beta_bernoulli), ("misclassified", misclassified)):
        for _, keep in policies:  # a first pass compiles every bucket the stream meets: the timed pass is warm
            stream(model, batches, keep)
        runs = {label: stream(model, batches, keep) for label, keep in policies}
        reference = runs["all"][0]
        for label, (post, seconds) in runs.items():
            row = dict(model=name, policy=label, rows_held=post.num_retained, sites=post.num_examples,
                       update_s=float(np.median(seconds[-10:])), kl_to_all=float(post.kl(reference)),
                       residual=float(post.residual))
            if name == "beta_bernoulli":
                exact = np.array([A0 + y.sum(), B0 + (1 - y).sum()])
                row["closed_form_err"] = float(np.max(np.abs(beta_args(post) / exact - 1)))
            result["table"].append(row)
            print(row)
    all_rows = {(r["model"], r["policy"]): r for r in result["table"]}
    table = ("| model | keep | rows held | sites | update s (median of last 10) | speed-up vs keep=\"all\" | "
             "KL to keep=\"all\" | closed-form rel. error | residual |\n|---|---|---|---|---|---|---|---|---|\n")
    table += "\n".join(
        f"| {r['model']} | {r['policy']} | {r['rows_held']} | {r['sites']} | {r['update_s']:.4f} | "
        f"{all_rows[(r['model'], 'all')]['update_s'] / r['update_s']:.1f}× | {r['kl_to_all']:.1e} | "
        f"{r.get('closed_form_err', float('nan')):.1e} | {r['residual']:.1e} |" for r in result["table"])
    conj = [r for r in result["table"] if r["model"] == "beta_bernoulli"]
    bounded = [r for r in result["table"] if r["policy"] != "all"]
    targets = [dict(target="conjugate model: every policy at the closed form (rel. error ≤ 1e-10)",
                    measured=", ".join(f"{r['closed_form_err']:.0e}" for r in conj),
                    met=all(r["closed_form_err"] <= 1e-10 for r in conj)),
               dict(target="bounded retention holds at most the reservoir's rows",
                    measured=", ".join(str(r["rows_held"]) for r in bounded),
                    met=all(r["rows_held"] <= args.reservoir for r in bounded))]
    write_results("bench_ef_retention", args.out, result, table, targets)


if __name__ == "__main__":
    main()
