"""Leave-one-out on breast cancer: predicted parameter change of each deletion method vs exact retraining.

What is measured
----------------
Bayesian logistic regression with an intercept on scikit-learn's breast-cancer data
(569 × 30, features standardised), prior ``b, w_j ~ Normal(0, 1)`` (prior precision 1),
full Gaussian (d = 31), ``post = pc.fit(model, X, y, family="full", tol=1e-12)`` (``gh``
rule). For every example ``i`` (or a random subset, see below):

* **exact** LOO change ``Δ_i = m_{∖i} − m`` from ``post.delete([i], method="retrain")``
  (the solver run to ``tol=1e-12`` on the other 568 examples, started from ``q``). The
  package default ``tol=1e-8`` is too loose for a LOO reference: the residual is relative
  to the whole posterior, so removing a well-classified example (``ĝ_i ≈ 0``) leaves a
  residual below 1e-8 and the "retrain" returns ``q`` unchanged (``Δ_i = 0`` exactly);
  ``--tol`` changes both tolerances;
* **predicted** change from ``remove_site`` (memory-perturbation equation,
  ``m + S_{∖i}⁻¹ ĝ_i``), ``influence`` (``m + H_{∖i}⁻¹ ∇ℓ_i(m)``, Hessian at the mean) and
  ``tracin`` (``m + ∇ℓ_i(m)``).

Scores per method: the Pearson correlation between predicted and exact changes pooled over
all examples and coordinates (``n × d`` pairs); the per-coordinate correlation (over the
examples, for each of the d coordinates) summarised by its median and minimum; the median
relative error ``‖Δ̂_i − Δ_i‖ / ‖Δ_i‖``; and the median wall time per deletion.

All 569 examples are used when the measured time of one retrain (after a warm-up call),
times 569, fits in ``--budget`` seconds; otherwise a random subset of
``max(150, budget / t_retrain)`` examples (``numpy`` seed ``--seed``), and the output says so.

Fairness rules
--------------
* Same data, same process, same fitted posterior, float64 (``jax_enable_x64``).
* Compile time separate: each method is called once before timing (all deletions of one
  example have the same shapes, so one compile per method); per-deletion times are medians
  over the examples. Correlations are computed on the exact outputs, not timed.

Usage::

    python benchmarks/bench_loo.py            # all 569 examples (~6-7 min on 2 cores; influence's ~0.5 s per call dominates)
    python benchmarks/bench_loo.py --quick    # 40 random examples (~1 min)
    python benchmarks/bench_loo.py --elpd     # all-N LOO ELPD (pc.loo) vs brute-force refits and PSIS-LOO on NUTS

``--elpd`` (issue 14): for breast cancer (569, prior precision 1), a7a (16 100 × 123, prior
precision 5, as ``bench_continual.py``) and three posteriordb models, times ``pc.fit`` (second
call, compiled) and the all-N ``pc.loo`` (first call with compilation, and a second call);
scores ``elpd_loo`` and the pointwise values against brute-force LOO — ``post.delete([i],
method="corrected", tol=1e-12)``, an exact warm-started refit of the same variational family
(``pc.loo(post, method="corrected", where=all)``) — on every example, or on a random subset
(``--subset``, seed 0) where N refits cost too much (a7a); and runs NumPyro NUTS (1 chain,
``--warmup``/``--draws``) with ``arviz.loo`` (PSIS) on its draws, timed. The PSIS error is
measured against the same brute-force reference, so it includes the gap between NUTS's exact
posterior and the variational one; both are reported.

Outputs: ``benchmarks/_out/bench_loo.json``, ``bench_loo.md``, ``bench_loo.png``
(scatter of predicted vs exact change, one panel per method).
"""

from __future__ import annotations

import argparse
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import numpyro_pc as pc  # noqa: E402
from _common import machine_info, quiet as _quiet, write_results  # noqa: E402
from numpyro_pc.datasets.loaders import load_breast_cancer  # noqa: E402

OUT = os.path.join(HERE, "_out")
PREDICTORS = ("remove_site", "influence", "tracin")
TARGET_R = 0.99


