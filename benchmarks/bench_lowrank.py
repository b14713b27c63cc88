"""The low-rank family at large d: pc.fit and an exact update on sparse logistic regression.

What is measured
----------------
Synthetic logistic regression with a sparse design: ``N`` examples, ``k = 10`` nonzeros per
row held as index/value arrays (``logits_i = Σ_j val_ij · w[idx_ij]``, a gather in the model;
a dense ``N × d`` design is never formed), ``w ~ Normal(0, 1)`` of dimension ``d``, labels
drawn from a sparse true ``w``. float32 (the package default). Each configuration runs in
its own subprocess, which reports:

* ``fit_s``: wall time of ``pc.fit(model, ..., family=..., init="prior")`` (cold: tracing and
  compilation included) on the first ``N`` examples;
* ``update_s``: wall time of ``post.update(batch, correction="exact")`` with ``N/10`` new
  examples;
* ``peak_gb``: the subprocess's peak resident memory (``getrusage`` ``ru_maxrss``), and
  ``base_gb`` its resident memory after importing JAX and making the data;
* for NumPyro SVI with ``AutoLowRankMultivariateNormal`` (same rank, Adam 0.01, full
  batch, blocks of 500 steps under one ``jit``, at most ``--svi-seconds``): after each block,
  the KL between its coordinate marginals and those of pc.fit's low-rank posterior,
  ``Σ_j KL(N(m_j, v_j) ‖ N(m*_j, v*_j))`` (the two families differ — covariance versus
  precision form — so the comparison is on the marginals, which both give in ``O(d r)``).

Families: ``lowrank`` (rank 20) and ``diagonal``. A configuration that exceeds its time
limit or memory is reported as such (``status``).

Usage::

    python benchmarks/bench_lowrank.py --quick   # d = 2,000, N = 2,000
    python benchmarks/bench_lowrank.py           # d = 20,000 and 100,000, N = 10,000

Outputs: ``benchmarks/_out/bench_lowrank.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

K = 10  # nonzeros per row


def make_data(n, d, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    idx = rng.integers(0, d, size=(n, K)).astype(np.int32)
    val = (rng.normal(size=(n, K)) / np.sqrt(K) * 2.0).astype(np.float32)
    w = np.where(rng.uniform(size=d) < 0.05, rng.normal(size=d) * 2.0, 0.0)
    logits = np.sum(val * w[idx], 1)
    y = (rng.uniform(size=n) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    return idx, val, y


def make_model(d):
    import numpyro
    import numpyro.distributions as dist
    import jax.numpy as jnp

    def model(idx, val, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([d]).to_event(1))
        with numpyro.plate("data", idx.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=jnp.sum(val * w[idx], -1)), obs=y)

    return model


def _rss_gb():
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def marginal_kl(m, v, m_ref, v_ref):
    import numpy as np

    m, v, m_ref, v_ref = (np.asarray(x, np.float64) for x in (m, v, m_ref, v_ref))
    return float(0.5 * np.sum(v / v_ref + (m - m_ref) ** 2 / v_ref - 1.0 + np.log(v_ref / v)))


def run_one(cfg):
    """One configuration in this process: returns a dict of measurements."""
    import numpy as np

    d, n, family, rank = cfg["d"], cfg["n"], cfg["family"], cfg.get("rank")
    idx, val, y = make_data(n + n // 10, d, seed=cfg.get("seed", 0))
    import jax

    import numpyro_pc as pc

    model = make_model(d)
    out = dict(cfg, base_gb=_rss_gb())
    options = dict(family=family, init="prior")
    if rank:
        options["rank"] = rank
    if family == "svi":
        return run_svi(cfg, model, idx[:n], val[:n], y[:n], out)
    t = time.perf_counter()
    post = pc.fit(model, idx[:n], val[:n], y[:n], **options)
    jax.block_until_ready(post.mean)
    out["fit_s"] = time.perf_counter() - t
    out["fit_iterations"] = len(post.history) - 1
    out["residual"] = float(post.residual)
    out["fit_peak_gb"] = _rss_gb()
    t = time.perf_counter()
    upd = post.update(idx[n:], val[n:], y[n:], correction="exact")
    jax.block_until_ready(upd.mean)
    out["update_s"] = time.perf_counter() - t
    out["update_iterations"] = len(upd.history) - 1
    out["peak_gb"] = _rss_gb()
    if cfg.get("save"):
        np.savez(cfg["save"], mean=np.asarray(post.mean), var=np.asarray(post.family.marginal_variance(post.state)))
    return out


def run_svi(cfg, model, idx, val, y, out):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from numpyro.infer import SVI, Trace_ELBO
    from numpyro.infer.autoguide import AutoLowRankMultivariateNormal

    ref = np.load(cfg["reference"])
    guide = AutoLowRankMultivariateNormal(model, rank=cfg["rank"])
    svi = SVI(model, guide, optax.adam(0.01), Trace_ELBO())
    state = svi.init(jax.random.PRNGKey(0), idx, val, y)
    block = cfg.get("block", 500)
    step = jax.jit(lambda s: jax.lax.fori_loop(0, block, lambda _, st: svi.update(st, idx, val, y)[0], s))
    trace, t, steps = [], time.perf_counter(), 0
    while steps < cfg["max_steps"] and time.perf_counter() - t < cfg["svi_seconds"]:
        state = step(state)
        params = svi.get_params(state)
        jax.block_until_ready(params)
        steps += block
        w, s = params["auto_cov_factor"], params["auto_scale"]
        var = jnp.sum(w**2, 1) + s**2
        trace.append(dict(steps=steps, seconds=time.perf_counter() - t,
                          kl=marginal_kl(params["auto_loc"], var, ref["mean"], ref["var"])))
    out["svi"] = trace
    out["peak_gb"] = _rss_gb()
    return out


def _dense_gb(cfg):
    """GB of the (d, d) float32 arrays a configuration forms: the diagonal family keeps a dense prior
    curvature and forms a (d, d) curvature per example in its chunks; the low-rank family (sparse
    sites, diagonal prior site) and SVI form none."""
    return 2 * cfg["d"] ** 2 * 4 / 2**30 if cfg["family"] == "diagonal" else 0.0


def _available_gb():
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) / 2**20


def _rss_of(pid):
    """Resident memory of process ``pid`` in GB (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def spawn(cfg, timeout, max_gb):
    need = _dense_gb(cfg)
    if need > min(max_gb, 0.5 * _available_gb()):
        return dict(cfg, status=f"not run: its (d, d) arrays alone need {need:.0f} GB (limit {max_gb:.0f} GB, "
                                f"{_available_gb():.0f} GB available)")
    cmd = [sys.executable, os.path.abspath(__file__), "--one", json.dumps(cfg)]
    t = time.perf_counter()
    out_file, err_file = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # no pipe to fill up
    proc = subprocess.Popen(cmd, stdout=out_file, stderr=err_file, text=True)
    while proc.poll() is None:  # a watchdog: the machine is shared, so a run is stopped at max_gb
        rss = _rss_of(proc.pid)
        if rss > max_gb or time.perf_counter() - t > timeout:
            proc.kill()
            proc.wait()
            why = f"resident memory {rss:.1f} GB > {max_gb:.0f} GB" if rss > max_gb else f"timeout after {timeout} s"
            return dict(cfg, status=f"stopped: {why}", wall=time.perf_counter() - t)
        time.sleep(0.5)
    out_file.seek(0)
    err_file.seek(0)
    out, err = out_file.read(), err_file.read()
    if proc.returncode != 0:
        tail = (err or "").strip().splitlines()[-1:] or [""]
        return dict(cfg, status=f"failed (rc {proc.returncode}): {tail[0][:160]}", wall=time.perf_counter() - t)
    return dict(json.loads(out.strip().splitlines()[-1]), status="ok")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=int, default=1500)
    parser.add_argument("--svi-seconds", type=float, default=300.0)
    parser.add_argument("--diag-timeout", type=int, default=600)
    parser.add_argument("--sizes", help="comma-separated dxN pairs, e.g. 10000x10000 (overrides the defaults)")
    parser.add_argument("--max-gb", type=float, default=6.0, help="stop a configuration above this resident memory")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return
    from _common import machine_info

    out_dir = os.path.join(HERE, "_out")
    os.makedirs(out_dir, exist_ok=True)
    sizes = [(2000, 2000)] if args.quick else [(20000, 10000), (100000, 10000)]
    if args.sizes:
        sizes = [tuple(int(v) for v in pair.split("x")) for pair in args.sizes.split(",")]
    rows = []
    for d, n in sizes:
        ref = os.path.join(out_dir, f"bench_lowrank_ref_{d}.npz")
        low = spawn(dict(d=d, n=n, family="lowrank", rank=20, save=ref), args.timeout, args.max_gb)
        rows.append(low)
        rows.append(spawn(dict(d=d, n=n, family="diagonal"), args.diag_timeout, args.max_gb))
        if low["status"] == "ok":
            rows.append(spawn(dict(d=d, n=n, family="svi", rank=20, reference=ref, max_steps=20000,
                                   svi_seconds=args.svi_seconds, block=500), args.timeout, args.max_gb))
        print(json.dumps(rows[-3:], indent=1), flush=True)
    result = dict(machine=machine_info(), rows=rows, quick=args.quick)
    with open(os.path.join(out_dir, "bench_lowrank.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = ["| d | N | method | status | fit s | update s | peak GB | note |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        note = ""
        if r.get("svi"):
            last, best = r["svi"][-1], min(r["svi"], key=lambda e: e["kl"])
            note = (f"marginal KL to the lowrank fit: {last['kl']:.3g} after {last['steps']} steps "
                    f"({last['seconds']:.0f} s); lowest {best['kl']:.3g} at {best['steps']} steps ({best['seconds']:.0f} s)")
        elif "residual" in r:
            note = (f"{r['fit_iterations']}+{r['update_iterations']} iterations, residual {r['residual']:.1e}, "
                    f"fit peak {r['fit_peak_gb']:.1f} GB, after imports {r['base_gb']:.1f} GB")
        fmt = lambda key: f"{r[key]:.1f}" if key in r else "–"  # noqa: E731
        lines.append(f"| {r['d']} | {r['n']} | {r['family']} | {r['status']} | {fmt('fit_s')} | {fmt('update_s')} "
                     f"| {fmt('peak_gb')} | {note} |")
    with open(os.path.join(out_dir, "bench_lowrank.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
