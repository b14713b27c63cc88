#!/usr/bin/env python
"""Execute every ``*.ipynb`` in a folder and fail loudly if any cell errors.

Usage::

    python scripts/run_notebooks.py notebooks            # fast mode (NUMPYRO_PC_FAST=1)
    python scripts/run_notebooks.py notebooks --full     # full-size runs

Notebooks run in sorted order with the ``python3`` kernel, which jupyter_client
resolves to the interpreter running this script (ipykernel must be installed
there; ``make venv`` does that).  The working directory of each kernel is the
notebook folder.  Executed copies go to ``<folder>/_executed/``; the source
notebooks are never modified.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError

KERNEL_NAME = "python3"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _check_kernel() -> None:
    """Make sure ``python3`` launches this interpreter, not some other Python."""
    spec = KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    exe = spec.argv[0]
    # jupyter_client substitutes sys.executable for a bare "python"/"python3".
    if exe in {"python", "python3", f"python3.{sys.version_info[1]}"}:
        return
    if Path(exe).resolve() != Path(sys.executable).resolve():
        sys.exit(
            f"error: kernel '{KERNEL_NAME}' runs {exe}, not {sys.executable}; "
            "remove the stale kernelspec or install ipykernel in this environment"
        )


def run_one(path: Path, out_dir: Path, timeout: int) -> tuple[bool, float, str]:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name=KERNEL_NAME,
        resources={"metadata": {"path": str(path.parent)}},
    )
    start = time.perf_counter()
    ok, message = True, ""
    try:
        client.execute()
    except CellTimeoutError as err:
        ok, message = False, f"cell timed out after {timeout} s\n{err}"
    except CellExecutionError as err:
        ok, message = False, _ANSI.sub("", str(err))
    except Exception as err:  # kernel died, bad notebook, ...
        ok, message = False, f"{type(err).__name__}: {err}"
    elapsed = time.perf_counter() - start
    # Keep the (possibly partial) executed notebook for inspection.
    nbformat.write(nb, out_dir / path.name)
    return ok, elapsed, message


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="folder holding the notebooks")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per cell (default 900)")
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("NOTEBOOK_JOBS", "2")),
                        help="notebooks run at once, each in its own kernel (default 2: the project's 2 cores)")
    parser.add_argument(
        "--full",
        action="store_true",
        help="unset NUMPYRO_PC_FAST instead of defaulting it to 1",
    )
    args = parser.parse_args(argv)

    folder = args.folder.resolve()
    if not folder.is_dir():
        print(f"error: {folder} is not a directory", file=sys.stderr)
        return 2
    notebooks = sorted(folder.glob("*.ipynb"))
    if not notebooks:
        print(f"no notebooks in {folder}; nothing to run")
        return 0

    # The kernel inherits this process's environment.
    if args.full:
        os.environ.pop("NUMPYRO_PC_FAST", None)
    else:
        os.environ.setdefault("NUMPYRO_PC_FAST", "1")
    _check_kernel()

    out_dir = folder / "_executed"
    out_dir.mkdir(exist_ok=True)
    print(
        f"running {len(notebooks)} notebook(s) from {folder} "
        f"(NUMPYRO_PC_FAST={os.environ.get('NUMPYRO_PC_FAST', '<unset>')}, "
        f"python={sys.executable})",
        flush=True,
    )

    failures: list[tuple[str, str]] = []
    wall = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:  # one driver process per running notebook
        futures = {pool.submit(run_one, path, out_dir, args.timeout): path for path in notebooks}
        for future in as_completed(futures):
            path = futures[future]
            ok, elapsed, message = future.result()
            print(f"  {path.name} ... {'ok' if ok else 'FAILED'} ({elapsed:.1f} s)", flush=True)
            if not ok:
                failures.append((path.name, message))

    print(f"{len(notebooks) - len(failures)}/{len(notebooks)} notebooks passed in "
          f"{time.perf_counter() - wall:.1f} s ({args.jobs} at a time)")
    print(f"executed copies in {out_dir}")
    for name, message in failures:
        print(f"\n===== {name} failed =====\n{message}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