def model(X, y=None):
    """Logistic regression with intercept, prior precision 1."""
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def change(post, i, method, tol=None):
    """``(m_{∖i} − m, wall seconds, posterior)`` for one deletion."""
    kw = dict(tol=tol) if method == "retrain" else {}
    t0 = time.perf_counter()
    out = _quiet(post.delete, [int(i)], method=method, **kw)
    jax.block_until_ready(out.state)
    dt = time.perf_counter() - t0
    return np.asarray(out.mean) - np.asarray(post.mean), dt, out


def correlations(pred, exact):
    pooled = float(np.corrcoef(pred.ravel(), exact.ravel())[0, 1])
    per = np.array([np.corrcoef(pred[:, j], exact[:, j])[0, 1] for j in range(exact.shape[1])])
    rel = np.linalg.norm(pred - exact, axis=1) / np.linalg.norm(exact, axis=1)
    return dict(pooled_r=pooled, per_coordinate_r=per.tolist(), median_coordinate_r=float(np.median(per)),
                min_coordinate_r=float(np.min(per)), median_rel_error=float(np.median(rel)),
                p90_rel_error=float(np.quantile(rel, 0.9)))


def render(res):
    info = res["machine"]
    lines = [f"Machine: {info['cpu']}, {info['cores']} cores, JAX {info['jax']} ({info['backend']}), "
             f"NumPyro {info['numpyro']}; numpyro_pc {info['numpyro_pc']}; load average at start "
             f"{', '.join(f'{x:.1f}' for x in info['loadavg'])}. Data: breast cancer N={res['N']}, d={res['d']}; "
             f"fit: {res['fit_iterations']} iterations, residual {res['fit_residual']:.1e}.", "",
             f"Examples: {res['num_examples']} of {res['N']} ({res['subset_note']}). One retrain after warm-up: "
             f"{res['t_retrain_probe']:.3f} s → all {res['N']} ≈ {res['N'] * res['t_retrain_probe']:.0f} s "
             f"(budget {res['budget_s']:.0f} s). Retrain iterations per deletion: median "
             f"{res['retrain_iterations_median']}, max {res['retrain_iterations_max']}; median ‖Δ_i‖ = "
             f"{res['median_exact_norm']:.3e}.", "",
             "| method | pooled r (n·d pairs) | per-coordinate r: median | min | median ‖Δ̂−Δ‖/‖Δ‖ | 90th pct "
             "| median s / deletion | first call s |", "|---|---|---|---|---|---|---|---|"]
    for m, r in res["methods"].items():
        lines.append(f"| {m} | {r['pooled_r']:.5f} | {r['median_coordinate_r']:.5f} | {r['min_coordinate_r']:.4f} "
                     f"| {r['median_rel_error']:.3e} | {r['p90_rel_error']:.3e} | {r['median_s']:.4f} "
                     f"| {r['first_s']:.2f} |")
    lines.append(f"| retrain (exact) | 1 | 1 | 1 | 0 | 0 | {res['retrain_median_s']:.4f} | "
                 f"{res['retrain_first_s']:.2f} |")
    return "\n".join(lines)


