"""What the collapsed-scale check costs ``pc.dual_form`` (issue 32 item 5b), and what it finds.

What is measured
----------------
After a dual form converges from a user's guide, :func:`numpyro_pc.solvers.boundary.check_boundary`
flags constrained coordinates beyond the prior's 1–99 % range (prior draws) and, only then,
scores the default start of ``pc.fit`` against the posterior on the fixed-draw variational
objective. Two cases (float64, seed 0):

* ``regression`` — nothing to flag: a linear regression with a ``HalfNormal(1)`` noise scale
  (``d`` covariates, default 10; 2,000 synthetic rows), ``AutoNormal`` fitted by SVI. The
  check is the prior draws and the quantiles only.
* ``admissions`` — a collapse: UC Berkeley admissions with a correlated intercept and gender
  slope per department (non-centred, LKJ-Cholesky; NumPyro's ``ucbadmit`` model), 12 rows,
  ``AutoNormal`` + Adam(0.01) for 5,000 steps, which collapses ``sigma[0]``. The check adds
  the default-start search and two objective evaluations.

Columns: the warm ``dual_form`` (check included, as a user runs it), the check alone (warm,
median of ``--repeats``), their ratio, and — what a careful user would otherwise do to find
out — a ``pc.fit`` in the same family from the default start (warm), with both objectives.

Usage::

    python benchmarks/bench_boundary_check.py            # 5 repeats
    python benchmarks/bench_boundary_check.py --quick    # 2 repeats
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import SVI, Trace_ELBO, autoguide

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpyro_pc as pc  # noqa: E402
from numpyro_pc.solvers import boundary
from numpyro_pc.solvers import start  # noqa: E402
from numpyro_pc.model.likelihood import bind_model  # noqa: E402
from numpyro_pc.posteriordb.suite import correlated_admissions  # noqa: E402

from _common import machine_info, write_results  # noqa: E402


def regression(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, sigma), obs=y)


def case_data(name, d, rng):
    if name == "regression":
        X = rng.normal(size=(2000, d))
        return regression, (jnp.asarray(X), jnp.asarray(X @ rng.normal(size=d) + 0.5 * rng.normal(size=2000)))
    problem = correlated_admissions()
    return problem.model, tuple(jnp.asarray(a) for a in problem.args)


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, float(np.median(times))


def run_case(name, d, repeats, rng):
    model, args = case_data(name, d, rng)
    guide = autoguide.AutoNormal(model)
    svi = SVI(model, guide, numpyro.optim.Adam(0.01), Trace_ELBO())
    params = svi.run(jax.random.PRNGKey(0), 5000, *args, progress_bar=False).params
    spec, data = bind_model(model, args, {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        post = pc.dual_form(model, guide, params, *args)  # compiles the dual form and the check
        _, dual_s = timed(lambda: pc.dual_form(model, guide, params, *args), repeats)
        found, check_s = timed(lambda: boundary.check_boundary(spec, data, post.family, post.state), repeats)
        refit = pc.fit(model, *args, family=post.family.name)
        _, refit_s = timed(lambda: pc.fit(model, *args, family=post.family.name), repeats)
    refit_objective = start.fixed_draw_objective(spec, data, refit.family, refit.state)
    return dict(case=name, d=spec.latent.dim, n=spec.num_examples, flagged=list(found.flagged),
                warned=bool(found.worse_optimum), dual_form_s=dual_s, check_s=check_s, share=check_s / dual_s,
                refit_s=refit_s, objective=found.objective, start_objective=found.start_objective,
                refit_objective=refit_objective)


def _score(x):
    return "—" if not np.isfinite(x) else f"{x:.1f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "_out"))
    args = parser.parse_args()
    repeats = 2 if args.quick else args.repeats
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        rows = [run_case(name, args.d, repeats, rng) for name in ("regression", "admissions")]
    table = ("| case | d | N | flagged | warned | dual_form warm s (check included) | check s | check / dual_form "
             "| pc.fit warm s | objective: dual form / default start / pc.fit |\n"
             "|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(
                 f"| {r['case']} | {r['d']} | {r['n']} | {', '.join(r['flagged']) or '—'} | {r['warned']} | "
                 f"{r['dual_form_s']:.3f} | {r['check_s']:.3f} | {100 * r['share']:.1f} % | {r['refit_s']:.3f} | "
                 f"{_score(r['objective'])} / {_score(r['start_objective'])} / {_score(r['refit_objective'])} |"
                 for r in rows))
    quiet, collapsed = rows
    targets = [dict(target="nothing flagged: the check adds < 5 % to a warm dual_form",
                    measured=f"{100 * quiet['share']:.1f} %", met=bool(quiet["share"] < 0.05)),
               dict(target="the collapsed SVI solution is warned about, and pc.fit's objective confirms it",
                    measured=f"warned {collapsed['warned']}; {collapsed['objective']:.1f} against "
                             f"{collapsed['refit_objective']:.1f}",
                    met=bool(collapsed["warned"] and collapsed["refit_objective"] < collapsed["objective"]))]
    write_results("bench_boundary_check", args.out, dict(machine=machine_info(), rows=rows), table, targets)


if __name__ == "__main__":
    main()
