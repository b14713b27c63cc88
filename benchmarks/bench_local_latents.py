"""Local latents: NumPyro's examples as written (one latent per unit inside the data plate).

What is measured
----------------
For NumPyro's baseball example (``partially_pooled``: Beta abilities, Binomial hits; Efron &
Morris's 18 players) and eight schools (centred, ``theta`` inside the schools plate), both fed
to ``pc.fit`` exactly as NumPyro writes them, in one process, float64:

* **pc.fit** with every default: cold (compilation included) and warm wall seconds; its draws
  (globals, and the units from their local factors) against NUTS: ``max |z|`` = max over every
  latent of |mean − NUTS mean| / NUTS sd (constrained values), and the range of sd / NUTS sd.
* **A new unit** (the last unit held out, then added): ``post.update(new unit,
  correction="exact")`` against what a user would otherwise do — ``pc.fit`` on all units again,
  and NUTS again — wall seconds (the update's first call, which compiles its programs, and a
  second identical call; the refit is warm) and the KL of the update to the refit.
* **SVI** on the model as written (``AutoNormal`` over globals and units, ``Adam(0.01)``,
  10,000 steps in one jitted ``lax.scan``): seconds and the same ``max |z|`` vs NUTS.
* **NUTS**: one chain, 1,000 warm-up and 4,000 draws, ``target_accept_prob=0.95``; for eight
  schools on the model made non-centred by ``LocScaleReparam`` (NUTS on the centred form is
  biased in ``tau`` by its funnel), for baseball on the model as written.

Ratios are from the same run. Usage::

    python benchmarks/bench_local_latents.py

Outputs: ``benchmarks/_out/bench_local_latents.{json,md}``.
"""

from __future__ import annotations

import os
import sys
import time
import warnings

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402
import numpyro  # noqa: E402
from numpyro.handlers import reparam  # noqa: E402
from numpyro.infer import MCMC, NUTS, SVI, Predictive, Trace_ELBO  # noqa: E402
from numpyro.infer.autoguide import AutoNormal  # noqa: E402
from numpyro.infer.reparam import LocScaleReparam  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import numpyro_pc as pc  # noqa: E402
from _common import machine_info, write_results  # noqa: E402
from numpyro_pc.posteriordb.suite import local_latent_examples  # noqa: E402

OUT = os.path.join(HERE, "_out")


def _timed(fn, *args, **kwargs):
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t


def _nuts(problem):
    model = problem.model
    if problem.name.startswith("eight schools"):
        model = reparam(model, config={"theta": LocScaleReparam(centered=0)})
    mcmc = MCMC(NUTS(model, target_accept_prob=0.95), num_warmup=1000, num_samples=4000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), *problem.args)
    return {k: np.asarray(v) for k, v in mcmc.get_samples().items()}


def _against(draws, reference):
    """``(max |z|, worst latent, lowest sd ratio, highest sd ratio)`` of ``draws`` against NUTS."""
    worst, name_of_worst, ratios = 0.0, "", []
    for name, ref in reference.items():
        if name not in draws:  # the reparametrised model's auxiliary site
            continue
        z = np.abs(np.asarray(draws[name]).mean(0) - ref.mean(0)) / ref.std(0)
        if np.max(z) > worst:
            worst, name_of_worst = float(np.max(z)), name
        ratios.append(np.atleast_1d(np.asarray(draws[name]).std(0) / ref.std(0)))
    ratios = np.concatenate(ratios)
    return worst, name_of_worst, float(ratios.min()), float(ratios.max())


def _svi(problem, steps=10_000):
    guide = AutoNormal(problem.model)
    svi = SVI(problem.model, guide, numpyro.optim.Adam(0.01), Trace_ELBO())
    t = time.perf_counter()
    state = svi.init(jax.random.PRNGKey(0), *problem.args)
    run = jax.jit(lambda s: jax.lax.scan(lambda c, _: (svi.update(c, *problem.args)[0], None), s, None, length=steps)[0])
    state = jax.block_until_ready(run(state))
    seconds = time.perf_counter() - t
    params = svi.get_params(state)
    draws = Predictive(guide, params=params, num_samples=20_000)(jax.random.PRNGKey(1), *problem.args)
    return draws, seconds