def plot(res, exact, preds, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(preds), figsize=(4.3 * len(preds), 4.3))
    for ax, (m, p) in zip(np.atleast_1d(axes), preds.items()):
        ax.scatter(exact.ravel(), p.ravel(), s=3, alpha=0.4)
        lo = min(exact.min(), p.min())
        hi = max(exact.max(), p.max())
        ax.plot([lo, hi], [lo, hi], color="k", lw=0.8, ls=":")
        r = res["methods"][m]
        ax.set_title(f"{m}: pooled r={r['pooled_r']:.4f}\nmedian per-coord r={r['median_coordinate_r']:.4f}",
                     fontsize=9)
        ax.set_xlabel(r"exact $m_{\setminus i} - m$ (retrain)")
        ax.set_ylabel(r"predicted $m_{\setminus i} - m$")
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"Breast cancer LOO, {res['num_examples']} examples × d={res['d']} coordinates", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 40 random examples")
    parser.add_argument("--num", type=int, default=None, help="force a random subset of this size")
    parser.add_argument("--budget", type=float, default=300.0,
                        help="seconds allowed for the retrains; all examples if 569 × t_retrain fits")
    parser.add_argument("--tol", type=float, default=1e-12,
                        help="residual tolerance of the fit and of every retrain (package default 1e-8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--elpd", action="store_true", help="all-N LOO ELPD vs refits and PSIS (issue 14)")
    parser.add_argument("--only", nargs="*", default=None, help="--elpd: datasets to run")
    parser.add_argument("--subset", type=int, default=40, help="--elpd: refits on a7a (random subset)")
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--draws", type=int, default=1000)
    parser.add_argument("--diagnose", default=None, metavar="DATASET",
                        help="split pc.loo's error on DATASET into cavity and quadrature parts (issue 14)")
    args = parser.parse_args(argv)
    if args.diagnose:
        return diagnose_main(args)
    if args.elpd:
        return elpd_main(args)
    if args.quick:
        args.num = 40
    start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - start:6.1f}s] {msg}", flush=True)  # noqa: E731
    info = machine_info()

    X, y, _ = load_breast_cancer(standardize=True)
    X, y = jnp.asarray(X), jnp.asarray(y)
    post = _quiet(pc.fit, model, X, y, family="full", tol=args.tol)
    n = int(X.shape[0])
    log(f"fit: {post.history[-1]['iteration']} iterations, residual {post.residual:.1e}")

    # warm-up (compile) every method, then probe one retrain
    first = {}
    for m in PREDICTORS + ("retrain",):
        _, first[m], _ = change(post, 0, m, args.tol)
    probes = [change(post, i, "retrain", args.tol)[1] for i in (1, 2, 3)]
    t_probe = statistics.median(probes)
    log(f"one retrain {t_probe:.3f} s → all {n}: {n * t_probe:.0f} s")
    rng = np.random.default_rng(args.seed)
    if args.num:
        idx = np.sort(rng.choice(n, size=min(args.num, n), replace=False))
        note = f"random subset of {idx.size} forced by --num/--quick (seed {args.seed})"
    elif n * t_probe <= args.budget:
        idx = np.arange(n)
        note = "all examples"
    else:
        size = int(min(n, max(150, args.budget / t_probe)))
        idx = np.sort(rng.choice(n, size=size, replace=False))
        note = (f"random subset of {size} (seed {args.seed}): {n} retrains ≈ {n * t_probe:.0f} s exceed the "
                f"{args.budget:.0f} s budget")
    log(f"using {idx.size} examples ({note})")

    exact = np.zeros((idx.size, post.dim))
    preds = {m: np.zeros_like(exact) for m in PREDICTORS}
    times = {m: [] for m in PREDICTORS + ("retrain",)}
    iters = []
    for k, i in enumerate(idx):
        exact[k], dt, out = change(post, i, "retrain", args.tol)
        times["retrain"].append(dt)
        iters.append(out.history[-1]["iteration"])
        for m in PREDICTORS:
            preds[m][k], dt, _ = change(post, i, m)
            times[m].append(dt)
        if (k + 1) % 50 == 0:
            log(f"  {k + 1}/{idx.size}")

    methods = {}
    for m in PREDICTORS:
        methods[m] = correlations(preds[m], exact)
        methods[m].update(median_s=statistics.median(times[m]), first_s=first[m])
    result = dict(machine=info, argv=sys.argv[1:], N=n, d=int(post.dim), fit_iterations=post.history[-1]["iteration"],
                  fit_residual=float(post.residual), num_examples=int(idx.size), subset_note=note,
                  examples=idx.tolist(), t_retrain_probe=t_probe, budget_s=args.budget, methods=methods,
                  retrain_median_s=statistics.median(times["retrain"]), retrain_first_s=first["retrain"],
                  retrain_iterations_median=int(np.median(iters)), retrain_iterations_max=int(np.max(iters)),
                  median_exact_norm=float(np.median(np.linalg.norm(exact, axis=1))),
                  exact_changes=exact.tolist(), predicted_changes={m: p.tolist() for m, p in preds.items()})
    rs, ri = methods["remove_site"], methods["influence"]
    result["targets"] = [
        dict(target=f"remove_site r ≥ {TARGET_R} (pooled / per-coordinate median)",
             measured=f"{rs['pooled_r']:.5f} / {rs['median_coordinate_r']:.5f}",
             met=bool(rs["pooled_r"] >= TARGET_R and rs["median_coordinate_r"] >= TARGET_R)),
        dict(target="remove_site better than influence (pooled r, per-coordinate median r, median rel. error)",
             measured=f"{rs['pooled_r']:.5f} vs {ri['pooled_r']:.5f}; {rs['median_coordinate_r']:.5f} vs "
                      f"{ri['median_coordinate_r']:.5f}; {rs['median_rel_error']:.2e} vs {ri['median_rel_error']:.2e}",
             met=bool(rs["pooled_r"] > ri["pooled_r"] and rs["median_coordinate_r"] > ri["median_coordinate_r"])),
    ]
    result["total_s"] = time.perf_counter() - start
    write_results("bench_loo", args.out, result, render(result), result["targets"],
                  lambda path: plot(result, exact, preds, path))
    print(f"\ntotal {time.perf_counter() - start:.0f}s; wrote {args.out}/bench_loo.json, bench_loo.md, bench_loo.png")
    return 0


