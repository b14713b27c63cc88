"""Cost of ``numpyro_pc.compute_sites`` against one jitted gradient of the log-likelihood.

What is measured
----------------
Bayesian logistic regression ``w ~ Normal(0, 1)^d``, ``y_i ~ Bernoulli(logits=x_iᵀw)`` in
plate ``"data"`` on synthetic data (``x_i ~ N(0, (2/√d)² I)``, ``w_true ~ N(0, I)``), over
the grid ``N ∈ {1e3, 1e4, 1e5}``, ``d ∈ {10, 100}`` and three site storages:

========  ==========  ========  =========
name      family      storage   curvature
========  ==========  ========  =========
diagonal  diagonal    diag      hessian
ggn       full        factor    ggn
dense     full        dense     hessian
========  ==========  ========  =========

each with the ``delta`` and the ``gh`` (Gauss–Hermite, the package's default number of
nodes) expectation rule. Dense
storage is skipped when ``N·d² > 1e8`` numbers (0.8 GB in float64).

For every configuration a fresh subprocess (so that peak-memory numbers belong to that
configuration alone) builds the data, binds the model and measures

* the baseline: ``jax.jit(jax.grad(f))`` of the summed Bernoulli log-likelihood written as
  a plain JAX function of ``w``, and also of NumPyro's
  ``numpyro.infer.util.log_density`` (the whole model: prior + likelihood);
* ``compute_sites``: first call (trace + compile + one run) and the steady state;
* ``Sites.stored_numbers() / (N·d)``;
* memory: ``ru_maxrss`` (peak resident set of the process, a high-water mark) after
  setup (data, binding, baselines), after an ahead-of-time compile of the site
  computation, and after executing it once; plus XLA's own buffer accounting of the
  compiled site computation (``compiled.memory_analysis()``: argument, output and
  temporary bytes — an upper bound on the device buffers one call holds).

A profile subprocess then takes the target configuration (``N=1e5, d=100``, and ``d=10``; Gauss–Newton
sites) apart: chunk size (padding, ``lax.scan``), the ``eigh`` projection of ``Λ_i``, the
same computation written in plain JAX without NumPyro, a closed-form version without
per-example autodiff, and the bare cost of writing two ``(N, d)`` arrays.

Fairness rules
--------------
* Same data, same process: the baseline and the sites of a configuration are timed in
  the same subprocess, interleaved (gradient, sites, gradient, sites, ...), so that load
  from other work on the machine affects both; ratios are of medians taken in that run.
* Everything is jitted: the gradient baselines with ``jax.jit``, the sites through the
  package's own jitted implementation.
* Compile time is reported separately: one call to compile, then the median of ``--reps``
  (≥ 3) timed calls, each ended by ``jax.block_until_ready``.
* float64 is enabled in every process (``jax_enable_x64``).

Usage::

    python benchmarks/bench_sites.py            # full grid + profile (~5-8 min on 2 cores)
    python benchmarks/bench_sites.py --quick    # smoke run (< 1 min)

Results go to ``benchmarks/_out/bench_sites.json`` and ``.md`` (``bench_sites_quick.*`` with
``--quick``, ``bench_sites_profile.*`` with ``--profile-only``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "_out")
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _common import machine_info  # noqa: E402

STORAGES = {  # name: (family, storage, curvature)
    "diagonal": ("diagonal", "diag", "hessian"),
    "ggn": ("full", "factor", "ggn"),
    "dense": ("full", "dense", "hessian"),
}
DENSE_LIMIT = 1e8  # numbers: skip dense storage above N·d² = 1e8
TARGET_RATIO = 5.0  # Gauss–Newton sites at N=1e5, d=100 within 5x of the gradient
TARGET_STORED = 3.0  # stored numbers / (N·d) for Gauss–Newton sites


# --------------------------------------------------------------------------- helpers (worker side)


def _setup_jax():
    import jax

    jax.config.update("jax_enable_x64", True)
    return jax


def make_data(n, d, seed=0):
    """Synthetic logistic-regression data (float64 numpy arrays)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)) * (2.0 / np.sqrt(d))
    w_true = rng.normal(size=d)
    y = (rng.random(n) < 1.0 / (1.0 + np.exp(-X @ w_true))).astype(np.float64)
    return X, y


def logistic_model(X, y=None):
    import numpyro
    import numpyro.distributions as dist

    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def _maxrss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _time_interleaved(fns, reps, with_min=False):
    """Median wall time of each zero-argument function, calls interleaved round-robin."""
    import jax

    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    if with_min:
        return med, {name: min(ts) for name, ts in times.items()}
    return med


