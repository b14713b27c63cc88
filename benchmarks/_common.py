"""Helpers shared by the benchmark scripts: provenance, machine description, output files."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import platform
import subprocess
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Benchmarks time compilation (their "cold" columns): the package's persistent compilation cache, on by
#: default for users, is off in benchmark processes and the processes they start, so that a cold time never
#: reads programs an earlier run wrote. ``NUMPYRO_PC_BENCH_CACHE=1`` keeps it (then say so beside the numbers).
PERSISTENT_CACHE = os.environ.get("NUMPYRO_PC_BENCH_CACHE", "").strip() == "1"
if not PERSISTENT_CACHE:
    os.environ["NUMPYRO_PC_NO_COMPILATION_CACHE"] = "1"
    if "numpyro_pc" in sys.modules:  # imported before this module: turned on already
        sys.modules["numpyro_pc"].disable_compilation_cache()


def package_version():
    """Which numpyro_pc the numbers belong to: git HEAD, whether numpyro_pc/ has uncommitted
    changes, and a hash of its sources."""
    digest = hashlib.sha1()
    for path in sorted(glob.glob(os.path.join(ROOT, "numpyro_pc", "**", "*.py"), recursive=True)):
        with open(path, "rb") as f:
            digest.update(f.read())
    info = dict(source_sha1=digest.hexdigest()[:12])
    try:
        info["git_head"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                          text=True).stdout.strip()
        info["uncommitted_changes"] = bool(subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "numpyro_pc"],
                                                          capture_output=True, text=True).stdout.strip())
    except OSError:
        pass
    return info


def machine_info():
    """CPU model, cores, library versions, backend and load average at the start of a run."""
    import jax
    import numpyro

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return dict(cpu=cpu, cores=os.cpu_count(), jax=jax.__version__, numpyro=numpyro.__version__,
                backend=jax.default_backend(), python=platform.python_version(), platform=platform.platform(),
                numpyro_pc=package_version(), loadavg=os.getloadavg() if hasattr(os, "getloadavg") else None,
                openblas_threads=os.environ.get("OPENBLAS_NUM_THREADS", "default"),
                persistent_compilation_cache=jax.config.jax_compilation_cache_dir or "off")


def quiet(fn, *args, **kwargs):
    """Call ``fn`` with RuntimeWarnings (e.g. fallback notices) silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return fn(*args, **kwargs)


def write_results(name, out, result, table, targets, plot_fn=None):
    """Write ``<name>.json``, ``<name>.md`` (table + targets) and ``<name>.png``; print the table."""
    os.makedirs(out, exist_ok=True)
    table += "\n\nTargets:\n\n| target | measured | verdict |\n|---|---|---|\n" + "\n".join(
        f"| {t['target']} | {t['measured']} | {'met' if t['met'] else 'missed'} |" for t in targets)
    if plot_fn is not None:
        plot_fn(os.path.join(out, f"{name}.png"))
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(table + "\n")
    print()
    print(table)
    return table