# --------------------------------------------------------------------------- --elpd (issue 14)

ELPD_DATASETS = ("breast_cancer", "a7a", "kidiq-kidscore_momhsiq", "mesquite-logmesquite_logvas",
                 "eight_schools-eight_schools_noncentered")


def a7a_model(X, y=None):
    """Logistic regression with intercept, prior precision 5 (as bench_continual.py)."""
    scale = 1.0 / np.sqrt(5.0)
    b = numpyro.sample("b", dist.Normal(0.0, scale))
    w = numpyro.sample("w", dist.Normal(0.0, scale).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def _problem(name):
    if name == "breast_cancer":
        X, y, _ = load_breast_cancer(standardize=True)
        return model, (jnp.asarray(X), jnp.asarray(y)), {}
    if name == "a7a":
        from numpyro_pc.datasets.loaders import load_a7a

        X, y = load_a7a("train")
        return a7a_model, (jnp.asarray(X), jnp.asarray(y)), {}
    from numpyro_pc.posteriordb import reference as pdb

    tr = pdb.translate(name)
    return tr.model, tuple(tr.args), dict(tr.kwargs)


def _timed(fn, *a, **kw):
    t0 = time.perf_counter()
    out = _quiet(fn, *a, **kw)
    jax.block_until_ready(jax.tree.leaves(getattr(out, "state", ())))
    return out, time.perf_counter() - t0


def _psis(mdl, margs, mkw, warmup, draws, seed):
    """NUTS draws, then arviz.loo on their per-example (joint) log likelihood; times of each."""
    import arviz as az
    from numpyro.infer import MCMC, NUTS, log_likelihood

    t0 = time.perf_counter()
    mcmc = MCMC(NUTS(mdl), num_warmup=warmup, num_samples=draws, num_chains=1, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(seed), *margs, **mkw)
    samples = mcmc.get_samples()
    jax.block_until_ready(samples)
    t_nuts = time.perf_counter() - t0
    t0 = time.perf_counter()
    ll = log_likelihood(mdl, samples, *margs, **mkw)
    joint = sum(np.asarray(v).reshape(draws, -1) for v in ll.values())
    bad = int(np.sum(~np.isfinite(joint)))
    if bad:
        print(f"  NUTS: {bad} non-finite log-likelihood values; divergences "
              f"{int(np.sum(mcmc.get_extra_fields()['diverging']))}", flush=True)
    posterior = {k: np.asarray(v)[None] for k, v in samples.items()}
    res = az.loo(az.from_dict(posterior=posterior, log_likelihood={"joint": joint[None]}), pointwise=True)
    pointwise, flat, failed = _psis_pointwise(res, joint)
    return res, pointwise, flat, failed, t_nuts, time.perf_counter() - t0


FLAT_SPAN = 1e-10  # log-likelihood range across draws below which importance weights are uniform to rounding


def _psis_pointwise(res, joint):
    """PSIS's ``loo_i`` with the examples whose log likelihood is flat across draws filled in.

    ``arviz.loo`` returns NaN for an example whose log likelihood varies across the draws by
    less than float64 can resolve after ``exp`` (breast cancer: example 461, log likelihood in
    [−3.9e−14, −6e−43]): the generalised-Pareto fit of the tail weights ``exp(x) − exp(x_cut)``
    divides by a zero quantile and returns σ = NaN, which propagates into every smoothed weight.
    The importance weights ``1/p(y_i | θ_s)`` of such an example are equal to within
    ``exp(range) − 1``, so any weighting — Pareto-smoothed or raw — gives a value inside
    ``[min_s ℓ_is, max_s ℓ_is]``; we use the raw importance-sampling estimate
    ``−log mean_s exp(−ℓ_is)`` (error below the range, ≤ 1e−10). Examples that are NaN with a
    larger range are genuine PSIS failures and stay NaN (counted in ``failed``).
    """
    from scipy.special import logsumexp

    pointwise = np.array(res.loo_i.values, dtype=np.float64)
    nan = ~np.isfinite(pointwise)
    flat = nan & (np.ptp(joint, axis=0) <= FLAT_SPAN)
    raw = -(logsumexp(-joint, axis=0) - np.log(joint.shape[0]))
    pointwise[flat] = raw[flat]
    return pointwise, np.flatnonzero(flat), np.flatnonzero(nan & ~flat)


def elpd_main(args):
    start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - start:6.1f}s] {msg}", flush=True)  # noqa: E731
    info = machine_info()
    rows = []
    for name in args.only or ELPD_DATASETS:
        mdl, margs, mkw = _problem(name)
        post, t_fit_first = _timed(pc.fit, mdl, *margs, **mkw)
        post, t_fit = _timed(pc.fit, mdl, *margs, **mkw)
        res, t_loo_first = _timed(pc.loo, post)
        res, t_loo = _timed(pc.loo, post)
        n = int(res["n_data_points"])
        log(f"{name}: N={n} d={post.dim} rule={post.rule.kind} fit {t_fit:.2f}s (first {t_fit_first:.2f}s), "
            f"loo {t_loo:.2f}s (first {t_loo_first:.2f}s), elpd {res.elpd_loo:.3f}, flagged {int(res.flagged.sum())}")
        rng = np.random.default_rng(args.seed)
        subset = np.arange(n) if n <= 600 else np.sort(rng.choice(n, size=min(args.subset, n), replace=False))
        mask = np.zeros(n, bool)
        mask[subset] = True
        brute, t_brute = _timed(pc.loo, post, method="corrected", where=mask)
        err = res.pointwise[subset] - brute.pointwise[subset]
        fixed, t_fixed = _timed(pc.loo, post, method="corrected")  # refits only where k̂ > 0.7
        try:  # second-order expansion of the retained sites (refused for large d)
            taylor, t_taylor_first = _timed(pc.loo, post, method="taylor")
            taylor, t_taylor = _timed(pc.loo, post, method="taylor")
            err_t = taylor.pointwise[subset] - brute.pointwise[subset]
            n_conv = int(np.sum(taylor["taylor_converged"]))
        except pc.errors.InvalidOptionError as exc:
            log(f"  taylor: {exc}")
            taylor = err_t = n_conv = None
            t_taylor = t_taylor_first = float("nan")
        err_c = fixed.pointwise[subset] - brute.pointwise[subset]
        psis, psis_i, psis_flat, psis_failed, t_nuts, t_psis = _psis(mdl, margs, mkw, args.warmup, args.draws,
                                                                      args.seed)
        perr = psis_i[subset] - brute.pointwise[subset]
        flag_err = np.abs(err)[res.flagged[subset]]
        row = dict(name=name, N=n, d=int(post.dim), rule=post.rule.kind, storage=post.sites.storage,
                   t_fit=t_fit, t_fit_first=t_fit_first, t_loo=t_loo, t_loo_first=t_loo_first,
                   ratio_loo_fit=t_loo / t_fit, ratio_loo_first_fit_first=t_loo_first / t_fit_first,
                   elpd_pc=float(res.elpd_loo), se=float(res.se), p_loo=float(res.p_loo),
                   elpd_psis=float(np.sum(psis_i)), elpd_psis_arviz=float(psis.elpd_loo),
                   psis_flat=psis_flat.tolist(), psis_failed=psis_failed.tolist(), p_loo_psis=float(psis.p_loo),
                   psis_khat_max=float(np.nanmax(psis.pareto_k.values)), pc_khat_max=float(np.max(res.khat)),
                   flagged=int(res.flagged.sum()), num_refits=int(subset.size), t_refits=t_brute,
                   t_per_refit=t_brute / max(subset.size, 1), t_nuts=t_nuts, t_psis=t_psis,
                   sum_err_pc=float(np.sum(err)), sum_err_psis=float(np.sum(perr)),
                   t_loo_corrected=t_fixed, sum_err_corrected=float(np.sum(err_c)),
                   max_err_corrected=float(np.max(np.abs(err_c))), elpd_corrected=float(fixed.elpd_loo),
                   max_err_pc=float(np.max(np.abs(err))), max_err_psis=float(np.max(np.abs(perr))),
                   mean_abs_err_pc=float(np.mean(np.abs(err))), mean_abs_err_psis=float(np.mean(np.abs(perr))),
                   max_err_flagged=float(flag_err.max()) if flag_err.size else 0.0,
                   khat_err_spearman=_spearman(res.khat[subset], np.abs(err)),
                   t_taylor=t_taylor, t_taylor_first=t_taylor_first, ratio_taylor_fit=t_taylor / t_fit,
                   sum_err_taylor=float(np.sum(err_t)) if err_t is not None else None, taylor_converged=n_conv,
                   max_err_taylor=float(np.max(np.abs(err_t))) if err_t is not None else None)
        if subset.size < n:  # extrapolated to all N (stated as such)
            row["sum_err_pc_scaled"] = row["sum_err_pc"] * n / subset.size
        rows.append(row)
        log(f"  refits {subset.size} in {t_brute:.1f}s: |Σ err| pc {abs(row['sum_err_pc']):.2e} vs PSIS "
            f"{abs(row['sum_err_psis']):.2e}; max |err_i| {row['max_err_pc']:.2e} vs {row['max_err_psis']:.2e}; "
            f"NUTS {t_nuts:.1f}s + loo {t_psis:.2f}s")
    result = dict(machine=info, argv=sys.argv[1:], rows=rows, total_s=time.perf_counter() - start)
    targets = []
    for r in rows:
        targets.append(dict(target=f"{r['name']}: all-N LOO ≤ 3× one pc.fit", measured=f"{r['ratio_loo_fit']:.2f}×",
                            met=bool(r["ratio_loo_fit"] <= 3.0)))
        targets.append(dict(target=f"{r['name']}: |elpd − brute force| < PSIS's (corrected where k̂ > 0.7)", measured=(
            f"{abs(r['sum_err_corrected']):.2e} vs {abs(r['sum_err_psis']):.2e}" + (
                f" (on {r['num_refits']} of {r['N']})" if r["num_refits"] < r["N"] else "")),
            met=bool(abs(r["sum_err_corrected"]) < abs(r["sum_err_psis"]))))
        if r["sum_err_taylor"] is not None:
            targets.append(dict(target=f"{r['name']}: method='taylor' ≤ 3× one pc.fit",
                                measured=f"{r['ratio_taylor_fit']:.2f}×", met=bool(r["ratio_taylor_fit"] <= 3.0)))
            targets.append(dict(target=f"{r['name']}: |elpd − brute force| < PSIS's (method='taylor')",
                                measured=f"{abs(r['sum_err_taylor']):.2e} vs {abs(r['sum_err_psis']):.2e}",
                                met=bool(abs(r["sum_err_taylor"]) < abs(r["sum_err_psis"]))))
        if r["name"] == "a7a":
            targets.append(dict(target="a7a all-N LOO under a minute", measured=f"{r['t_loo']:.1f} s "
                                f"(first call {r['t_loo_first']:.1f} s)", met=bool(r["t_loo_first"] < 60)))
    write_results("bench_loo_elpd", args.out, result, render_elpd(result), targets)
    return 0


