"""Every Gaussian family's default path at large d: fit + exact update + corrected deletion (issue 30 item 1).

What is measured
----------------
Logistic regression, ``w ~ Normal(0, 1)`` of dimension ``d``, ``N`` examples; the design is dense
(``X @ w``, ``N × d``) or sparse (``k = 10`` nonzeros per row held as index/value arrays, a gather in
the model, as in ``bench_lowrank.py``). Default options only (no ``init=``, ``storage=``,
``expectation=``): the family, and ``rank`` for the low-rank family. Each configuration runs in its
own subprocess, stopped above ``--max-gb`` resident memory (watchdog, every 0.5 s) or after
``--timeout`` seconds, and reports:

* ``fit_s``: ``pc.fit`` on the first ``N`` examples (cold: tracing and compilation included);
* ``update_s``: ``post.update(new, correction="exact")`` with ``N/10`` new examples;
* ``delete_s``: ``post.delete(100 ids, method="corrected")``;
* ``peak_gb``: the subprocess's peak resident memory (``getrusage`` ``ru_maxrss``) and
  ``base_gb`` after importing JAX and making the data; ``residual``: the deleted posterior's.

A configuration whose design alone exceeds the memory limit (dense ``N × d``) is reported as
impossible with that number, not run.

Usage::

    python benchmarks/bench_large_d.py --quick     # d = 3,000, N = 1,000
    python benchmarks/bench_large_d.py             # d = 20,000 and 100,000, N = 10,000
    python benchmarks/bench_large_d.py --only sparse:100000:10000:float32:lowrank
    python benchmarks/bench_large_d.py --sizes 20000x4000   # the issue's dense low-rank case

Outputs: ``benchmarks/_out/bench_large_d.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

K = 10  # nonzeros per row of a sparse design
RANK = 10


def make_data(n, d, kind, dtype, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    w = np.where(rng.uniform(size=d) < 0.05, rng.normal(size=d) * 2.0, 0.0)
    if kind == "sparse":
        idx = rng.integers(0, d, size=(n, K)).astype(np.int32)
        val = (rng.normal(size=(n, K)) * 2.0 / np.sqrt(K)).astype(dtype)
        logits = np.sum(val * w[idx], 1)
        data = (idx, val)
    else:
        x = np.empty((n, d), dtype)
        for start in range(0, n, 1000):  # in blocks: no float64 copy of the whole design
            x[start:start + 1000] = rng.normal(size=(min(1000, n - start), d)) * (2.0 / np.sqrt(d))
        logits = np.concatenate([x[s:s + 1000] @ w.astype(dtype) for s in range(0, n, 1000)])
        data = (x,)
    y = (rng.uniform(size=n) < 1.0 / (1.0 + np.exp(-logits))).astype(dtype)
    return data, y


def make_model(d, kind):
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist

    if kind == "sparse":
        def model(idx, val, y=None):
            w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([d]).to_event(1))
            with numpyro.plate("data", idx.shape[0]):
                numpyro.sample("y", dist.Bernoulli(logits=jnp.sum(val * w[idx], -1)), obs=y)
    else:
        def model(x, y=None):
            w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([d]).to_event(1))
            with numpyro.plate("data", x.shape[0]):
                numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)
    return model


def _rss_gb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_one(cfg):
    """One configuration in this process: a dict of measurements."""
    import jax

    if cfg["dtype"] == "float64":
        jax.config.update("jax_enable_x64", True)
    import numpy as np

    import numpyro_pc as pc

    d, n, kind = cfg["d"], cfg["n"], cfg["input"]
    extra = n // 10
    data, y = make_data(n + extra, d, kind, np.dtype(cfg["dtype"]))
    model = make_model(d, kind)
    out = dict(cfg, base_gb=_rss_gb())
    options = dict(family=cfg["family"])
    if cfg["family"] == "lowrank":
        options["rank"] = RANK
    first = [a[:n] for a in data] + [y[:n]]
    new = [a[n:] for a in data] + [y[n:]]
    t = time.perf_counter()
    post = pc.fit(model, *first, **options)
    jax.block_until_ready(post.mean)
    out.update(fit_s=time.perf_counter() - t, fit_peak_gb=_rss_gb(), start=post.record["start"].kind,
               fit_residual=float(post.residual))
    t = time.perf_counter()
    upd = post.update(*new, correction="exact")
    jax.block_until_ready(upd.mean)
    out.update(update_s=time.perf_counter() - t, update_residual=float(upd.residual))
    t = time.perf_counter()
    gone = upd.delete(np.arange(100), method="corrected")
    jax.block_until_ready(gone.mean)
    out.update(delete_s=time.perf_counter() - t, residual=float(gone.residual), peak_gb=_rss_gb())
    return out


def _rss_of(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def design_gb(cfg):
    """GB of the dense design by itself (``N·d`` numbers of the dtype), 0 for a sparse one."""
    size = 8 if cfg["dtype"] == "float64" else 4
    return 1.1 * cfg["n"] * cfg["d"] * size / 2**30 if cfg["input"] == "dense" else 0.0


def spawn(cfg, timeout, max_gb):
    need = design_gb(cfg)
    if need >= max_gb:
        return dict(cfg, status=f"impossible: the dense design alone is {need:.1f} GB (N·d·{cfg['dtype']}, "
                                f"with the update's rows) >= {max_gb:.0f} GB")
    cmd = [sys.executable, os.path.abspath(__file__), "--one", json.dumps(cfg)]
    t, peak = time.perf_counter(), 0.0
    out_file, err_file = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=out_file, stderr=err_file, text=True)
    while proc.poll() is None:  # the machine is shared: a run is stopped at max_gb or the timeout
        rss = _rss_of(proc.pid)
        peak = max(peak, rss)
        if rss > max_gb or time.perf_counter() - t > timeout:
            proc.kill()
            proc.wait()
            why = f"resident memory {rss:.1f} GB > {max_gb:.0f} GB" if rss > max_gb else f"timeout after {timeout} s"
            return dict(cfg, status=f"stopped: {why}", wall=time.perf_counter() - t, peak_gb=peak)
        time.sleep(0.5)
    out_file.seek(0)
    err_file.seek(0)
    out, err = out_file.read(), err_file.read()
    if proc.returncode != 0:
        tail = (err or "").strip().splitlines()[-1:] or [""]
        return dict(cfg, status=f"failed (rc {proc.returncode}): {tail[0][:200]}", wall=time.perf_counter() - t)
    return dict(json.loads(out.strip().splitlines()[-1]), status="ok", wall=time.perf_counter() - t)


def configurations(quick, sizes=None):
    """Every input, dtype and family at each ``(d, N)`` of ``sizes`` (default: d = 20,000 and 100,000, N = 10,000)."""
    sizes = sizes or ([(3000, 1000)] if quick else [(20000, 10000), (100000, 10000)])
    return [dict(input=kind, d=d, n=n, dtype=dtype, family=family)
            for d, n in sizes for kind in ("sparse", "dense") for dtype in ("float32", "float64")
            for family in ("lowrank", "diagonal", "isotropic")]


def _key(cfg):
    return f"{cfg['input']}:{cfg['d']}:{cfg['n']}:{cfg['dtype']}:{cfg['family']}"


def table(rows):
    lines = ["| input | d | N | dtype | family | status | fit s | update s | delete s | peak GB | residual |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fmt = lambda key, f="{:.1f}": f.format(r[key]) if key in r else "–"  # noqa: E731
        lines.append(f"| {r['input']} | {r['d']:,} | {r['n']:,} | {r['dtype']} | {r['family']} | {r['status']} "
                     f"| {fmt('fit_s')} | {fmt('update_s')} | {fmt('delete_s')} | {fmt('peak_gb', '{:.2f}')} "
                     f"| {fmt('residual', '{:.1e}')} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--only", help="comma-separated input:d:N:dtype:family keys")
    parser.add_argument("--sizes", help="comma-separated dxN pairs (default 20000x10000,100000x10000)")
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--max-gb", type=float, default=4.0)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return
    from _common import machine_info

    sizes = [tuple(int(v) for v in pair.split("x")) for pair in args.sizes.split(",")] if args.sizes else None
    cfgs = configurations(args.quick, sizes)
    if args.only:
        keep = set(args.only.split(","))
        cfgs = [c for c in cfgs if _key(c) in keep]
    out_dir = os.path.join(HERE, "_out")
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for cfg in cfgs:
        rows.append(spawn(cfg, args.timeout, args.max_gb))
        print(json.dumps(rows[-1]), flush=True)
        with open(os.path.join(out_dir, "bench_large_d.json"), "w") as f:
            json.dump(dict(machine=machine_info(), rows=rows), f, indent=1)
        with open(os.path.join(out_dir, "bench_large_d.md"), "w") as f:
            f.write(table(rows) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