def _first_call(fn):
    import jax

    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    return time.perf_counter() - t0, out


def _mem_analysis(compiled):
    try:
        ma = compiled.memory_analysis()
        return dict(argument_mb=ma.argument_size_in_bytes / 2**20, output_mb=ma.output_size_in_bytes / 2**20,
                    temp_mb=ma.temp_size_in_bytes / 2**20)
    except Exception as err:  # noqa: BLE001 - not every backend implements it
        return dict(error=repr(err))


def _baselines(jax, X, y):
    import jax.numpy as jnp
    from numpyro.infer.util import log_density

    def loglik(w):
        t = X @ w
        return jnp.sum(y * t - jnp.logaddexp(0.0, t))

    grad_plain = jax.jit(jax.grad(loglik))
    grad_numpyro = jax.jit(jax.grad(lambda w: log_density(logistic_model, (X, y), {}, {"w": w})[0]))
    return grad_plain, grad_numpyro


def worker_config(cfg):
    """Measure one grid configuration; returns a dict (printed as JSON by the caller)."""
    jax = _setup_jax()
    import jax.numpy as jnp
    import numpy as np

    import numpyro_pc as pc
    from numpyro_pc.sites.expectations import get_rule, prepare_rule
    from numpyro_pc.sites.gaussian import compute_sites

    n, d, reps = cfg["N"], cfg["d"], cfg["reps"]
    fam_name, storage, curvature = STORAGES[cfg["storage"]]
    Xn, yn = make_data(n, d)
    X, y = jnp.asarray(Xn), jnp.asarray(yn)
    w0 = jnp.asarray(np.random.default_rng(1).normal(size=d) * 0.3)

    t0 = time.perf_counter()
    spec, data = pc.bind_model(logistic_model, (X, y))
    bind_s = time.perf_counter() - t0

    grad_plain, grad_numpyro = _baselines(jax, X, y)
    grad_compile, _ = _first_call(lambda: grad_plain(w0))
    grad_np_compile, _ = _first_call(lambda: grad_numpyro(w0))
    rss_setup = _maxrss_mb()

    fam = pc.get_family(fam_name)
    precision = jnp.eye(d) * 3.0 if fam_name == "full" else jnp.full((d,), 3.0)
    q = pc.Gaussian(w0, precision)
    rule = prepare_rule(get_rule(cfg["rule"]), spec, data, w0)

    def sites_call():
        return compute_sites(spec, data, fam, q, rule, curvature=curvature, storage=storage)

    # Ahead-of-time compile of the same computation (for XLA's buffer accounting and to
    # separate compile memory from execution memory in the RSS high-water mark).
    wrapped = jax.jit(lambda q_, data_: compute_sites(spec, data_, fam, q_, rule, curvature=curvature,
                                                      storage=storage))
    compiled = wrapped.lower(q, data).compile()
    mem = _mem_analysis(compiled)
    rss_compiled = _maxrss_mb()
    out = jax.block_until_ready(compiled(q, data))
    rss_exec = _maxrss_mb()
    del out, compiled

    sites_compile, (sites, _) = _first_call(sites_call)
    stored = sites.stored_numbers()
    del sites
    med, mins = _time_interleaved({"grad": lambda: grad_plain(w0), "grad_numpyro": lambda: grad_numpyro(w0),
                                   "sites": sites_call}, reps, with_min=True)
    return dict(
        cfg, family=fam_name, storage_kind=storage, curvature=curvature, bind_s=bind_s,
        grad_compile_s=grad_compile, grad_numpyro_compile_s=grad_np_compile, sites_compile_s=sites_compile,
        grad_s=med["grad"], grad_numpyro_s=med["grad_numpyro"], sites_s=med["sites"],
        ratio=med["sites"] / med["grad"], ratio_numpyro=med["sites"] / med["grad_numpyro"],
        sites_min_s=mins["sites"], grad_min_s=mins["grad"], ratio_min=mins["sites"] / mins["grad"],
        stored_numbers=stored, stored_per_nd=stored / (n * d),
        rss_setup_mb=rss_setup, rss_compiled_mb=rss_compiled, rss_peak_mb=rss_exec, xla=mem,
    )


