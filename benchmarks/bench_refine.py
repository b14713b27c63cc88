"""Natural-gradient refinement (``pc.fit``, ``pc.dual_form``) against NumPyro SVI with Adam.

What is measured
----------------
Bayesian logistic regression ``w ~ Normal(0, 1)^d``, ``y_i ~ Bernoulli(logits=x_iᵀw)`` on
synthetic data (default ``N = 1e4``, ``d = 100``; ``x_i ~ N(0, (2/√d)² I)`` so that the
logits have standard deviation ≈ 2, ``w_true ~ N(0, I)``). The variational family is the
full-covariance Gaussian; every method is scored by ``KL(q ‖ q_ref)`` computed here in
float64 (eigenvalues of ``L_refᵀ Σ_q L_ref``, so that small KLs are not lost to
cancellation).

* **reference** ``q_ref``: ``pc.fit(model, X, y, family="full", expectation="gh",
  tol=1e-12)`` — the Gauss–Hermite VB optimum; its dual-form residual is reported.
* **(a) pc.fit from the prior** (defaults: ``expectation="gh"``, ``tol=1e-8``):
  iterations and wall time to residual 1e-8; KL of iterate ``k`` to ``q_ref`` is obtained
  by re-running ``pc.fit(..., max_iters=k, raise_on_failure=False)`` (the solver is
  deterministic; the residual of each re-run is checked against the timed run's history).
  Wall time of iterate ``k`` = set-up time of ``pc.fit`` (binding, prior curvature, first
  sites) + ``history[k]["seconds"]`` of the median timed run.
* **(b) pc.dual_form refine from SVI**: ``pc.dual_form(model, AutoMultivariateNormal,
  svi_params, X, y)`` started from SVI parameters at several SVI checkpoints; iterations,
  refine time, KL per iteration (same re-run method), and SVI time + refine time.
* **(c) NumPyro SVI** with ``optax``-style Adam (``numpyro.optim.Adam``), ``AutoMultivariateNormal``,
  ``Trace_ELBO`` (1 particle), several learning rates, up to ``--svi-steps`` steps. The run
  is split into segments (checkpoints at 10, 20, …, 100, 200, …, 1000, 2000, …) continued
  with ``init_state``; each segment length is ``SVI.run`` wrapped in ``jax.jit`` and
  compiled once before timing. ``q_svi``: mean ``auto_loc``, covariance
  ``auto_scale_tril @ auto_scale_tril.T``.

Fairness rules
--------------
* Same data, same process, float64 everywhere (``jax_enable_x64``).
* Jitted baselines: ``SVI.run`` under ``jax.jit`` (a bare ``SVI.run(progress_bar=False)``
  re-traces and re-compiles its ``lax.scan`` on every call, which would charge SVI ~1 s of
  compilation per checkpoint).
* Compile time separate: every timed quantity is measured after a warm-up call with the
  same shapes; ``pc.fit`` / ``pc.dual_form`` times are medians of ``--reps`` full runs.
  Checkpoint KL evaluations are not timed.
* Time to a KL level is read at checkpoints (SVI) or iterates (ours), so it is an upper
  bound within one segment / iteration.

Usage::

    python benchmarks/bench_refine.py            # N=1e4, d=100, 1e4 SVI steps (~2-4 min on 2 cores)
    python benchmarks/bench_refine.py --quick    # smoke run (< 1 min)

Outputs: ``benchmarks/_out/bench_refine.json``, ``bench_refine.md`` and
``bench_refine_kl.png`` (KL vs wall time, log-log).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402
import scipy.linalg  # noqa: E402
from numpyro.infer import SVI, Trace_ELBO  # noqa: E402
from numpyro.infer.autoguide import AutoMultivariateNormal  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import numpyro_pc as pc  # noqa: E402
from _common import machine_info, quiet as _quiet  # noqa: E402

OUT = os.path.join(HERE, "_out")
KL_LEVELS = (1e-1, 1e-2, 1e-3, 1e-4, 1e-6, 1e-8)
TARGET_ITERS = 20
TARGET_SPEEDUP = 10.0


def make_data(n, d, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)) * (2.0 / np.sqrt(d))
    w_true = rng.normal(size=d)
    y = (rng.random(n) < 1.0 / (1.0 + np.exp(-X @ w_true))).astype(np.float64)
    return jnp.asarray(X), jnp.asarray(y)


def logistic_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


# --------------------------------------------------------------------------- KL in float64


class RefGaussian:
    """``q_ref`` prepared for repeated ``KL(q ‖ q_ref)``: mean and Cholesky of its precision."""

    def __init__(self, mean, precision):
        self.mean = np.asarray(mean, np.float64)
        self.prec = np.asarray(precision, np.float64)
        self.chol = np.linalg.cholesky(0.5 * (self.prec + self.prec.T))

    def _kl(self, mean, sv):
        """``sv``: singular values of a square root of ``L_refᵀ Σ_q L_ref``."""
        lam = sv**2
        x = lam - 1.0
        delta = np.asarray(mean, np.float64) - self.mean
        maha = float(np.sum((self.chol.T @ delta) ** 2))
        return 0.5 * (float(np.sum(x - np.log1p(x))) + maha)

    def kl_from_scale_tril(self, mean, scale_tril):
        """``q = N(mean, L Lᵀ)`` (SVI's ``auto_scale_tril``)."""
        return self._kl(mean, np.linalg.svd(self.chol.T @ np.asarray(scale_tril, np.float64), compute_uv=False))

    def kl_from_precision(self, mean, precision):
        """``q = N(mean, P⁻¹)`` (a ``DualPosterior``)."""
        prec = np.asarray(precision, np.float64)
        chol_q = np.linalg.cholesky(0.5 * (prec + prec.T))
        root = scipy.linalg.solve_triangular(chol_q, self.chol, lower=True)  # L_q⁻¹ L_ref
        return self._kl(mean, np.linalg.svd(root, compute_uv=False))


# --------------------------------------------------------------------------- helpers


def _median_run(fn, reps):
    """Run ``fn`` ``reps`` times; return (median wall time, result of the median run)."""
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        runs.append((time.perf_counter() - t0, out))
    runs.sort(key=lambda r: r[0])
    return runs[len(runs) // 2]


def _first_below(times, kls, level):
    for t, k in zip(times, kls):
        if k <= level:
            return t
    return None


def _iters_to(history, tol):
    for h in history:
        if h["residual"] <= tol:
            return h["iteration"]
    return None


def trajectory(run_k, post_full, ref, setup_s, offset_s=0.0):
    """KL and wall time of every iterate of a (deterministic) refinement.

    :param run_k: ``k -> DualPosterior`` after at most ``k`` iterations.
    :param post_full: the timed run (its history gives per-iteration seconds).
    """
    hist = post_full.history
    rows = []
    for h in hist:
        k = h["iteration"]
        post_k = post_full if k == hist[-1]["iteration"] else run_k(k)
        res_k = post_k.history[-1]["residual"]
        rows.append(dict(iteration=k, residual=h["residual"], residual_mean=h.get("residual_mean"),
                         residual_precision=h.get("residual_precision"), step=h.get("step"),
                         accelerated=h.get("accelerated"), rerun_residual=res_k,
                         rerun_matches=bool(np.isclose(res_k, h["residual"], rtol=1e-6, atol=0.0)),
                         seconds=offset_s + setup_s + h["seconds"],
                         kl=ref.kl_from_precision(post_k.mean, post_k.precision)))
    return rows


# --------------------------------------------------------------------------- methods


def run_reference(X, y, tol, max_iters):
    t0 = time.perf_counter()
    post = _quiet(pc.fit, logistic_model, X, y, family="full", expectation="gh", tol=tol, max_iters=max_iters,
                  raise_on_failure=False)
    return post, time.perf_counter() - t0


def count_site_computations(fn):
    """Run ``fn()`` (untimed) counting the solver's site computations (accepted and rejected
    trials) by wrapping ``SiteProblem.sites`` for the duration of the call."""
    from numpyro_pc.solvers import site_problem

    original = site_problem.SiteProblem.sites
    count = [0]

    def counting(self, *args, **kwargs):
        count[0] += 1
        return original(self, *args, **kwargs)

    site_problem.SiteProblem.sites = counting
    try:
        fn()
    finally:
        site_problem.SiteProblem.sites = original
    return count[0]


def run_fit(X, y, ref, tol, reps):
    fit = lambda **kw: _quiet(pc.fit, logistic_model, X, y, family="full", tol=tol,  # noqa: E731
                              raise_on_failure=False, **kw)
    t0 = time.perf_counter()
    fit()  # compile
    first_s = time.perf_counter() - t0
    wall, post = _median_run(fit, reps)
    setup = wall - post.history[-1]["seconds"]
    rows = trajectory(lambda k: fit(max_iters=k), post, ref, setup)
    return dict(site_computations=count_site_computations(fit), first_call_s=first_s, wall_s=wall, setup_s=setup, iterations=post.history[-1]["iteration"],
                iters_to_tol=_iters_to(post.history, tol), final_residual=post.history[-1]["residual"],
                rule=post.rule.kind, storage=post.sites.storage, trajectory=rows)


def setup_breakdown(X, y, reps):
    """Steady-state cost of the pieces ``pc.fit`` runs before its first iteration."""
    from numpyro_pc.sites.expectations import get_rule, prepare_rule
    from numpyro_pc.model.likelihood import prior_loss
    from numpyro_pc.sites.gaussian import compute_sites

    spec, data = pc.bind_model(logistic_model, (X, y))
    fam = pc.get_family("full")
    mean = jnp.zeros(spec.latent.dim)
    times = {"bind_model": [], "prior Hessian": [], "prepare_rule(gh)": [], "compute_sites(gh) at q0": []}
    for _ in range(reps + 1):  # the first round compiles
        t0 = time.perf_counter()
        spec, data = pc.bind_model(logistic_model, (X, y))
        t1 = time.perf_counter()
        prec = jax.block_until_ready(jax.hessian(lambda z: prior_loss(spec, z, data))(mean))
        t2 = time.perf_counter()
        rule = prepare_rule(get_rule("gh"), spec, data, mean)
        t3 = time.perf_counter()
        jax.block_until_ready(compute_sites(spec, data, fam, pc.Gaussian(mean, prec), rule))
        t4 = time.perf_counter()
        for name, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            times[name].append(dt)
    return {name: statistics.median(ts[1:]) for name, ts in times.items()}


def svi_schedule(total):
    """Segment lengths giving checkpoints 10, 20, …, 90, 100, 200, …, 1000, 2000, … and ``total``."""
    marks = sorted({m * 10**e for e in range(1, 9) for m in range(1, 10) if m * 10**e <= total} | {total})
    return [int(b - a) for a, b in zip([0] + marks[:-1], marks)]


def make_optimizer(lr, decay_to, total_steps):
    """Adam with a constant rate, or exponentially decayed from ``lr`` to ``decay_to``."""
    if not decay_to:
        return numpyro.optim.Adam(lr), f"Adam lr={lr:g}"
    import optax

    schedule = optax.exponential_decay(lr, transition_steps=total_steps, decay_rate=decay_to / lr)
    return numpyro.optim.optax_to_numpyro(optax.adam(schedule)), f"Adam lr={lr:g}→{decay_to:g} (exp. decay)"


def run_svi(X, y, ref, lr, total_steps, seed, decay_to=None):
    guide = AutoMultivariateNormal(logistic_model)
    optimizer, label = make_optimizer(lr, decay_to, total_steps)
    svi = SVI(logistic_model, guide, optimizer, Trace_ELBO())
    state0 = svi.init(jax.random.PRNGKey(seed), X, y)
    segs = svi_schedule(total_steps)
    runners, compile_s = {}, 0.0
    key = jax.random.PRNGKey(seed)
    for length in sorted(set(segs)):
        runners[length] = jax.jit(
            lambda s, X_, y_, length=length: svi.run(key, length, X_, y_, init_state=s, progress_bar=False).state)
        t0 = time.perf_counter()
        jax.block_until_ready(runners[length](state0, X, y))
        compile_s += time.perf_counter() - t0
    params = svi.get_params(state0)
    rows = [dict(step=0, seconds=0.0, kl=ref.kl_from_scale_tril(params["auto_loc"], params["auto_scale_tril"]))]
    state, elapsed, step, checkpoints = state0, 0.0, 0, {}
    for length in segs:
        t0 = time.perf_counter()
        state = jax.block_until_ready(runners[length](state, X, y))
        elapsed += time.perf_counter() - t0
        step += length
        params = svi.get_params(state)
        rows.append(dict(step=step, seconds=elapsed,
                         kl=ref.kl_from_scale_tril(params["auto_loc"], params["auto_scale_tril"])))
        checkpoints[step] = (params, elapsed)
    return dict(lr=lr, decay_to=decay_to, label=label, compile_s=compile_s, total_s=elapsed, steps=step,
                trajectory=rows,
                final_kl=rows[-1]["kl"], best_kl=min(r["kl"] for r in rows)), guide, checkpoints


def run_dual_form(X, y, ref, guide, params, svi_seconds, tol, reps):
    refine = lambda **kw: _quiet(pc.dual_form, logistic_model, guide, params, X, y, tol=tol,  # noqa: E731
                                 raise_on_failure=False, **kw)
    t0 = time.perf_counter()
    refine()
    first_s = time.perf_counter() - t0
    wall, post = _median_run(refine, reps)
    setup = wall - post.history[-1]["seconds"]
    rows = trajectory(lambda k: refine(max_iters=k), post, ref, setup, offset_s=svi_seconds)
    return dict(site_computations=count_site_computations(refine), first_call_s=first_s, refine_s=wall, setup_s=setup, svi_s=svi_seconds,
                iterations=post.history[-1]["iteration"], iters_to_tol=_iters_to(post.history, tol),
                final_residual=post.history[-1]["residual"], rule=post.rule.kind,
                start_kl=ref.kl_from_scale_tril(params["auto_loc"], params["auto_scale_tril"]), trajectory=rows)


# --------------------------------------------------------------------------- report


def _t(x):
    return "never" if x is None else f"{x:.3g} s"


def render(res):
    info, a = res["machine"], res["fit"]
    lines = [f"Machine: {info['cpu']}, {info['cores']} cores, JAX {info['jax']} ({info['backend']}), "
             f"NumPyro {info['numpyro']}; numpyro_pc {info['numpyro_pc']}; load average at start "
             f"{', '.join(f'{x:.1f}' for x in info['loadavg'])}. Data: N={res['N']}, d={res['d']}.", "",
             f"Reference: `pc.fit(family='full', expectation='gh', tol={res['ref_tol']:g})` — "
             f"{res['reference']['iterations']} iterations, residual {res['reference']['residual']:.2e} "
             f"({res['reference']['wall_s']:.2f} s incl. compile).", "",
             "**(a) `pc.fit` from the prior, per iteration** (time = steady state, compile excluded):", "",
             "| iteration | residual | (mean part) | (precision part) | KL(q‖q_ref) | wall s | step ρ | Anderson |",
             "|---|---|---|---|---|---|---|---|"]
    for r in a["trajectory"]:
        lines.append(f"| {r['iteration']} | {r['residual']:.2e} | {r['residual_mean']:.1e} "
                     f"| {r['residual_precision']:.1e} | {r['kl']:.3e} | {r['seconds']:.3f} "
                     f"| {r['step'] if r['step'] is not None else '—'} "
                     f"| {'yes' if r['accelerated'] else 'no' if r['accelerated'] is not None else '—'} |")
    lines += ["", f"(a) summary: {a['iters_to_tol']} iterations ({a['site_computations']} site computations, "
              f"counting the one before the solver and rejected trials) to residual ≤ {res['tol']:g}, "
              f"{a['wall_s']:.3f} s steady (median of {res['reps']}; set-up {a['setup_s']:.3f} s of it), "
              f"first call {a['first_call_s']:.2f} s incl. compile; rule {a['rule']}, storage {a['storage']}. "
              f"Re-run residuals match the timed history: {all(r['rerun_matches'] for r in a['trajectory'])}.",
              "", "Set-up before the solver's first iteration, measured piece by piece (steady state): "
              + ", ".join(f"{k} {v:.3f} s" for k, v in a["setup_breakdown"].items())
              + f"; the solver's own initial site computation (history[0]) took "
              f"{a['trajectory'][0]['seconds'] - a['setup_s']:.3f} s.",
              "", "**(b) `pc.dual_form` refine from SVI (Adam lr="
              f"{res['dual_form_lr']:g}) checkpoints:**", "",
              "| SVI steps | SVI s | KL at start | iterations to 1e-8 | site computations | refine s "
              "| SVI + refine s | final KL |", "|---|---|---|---|---|---|---|---|"]
    for b in res["dual_form"]:
        lines.append(f"| {b['svi_steps']} | {b['svi_s']:.3f} | {b['start_kl']:.3e} | {b['iters_to_tol']} "
                     f"| {b['site_computations']} "
                     f"| {b['refine_s']:.3f} | {b['svi_s'] + b['refine_s']:.3f} | {b['trajectory'][-1]['kl']:.2e} |")
    lines += ["", "**(c) SVI (Adam, AutoMultivariateNormal, Trace_ELBO 1 particle, jitted `SVI.run`):**", "",
              "| optimizer | steps | compile s | run s | ms/step | KL after all steps | best KL | time to KL<1e-6 |",
              "|---|---|---|---|---|---|---|---|"]
    for c in res["svi"]:
        t6 = _first_below([r["seconds"] for r in c["trajectory"]], [r["kl"] for r in c["trajectory"]], 1e-6)
        lines.append(f"| {c['label']} | {c['steps']} | {c['compile_s']:.2f} | {c['total_s']:.2f} "
                     f"| {1e3 * c['total_s'] / c['steps']:.3f} | {c['final_kl']:.3e} | {c['best_kl']:.3e} | {_t(t6)} |")
    lines += ["", "**Wall time to reach KL(q‖q_ref) ≤ level** (steady state; ours read at iterates, SVI at "
              "checkpoints):", "", "| method | " + " | ".join(f"{lv:g}" for lv in KL_LEVELS) + " |",
              "|---|" + "---|" * len(KL_LEVELS)]
    for name, times, kls in res["curves"]:
        lines.append(f"| {name} | " + " | ".join(_t(_first_below(times, kls, lv)) for lv in KL_LEVELS) + " |")
    lines += ["", "**Speed-up at equal KL** (SVI's best KL over the run, and the time SVI needed to first reach "
              "it, vs. `pc.fit` from the prior):", "", "| SVI | SVI best KL | SVI time | pc.fit time to that KL "
              "| speed-up |", "|---|---|---|---|---|"]
    for s in res["speedups"]:
        lines.append(f"| {s['label']} | {s['kl']:.2e} | {s['svi_s']:.3g} s | {_t(s['pc_s'])} | "
                     f"{'—' if s['speedup'] is None else format(s['speedup'], '.3g') + '×'} |")
    return "\n".join(lines)


def plot(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    floor = 1e-16
    fig, ax = plt.subplots(figsize=(7.5, 5))
    styles = {"pc.fit": dict(color="k", marker="o", lw=2)}
    for name, times, kls in res["curves"]:
        t = np.maximum(np.asarray(times, float), 1e-4)
        k = np.maximum(np.asarray(kls, float), floor)
        if name.startswith("pc.fit"):
            ax.plot(t, k, label=name, **styles["pc.fit"])
        elif name.startswith("dual_form"):
            ax.plot(t, k, label=name, marker="s", ms=4, lw=1.5)
        else:
            ax.plot(t, k, label=name, lw=1.2, alpha=0.85)
    ax.axhline(1e-6, color="grey", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("wall time, s (steady state, compile excluded)")
    ax.set_ylabel("KL(q ‖ q_ref)  (clipped at 1e-16)")
    ax.set_title(f"Logistic regression N={res['N']}, d={res['d']}, full-covariance Gaussian")
    ax.legend(fontsize=7, loc="lower left")
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: N=2000, d=20, 1000 SVI steps")
    parser.add_argument("--N", type=int, default=10000)
    parser.add_argument("--d", type=int, default=100)
    parser.add_argument("--svi-steps", type=int, default=10000)
    parser.add_argument("--lrs", default="1e-2,3e-3,1e-3", help="comma-separated Adam learning rates")
    parser.add_argument("--decay-to", type=float, default=1e-5,
                        help="also run Adam decayed exponentially from the first lr to this lr (0: skip)")
    parser.add_argument("--dual-form-checkpoints", default="100,1000,10000",
                        help="SVI steps (of the first learning rate) to start pc.dual_form from")
    parser.add_argument("--reps", type=int, default=3, help="timed runs of pc.fit / dual_form (median; >= 3)")
    parser.add_argument("--tol", type=float, default=1e-8)
    parser.add_argument("--ref-tol", type=float, default=1e-12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args(argv)
    if args.quick:
        args.N, args.d, args.svi_steps, args.lrs, args.dual_form_checkpoints = 2000, 20, 1000, "1e-2", "100,1000"
    reps = max(3, args.reps)
    lrs = [float(x) for x in args.lrs.split(",") if x]
    start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - start:6.1f}s] {msg}", flush=True)  # noqa: E731

    X, y = make_data(args.N, args.d, args.seed)
    ref_post, ref_wall = run_reference(X, y, args.ref_tol, max_iters=200)
    ref = RefGaussian(ref_post.mean, ref_post.precision)
    reference = dict(iterations=ref_post.history[-1]["iteration"], residual=ref_post.history[-1]["residual"],
                     residual_parts=ref_post.residual_parts, wall_s=ref_wall)
    log(f"reference: {reference['iterations']} iterations, residual {reference['residual']:.2e}")

    fit_res = run_fit(X, y, ref, args.tol, reps)
    fit_res["setup_breakdown"] = setup_breakdown(X, y, reps)
    log(f"(a) pc.fit: {fit_res['iters_to_tol']} iterations, {fit_res['wall_s']:.3f} s")

    svi_res, dual_res, curves = [], [], []
    checkpoints_wanted = [int(x) for x in args.dual_form_checkpoints.split(",") if x]
    first_guide, first_ckpts = None, None
    svi_runs = [(lr, None) for lr in lrs] + ([(lrs[0], args.decay_to)] if args.decay_to else [])
    for i, (lr, decay_to) in enumerate(svi_runs):
        res, guide, ckpts = run_svi(X, y, ref, lr, args.svi_steps, args.seed, decay_to=decay_to)
        svi_res.append(res)
        if i == 0:
            first_guide, first_ckpts = guide, ckpts
        log(f"(c) SVI {res['label']}: {res['total_s']:.2f} s for {res['steps']} steps, final KL "
            f"{res['final_kl']:.3e}, best {res['best_kl']:.3e}")
    for steps in checkpoints_wanted:
        if steps not in first_ckpts:
            continue
        params, svi_s = first_ckpts[steps]
        b = run_dual_form(X, y, ref, first_guide, params, svi_s, args.tol, reps)
        b["svi_steps"] = steps
        dual_res.append(b)
        log(f"(b) dual_form after {steps} SVI steps: {b['iters_to_tol']} iterations, refine {b['refine_s']:.3f} s")

    curves.append(("pc.fit from prior", [r["seconds"] for r in fit_res["trajectory"]],
                   [r["kl"] for r in fit_res["trajectory"]]))
    for b in dual_res:
        curves.append((f"dual_form after {b['svi_steps']} SVI steps (lr={lrs[0]:g})",
                       [b["svi_s"]] + [r["seconds"] for r in b["trajectory"]],
                       [b["start_kl"]] + [r["kl"] for r in b["trajectory"]]))
    for c in svi_res:
        rows = c["trajectory"][1:]
        curves.append((f"SVI {c['label']}", [r["seconds"] for r in rows], [r["kl"] for r in rows]))

    fit_times = [r["seconds"] for r in fit_res["trajectory"]]
    fit_kls = [r["kl"] for r in fit_res["trajectory"]]
    speedups = []
    for c in svi_res:
        best = min(c["trajectory"][1:], key=lambda r: r["kl"])
        pc_s = _first_below(fit_times, fit_kls, best["kl"])
        speedups.append(dict(label=c["label"], kl=best["kl"], svi_s=best["seconds"], pc_s=pc_s,
                             speedup=None if not pc_s else best["seconds"] / pc_s))

    result = dict(machine=machine_info(), argv=sys.argv[1:], N=args.N, d=args.d, tol=args.tol, ref_tol=args.ref_tol,
                  reps=reps, reference=reference, fit=fit_res, dual_form=dual_res, dual_form_lr=lrs[0],
                  svi=svi_res, curves=curves, speedups=speedups, total_s=time.perf_counter() - start)
    os.makedirs(args.out, exist_ok=True)
    table = render(result)
    png = os.path.join(args.out, "bench_refine_kl.png")
    plot(result, png)
    with open(os.path.join(args.out, "bench_refine.json"), "w") as f:
        json.dump(result, f, indent=1, default=float)
    with open(os.path.join(args.out, "bench_refine.md"), "w") as f:
        f.write(table + "\n")
    print()
    print(table)
    a_ok = fit_res["iters_to_tol"] is not None and fit_res["iters_to_tol"] <= TARGET_ITERS
    print(f"\nTarget: residual {args.tol:g} in ≤ {TARGET_ITERS} iterations: {'MET' if a_ok else 'MISSED'} "
          f"({fit_res['iters_to_tol']} iterations).")
    for s in speedups:
        ok = s["speedup"] is not None and s["speedup"] >= TARGET_SPEEDUP
        print(f"Target ≥{TARGET_SPEEDUP:g}× faster than SVI {s['label']} to its best KL {s['kl']:.2e}: "
              f"{'MET' if ok else 'MISSED'} ({'—' if s['speedup'] is None else format(s['speedup'], '.3g')}×).")
    print(f"\ntotal {time.perf_counter() - start:.0f}s; wrote {args.out}/bench_refine.json, bench_refine.md, "
          "bench_refine_kl.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
