"""Command line: ``python -m numpyro_pc demo`` (also installed as ``numpyro-pc``)."""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpyro
import numpyro.distributions as dist

import numpyro_pc as pc

from .errors import InvalidOptionError
from numpyro_pc.demos.plotting import save_figure

__all__ = ["main", "demo", "SECTIONS"]


def _logistic_model(X, y=None):
    import numpyro
    import numpyro.distributions as dist

    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


SECTIONS = ("dual_form", "trust", "hierarchical", "streaming", "criticism", "merging_federated", "expfam",
            "streaming_gp")


def demo(out="demo_output", fast=False, svi_steps=None, seed=0, sections=None) -> dict:
    """The package on scikit-learn's breast-cancer data, in sections (:data:`SECTIONS`):

    1. ``dual_form``: SVI → ``dual_form`` → ``refine``; prints the residual before and after,
       the KL between the SVI guide and the refined posterior and the time of each step;
       writes ``dual_form.png``.
    2. ``trust`` (right or refused): a regression on scikit-learn's *unscaled* diabetes data with a
       weakly-informative ``HalfNormal(100)`` noise prior fitted from the default start, and
       a model whose plate size is not tied to the data refused with a typed error.
    3. ``hierarchical``: a centred hierarchy fitted from the ELBO start and updated exactly.
    4. ``streaming``: the data in 5 drifting batches with every correction policy, then a group
       deletion with every method; prints tables of KL and time; writes ``streaming.png``.
    5. ``criticism``: all-N leave-one-out from the sites, ``az.compare`` against a smaller
       model, exact refits of the flagged examples; writes ``criticism.png``.
    6. ``merging_federated``: two half-data posteriors merged with every method; 10 non-IID
       clients reaching the joint posterior; writes ``merging_federated.png``.
    7. ``expfam``: a regression with a full Gaussian weight block and a Gamma noise precision
       on the unscaled diabetes data, streamed and pruned, checked against closed-form
       coordinate ascent; writes ``expfam.png``.
    8. ``streaming_gp`` (``gp`` extra): a 1-D stream in 4 batches with learned
       hyperparameters and inducing inputs; writes ``streaming_gp.png``.

    :param sections: names from :data:`SECTIONS` to run (default: all, in that order). Without
        ``dual_form`` the sections that need a fitted posterior use one ``pc.fit``.
    :return: a dict of the measured numbers of the sections that ran.
    """
    import jax
    import jax.numpy as jnp
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from numpyro_pc.datasets.loaders import load_breast_cancer

    chosen = SECTIONS if sections is None else tuple(sections)
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        raise InvalidOptionError(f"unknown demo section(s) {unknown}; expected some of {list(SECTIONS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    result = {}
    with jax.enable_x64(True):
        X, y, names = load_breast_cancer()
        X, y = jnp.asarray(X), jnp.asarray(y)
        print(f"breast-cancer data: N={X.shape[0]} examples, {X.shape[1]} features (+ intercept), float64")
        post = scratch = None
        if "dual_form" in chosen:
            result.update(_demo_dual_form(X, y, names, out, plt, fast, svi_steps, seed))
            post, scratch = result.pop("_post"), result.pop("_scratch")
        elif {"criticism", "merging_federated"} & set(chosen):
            t0 = time.perf_counter()
            scratch = post = pc.fit(_logistic_model, X, y, family="full")
            result["timings"] = dict(fit=time.perf_counter() - t0)
        if "trust" in chosen:
            result["trust"] = _demo_trust()
        if "hierarchical" in chosen:
            result["hierarchical"] = _demo_hierarchical()
        if "streaming" in chosen:
            result["streaming"] = _demo_streaming(X, y, out, plt, fast)
        if "criticism" in chosen:
            result["criticism"] = _demo_criticism(post, X, y, out, plt, result["timings"]["fit"])
        if "merging_federated" in chosen:
            from .federated.demo import demo_merging_federated

            result["merging_federated"] = demo_merging_federated(_logistic_model, X, y, out, plt, fast, joint=scratch)
        if "expfam" in chosen:
            from numpyro_pc.demos.expfam import demo_expfam

            result["expfam"] = demo_expfam(out, plt, fast)
        if "streaming_gp" in chosen:
            try:  # the streaming-GP section needs the optional ``gp`` extra (GPJax)
                from .gp.demo import demo_streaming_gp
            except ImportError:
                result["streaming_gp"] = None
                print("\nstreaming sparse GP section skipped (install the 'gp' extra for GPJax)")
            else:
                result["streaming_gp"] = demo_streaming_gp(out, plt, fast, seed)
    return result


def _demo_dual_form(X, y, names, out, plt, fast, svi_steps, seed):
    """SVI, the dual form at its guide, refinement and ``pc.fit``; prints the table and the KLs."""
    import jax
    import optax
    from numpyro.infer import SVI, Trace_ELBO
    from numpyro.infer.autoguide import AutoMultivariateNormal

    steps = svi_steps or (500 if fast else 3000)
    timings = {}
    guide = AutoMultivariateNormal(_logistic_model)
    svi = SVI(_logistic_model, guide, optax.adam(0.01), Trace_ELBO())
    t0 = time.perf_counter()
    res = svi.run(jax.random.PRNGKey(seed), steps, X, y, progress_bar=False)
    jax.block_until_ready(res.params)
    timings["svi"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    raw = pc.dual_form(_logistic_model, guide, res.params, X, y, refine=False)
    timings["dual_form"] = time.perf_counter() - t0
    before = raw.residual

    t0 = time.perf_counter()
    post = raw.refine(progress=not fast)
    timings["refine"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    scratch = pc.fit(_logistic_model, X, y, family="full")
    timings["fit"] = time.perf_counter() - t0

    kl_svi = float(raw.kl(post))
    kl_fit = float(scratch.kl(post))
    rows = [
        ("SVI (Adam, AutoMultivariateNormal)", f"{steps} steps", timings["svi"]),
        ("dual_form: sites at the SVI guide", f"residual {before:.2e}", timings["dual_form"]),
        ("refine: natural-gradient steps", f"residual {post.residual:.2e} in {len(post.history) - 1} it.",
         timings["refine"]),
        ("pc.fit (MAP/Laplace start, no SVI)", f"residual {scratch.residual:.2e}", timings["fit"]),
    ]
    print()
    print(f"{'step':40s} {'result':32s} {'time [s]':>9s}")
    for name, result, seconds in rows:
        print(f"{name:40s} {result:32s} {seconds:9.2f}")
    print()
    print(f"KL(SVI guide ‖ refined posterior)     = {kl_svi:.3e}")
    print(f"KL(pc.fit ‖ refined posterior)         = {kl_fit:.3e}")
    path = save_figure(_plot(post, raw, X, y, names, plt), out, "dual_form.png")
    return dict(residual_before=before, residual_after=post.residual, kl_svi=kl_svi, kl_fit=kl_fit, timings=timings,
                iterations=len(post.history) - 1, plot=str(path), _post=post, _scratch=scratch)


def _demo_criticism(post, X, y, out, plt, fit_seconds):
    """All-N leave-one-out of the refined posterior against a 10-feature model, ``az.compare``, exact refits
    of the flagged examples; writes ``criticism.png``."""
    import arviz as az
    import jax
    import numpy as np

    t0 = time.perf_counter()
    loo_all = pc.loo(post)
    seconds = time.perf_counter() - t0
    small = pc.fit(_logistic_model, X[:, :10], y, family="full")
    loo_small = pc.loo(small)
    table = az.compare({"30 features": loo_all, "first 10 features": loo_small})
    t0 = time.perf_counter()
    refined = pc.loo(post, method="corrected", where=loo_all.flagged)
    refit_seconds = time.perf_counter() - t0
    print("\nmodel criticism without refits: all-N leave-one-out from the sites")
    print(f"  pc.loo, {loo_all.pointwise.size} examples at once: elpd_loo {loo_all.elpd_loo:.2f} ± {loo_all.se:.2f}, "
          f"p_loo {loo_all.p_loo:.2f}, {seconds:.2f} s (one pc.fit: {fit_seconds:.2f} s)")
    print(f"  {int(loo_all.flagged.sum())} example(s) with k̂ > {float(loo_all['good_k']):.1f}; exact refits of those: "
          f"elpd_loo {refined.elpd_loo:.2f} ({refit_seconds:.2f} s)")
    print("  az.compare:")
    print("    " + table[["rank", "elpd_loo", "elpd_diff", "dse"]].to_string().replace("\n", "\n    "))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    diff = loo_all.pointwise - loo_small.pointwise
    axes[0].scatter(np.arange(diff.size), diff, s=8, c=np.where(loo_all.flagged, "tab:red", "tab:blue"))
    axes[0].axhline(0.0, color="grey", lw=0.8)
    axes[0].set_xlabel("example")
    axes[0].set_ylabel("elpd_i(30 features) − elpd_i(10 features)")
    axes[0].set_title("pointwise LOO difference (red: k̂ > 0.7)", fontsize=9)
    axes[1].scatter(loo_all.pointwise, loo_all.khat, s=8, c=np.where(loo_all.flagged, "tab:red", "tab:blue"))
    axes[1].axhline(float(loo_all["good_k"]), color="grey", lw=0.8, ls="--")
    axes[1].set_xlabel("elpd_i (30 features, site removal)")
    axes[1].set_ylabel("k̂_i")
    axes[1].set_title(f"reliability per example; exact refits of the {int(loo_all.flagged.sum())} red ones move "
                      f"elpd_loo by {refined.elpd_loo - loo_all.elpd_loo:+.2f}", fontsize=9)
    fig.tight_layout()
    path = save_figure(fig, out, "criticism.png")
    jax.block_until_ready(loo_all.pointwise)
    return dict(elpd_loo=float(loo_all.elpd_loo), se=float(loo_all.se), seconds=seconds, fit_seconds=fit_seconds,
                flagged=int(loo_all.flagged.sum()), refitted_elpd=float(refined.elpd_loo),
                best=str(table.index[0]), plot=str(path))


def _raw_diabetes_regression(bmi, bp, y=None, noise_scale=100.0):
    import numpyro
    import numpyro.distributions as dist

    a = numpyro.sample("a", dist.Normal(0.0, 100.0))
    b = numpyro.sample("b", dist.Normal(0.0, 10.0).expand([2]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(noise_scale))
    with numpyro.plate("data", bmi.shape[0]):
        numpyro.sample("y", dist.Normal(a + b[0] * bmi + b[1] * bp, sigma), obs=y)


def _plate_from_argument(n, bmi, y=None):
    import numpyro
    import numpyro.distributions as dist

    a = numpyro.sample("a", dist.Normal(0.0, 100.0))
    with numpyro.plate("data", n):
        numpyro.sample("y", dist.Normal(a + bmi, 50.0), obs=y)


def _progression_classifier(x, y=None) -> None:
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=w[0] + w[1] * x), obs=y)


def _demo_trust():
    """Right or refused: an unscaled regression from the default start, and a mis-bound model refused."""
    import jax.numpy as jnp
    from sklearn.datasets import load_diabetes


    raw = load_diabetes(scaled=False)
    bmi, bp = (jnp.asarray(raw.data[:, raw.feature_names.index(c)]) for c in ("bmi", "bp"))
    y = jnp.asarray(raw.target)
    print(f"\nRight or refused: diabetes, unscaled (bmi, bp, disease progression up to {float(y.max()):.0f}), "
          "sigma ~ HalfNormal(100)")
    t0 = time.perf_counter()
    post = pc.fit(_raw_diabetes_regression, bmi, bp, y)
    seconds = time.perf_counter() - t0
    start = post.record["start"]
    sd = jnp.sqrt(jnp.diag(post.covariance))
    print(f"  start: MAP by L-BFGS ({start['iterations']} it.) + Laplace precision; rule "
          f"'{post.rule.kind}' over a {post.rule.subspace_dim}-dimensional subspace per example")
    print(f"  converged: residual {post.residual:.1e} in {len(post.history) - 1} iterations, {seconds:.1f} s; "
          f"slope of bmi {float(post.mean[1]):.2f} ± {float(sd[1]):.2f}")
    try:
        pc.fit(_plate_from_argument, int(bmi.shape[0]), bmi, y)
        refused = None
    except pc.errors.ModelBindingError as err:
        refused = str(err)
        print(f"  plate('data', n) with n an argument: refused with ModelBindingError — {refused.split('. ')[0]}.")
    high = (y > 140).astype(y.dtype).at[100].set(2.0)  # one label outside {0, 1}, far past the first rows
    try:
        pc.fit(_progression_classifier, (bmi - bmi.mean()) / bmi.std(), high)
        support_refused = None
    except pc.DataSupportError as err:
        support_refused = str(err)
        print(f"  a Bernoulli label 2 in row 100: refused with DataSupportError — {support_refused.split('; first')[0]}.")
    return dict(residual=post.residual, iterations=len(post.history) - 1, seconds=seconds, refused=refused,
                support_refused=support_refused)


def _demo_hierarchical():
    """A centred hierarchy (eight schools, embedded): the start that is not the MAP, and an exact update."""
    import jax

    from numpyro_pc.posteriordb.suite import eight_schools

    problem = eight_schools(centred=True)
    print("\nA hierarchical model: eight schools, centred (theta_j ~ N(mu, tau), tau ~ HalfCauchy(5))")
    t0 = time.perf_counter()
    post = pc.fit(problem.model, *problem.args)
    seconds = time.perf_counter() - t0
    start = post.record["start"]
    scores = ", ".join(f"{k} {v:.1f}" for k, v in (start.get("candidates") or {}).items())
    print(f"  the joint density has no maximum (tau -> 0): start '{start['kind']}' chosen by objective ({scores})")
    print(f"  converged: residual {post.residual:.1e}, {seconds:.1f} s; "
          f"tau {float(post.sample(jax.random.PRNGKey(0), 2000)['tau'].mean()):.2f} (posterior mean)")
    half = pc.fit(problem.model, *(a[:4] for a in problem.args))
    updated = half.update(*(a[4:] for a in problem.args), correction="exact")
    kl = float(updated.kl(post))
    print(f"  schools 1-4 fitted, schools 5-8 added by an exact update: KL to the batch fit {kl:.1e}")
    return dict(start=start["kind"], residual=post.residual, seconds=seconds, update_kl=kl)


STREAM_POLICIES = (("none", {}), ("prior", {}), ("memory", dict(memory=0.1)), ("weighted", dict(memory=0.1)),
                   ("stochastic", dict(batch_fraction=0.1)), ("exact", {}))
DELETE_METHODS = ("tracin", "influence", "remove_site", "corrected", "retrain")


def _demo_streaming(X, y, out, plt, fast, num_batches=5):
    """Stream the data in non-IID batches with every correction policy, then delete a group."""
    import numpy as np


    order = np.argsort(np.asarray(X[:, 0]))  # sorted by the first feature: a drifting stream
    Xs, ys = X[order], y[order]
    parts = np.array_split(np.arange(Xs.shape[0]), num_batches)
    print(f"\nStreaming: {num_batches} batches sorted by 'mean radius', full Gaussian")
    t0 = time.perf_counter()
    first = pc.fit(_logistic_model, Xs[parts[0]], ys[parts[0]], family="full")
    first_seconds = time.perf_counter() - t0
    kl_curves, rows, finals = {}, [], {}
    batches = [pc.fit(_logistic_model, Xs[np.concatenate(parts[: k + 1])], ys[np.concatenate(parts[: k + 1])],
                      family="full") for k in range(1, num_batches)]  # the oracle after each batch
    fallbacks = {}
    for name, options in STREAM_POLICIES:
        post, kls, seconds = first, [], first_seconds
        for k, part in enumerate(parts[1:], start=1):
            opts = dict(options)
            if "memory" in opts:
                opts["memory"] = max(1, int(opts["memory"] * post.num_retained))
            t0 = time.perf_counter()
            with warnings.catch_warnings():  # a fallback is reported under the table, with its batch
                warnings.filterwarnings("ignore", "weighted correction failed", RuntimeWarning)
                post = post.update(Xs[part], ys[part], correction=name, **opts)
            seconds += time.perf_counter() - t0
            if post.record.get("fallback"):
                fallbacks.setdefault(name, []).append((k + 1, post.record["fallback"]))
            kls.append(max(float(post.kl(batches[k - 1])), 1e-16))
        kl_curves[name] = kls
        finals[name] = post
        label = name + (" (10 %)" if name in ("memory", "weighted") else "") + (" *" if name in fallbacks else "")
        rows.append((label, kls[-1], seconds))
    print(f"{'policy':18s} {'KL to batch posterior':>22s} {'time [s]':>9s}")
    for label, kl, seconds in rows:
        print(f"{label:18s} {kl:22.3e} {seconds:9.2f}")
    final_kl = {name: kls[-1] for name, kls in kl_curves.items()}
    for name, events in fallbacks.items():
        reason = events[0][1].split(";")[0]
        worse = (f"; it ends further from the batch posterior than no correction ({final_kl[name]:.2g} against "
                 f"{final_kl['none']:.2g})" if final_kl[name] > final_kl["none"] else "")
        print(f"* {name}: at batch(es) {', '.join(str(b) for b, _ in events)} {reason} (the update kept the "
              f"unweighted memory){worse}. Scaling a 10 % memory's corrections by n/m ≈ 10 estimates the "
              "correction of all retained sites with ten times the memory's sampling error, too much on a "
              "drifting stream whose corrections differ widely; that is why 'memory' is the default and "
              "'weighted' is opt-in.")

    exact = finals["exact"]
    curvature = np.asarray(exact.sites.curvature_trace())
    gone = np.asarray(exact.ids)[np.argsort(-curvature)[:20]]
    print(f"\nDeleting the 20 examples of largest site curvature (full data, {exact.num_examples} examples)")
    deleted = {}
    for method in DELETE_METHODS:
        t0 = time.perf_counter()
        deleted[method] = exact.delete(gone, method=method, damping=True)
        deleted[method + "_seconds"] = time.perf_counter() - t0
    print(f"{'method':12s} {'KL to retrain':>14s} {'time [s]':>9s}")
    del_rows = []
    for method in DELETE_METHODS:
        kl = max(float(deleted[method].kl(deleted["retrain"])), 0.0)
        del_rows.append((method, kl, deleted[method + "_seconds"]))
        print(f"{method:12s} {kl:14.3e} {deleted[method + '_seconds']:9.2f}")

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    ax = axes[0]
    for name, kls in kl_curves.items():
        ax.semilogy(range(2, num_batches + 1), kls, "o-", label=name)
    ax.set_xlabel("batches seen")
    ax.set_ylabel("KL(streamed ‖ batch posterior)")
    ax.set_title("Streaming with correction policies")
    ax.legend(fontsize=8)
    ax = axes[1]
    names = [r[0] for r in del_rows[:-1]]
    ax.bar(names, [max(r[1], 1e-16) for r in del_rows[:-1]], color="tab:purple")
    ax.set_yscale("log")
    ax.set_ylabel("KL(method ‖ retrain)")
    ax.set_title("Deleting 20 high-curvature examples")
    fig.tight_layout()
    path = save_figure(fig, out, "streaming.png")
    return dict(stream=rows, delete=del_rows, plot=str(path), fallbacks=fallbacks)


def _plot(post, raw, X, y, names, plt):
    import numpy as np

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    margin = np.asarray(X @ post.mean[1:] + post.mean[0])
    beta = np.asarray(post.sites.curv.lam[:, 0, 0])  # the logistic model's factorised sites: Λ_i = p_i(1 − p_i)
    ax = axes[0]
    for label, colour in [(0, "tab:red"), (1, "tab:blue")]:
        sel = np.asarray(y) == label
        ax.scatter(np.abs(margin[sel]), beta[sel], s=10, alpha=0.7, c=colour,
                   label=["malignant", "benign"][label])
    ax.set_yscale("log")
    ax.set_xlabel("distance to the decision boundary |xᵢᵀm + b|")
    ax.set_ylabel("site curvature βᵢ = E_q[σ'(fᵢ)]")
    ax.set_title("Per-example site curvature")
    ax.legend()

    ax = axes[1]
    order = np.argsort(-np.abs(np.asarray(post.mean[1:])))[:8] + 1
    sd_post = np.sqrt(np.diag(np.asarray(post.covariance)))
    sd_raw = np.sqrt(np.diag(np.asarray(raw.covariance)))
    for k, idx in enumerate(order):
        grid = np.linspace(-4, 4, 200)
        for mean, sd, style in [(post.mean[idx], sd_post[idx], "-"), (raw.mean[idx], sd_raw[idx], ":")]:
            dens = np.exp(-0.5 * grid**2) / (sd * np.sqrt(2 * np.pi))
            ax.plot(float(mean) + sd * grid, dens / dens.max() * 0.8 + k, style, c=f"C{k}")
    ax.set_yticks(range(len(order)))
    ax.set_yticklabels([names[i - 1] for i in order], fontsize=8)
    ax.set_xlabel("coefficient (unconstrained)")
    ax.set_title("Posterior marginals: refined (—) vs SVI (⋯)")

    ax = axes[2]
    hist = post.history
    ax.semilogy([h["iteration"] for h in hist], [h["residual_mean"] for h in hist], "o-", label="Σĝᵢ = 0")
    ax.semilogy([h["iteration"] for h in hist], [max(h["residual_precision"], 1e-17) for h in hist], "s-",
                label="S = ΣĤᵢ")
    ax.axhline(1e-8, c="grey", ls="--", lw=1, label="tolerance")
    ax.set_xlabel("refinement iteration")
    ax.set_ylabel("relative residual")
    ax.set_title("Dual-form residual during refine")
    ax.legend()
    fig.tight_layout()
    return fig


def main(argv=None):
    parser = argparse.ArgumentParser(prog="numpyro_pc", description="numpyro_pc command line")
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="dual form of a logistic regression on scikit-learn's breast-cancer data")
    p_demo.add_argument("--out", default="demo_output", help="folder for the plots (default: demo_output)")
    p_demo.add_argument("--fast", action="store_true", help="fewer SVI steps, no progress bars")
    p_demo.add_argument("--svi-steps", type=int, default=None, help="SVI steps (default 3000, 500 with --fast)")
    p_demo.add_argument("--seed", type=int, default=0)
    p_demo.add_argument("--section", action="append", choices=SECTIONS, dest="sections",
                        help="run only this section (repeatable; default: all)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        demo(out=args.out, fast=args.fast, svi_steps=args.svi_steps, seed=args.seed, sections=args.sections)
    return 0


if __name__ == "__main__":
    sys.exit(main())
