"""Leave-one-out of exponential-family posteriors: ``pc.loo`` against brute-force refits.

What is measured
----------------
Three models with ``N`` examples (default 400, synthetic, seed 0), each fitted with
``pc.fit(model, ..., family={...}, tol=1e-12)`` in float64:

* ``gamma_poisson``: ``r ~ Gamma(2, 0.5)``, ``y_i ~ Poisson(r)`` (conjugate: the cavity is
  the exact leave-one-out posterior);
* ``lognormal_poisson``: ``r ~ LogNormal(0.5, 0.8)`` with a Gamma factor (the prior is not
  conjugate-form: the cavity keeps a stale prior term);
* ``misclassified``: ``p ~ Beta(2, 3)``, ``y_i ~ Bernoulli(0.1 + 0.8 p)`` (a likelihood that
  is not linear in the Beta's statistics: every retained site is stale in the cavity).

``pc.loo(post)`` (all ``N`` cavities ``λ + g_i`` at once, scored by the posterior's own
Gauss points) against what a user would otherwise do: refit the model without example ``i``
(``pc.fit`` on the other ``N − 1``, from the prior, ``tol=1e-12``) and score ``y_i`` under
that refit with the same rule — for every ``i`` (``--refits`` caps how many; the refitted
examples are a random subset then, and the refit time is scaled to all ``N``). The error is
``|elpd_i(pc.loo) − elpd_i(refit)|``; the timing is wall seconds, ``pc.loo`` cold (compile
included) and warm, against the refits' total (the first refit, which compiles, excluded
and reported apart).

Usage::

    python benchmarks/bench_ef_loo.py --quick   # N = 200, 40 refits per model
    python benchmarks/bench_ef_loo.py           # N = 400, every example refitted
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
from numpyro_pc.criticism.ef_cavity import ef_predictive  # noqa: E402

from _common import machine_info, write_results  # noqa: E402


def gamma_poisson(y=None):
    r = numpyro.sample("r", dist.Gamma(2.0, 0.5))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Poisson(r), obs=y)


def lognormal_poisson(y=None):
    r = numpyro.sample("r", dist.LogNormal(0.5, 0.8))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Poisson(r), obs=y)


def misclassified(y=None):
    p = numpyro.sample("p", dist.Beta(2.0, 3.0))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Bernoulli(0.1 + 0.8 * p), obs=y)


def cases(n, rng):
    counts = rng.poisson(4.0, n).astype(float)
    return [("gamma_poisson", gamma_poisson, {"r": "gamma"}, counts),
            ("lognormal_poisson", lognormal_poisson, {"r": "gamma"}, counts),
            ("misclassified", misclassified, {"p": "beta"}, rng.binomial(1, 0.3, n).astype(float))]


def run_case(name, model, family, y, refits, rng):
    post = pc.fit(model, y=jnp.asarray(y), family=family, tol=1e-12)
    t0 = time.perf_counter()
    cold = pc.loo(post)
    t_cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    pc.loo(post)
    t_warm = time.perf_counter() - t0
    rows = np.arange(y.size) if refits >= y.size else np.sort(rng.choice(y.size, refits, replace=False))
    exact, seconds = [], []
    for i in rows:
        t0 = time.perf_counter()
        refit = pc.fit(model, y=jnp.asarray(np.delete(y, i)), family=family, tol=1e-12)
        exact.append(float(ef_predictive(post, refit.natural[None], [i])[0]))
        seconds.append(time.perf_counter() - t0)
    err = np.abs(cold.pointwise[rows] - np.asarray(exact))
    per_refit = float(np.median(seconds[1:])) if len(seconds) > 1 else float(seconds[0])
    return dict(model=name, n=int(y.size), refitted=int(rows.size), loo_cold=t_cold, loo_warm=t_warm,
                refit_first=float(seconds[0]), refit_median=per_refit, refits_all_n=per_refit * y.size,
                max_err=float(err.max()), median_err=float(np.median(err)), max_khat=float(cold.khat.max()),
                elpd_loo=float(cold["elpd_loo"]), elpd_refit_subset=float(np.sum(exact)),
                elpd_loo_subset=float(np.sum(cold.pointwise[rows])))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--n", type=int, default=None)
    parser.add_argument("--refits", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "_out"))
    args = parser.parse_args(argv)
    n = args.n or (200 if args.quick else 400)
    refits = args.refits or (40 if args.quick else n)
    jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(args.seed)
    result = dict(machine=machine_info(), n=n, refits=refits, rows=[])
    for name, model, family, y in cases(n, rng):
        row = run_case(name, model, family, y, refits, rng)
        result["rows"].append(row)
        print(f"{name}: pc.loo {row['loo_cold']:.2f} s cold / {row['loo_warm']:.3f} s warm; refits "
              f"{row['refit_median']:.3f} s each ({row['refits_all_n']:.1f} s for all N); max |err| {row['max_err']:.1e}")
    table = ("| model | N | refitted | pc.loo cold s | pc.loo warm s | one refit s (median) | refits for all N s | "
             "speed-up (warm) | max \\|err\\| | median \\|err\\| | max k̂ |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    table += "\n".join(
        f"| {r['model']} | {r['n']} | {r['refitted']} | {r['loo_cold']:.2f} | {r['loo_warm']:.3f} | "
        f"{r['refit_median']:.3f} | {r['refits_all_n']:.1f} | {r['refits_all_n'] / r['loo_warm']:.0f}× | "
        f"{r['max_err']:.1e} | {r['median_err']:.1e} | {r['max_khat']:.2f} |" for r in result["rows"])
    conj = result["rows"][0]
    targets = [dict(target="conjugate pair: pc.loo equals the refits to 1e-8", measured=f"{conj['max_err']:.1e}",
                    met=conj["max_err"] < 1e-8),
               dict(target="pc.loo (warm) at least 10× faster than N refits on every model",
                    measured=", ".join(f"{r['refits_all_n'] / r['loo_warm']:.0f}×" for r in result["rows"]),
                    met=all(r["refits_all_n"] / r["loo_warm"] >= 10 for r in result["rows"]))]
    write_results("bench_ef_loo", args.out, result, table, targets)


if __name__ == "__main__":
    main()