def worker_profile(cfg):
    """Take the Gauss–Newton site computation apart at one (N, d)."""
    jax = _setup_jax()
    import jax.numpy as jnp
    import numpy as np
    from jax.scipy.linalg import solve_triangular

    import numpyro_pc as pc
    from numpyro_pc.curvature.stores import JacobianFactor
    from numpyro_pc.sites.expectations import get_rule, hermite_nodes, prepare_rule
    from numpyro_pc.sites.gaussian import compute_sites, default_chunk_size

    n, d, reps = cfg["N"], cfg["d"], cfg["reps"]
    Xn, yn = make_data(n, d)
    X, y = jnp.asarray(Xn), jnp.asarray(yn)
    w0 = jnp.asarray(np.random.default_rng(1).normal(size=d) * 0.3)
    spec, data = pc.bind_model(logistic_model, (X, y))
    fam = pc.get_family("full")
    q = pc.Gaussian(w0, jnp.eye(d) * 3.0)
    delta = get_rule("delta")
    gh = prepare_rule(get_rule("gh"), spec, data, w0)
    grad_plain, _ = _baselines(jax, X, y)
    default_chunk = default_chunk_size(spec, JacobianFactor, "ggn", n)
    # the largest chunk <= default that divides N (no padding), for the padding test
    divisor = max(c for c in range(1, default_chunk + 1) if n % c == 0)

    def pkg(rule=delta, curvature="ggn", chunk=None):
        return lambda: compute_sites(spec, data, fam, q, rule, curvature=curvature, storage="factor",
                                     chunk_size=chunk)

    @jax.jit
    def plain_vmap(w):
        """Same math as the package (jacrev of θ_i, value/grad/hessian of the loss in θ,
        eigh projection of Λ_i), vmapped over all examples, written without NumPyro."""
        def one(x, yy):
            theta = lambda ww: jnp.reshape(x @ ww, (1,))  # noqa: E731
            loss_fn = lambda t: -jnp.sum(yy * t - jnp.logaddexp(0.0, t))  # noqa: E731
            jac = jax.jacrev(theta)(w)
            loss, g_t = jax.value_and_grad(loss_fn)(theta(w))
            lam = jax.hessian(loss_fn)(theta(w))
            vals, vecs = jnp.linalg.eigh(lam)
            lam = (vecs * jnp.maximum(vals, 0.0)) @ vecs.T
            return loss, jac.T @ g_t, jac, lam
        return jax.vmap(one)(X, y)

    @jax.jit
    def closed_form(w):
        """The stored outputs in closed form: ĝ_i = (σ(t_i) − y_i) x_i, J_i = x_i, Λ_i = σ(1−σ)."""
        t = X @ w
        p = jax.nn.sigmoid(t)
        return (jnp.logaddexp(0.0, t) - y * t, X * (p - y)[:, None], X[:, None, :] * 1.0,
                (p * (1.0 - p))[:, None, None])

    @jax.jit
    def write_floor(w):
        """Memory-traffic floor: read X once, write two (N, d) arrays."""
        return X * w[0], X * w[1]

    nodes, node_w = hermite_nodes(gh.num_nodes, jnp.float64)

    @jax.jit
    def closed_form_gh(w, precision):
        """Gauss–Hermite sites in closed form: one batched triangular solve for a_iᵀΣa_i."""
        chol = jnp.linalg.cholesky(precision)
        std = jnp.sqrt(jnp.sum(solve_triangular(chol, X.T, lower=True) ** 2, 0))
        pts = (X @ w)[:, None] + std[:, None] * nodes[None, :]
        p = jax.nn.sigmoid(pts)
        loss = (jnp.logaddexp(0.0, pts) - y[:, None] * pts) @ node_w
        d1 = (p - y[:, None]) @ node_w
        d2 = (p * (1.0 - p)) @ node_w
        return loss, X * d1[:, None], X[:, None, :] * 1.0, d2[:, None, None]

    @jax.jit
    def quad_trsm(precision):
        """a_iᵀΣa_i for all i as the package's gh rule does it: a triangular solve per
        example (vmapped; XLA makes it one LAPACK trsm over N right-hand sides)."""
        chol = jnp.linalg.cholesky(precision)
        return jax.vmap(lambda a: jnp.sum(solve_triangular(chol, a, lower=True) ** 2))(X)

    @jax.jit
    def quad_gemm(precision):
        """a_iᵀΣa_i for all i with Σ formed once: one (N, d) x (d, d) matrix product."""
        chol = jnp.linalg.cholesky(precision)
        eye = jnp.eye(precision.shape[0], dtype=precision.dtype)
        cov = jax.scipy.linalg.cho_solve((chol, True), eye)
        return jnp.sum((X @ cov) * X, 1)

    variants = {
        "gradient (baseline)": lambda: grad_plain(w0),
        f"package GGN, default chunk ({default_chunk})": pkg(),
        f"package GGN, chunk {divisor} (divides N: no padding)": pkg(chunk=divisor),
        f"package GGN, one chunk ({n}: no scan)": pkg(chunk=n),
        "package exact Hessian (factor; no eigh of Λ_i)": pkg(curvature="hessian"),
        "plain JAX vmap(jacrev) + eigh, no NumPyro": lambda: plain_vmap(w0),
        "closed form (no per-example autodiff)": lambda: closed_form(w0),
        "floor: read X, write two (N, d) arrays": lambda: write_floor(w0),
        f"package GGN + gh rule ({gh.num_nodes} nodes)": pkg(rule=gh),
        "closed-form gh (one batched solve)": lambda: closed_form_gh(w0, q.precision),
        "component: a_iᵀΣa_i by triangular solve (as the gh rule)": lambda: quad_trsm(q.precision),
        "component: a_iᵀΣa_i by one GEMM with Σ": lambda: quad_gemm(q.precision),
    }
    compile_s = {}
    for name, fn in variants.items():
        compile_s[name], _ = _first_call(fn)
    med, mins = _time_interleaved(variants, reps, with_min=True)
    base, base_min = med["gradient (baseline)"], mins["gradient (baseline)"]
    rows = [dict(variant=name, compile_s=compile_s[name], steady_s=med[name], ratio=med[name] / base,
                 min_s=mins[name], ratio_min=mins[name] / base_min) for name in variants]
    return dict(cfg, default_chunk=default_chunk, rows=rows)