def run(problem):
    reference, nuts_s = _timed(_nuts, problem)
    post, cold = _timed(pc.fit, problem.model, *problem.args)
    _, warm = _timed(pc.fit, problem.model, *problem.args)
    pc_vs = _against(post.sample(jax.random.PRNGKey(1), 20_000), reference)
    first = [a[:-1] for a in problem.args]
    last = [a[-1:] for a in problem.args]
    held = pc.fit(problem.model, *first)
    updated, update_s = _timed(held.update, *last, correction="exact")
    _, update_warm_s = _timed(held.update, *last, correction="exact")
    _, refit_s = _timed(pc.fit, problem.model, *problem.args)
    _, nuts_again_s = _timed(_nuts, problem)
    svi_draws, svi_s = _svi(problem)
    svi_vs = _against(svi_draws, reference)
    return dict(name=problem.name, n=int(problem.args[0].shape[0]), d=int(post.spec.latent.dim),
                units=int(post.spec.local.dim) * int(problem.args[0].shape[0]), cold=cold, warm=warm,
                residual=float(post.residual), pc_vs_nuts=pc_vs, nuts_seconds=nuts_s, update_seconds=update_s,
                update_warm_seconds=update_warm_s,
                update_kl=float(max(updated.kl(post), post.kl(updated))), refit_seconds=refit_s,
                nuts_again_seconds=nuts_again_s, svi_seconds=svi_s, svi_vs_nuts=svi_vs)


def _vs(v):
    return f"{v[0]:.3f} ({v[1]}) | {v[2]:.2f}–{v[3]:.2f}"


def main():
    info = machine_info()
    rows = []
    for problem in local_latent_examples():
        print(problem.name, flush=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rows.append(run(problem))
        print(rows[-1], flush=True)
    lines = ["| model | units | global d | pc.fit cold / warm s | max \\|z\\| vs NUTS (latent) | sd / NUTS sd | "
             "NUTS s | SVI AutoNormal 10k s | SVI max \\|z\\| (latent) | SVI sd / NUTS sd | new unit: update s first / again | "
             "refit s | NUTS again s | update KL to refit |", "|" + "---|" * 14]
    for r in rows:
        lines.append(f"| {r['name']} | {r['n']} | {r['d']} | {r['cold']:.1f} / {r['warm']:.2f} | {_vs(r['pc_vs_nuts'])} | "
                     f"{r['nuts_seconds']:.1f} | {r['svi_seconds']:.1f} | {_vs(r['svi_vs_nuts'])} | "
                     f"{r['update_seconds']:.2f} / {r['update_warm_seconds']:.2f} | {r['refit_seconds']:.2f} | {r['nuts_again_seconds']:.1f} | "
                     f"{r['update_kl']:.1e} |")
    targets = [
        dict(target="every posterior mean within 0.15 NUTS sd (globals and units)",
             measured=", ".join(f"{r['pc_vs_nuts'][0]:.3f}" for r in rows),
             met=all(r["pc_vs_nuts"][0] <= 0.15 for r in rows)),
        dict(target="a new unit by exact update = refit (KL ≤ 1e-8)",
             measured=", ".join(f"{r['update_kl']:.1e}" for r in rows), met=all(r["update_kl"] <= 1e-8 for r in rows)),
        dict(target="a new unit by update (first call, compilation included) faster than NUTS again",
             measured=", ".join(f"{r['update_seconds']:.2f} vs {r['nuts_again_seconds']:.1f}" for r in rows),
             met=all(r["update_seconds"] < r["nuts_again_seconds"] for r in rows)),
        dict(target="a new unit by update (again) no slower than a warm refit",
             measured=", ".join(f"{r['update_warm_seconds']:.2f} vs {r['refit_seconds']:.2f}" for r in rows),
             met=all(r["update_warm_seconds"] <= r["refit_seconds"] for r in rows)),
        dict(target="pc.fit (cold) faster than NUTS",
             measured=", ".join(f"{r['cold']:.1f} vs {r['nuts_seconds']:.1f}" for r in rows),
             met=all(r["cold"] < r["nuts_seconds"] for r in rows)),
    ]
    write_results("bench_local_latents", OUT, dict(machine=info, rows=rows), "\n".join(lines), targets)


if __name__ == "__main__":
    main()
