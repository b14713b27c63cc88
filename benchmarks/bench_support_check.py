"""What the data-support check costs an update (issue 32: "< 5 % of an exact update of 1,000 rows").

What is measured
----------------
Every path that takes data tests each observed value with its distribution's support
(:func:`numpyro_pc.model.data_support.check_support`: one compiled pass over all rows). For a
Bernoulli logistic regression and a Poisson regression (``d`` covariates, default 10,
synthetic, seed 0, float64), a posterior is fitted on 2,000 rows; then, warm (after one
call of each has compiled):

* ``update``: ``post.update(X_new, y_new, correction="exact")`` on 1,000 new rows — the
  check included, as a user runs it;
* ``check``: ``check_support`` alone on the same 1,000 bound rows.

The ratio ``check / update`` is what the check adds. Median of ``--repeats`` (default 5)
calls each, alternated so that both see the same machine load.

Usage::

    python benchmarks/bench_support_check.py            # d = 10, N_new = 1000
    python benchmarks/bench_support_check.py --quick    # 3 repeats
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
from numpyro_pc.model.batches import bind_batch  # noqa: E402
from numpyro_pc.model.data_support import check_support  # noqa: E402

from _common import machine_info, write_results  # noqa: E402


def logistic(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def poisson(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 0.3).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(X @ w)), obs=y)


def data(name, n, d, rng):
    X = rng.normal(size=(n, d)) / np.sqrt(d)
    w = rng.normal(size=d)
    if name == "logistic":
        return X, (rng.random(n) < 1 / (1 + np.exp(-X @ w))).astype(float)
    return X, rng.poisson(np.exp(0.3 * X @ w)).astype(float)


def run_case(name, model, d, n_new, repeats, rng):
    X, y = data(name, 2000 + n_new, d, rng)
    post = pc.fit(model, X[:2000], y[:2000])
    Xn, yn = X[2000:], y[2000:]
    bound = bind_batch(post, (Xn, yn), {})
    post.update(Xn, yn, correction="exact")  # compile both
    check_support(post.spec, bound)
    updates, checks = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(post.update(Xn, yn, correction="exact").mean)
        updates.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        check_support(post.spec, bound)
        checks.append(time.perf_counter() - t0)
    update, check = float(np.median(updates)), float(np.median(checks))
    return dict(model=name, d=d, n_new=n_new, update_s=update, check_s=check, share=check / update)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d", type=int, default=10)
    parser.add_argument("--n-new", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "_out"))
    args = parser.parse_args()
    repeats = 3 if args.quick else args.repeats
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        rows = [run_case(name, model, args.d, args.n_new, repeats, rng)
                for name, model in (("logistic", logistic), ("poisson", poisson))]
    table = ("| model | d | new rows | exact update (warm, s) | support check (s) | check / update |\n"
             "|---|---|---|---|---|---|\n" + "\n".join(
                 f"| {r['model']} | {r['d']} | {r['n_new']} | {r['update_s']:.4f} | {r['check_s']:.5f} | "
                 f"{100 * r['share']:.2f} % |" for r in rows))
    worst = max(r["share"] for r in rows)
    targets = [dict(target="the check adds < 5 % to an exact update of 1,000 rows",
                    measured=f"{100 * worst:.2f} % (worst model)", met=bool(worst < 0.05))]
    write_results("bench_support_check", args.out, dict(machine=machine_info(), rows=rows), table, targets)


if __name__ == "__main__":
    main()
