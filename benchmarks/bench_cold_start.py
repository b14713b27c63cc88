"""Cold start of ``pc.fit``: wall time, XLA programs compiled and seconds spent compiling, in fresh processes.

What is measured
----------------
A user's first ``pc.fit`` in a new Python process (JAX's persistent compilation cache off, so that
every program compiles) on real models of the posteriordb suite: the wall time of the call, the
number of XLA programs it compiled (``jax.monitoring`` ``backend_compile`` events during the call;
binding the posteriordb data before it is not counted) and the seconds
those compilations took; then a second call in the same process (*warm*, nothing compiles). Each
model runs in its own subprocess, ``--repeat`` times; the table reports medians.

``--code PATH`` runs the measurement against another checkout of the package (e.g. a git worktree
of an earlier revision), so that two revisions are compared in one session on one machine::

    git worktree add /tmp/before <rev>
    python benchmarks/bench_cold_start.py --code /tmp/before --out before.json
    python benchmarks/bench_cold_start.py --out after.json

Usage::

    python benchmarks/bench_cold_start.py [--models kidiq-kidscore_momhs ...] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODELS = ("kidiq-kidscore_momhs", "eight_schools-eight_schools_noncentered", "arK-arK", "diamonds-diamonds")

_CHILD = r"""
import json, os, sys, time
os.environ["NUMPYRO_PC_NO_COMPILATION_CACHE"] = "1"
import jax
jax.config.update("jax_enable_x64", True)
events = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: events.append(duration) if "backend_compile" in event else None)
import numpyro_pc as pc
from numpyro_pc.posteriordb import reference as pdb
tr = pdb.translate(sys.argv[1])
events.clear()  # only what the fit compiles
t0 = time.perf_counter()
post = pc.fit(tr.model, *tr.args, **tr.kwargs)
jax.block_until_ready(post.state)
cold, programs, compiling = time.perf_counter() - t0, len(events), sum(events)
t0 = time.perf_counter()
jax.block_until_ready(pc.fit(tr.model, *tr.args, **tr.kwargs).state)
print(json.dumps(dict(cold=cold, warm=time.perf_counter() - t0, programs=programs, compiling=compiling,
                      residual=float(post.residual))))
"""


def measure(model: str, code: str) -> dict:
    data = os.environ.get("NUMPYRO_PC_DATA") or os.path.join(os.path.dirname(ROOT), "shared", "data")
    env = dict(os.environ, PYTHONPATH=code, NUMPYRO_PC_DATA=data,
               OPENBLAS_NUM_THREADS=os.environ.get("OPENBLAS_NUM_THREADS", "1"))
    # run in the measured checkout: ``python -c`` puts the working directory first on the path
    out = subprocess.run([sys.executable, "-c", _CHILD, model], env=env, cwd=code, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--code", default=ROOT, help="the checkout whose numpyro_pc is measured")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    rows = []
    print(f"{'model':45s} {'cold s':>7s} {'programs':>8s} {'compile s':>9s} {'warm s':>7s}")
    for model in args.models:
        runs = [measure(model, args.code) for _ in range(args.repeat)]
        row = dict(model=model, **{k: statistics.median(r[k] for r in runs)
                                   for k in ("cold", "programs", "compiling", "warm")},
                   residual=max(r["residual"] for r in runs), runs=runs)
        rows.append(row)
        print(f"{model:45s} {row['cold']:7.2f} {row['programs']:8.0f} {row['compiling']:9.2f} {row['warm']:7.2f}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(dict(code=args.code, rows=rows), handle, indent=1)


if __name__ == "__main__":
    main()
