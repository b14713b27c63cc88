"""Hierarchical suite: ``pc.fit`` from its default start vs NumPyro SVI and NUTS on the same models.

What is measured
----------------
For every model of :func:`numpyro_pc.posteriordb.suite.suite` (eight schools in both
parametrisations; varying-intercept/slope regressions with Gaussian, logistic and Poisson
likelihoods, centred and non-centred, HalfNormal/HalfCauchy/Exponential scales, 40 and 200
groups), in one process, float64:

* **pc.fit**: ``pc.fit(model, *args)`` with every default; cold (compilation included) and warm
  (a second identical call) wall seconds; the start chosen (``map`` or ``elbo``) and the
  residual; *exact update*: ``pc.fit`` on the first half of the rows then
  ``update(second half, correction="exact")``, and its KL to the batch fit (must be ≤ 1e-8).
* **SVI**: ``AutoMultivariateNormal``, ``Adam(0.01)``, ``Trace_ELBO`` (one particle), in jitted
  ``lax.scan`` chunks of 250 ``svi.update`` steps (compiled once); after each chunk the KL of its
  Gaussian to pc.fit's (the variational optimum the solver certifies, written in the guide's
  coordinates by ``post.to_guide_params``) is read, outside the clock. Reported: the wall seconds (compilation included) until ``KL(q_svi ‖ q_pc) ≤ 0.1`` and
  ``≤ 0.01``, or "—" when 20,000 steps do not get there, and the smallest KL seen.
* **NUTS**: one chain, 1,000 warm-up and 1,000 draws (``PRNGKey(0)``), wall seconds
  (compilation included); the reference for pc.fit's means (``max |z|`` = max over latents of
  |mean − NUTS mean| / NUTS sd, unconstrained space) and sds (range of sd / NUTS sd).

Ratios (ours / baseline) are from the same run. Usage::

    python benchmarks/bench_hierarchical.py            # the full suite (~30 min on 2 cores)
    python benchmarks/bench_hierarchical.py --fast     # the small suite of the tests
    python benchmarks/bench_hierarchical.py --only 0 3 # models by index

Outputs: ``benchmarks/_out/bench_hierarchical.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
from numpyro.infer import MCMC, NUTS, SVI, Trace_ELBO  # noqa: E402
from numpyro.infer.autoguide import AutoMultivariateNormal  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import numpyro_pc as pc  # noqa: E402
from _common import machine_info, write_results  # noqa: E402
from numpyro_pc.posteriordb.suite import suite  # noqa: E402

OUT = os.path.join(HERE, "_out")
CHUNK = 250
MAX_STEPS = 20_000


def gaussian_kl(m0, c0, m1, c1):
    """KL(N(m0, c0) ‖ N(m1, c1)) in float64."""
    m0, c0, m1, c1 = (np.asarray(a, np.float64) for a in (m0, c0, m1, c1))
    p1 = np.linalg.inv(c1)
    d = m0.size
    dm = m1 - m0
    return 0.5 * (np.trace(p1 @ c0) + dm @ p1 @ dm - d + np.linalg.slogdet(c1)[1] - np.linalg.slogdet(c0)[1])


def run_pc(problem):
    t = time.perf_counter()
    post = pc.fit(problem.model, *problem.args)
    cold = time.perf_counter() - t
    t = time.perf_counter()
    pc.fit(problem.model, *problem.args)
    warm = time.perf_counter() - t
    n = problem.args[0].shape[0]
    first, second = [a[: n // 2] for a in problem.args], [a[n // 2:] for a in problem.args]
    t = time.perf_counter()
    updated = pc.fit(problem.model, *first).update(*second, correction="exact")
    update_s = time.perf_counter() - t
    return post, dict(cold=cold, warm=warm, residual=float(post.residual), start=post.record["start"]["kind"],
                      update_seconds=update_s, update_kl=float(updated.kl(post)))


def run_svi(problem, post):
    """SVI in jitted chunks of ``CHUNK`` steps (one compilation, counted in the first chunk's time); the KL
    to pc.fit's Gaussian is read in the guide's own coordinates, outside the clock."""
    guide = AutoMultivariateNormal(problem.model)
    svi = SVI(problem.model, guide, numpyro.optim.Adam(0.01), Trace_ELBO())
    t = time.perf_counter()
    state = svi.init(jax.random.PRNGKey(0), *problem.args)
    target = post.to_guide_params(guide)
    mean = np.asarray(target["auto_loc"])
    cov = np.asarray(target["auto_scale_tril"]) @ np.asarray(target["auto_scale_tril"]).T

    @jax.jit
    def chunk(state):
        return jax.lax.scan(lambda s, _: (svi.update(s, *problem.args)[0], None), state, None, length=CHUNK)[0]

    elapsed, steps, best = time.perf_counter() - t, 0, np.inf
    reached = {0.1: None, 0.01: None}
    while steps < MAX_STEPS and reached[0.01] is None:
        t = time.perf_counter()
        state = jax.block_until_ready(chunk(state))
        elapsed += time.perf_counter() - t
        steps += CHUNK
        params = svi.get_params(state)
        scale_tril = np.asarray(params["auto_scale_tril"])
        kl = gaussian_kl(np.asarray(params["auto_loc"]), scale_tril @ scale_tril.T, mean, cov)
        best = min(best, kl) if np.isfinite(kl) else best
        for level in reached:
            if reached[level] is None and kl <= level:
                reached[level] = (elapsed, steps)
    return dict(to_0_1=reached[0.1], to_0_01=reached[0.01], best_kl=float(best), steps=steps)


def run_nuts(problem, post):
    t = time.perf_counter()
    mcmc = MCMC(NUTS(problem.model), num_warmup=1000, num_samples=1000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), *problem.args)
    samples = mcmc.get_samples()
    seconds = time.perf_counter() - t
    labels = post.spec.latent.labels()

    latent = post.spec.latent
    draws = np.concatenate([np.asarray(t.inv(jnp.asarray(samples[n]))).reshape(len(samples[n]), -1)
                            for n, t in zip(latent.names, latent.transforms)], -1)
    ref_mean, ref_sd = draws.mean(0), draws.std(0)
    ours_sd = np.sqrt(np.diag(np.asarray(post.covariance)))
    z = np.abs(np.asarray(post.mean) - ref_mean) / ref_sd
    ratio = ours_sd / ref_sd
    divergences = int(np.sum(mcmc.get_extra_fields()["diverging"]))
    return dict(seconds=seconds, max_z=float(z.max()), worst=labels[int(np.argmax(z))], sd_lo=float(ratio.min()),
                sd_hi=float(ratio.max()), divergences=divergences)


def _cell(reached):
    return "—" if reached is None else f"{reached[0]:.1f} ({reached[1]})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fast", action="store_true", help="the small suite of the tests")
    ap.add_argument("--only", nargs="*", type=int, help="model indices")
    ap.add_argument("--no-nuts", action="store_true")
    args = ap.parse_args()
    info = machine_info()
    rows = []
    problems = suite(fast=args.fast)
    for i, problem in enumerate(problems):
        if args.only and i not in args.only:
            continue
        print(f"[{i}] {problem.name}", flush=True)
        row = dict(name=problem.name, n=int(problem.args[0].shape[0]))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                post, row["pc"] = run_pc(problem)
            except pc.errors.PosteriorCorrectionError as err:
                row["pc"] = dict(error=f"{type(err).__name__}: {str(err)[:160]}")
                rows.append(row)
                continue
            row["d"] = int(post.spec.latent.dim)
            row["svi"] = run_svi(problem, post)
            if not args.no_nuts:
                row["nuts"] = run_nuts(problem, post)
        print(row, flush=True)
        rows.append(row)

    header = ("| model | N | d | start | pc.fit cold / warm s | exact update KL | SVI s to KL ≤ 0.1 (steps) | "
              "SVI s to KL ≤ 0.01 (steps) | SVI best KL | NUTS s | pc.fit / NUTS | max \\|z\\| vs NUTS | sd / NUTS sd |")
    lines = [header, "|" + "---|" * 13]
    faster_than_nuts = no_slower_than_svi = compared = 0
    for r in rows:
        if "error" in r["pc"]:
            lines.append(f"| {r['name']} | {r['n']} | | refused | {r['pc']['error']} |" + " |" * 8)
            continue
        p, s, n = r["pc"], r["svi"], r.get("nuts")
        nuts_ratio = "" if n is None else f"{p['cold'] / n['seconds']:.2f}"
        if n is not None:
            compared += 1
            faster_than_nuts += p["cold"] < n["seconds"]
        # an SVI run that is not within 0.01 of the optimum after 20,000 steps is the slower one
        no_slower_than_svi += s["to_0_01"] is None or p["cold"] <= s["to_0_01"][0]
        lines.append(
            f"| {r['name']} | {r['n']} | {r['d']} | {p['start']} | {p['cold']:.1f} / {p['warm']:.1f} | "
            f"{p['update_kl']:.1e} | {_cell(s['to_0_1'])} | {_cell(s['to_0_01'])} | {s['best_kl']:.3g} | "
            + ("| | | |" if n is None else
               f"{n['seconds']:.1f} | {nuts_ratio} | {n['max_z']:.2f} ({n['worst']}) | {n['sd_lo']:.2f}–{n['sd_hi']:.2f} |"))
    table = "\n".join(lines)
    fitted = [r for r in rows if "error" not in r["pc"]]
    targets = [
        dict(target="pc.fit converges from the default start on every model (residual ≤ 1e-8)",
             measured=f"{sum(r['pc']['residual'] <= 1e-8 for r in fitted)}/{len(rows)}",
             met=len(fitted) == len(rows) and all(r["pc"]["residual"] <= 1e-8 for r in fitted)),
        dict(target="exact update of half by half = batch fit (KL ≤ 1e-8)",
             measured=f"max KL {max((r['pc']['update_kl'] for r in fitted), default=float('nan')):.1e}",
             met=bool(fitted) and all(r["pc"]["update_kl"] <= 1e-8 for r in fitted)),
        dict(target="pc.fit (cold) faster than NUTS on ≥ 80 % of the models",
             measured=f"{faster_than_nuts}/{compared}", met=compared > 0 and faster_than_nuts >= 0.8 * compared),
        dict(target="pc.fit (cold) no slower than SVI run to KL ≤ 0.01 of the same optimum",
             measured=f"{no_slower_than_svi}/{len(fitted)} (SVI not within 0.01 after 20,000 steps counts as slower)",
             met=no_slower_than_svi == len(fitted)),
    ]
    write_results("bench_hierarchical", OUT, dict(machine=info, rows=rows), table, targets)


if __name__ == "__main__":
    main()