def diagnose_main(args):
    """Where pc.loo's error comes from on one model, against exact refits of a random subset.

    For ``--subset`` random examples (seed ``--seed``): the predictive density by the
    posterior's rule under (a) the site-removal cavity, (b) the exact refit
    ``post.delete([i], method="corrected", tol=1e-12)``, (c) the cavity's mean with the
    refit's precision and vice versa; the rule against an 80-nodes-per-dimension Gauss–Hermite
    rule on the refits and the cavities; and one and two exact fixed-point iterations of the
    deletion from the cavity (every other site re-evaluated at the iterate, one site pass each:
    ``O(N)`` per example, ``O(N²)`` for all).
    """
    from dataclasses import replace as _replace

    import numpyro_pc.sites.expectations as expectations
    from numpyro_pc.criticism import cavity as cv
    from numpyro_pc.families.registry import Gaussian
    from numpyro_pc.model.rows import positions, take_data
    from numpyro_pc.sites.gaussian import compute_sites

    mdl, margs, mkw = _problem(args.diagnose)
    post = _quiet(pc.fit, mdl, *margs, **mkw)
    ids = np.asarray(post.data_ids)
    n = ids.size
    idx = np.sort(np.random.default_rng(args.seed).choice(n, size=min(args.subset, n), replace=False))
    sites = post.sites.take(positions(np.asarray(post.sites.ids), ids))
    cav = cv.cavities(post, sites, post.data)
    m, S = post.state.mean, post.state.precision
    H = post.family.site_curvatures(sites.curv)
    cav_mean = m + cav.shift[idx]
    cav_prec = S[None] - H[idx]
    means, precs = [], []
    for i in idx:
        refit = _quiet(post.delete, [int(ids[i])], method="corrected", tol=1e-12)
        means.append(refit.state.mean)
        precs.append(refit.state.precision)
    means, precs = jnp.stack(means), jnp.stack(precs)
    data = take_data(post.data, idx)
    score = lambda mu, pr, rule=None: np.asarray(  # noqa: E731
        cv._refit_predictive(_replace(post.spec, num_examples=int(idx.size)), rule or post.rule, post.family, data,
                             mu, pr))
    ref = score(means, precs)
    lines = [f"{args.diagnose}: N={n}, d={post.dim}, rule {post.rule.kind} ({post.rule.nodes_per_dim} nodes per "
             f"dimension, subspace {post.rule.subspace_dim}); {idx.size} random examples (seed {args.seed}), errors "
             "against the exact refits scored by the same rule:", ""]
    report = lambda label, v: lines.append(  # noqa: E731
        f"* {label}: Σ {np.sum(v - ref):+.3e} (× N/n = {np.sum(v - ref) * n / idx.size:+.2e}), "
        f"max |·| {np.max(np.abs(v - ref)):.2e}")
    report("site-removal cavity (= pc.loo)", score(cav_mean, cav_prec))
    report("cavity mean, refit precision", score(cav_mean, precs))
    report("refit mean, cavity precision", score(means, cav_prec))
    saved = expectations._NODE_BUDGET
    expectations._NODE_BUDGET = 80 ** max(1, post.rule.subspace_dim)
    try:
        fine = _replace(post.rule, num_nodes=80)
        ref_fine, cav_fine = score(means, precs, fine), score(cav_mean, cav_prec, fine)
        nodes_fine = fine.nodes_per_dim
    finally:
        expectations._NODE_BUDGET = saved
    lines.append(f"* the rule vs {nodes_fine} nodes per dimension on the refits: max |·| "
                 f"{np.max(np.abs(ref - ref_fine)):.1e}; on the cavities {np.max(np.abs(score(cav_mean, cav_prec) - cav_fine)):.1e}")

    @jax.jit
    def others(mean, precision, weights):
        out, _ = compute_sites(post.spec, post.data, post.family, Gaussian(mean, precision), post.rule,
                               curvature=post.curvature, storage=post.sites.storage, chunk_size=post.chunk_size,
                               num_devices=1)
        return weights @ out.grad + out.prior_grad, out.curv.weighted_dense(weights) + out.prior_curvature

    state = [(cav_mean[k], cav_prec[k]) for k in range(idx.size)]
    t0 = time.perf_counter()
    for step in (1, 2):
        for k, i in enumerate(idx):
            weights = jnp.ones(n).at[i].set(0.0)
            grad, hess = others(*state[k], weights)
            state[k] = (state[k][0] - jnp.linalg.solve(hess, grad), hess)
        report(f"{step} exact fixed-point iteration(s) from the cavity",
               score(jnp.stack([a for a, _ in state]), jnp.stack([b for _, b in state])))
    lines.append(f"* those iterations: {(time.perf_counter() - t0) / (2 * idx.size):.4f} s per example and step "
                 f"(one site pass each; pc.fit {post.history[-1]['iteration']} iterations)")
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"bench_loo_diagnose_{args.diagnose}.md"), "w") as fh:
        fh.write(text + "\n")
    return 0


