#!/usr/bin/env python
"""Execute every ``*.ipynb`` in a folder and fail loudly if any cell errors.

Usage::

    python scripts/run_notebooks.py notebooks                    # fast mode (NUMPYRO_PC_FAST=1)
    python scripts/run_notebooks.py notebooks --full             # full-size runs
    python scripts/run_notebooks.py notebooks --full --write-back  # ... committed with their outputs
    python scripts/run_notebooks.py notebooks --check-committed  # are the committed outputs current?

Notebooks run in sorted order with the ``python3`` kernel, which jupyter_client
resolves to the interpreter running this script (ipykernel must be installed
there; ``make venv`` does that).  The working directory of each kernel is the
notebook folder.  Executed copies go to ``<folder>/_executed/``; the source
notebooks are modified only by ``--write-back`` (``make notebooks-full``), which
replaces each source notebook that ran without error by its executed copy, stamped
in ``metadata.numpyro_pc`` with the mode, the run time, the versions and the SHA-256
of its code cells.  ``--check-committed`` runs nothing: it fails unless every
notebook carries a full-run stamp whose code digest equals that of its code cells now
(an edited cell without a re-run is stale) and at least one figure.
"""

from __future__ import annotations

import argparse
import hashlib
from importlib import metadata
import os
import platform
import re
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
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
    sockets = tempfile.TemporaryDirectory(prefix="nbkernel-")
    # IPC sockets in a private folder: nothing crosses TCP, so the kernel has nothing to warn about
    manager = KernelManager(kernel_name=KERNEL_NAME, transport="ipc", ip=os.path.join(sockets.name, "kernel"))
    client = NotebookClient(
        nb,
        km=manager,
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
    finally:  # a manager handed to nbclient is the caller's to shut down
        if manager.has_kernel:
            manager.shutdown_kernel(now=True)
        sockets.cleanup()
    elapsed = time.perf_counter() - start
    if ok:
        nb.metadata["numpyro_pc"] = _stamp(nb, elapsed)
    # Keep the (possibly partial) executed notebook for inspection.
    nbformat.write(nb, out_dir / path.name)
    return ok, elapsed, message


def code_digest(nb) -> str:
    """SHA-256 of the notebook's code cells, in order (outputs and metadata excluded)."""
    digest = hashlib.sha256()
    for cell in nb.cells:
        if cell.cell_type == "code":
            digest.update(cell.source.encode("utf-8") + b"\0")
    return digest.hexdigest()


def _stamp(nb, elapsed: float) -> dict:
    versions = {}
    for name in ("numpyro-pc", "jax", "numpyro"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return {"mode": "fast" if os.environ.get("NUMPYRO_PC_FAST") == "1" else "full", "seconds": round(elapsed, 1),
            "code_sha256": code_digest(nb), "versions": versions, "machine": f"{platform.machine()}, "
            f"{os.cpu_count()} cores"}


def check_committed(notebooks: list[Path]) -> list[str]:
    """Problems of the committed outputs: no full-run stamp, a stamp of other code cells, no figure."""
    problems, total = [], 0
    for path in notebooks:
        total += path.stat().st_size
        nb = nbformat.read(path, as_version=4)
        stamp = nb.metadata.get("numpyro_pc", {})
        figures = sum("image/png" in out.get("data", {}) for cell in nb.cells if cell.cell_type == "code"
                      for out in cell.get("outputs", []))
        if stamp.get("mode") != "full":
            problems.append(f"{path.name}: no outputs of a full run (stamp {stamp.get('mode', 'missing')!r})")
        elif stamp.get("code_sha256") != code_digest(nb):
            problems.append(f"{path.name}: its code cells changed after the committed full run (stale outputs)")
        elif not figures:
            problems.append(f"{path.name}: the committed run shows no figure")
    print(f"{len(notebooks)} committed notebook(s), {total / 1e6:.1f} MB with outputs; "
          f"{len(problems)} problem(s)")
    return problems


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
    parser.add_argument("--write-back", action="store_true",
                        help="with --full: replace each source notebook that ran by its executed, stamped copy")
    parser.add_argument("--check-committed", action="store_true",
                        help="run nothing; fail unless the committed outputs are a full run of the current code cells")
    args = parser.parse_args(argv)
    if args.write_back and not args.full:
        parser.error("--write-back commits outputs of full runs only: add --full")

    folder = args.folder.resolve()
    if not folder.is_dir():
        print(f"error: {folder} is not a directory", file=sys.stderr)
        return 2
    notebooks = sorted(folder.glob("*.ipynb"))
    if not notebooks:
        print(f"no notebooks in {folder}; nothing to run")
        return 0

    if args.check_committed:
        problems = check_committed(notebooks)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        if problems:
            print("re-run `make notebooks-full` and commit the notebooks", file=sys.stderr)
        return 1 if problems else 0

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
            elif args.write_back:
                (out_dir / path.name).replace(path)

    print(f"{len(notebooks) - len(failures)}/{len(notebooks)} notebooks passed in "
          f"{time.perf_counter() - wall:.1f} s ({args.jobs} at a time)")
    print(f"executed copies in {out_dir}")
    for name, message in failures:
        print(f"\n===== {name} failed =====\n{message}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
