"""The test suite's persistent JAX compilation cache, for pytest's workers and for the processes tests
start (they import :mod:`models`, which calls :func:`use_test_compilation_cache`)."""

import os
from pathlib import Path

import jax

# the harness decides, not the package's default (numpyro_pc.compilation_cache), in this process and in the
# processes tests start (the demo, scripts): set before numpyro_pc is imported, which reads it
os.environ["NUMPYRO_PC_NO_COMPILATION_CACHE"] = "1"


def use_test_compilation_cache() -> None:
    """Keep every compiled program on disk for the test session (``.pytest_cache/jax``, or
    ``$NUMPYRO_PC_TEST_JAX_CACHE``; ``0`` turns it off). conftest's fixtures drop the in-memory
    programs after each module to bound memory, and many modules compile the same programs
    (the same small models, solvers and site kernels): with 2 workers and an empty cache
    tests/dual/test_expfam_adapt.py takes 114 s instead of 236 s, though a whole first run gains nothing
    (other files got slower by as much); a second run on the same machine is faster (the demo's
    tests 157 s → 60 s).
    A program's key is its HLO, compile options and the JAX version, so an edited package never
    reads a stale entry."""
    folder = os.environ.get("NUMPYRO_PC_TEST_JAX_CACHE", str(Path(__file__).resolve().parent.parent
                                                              / ".pytest_cache" / "jax"))
    if folder in ("", "0") or jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
