"""JAX's persistent compilation cache: on by default in a per-user folder, off by an environment
variable or a function, never over the user's own choice (numpyro_pc.compilation_cache)."""

import os
import subprocess
import sys
import textwrap

import jax
import pytest

import numpyro_pc as pc
from numpyro_pc import compilation_cache
from numpyro_pc.errors import InvalidOptionError

_PROBE = textwrap.dedent("""
    import os, jax, jax.numpy as jnp
    import numpyro_pc as pc
    jax.jit(lambda x: jnp.sin(x) * 3.0)(jnp.arange(5.0)).block_until_ready()
    folder = pc.compilation_cache_dir()
    print(folder, len(os.listdir(folder)) if folder and os.path.isdir(folder) else 0)
""")


def _probe(env_changes):
    env = {k: v for k, v in os.environ.items()
           if k not in ("NUMPYRO_PC_NO_COMPILATION_CACHE", "JAX_COMPILATION_CACHE_DIR", "NUMPYRO_PC_JAX_CACHE")}
    env.update(env_changes)
    done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    folder, entries = done.stdout.split()[-2:]
    return folder, int(entries)


def test_a_fresh_process_caches_in_the_default_folder_unless_told_otherwise(tmp_path):
    own = tmp_path / "default"
    folder, entries = _probe({"NUMPYRO_PC_JAX_CACHE": str(own)})
    assert folder == str(own) and entries > 0  # on by default: the program was written there
    assert _probe({"NUMPYRO_PC_JAX_CACHE": str(own), "NUMPYRO_PC_NO_COMPILATION_CACHE": "1"})[0] == "None"
    assert _probe({"NUMPYRO_PC_JAX_CACHE": "0"})[0] == "None"  # the streaming GP demo's spelling of "off"
    users = tmp_path / "users"  # a folder the user gave JAX is kept
    assert _probe({"NUMPYRO_PC_JAX_CACHE": str(own), "JAX_COMPILATION_CACHE_DIR": str(users)})[0] == str(users)
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")  # a folder that cannot be written: the import goes on without the cache
    assert _probe({"NUMPYRO_PC_JAX_CACHE": str(blocked / "jax")})[0] == "None"


@pytest.fixture
def restore_cache_setting():
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs", "jax_compilation_cache_max_size")
    saved = {name: getattr(jax.config, name) for name in names}
    yield
    for name, value in saved.items():
        jax.config.update(name, value)
    compilation_cache._jax_cache.reset_cache()


def test_enable_and_disable_in_a_running_process(tmp_path, restore_cache_setting):
    pc.disable_compilation_cache()
    assert pc.compilation_cache_dir() is None
    here = pc.enable_compilation_cache(tmp_path / "a", min_compile_seconds=0.0)
    assert here == str(tmp_path / "a") and pc.compilation_cache_dir() == here
    jax.jit(lambda x: x * 7.0 + 1.0)(jax.numpy.arange(3.0)).block_until_ready()
    assert os.listdir(here)  # written after the switch (JAX re-decided whether to use the cache)
    assert pc.enable_compilation_cache(tmp_path / "b") == here  # a folder in use is kept by default
    assert pc.enable_compilation_cache(tmp_path / "b", replace=True) == str(tmp_path / "b")
    with pytest.raises(InvalidOptionError, match="min_compile_seconds"):
        pc.enable_compilation_cache(tmp_path / "c", min_compile_seconds=-1.0, replace=True)
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    with pytest.raises(InvalidOptionError, match="cannot use"):
        pc.enable_compilation_cache(blocked / "inside", replace=True)


def test_programs_without_an_access_time_do_not_stop_the_bounded_cache(tmp_path):
    # A program written by an unbounded process has no "-atime" file; JAX's bounded cache reads every access time
    # before each write, so without healing every later write fails ("Error writing persistent compilation cache
    # entry ... FileNotFoundError") and nothing new is stored. The package gives such programs the oldest time.
    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / "jit_orphan-0123-cache").write_bytes(b"a program of an unbounded process")
    env = {k: v for k, v in os.environ.items()
           if k not in ("NUMPYRO_PC_NO_COMPILATION_CACHE", "JAX_COMPILATION_CACHE_DIR")}
    env["NUMPYRO_PC_JAX_CACHE"] = str(folder)
    done = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", _PROBE], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (folder / "jit_orphan-0123-atime").read_bytes() == (0).to_bytes(8, "little")
    written = [name for name in os.listdir(folder) if name.endswith("-cache") and "orphan" not in name]
    assert written  # the new program was stored
    assert compilation_cache.heal_access_times(str(folder)) == 0  # nothing left to heal
    # control: the same folder with the orphan's access time removed fails JAX's bounded write
    (folder / "jit_orphan-0123-atime").unlink()
    for name in written:
        (folder / name).unlink()
        (folder / name.replace("-cache", "-atime")).unlink(missing_ok=True)
    unhealed = textwrap.dedent("""
        import jax, jax.numpy as jnp, sys
        jax.config.update("jax_compilation_cache_dir", sys.argv[1])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_compilation_cache_max_size", 2**30)
        jax.jit(lambda x: jnp.sin(x) * 3.0)(jnp.arange(5.0)).block_until_ready()
    """)
    raw = {k: v for k, v in env.items() if k != "NUMPYRO_PC_JAX_CACHE"}
    done = subprocess.run([sys.executable, "-c", unhealed, str(folder)], env=raw, capture_output=True, text=True,
                          timeout=300)
    assert "FileNotFoundError" in done.stderr
