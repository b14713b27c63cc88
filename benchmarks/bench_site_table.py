"""Pure correction kernels under ``jax.lax.scan`` against the host driver ``post.update``.

What is measured
----------------
Bayesian logistic regression with an intercept on scikit-learn's breast-cancer data (569 ×
30, standardised, shuffled with ``--seed``; prior precision 1, full Gaussian, d = 31; the
demo's model). ``pc.fit`` on the first 50 examples, then ``--batches`` batches of
``--batch-size`` examples, each added with

* ``memory``: the prior and ``--memory`` past examples drawn at random for every batch, and
* ``exact``: every past example and the prior,

in two ways that solve the same corrected problem (docs/adapting.md, "Adding data"):

* **host** — ``post.update(X_t, y_t, correction="memory", memory=ids)`` (resp. ``"exact"``)
  in a Python loop: what a user writes today;
* **scan** — :func:`numpyro_pc.kernels.site_table.correct_step` over all batches in one jitted
  ``jax.lax.scan`` (the memories drawn inside the trace by ``random_memory``; the host loop
  replays the same ids). Reported cold (first call: tracing and compilation) and warm (a
  second call on the same shapes: a user's next stream).

Reported: wall time of each (the stream in one number), the ratio host ÷ scan, and the
largest relative difference between the two final means (both solve to residual 1e-10).

Usage::

    python benchmarks/bench_site_table.py            # 30 batches of 10 (~2 min on 2 cores)
    python benchmarks/bench_site_table.py --quick    # 8 batches

Outputs: ``benchmarks/_out/bench_site_table.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import numpyro_pc as pc  # noqa: E402
from _common import machine_info, quiet, write_results  # noqa: E402
from bench_small_batches import demo_model  # noqa: E402
from numpyro_pc.datasets.loaders import load_breast_cancer  # noqa: E402
from numpyro_pc.model.likelihood import ModelData, bind_model  # noqa: E402
from numpyro_pc.kernels.site_table import correct_step, from_posterior, random_memory, to_posterior  # noqa: E402

OUT = os.path.join(HERE, "_out")
FIRST = 50
TOL = 1e-10


def scanned(config, state, batches, shared, memory, exact):
    """All batches in one jitted scan; returns the program and the memories it drew."""
    size = jax.tree.leaves(batches)[0].shape[1]

    @jax.jit
    def run(state, key):
        def body(state, xs):
            batch, k = xs
            chosen = state.has_site & state.has_data if exact else random_memory(k, state, memory)
            new, info = correct_step(config, state, ModelData(batch, shared), jnp.ones(size, bool), chosen, True)
            return new, (info.converged, chosen)

        steps = jax.tree.leaves(batches)[0].shape[0]
        return jax.lax.scan(body, state, (batches, jax.random.split(key, steps)))

    return run


def host_loop(post, X, y, size, steps, memories, exact):
    for t in range(steps):
        rows = slice(FIRST + t * size, FIRST + (t + 1) * size)
        options = dict(correction="exact") if exact else dict(correction="memory",
                                                              memory=np.flatnonzero(memories[t]))
        post = quiet(post.update, X[rows], y[rows], tol=TOL, **options)
    jax.block_until_ready(post.state)
    return post


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--memory", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args()
    steps = 8 if args.quick else args.batches
    size = args.batch_size
    X, y, _ = load_breast_cancer()
    order = np.random.default_rng(args.seed).permutation(X.shape[0])
    X, y = jnp.asarray(X[order]), jnp.asarray(y[order])
    end = FIRST + steps * size
    if end > X.shape[0]:
        raise SystemExit(f"{steps} batches of {size} need {end} examples; the data has {X.shape[0]}")
    post = pc.fit(demo_model, X[:FIRST], y[:FIRST], family="full", tol=TOL)
    _, rest = bind_model(demo_model, (X[FIRST:end], y[FIRST:end]))
    batches = jax.tree.map(lambda a: a.reshape((steps, size) + a.shape[1:]), rest.per_example)
    info = machine_info()
    result = dict(machine=info, steps=steps, batch_size=size, memory=args.memory, policies={})
    lines = [f"Machine: {info['cpu']}, {info['cores']} cores, JAX {info['jax']}; load at start "
             f"{', '.join(f'{x:.1f}' for x in info['loadavg'])}. Breast cancer, first {FIRST} fitted, {steps} batches "
             f"of {size}; full Gaussian d = 31, float64, tol {TOL:g}.", "",
             "| correction | host loop s | scan cold s | scan warm s | host ÷ scan (warm) | max rel. mean diff |",
             "|---|---|---|---|---|---|"]
    for policy in ("memory", "exact"):
        exact = policy == "exact"
        config, state = from_posterior(post, end, tol=TOL,
                                       work_size=None if exact else size + args.memory)
        run = scanned(config, state, batches, rest.shared, args.memory, exact)
        key = jax.random.PRNGKey(args.seed)
        t0 = time.perf_counter()
        final, (converged, memories) = jax.block_until_ready(run(state, key))
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        final, (converged, memories) = jax.block_until_ready(run(state, key))
        warm = time.perf_counter() - t0
        t0 = time.perf_counter()
        host = host_loop(post, X, y, size, steps, np.asarray(memories), exact)
        host_s = time.perf_counter() - t0
        out = to_posterior(config, final, post)
        diff = float(np.max(np.abs(out.mean - host.mean) / np.maximum(np.abs(host.mean), 1e-12)))
        result["policies"][policy] = dict(host_s=host_s, scan_cold_s=cold, scan_warm_s=warm,
                                          converged=bool(np.all(converged)), max_rel_mean_diff=diff,
                                          kl=float(out.kl(host)))
        lines.append(f"| {policy} | {host_s:.2f} | {cold:.2f} | {warm:.3f} | {host_s / warm:.1f}× | {diff:.1e} |")
        print(lines[-1], flush=True)
    write_results("bench_site_table", args.out, result, "\n".join(lines), [])


if __name__ == "__main__":
    main()
