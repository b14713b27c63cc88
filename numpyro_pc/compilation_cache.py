"""JAX's persistent compilation cache, on by default in a per-user folder.

A fit compiles its site computation, solver steps and diagnostics once per model shape; a
fresh process compiles them again. With the cache on, a program compiled in one process is
read from disk by the next one with the same HLO, options and JAX version (JAX's own key:
an edited model or a new JAX never reads a stale entry).

On import the package turns the cache on in :func:`default_cache_dir` (every program, however
quick to compile, since a fit's are many and small; at most :data:`MAX_CACHE_BYTES`, least
recently used programs evicted first, where the ``filelock`` package JAX's eviction needs is
installed — else JAX's default, no bound) unless

- the environment sets ``NUMPYRO_PC_NO_COMPILATION_CACHE`` to ``1``/``true``/``yes``, or
  ``NUMPYRO_PC_JAX_CACHE`` to ``0`` or empty,
- the folder cannot be written (a read-only home): the import goes on without the cache, or
- JAX already has a cache folder (``jax_compilation_cache_dir`` set by the user, by
  ``JAX_COMPILATION_CACHE_DIR`` or by a test harness): the user's choice is left alone.

:func:`disable_compilation_cache` turns it off for the rest of the process and
:func:`enable_compilation_cache` on again (or in another folder). Nothing here runs inside a
jitted function; the setting is JAX's, process-wide, like every ``jax.config`` option.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile

import jax
from jax.experimental.compilation_cache import compilation_cache as _jax_cache

from .errors import InvalidOptionError

__all__ = ["CACHE_DIR_ENV", "DISABLE_ENV", "default_cache_dir", "enable_compilation_cache",
           "disable_compilation_cache", "compilation_cache_dir", "heal_access_times"]

CACHE_DIR_ENV = "NUMPYRO_PC_JAX_CACHE"  # the folder; "0" or empty: off (the streaming GP's demo read it so already)
DISABLE_ENV = "NUMPYRO_PC_NO_COMPILATION_CACHE"
MIN_COMPILE_SECONDS = 0.0  # a fit compiles ~100 small programs (kidiq: 112 in 4.6 s): each one counts
MAX_CACHE_BYTES = 2**30  # JAX evicts the least recently used programs above this (its own default: no limit)
_TRUE = ("1", "true", "yes", "on")
_OFF = ("", "0")


def default_cache_dir() -> str:
    """``$NUMPYRO_PC_JAX_CACHE`` (made absolute), else ``$XDG_CACHE_HOME/numpyro_pc/jax``, else
    ``~/.cache/numpyro_pc/jax``."""
    explicit = os.environ.get(CACHE_DIR_ENV, "").strip()
    if explicit not in _OFF:
        return os.path.abspath(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "numpyro_pc", "jax")


def _writable(folder: str) -> None:
    """Create ``folder`` and write a probe file in it, or raise :class:`InvalidOptionError` saying why."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-probe-"):
            pass
    except OSError as err:
        raise InvalidOptionError(f"cannot use {folder!r} as the compilation cache folder (it must be a folder this "
                                 f"process can write): {err}") from err


def compilation_cache_dir() -> str | None:
    """The folder JAX's persistent cache uses in this process, or ``None`` when it is off."""
    return jax.config.jax_compilation_cache_dir or None


def enable_compilation_cache(path: str | os.PathLike | None = None, min_compile_seconds: float = MIN_COMPILE_SECONDS,
                             replace: bool = False) -> str:
    """Turn on JAX's persistent compilation cache.

    :param path: the folder (created if missing); default :func:`default_cache_dir`.
    :param float min_compile_seconds: store only programs that took at least this long to compile.
    :param bool replace: replace a folder already set (by the user or JAX's environment variable);
        by default that folder is kept, with its settings (``min_compile_seconds`` then has no
        effect), and returned.
    :return: the folder in use.
    :raises InvalidOptionError: a negative or non-finite ``min_compile_seconds``, or a folder that
        cannot be created or written.
    """
    seconds = float(min_compile_seconds)
    if not (seconds >= 0.0 and seconds != float("inf")):
        raise InvalidOptionError(f"min_compile_seconds must be a finite number ≥ 0; got {min_compile_seconds!r}")
    current = compilation_cache_dir()
    if current and not replace:
        return current
    folder = os.path.abspath(os.fspath(path)) if path is not None else default_cache_dir()
    _writable(folder)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", seconds)
    if jax.config.jax_compilation_cache_max_size in (None, -1) and importlib.util.find_spec("filelock"):
        # unbounded: bound it (JAX's eviction needs filelock; without it JAX refuses every bounded read)
        jax.config.update("jax_compilation_cache_max_size", MAX_CACHE_BYTES)
    if jax.config.jax_compilation_cache_max_size not in (None, -1):
        heal_access_times(folder)
    _jax_cache.reset_cache()  # JAX decides once per process whether to use the cache: let it decide again
    return folder


def heal_access_times(folder: str, timeout: float = 10.0) -> int:
    """Give every program in ``folder`` that has no access-time file one, dated the epoch (evicted first).

    JAX's bounded cache keeps an access time beside each program and reads all of them before every
    write; a program written by a process without the bound (no ``filelock``, or another program using
    the folder unbounded) has none, and from then on every write in a bounded process fails with
    "Error writing persistent compilation cache entry … FileNotFoundError (…-atime)": the cache warns and
    stores nothing new. Done under JAX's own lock; a lock not obtained in ``timeout`` seconds or a file
    another process removes meanwhile is left for the next start.

    :return: how many access times were written.
    """
    import filelock

    healed = 0
    try:
        with filelock.FileLock(os.path.join(folder, ".lockfile"), timeout=timeout):
            names = set(os.listdir(folder))
            for name in names:
                if name.endswith(_PROGRAM) and name[: -len(_PROGRAM)] + _ACCESS not in names:
                    with open(os.path.join(folder, name[: -len(_PROGRAM)] + _ACCESS), "wb") as out:
                        out.write((0).to_bytes(8, "little"))
                    healed += 1
    except (OSError, filelock.Timeout):
        pass
    return healed


_PROGRAM, _ACCESS = "-cache", "-atime"  # JAX's suffixes of a program and of its access time (jax._src.lru_cache)


def disable_compilation_cache() -> None:
    """Turn JAX's persistent compilation cache off for the rest of this process (programs compiled
    from now on are neither read from nor written to disk)."""
    jax.config.update("jax_compilation_cache_dir", None)
    _jax_cache.reset_cache()


def enable_by_default() -> str | None:
    """What the package does on import (module docstring): the folder it turned on, or ``None``."""
    if (os.environ.get(DISABLE_ENV, "").strip().lower() in _TRUE or compilation_cache_dir()
            or os.environ.get(CACHE_DIR_ENV, "unset").strip() in _OFF):
        return None
    try:
        return enable_compilation_cache()
    except InvalidOptionError:  # an unwritable or read-only home: run without the cache rather than fail the import
        return None