# --------------------------------------------------------------------------- driver


def _run_worker(kind, cfg, timeout):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, json.dumps(cfg)]
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(cfg, error=f"timed out after {timeout}s")
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return dict(cfg, error=(proc.stderr or proc.stdout)[-2000:])
    result = json.loads(lines[-1])
    result["worker_wall_s"] = wall
    return result


def _fmt(x, spec=".3g"):
    return "—" if x is None else format(x, spec)


def render(results, profiles, info, args):
    lines = [f"Machine: {info['cpu']}, {info['cores']} cores, JAX {info['jax']} ({info['backend']}), "
             f"Python {info['python']}; numpyro_pc {info['numpyro_pc']}; load average at start "
             f"{', '.join(f'{x:.1f}' for x in info['loadavg'])}.", ""]
    lines.append("| N | d | storage | rule | compile s | sites s | grad s | sites/grad | min/min "
                 "| sites/grad(log_density) | stored/(N·d) | RSS setup MB | RSS peak MB | XLA out MB | XLA temp MB |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        head = f"| {r['N']:.0e} | {r['d']} | {r['storage']} | {r['rule']} "
        if r.get("skipped"):
            lines.append(head + f"| skipped: {r['skipped']} |" + " |" * 10)
            continue
        if r.get("error"):
            err = r["error"].strip().splitlines()[-1][:120].replace("|", "/")
            lines.append(head + f"| error: {err} |" + " |" * 10)
            continue
        xla = r.get("xla", {})
        lines.append(
            head + f"| {r['sites_compile_s']:.2f} | {r['sites_s']:.4g} | {r['grad_s']:.3g} | **{r['ratio']:.1f}** "
            f"| {r['ratio_min']:.1f} | {r['ratio_numpyro']:.1f} | {r['stored_per_nd']:.2f} | {r['rss_setup_mb']:.0f} "
            f"| {r['rss_peak_mb']:.0f} | {_fmt(xla.get('output_mb'), '.1f')} | {_fmt(xla.get('temp_mb'), '.1f')} |")
    for profile in profiles:
        lines += ["", f"Profile at N={profile['N']:.0e}, d={profile['d']} (full family, factor storage, "
                  f"median of {profile['reps']}, interleaved):", "",
                  "| variant | compile s | median s | / gradient (median) | min s | / gradient (min) |",
                  "|---|---|---|---|---|---|"]
        if profile.get("error"):
            lines.append(f"| error: {profile['error'].strip().splitlines()[-1][:150]} | | | |")
        else:
            for row in profile["rows"]:
                lines.append(f"| {row['variant']} | {row['compile_s']:.2f} | {row['steady_s']:.4g} "
                             f"| {row['ratio']:.1f} | {row['min_s']:.4g} | {row['ratio_min']:.1f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: small grid, < 1 min")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per measurement (median; >= 3)")
    parser.add_argument("--rules", default="delta,gh", help="comma-separated expectation rules")
    parser.add_argument("--no-profile", action="store_true", help="skip the profile of the target config")
    parser.add_argument("--profile-only", action="store_true", help="run only the profile(s), not the grid")
    parser.add_argument("--profile-at", default="1e5x100,1e5x10", help="comma-separated NxD configs to profile")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per configuration subprocess")
    parser.add_argument("--out", default=OUT, help="output folder")
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        kind, cfg = args.worker[0], json.loads(args.worker[1])
        result = worker_config(cfg) if kind == "config" else worker_profile(cfg)
        print(json.dumps(result))
        return 0

    reps = max(3, args.reps)
    rules = [r for r in args.rules.split(",") if r]
    if args.quick:
        grid_n, grid_d, rules, reps = [1000, 10000], [10], ["delta"], 3
        profile_cfg = dict(N=10000, d=10, reps=3)
        profile_at = [(10000, 10)]
    else:
        grid_n, grid_d = [1000, 10000, 100000], [10, 100]
        profile_cfg = dict(N=100000, d=100, reps=max(reps, 7))
        profile_at = [tuple(int(float(v)) for v in spec.split("x")) for spec in args.profile_at.split(",") if spec]

    _setup_jax()
    info = machine_info()
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    results = []
    for n in ([] if args.profile_only else grid_n):
        for d in grid_d:
            for storage in STORAGES:
                for rule in rules:
                    if args.quick and storage != "ggn" and n > 1000:
                        continue
                    cfg = dict(N=n, d=d, storage=storage, rule=rule, reps=reps)
                    if storage == "dense" and n * d * d > DENSE_LIMIT:
                        res = dict(cfg, skipped=f"N·d² = {n * d * d:.0e} > {DENSE_LIMIT:.0e} numbers")
                    else:
                        res = _run_worker("config", cfg, args.timeout)
                    results.append(res)
                    if res.get("error"):
                        msg = "ERROR " + res["error"].strip().splitlines()[-1][:200]
                    elif res.get("skipped"):
                        msg = "skipped"
                    else:
                        msg = (f"sites {res['sites_s']:.4g}s grad {res['grad_s']:.3g}s ratio {res['ratio']:.1f} "
                               f"stored/(Nd) {res['stored_per_nd']:.2f} peak RSS {res['rss_peak_mb']:.0f} MB")
                    print(f"[{time.perf_counter() - start:6.1f}s] N={n:.0e} d={d} {storage:8s} {rule:5s} {msg}",
                          flush=True)
    profiles = []
    if not args.no_profile:
        for n, d in profile_at:
            profiles.append(_run_worker("profile", dict(profile_cfg, N=n, d=d), args.timeout))
            print(f"[{time.perf_counter() - start:6.1f}s] profile N={n:.0e} d={d} done", flush=True)

    table = render(results, profiles, info, args)
    print()
    print(table)
    target = next((r for r in results if r["N"] == 100000 and r["d"] == 100 and r["storage"] == "ggn"
                   and r["rule"] == "delta" and "ratio" in r), None)
    if target is not None:
        verdict = "MET" if target["ratio"] <= TARGET_RATIO else "MISSED"
        print(f"\nTarget (GGN sites at N=1e5, d=100 within {TARGET_RATIO:g}x of the gradient): {verdict} — "
              f"measured {target['ratio']:.1f}x; stored/(N·d) = {target['stored_per_nd']:.2f} "
              f"(target <= {TARGET_STORED:g}).")
    info["loadavg_end"] = os.getloadavg()
    payload = dict(machine=info, argv=sys.argv[1:], quick=args.quick, reps=reps,
                   total_s=time.perf_counter() - start, results=results, profiles=profiles)
    stem = "bench_sites_profile" if args.profile_only else "bench_sites_quick" if args.quick else "bench_sites"
    with open(os.path.join(args.out, stem + ".json"), "w") as f:
        json.dump(payload, f, indent=1)
    with open(os.path.join(args.out, stem + ".md"), "w") as f:
        f.write(table + "\n")
    print(f"\ntotal {time.perf_counter() - start:.0f}s; wrote {args.out}/{stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
