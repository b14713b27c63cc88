"""Flower's simulation engine with the package's ServerApp/ClientApp vs the in-process run; clients bucketed by size.

Issue 28 item 3. Two parts:

* ``sim``: a7a (16 100 examples, 123 features, logistic regression with prior N(0, I), the full family,
  d = 123; the model and data of ``examples/flower_app``), cut into K = 100 and K = 1 000 IID partitions
  (``flower_apps.partition_rows``, seed 0). Each K runs ``flower_apps.simulate`` (``run_simulation``, one virtual
  node per client, ``rounds`` rounds after the initialisation round, the plain global step) and then
  ``federated.run`` on the same partitions with the same settings, in the same process. Reported: rounds,
  bytes (the server's count: one site up and the global Gaussian down per client and round), wall time,
  peak memory (resident set of this process and every process it started: Ray's workers, GCS, raylet) and
  KL(q_simulation ‖ q_in-process).
* ``buckets``: ``federated.run`` on a7a over 100 clients with Dirichlet(0.1) label skew (the split of
  ``bench_federated.py``), clients bucketed by shard size vs every client padded to the largest shard
  (``stacking.BUCKET_BASE = inf``): rows one pass over the clients processes, wall time of the whole run
  (compilation included, and a second, warm run), and the largest difference of the results.

Run::

    PYTHONPATH=. python benchmarks/bench_flower_simulation.py                 # both parts, K = 100 and 1000
    PYTHONPATH=. python benchmarks/bench_flower_simulation.py --only sim --clients 100 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
APP = os.path.join(ROOT, "examples", "flower_app")
# the simulation's worker processes import the model and the data by name: the package and the example app
os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, APP, os.environ.get("PYTHONPATH", "")])
sys.path[:0] = [ROOT, APP, HERE]

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
import numpy as np  # noqa: E402
import psutil  # noqa: E402

from _common import machine_info, write_results  # noqa: E402
from numpyro_pc import federated  # noqa: E402
from numpyro_pc.families.registry import Gaussian, get_family  # noqa: E402
from numpyro_pc.federated import flower_apps, stacking  # noqa: E402
from numpyro_pc.federated.options import Safeguard, StopRule  # noqa: E402
from pcflower import task  # noqa: E402

OUT = os.path.join(HERE, "_out")


class PeakMemory:
    """Peak resident memory of this process and all its descendants, sampled every 0.2 s."""

    def __enter__(self):
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self):
        me = psutil.Process()
        while not self._stop.is_set():
            total = 0
            for p in [me, *me.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            self._stop.wait(0.2)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def in_process(parts, rounds):
    kw = dict(rounds=rounds, stop=StopRule(tol=0.0, residual_tol=0.0), keep_data=False,
              safeguard=Safeguard(line_search=False))  # the Flower server takes the plain global step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return federated.run(task.model, parts, **kw)


def sim_case(X, y, k, rounds):
    out = os.path.join(OUT, f"flower_sim_K{k}.npz")
    config = {"model": "pcflower.task:model", "data": "pcflower.task:a7a", "rounds": rounds, "x64": True,
              "out": out, "connect-timeout": 600.0, "round-timeout": 1800.0}
    with PeakMemory() as mem:
        start = time.perf_counter()
        flower_apps.simulate(config, k)
        sim_seconds = time.perf_counter() - start
    with np.load(out) as res:
        q_sim = Gaussian(res["mean"], res["precision"])
        history, failure = json.loads(str(res["history"])), json.loads(str(res["failure"]))
        not_started = json.loads(str(res["not_started"]))
    parts = [flower_apps.partition((X, y), i, k) for i in range(k)]
    with PeakMemory() as mem_ref:
        start = time.perf_counter()
        ref = in_process(parts, rounds)
        ref_seconds = time.perf_counter() - start
    full = get_family("full")
    kl = float(full.kl(q_sim, ref.state))
    return dict(clients=k, rounds=len(history), bytes=history[-1]["bytes"] if history else None,
                ref_bytes=ref.history[-1]["bytes"], sim_seconds=sim_seconds, ref_seconds=ref_seconds,
                ratio=sim_seconds / ref_seconds, sim_peak_mb=mem.peak / 2**20, ref_peak_mb=mem_ref.peak / 2**20,
                kl=kl, failure=failure, not_started=len(not_started),
                participants=[h["participants"] for h in history], last_residual=history[-1]["residual"])


def bucket_case(rounds):
    from bench_federated import dirichlet_split

    X, y = task.a7a()
    rows = dirichlet_split(y, 100, 0.1)
    parts = [(X[r], y[r]) for r in rows]
    _, datas = federated.core.bind_shards(task.model, parts)
    out = dict(examples=int(sum(len(r) for r in rows)), largest=int(max(len(r) for r in rows)),
               smallest=int(min(len(r) for r in rows)))
    results = {}
    for name, base in (("padded", math.inf), ("bucketed", 2.0)):
        stacking.BUCKET_BASE = base
        buckets = stacking.bucket_clients(datas)
        times = []
        for _ in range(2):  # cold (compilation), warm
            start = time.perf_counter()
            results[name] = in_process(parts, rounds)
            times.append(time.perf_counter() - start)
        out[name] = dict(rows=buckets.rows, buckets=len(buckets.stacks), cold_seconds=times[0], warm_seconds=times[1])
    stacking.BUCKET_BASE = math.inf  # the default
    a, b = results["padded"], results["bucketed"]
    out["max_abs_diff_mean"] = float(np.max(np.abs(np.asarray(a.state.mean) - np.asarray(b.state.mean))))
    out["max_abs_diff_precision"] = float(np.max(np.abs(np.asarray(a.state.precision) - np.asarray(b.state.precision))))
    out["rounds"] = rounds
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=["sim", "buckets"], default=None)
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    os.makedirs(OUT, exist_ok=True)
    result = dict(machine=machine_info(), rounds=args.rounds)
    lines = []
    if args.only in (None, "sim"):
        X, y = task.a7a()
        result["sim"] = []
        lines += ["| K | rounds | bytes | simulation s | in-process s | ratio | peak MB sim / in-process | "
                  "KL(sim ‖ in-process) |", "|---|---|---|---|---|---|---|---|"]
        for k in args.clients:
            r = sim_case(X, y, k, args.rounds)
            result["sim"].append(r)
            print(json.dumps(r), flush=True)
            lines.append(f"| {k} | {r['rounds']} | {r['bytes'] / 1e6:.1f} MB | {r['sim_seconds']:.0f} | "
                         f"{r['ref_seconds']:.1f} | {r['ratio']:.0f}× | {r['sim_peak_mb']:.0f} / "
                         f"{r['ref_peak_mb']:.0f} | {r['kl']:.1e} |")
    if args.only in (None, "buckets"):
        b = bucket_case(args.rounds)
        result["buckets"] = b
        print(json.dumps(b), flush=True)
        lines += ["", "| layout | buckets | rows per pass | run s (cold) | run s (warm) |", "|---|---|---|---|---|"]
        for name in ("padded", "bucketed"):
            r = b[name]
            lines.append(f"| {name} | {r['buckets']} | {r['rows']:,} | {r['cold_seconds']:.1f} | "
                         f"{r['warm_seconds']:.1f} |")
        lines.append(f"\n{b['examples']:,} examples, shards {b['smallest']}–{b['largest']} rows; largest difference "
                     f"of the results: mean {b['max_abs_diff_mean']:.1e}, precision {b['max_abs_diff_precision']:.1e}")
    targets = []
    if "sim" in result:
        targets += [dict(target=f"K = {r['clients']} virtual clients run on Flower's simulation engine",
                         measured=f"{r['rounds']} rounds, KL {r['kl']:.1e}",
                         met=r["failure"] is None and r["kl"] <= 1e-8) for r in result["sim"]]
    if "buckets" in result:
        b = result["buckets"]
        targets.append(dict(target="bucketed rows ≤ 2× the examples, same result",
                            measured=f"{b['bucketed']['rows']:,} rows for {b['examples']:,}",
                            met=b["bucketed"]["rows"] <= 2 * b["examples"] and b["max_abs_diff_mean"] <= 1e-10))
    write_results("flower_simulation", OUT, result, "\n".join(lines), targets)


if __name__ == "__main__":
    main()