def _spearman(a, b):
    if len(a) < 3:
        return float("nan")
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def _psis_note(r):
    flat, failed = len(r.get("psis_flat", [])), len(r.get("psis_failed", []))
    return (f" ({flat} flat)" if flat else "") + (f" ({failed} NaN)" if failed else "")


def render_elpd(res):
    info = res["machine"]
    lines = [f"Machine: {info['cpu']}, {info['cores']} cores, JAX {info['jax']} ({info['backend']}), NumPyro "
             f"{info['numpyro']}; numpyro_pc {info['numpyro_pc']}; load average at start "
             f"{', '.join(f'{x:.1f}' for x in info['loadavg'])}.", "",
             "| model | N | d | rule | pc.fit s | pc.loo s (first) | loo/fit | elpd pc.loo | elpd PSIS | "
             "refits (s each) | Σ err pc | k̂>0.7 | + refit flagged: s, Σ err | Σ err PSIS | max |err_i| pc | "
             "PSIS | ρ(k̂, |err|) | NUTS s + loo s | taylor s (first), converged, Σ err, max |err_i| |",
             "|" + "---|" * 19]
    for r in res["rows"]:
        lines.append(
            f"| {r['name']} | {r['N']} | {r['d']} | {r['rule']} | {r['t_fit']:.2f} | {r['t_loo']:.2f} "
            f"({r['t_loo_first']:.2f}) | {r['ratio_loo_fit']:.2f} | {r['elpd_pc']:.2f} ± {r['se']:.1f} | "
            f"{r['elpd_psis']:.2f}{_psis_note(r)} | {r['num_refits']} ({r['t_per_refit']:.3f}) | {r['sum_err_pc']:+.1e} | "
            f"{r['flagged']} | {r['t_loo_corrected']:.2f}, {r['sum_err_corrected']:+.1e} | "
            f"{r['sum_err_psis']:+.1e} | {r['max_err_pc']:.1e} | {r['max_err_psis']:.1e} | "
            f"{r['khat_err_spearman']:.2f} | {r['t_nuts']:.1f} + {r['t_psis']:.2f} | " + (
                f"{r['t_taylor']:.2f} ({r['t_taylor_first']:.2f}), {r['taylor_converged']}, {r['sum_err_taylor']:+.1e}, "
                f"{r['max_err_taylor']:.1e} |" if r["sum_err_taylor"] is not None else "refused (d too large) |"))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
