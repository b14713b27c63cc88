"""Row bookkeeping of per-example arrays outside compiled code: take, join, pad, buckets.

Streaming changes the number of examples at every update, so the arrays that hold sites
and data change shape every time. An eager ``jnp`` operation compiles one small XLA
program per distinct input shape (10–20 ms each); a small-batch update made about forty
of them (concatenations, gathers, ``jnp.full``) and spent most of its time compiling.

Arrays that live in host memory (NumPy arrays, JAX arrays on the CPU backend) are
therefore rearranged with NumPy — a memory copy, nothing compiled — and put back with
``jax.device_put`` (``jnp.asarray`` would compile a conversion per shape). Arrays on an
accelerator, tracers, and 64-bit arrays while 64-bit mode is off (``device_put`` would
narrow them) take the ``jnp`` path, whose compilations are cached per shape as before.
The compiled site and solver computations do not see these shapes: they run on
bucket-padded inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.errors import InvalidIdsError

__all__ = ["all_finite", "bucket_size", "on_host", "to_device", "take_rows", "join_rows", "pad_last_row", "shifted", "filled",
           "is_every_row"]


def on_host(x):
    """Whether ``x`` is in host memory (a NumPy array or a JAX array on the CPU backend)."""
    if isinstance(x, np.ndarray):
        return True
    if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
        return False
    return x.is_fully_addressable and all(device.platform == "cpu" for device in x.devices())


def _representable(dtype):
    return jax.dtypes.canonicalize_dtype(dtype) == np.dtype(dtype)


def _host_path(*arrays):
    return all(on_host(a) for a in arrays) and all(_representable(a.dtype) for a in arrays)


def to_device(x):
    """``jnp.asarray(x)`` for host data, without compiling a conversion for each new shape."""
    if isinstance(x, jax.Array):
        return x
    host = np.asarray(x)
    if _representable(host.dtype):
        return jax.device_put(host)
    return jnp.asarray(host)


def all_finite(x):
    """Whether every value of ``x`` is finite, checked with NumPy for host data (nothing compiled)."""
    if on_host(x) or not isinstance(x, jax.Array):
        return bool(np.all(np.isfinite(np.asarray(x))))
    return bool(jnp.all(jnp.isfinite(x)))


def take_rows(x, rows):
    """``x[rows]`` along the first axis (``None`` stays ``None``)."""
    if x is None:
        return None
    if _host_path(x) and not isinstance(rows, jax.core.Tracer) and (not isinstance(rows, jax.Array) or on_host(rows)):
        return jax.device_put(np.take(np.asarray(x), np.asarray(rows, np.int64), axis=0))
    return x[jnp.asarray(rows, jnp.int32)]


def join_rows(*arrays):
    """Concatenation along the first axis (``None`` if the first array is ``None``)."""
    if arrays[0] is None:
        return None
    if _host_path(*arrays):
        return jax.device_put(np.concatenate([np.asarray(a) for a in arrays], 0))
    return jnp.concatenate(arrays, 0)


def pad_last_row(x, pad):
    """``x`` followed by ``pad`` copies of its last row."""
    if pad == 0:
        return x
    if _host_path(x):
        host = np.asarray(x)
        return jax.device_put(np.concatenate([host, np.repeat(host[-1:], pad, 0)], 0))
    return jnp.concatenate([x, jnp.repeat(x[-1:], pad, 0)], 0)


def shifted(x, by):
    """``x + by`` for an integer array (row numbers moved past ``by`` earlier rows)."""
    if _host_path(x):
        return jax.device_put(np.asarray(x) + np.asarray(by, np.asarray(x).dtype))
    return x + by


def filled(parts, dtype):
    """A vector made of ``(count, value)`` runs, e.g. ``[(3, 1.0), (2, 0.0)]`` → ``[1, 1, 1, 0, 0]``."""
    if _representable(dtype) and jax.default_backend() == "cpu":
        return jax.device_put(np.concatenate([np.full(int(n), v, dtype) for n, v in parts] or [np.zeros(0, dtype)]))
    return jnp.concatenate([jnp.full(int(n), v, dtype) for n, v in parts])


def bucket_size(num, smallest=8, fine_from=2048):
    """The size a set of ``num`` examples is padded to, so that varying sizes reuse a few compilations.

    Up to ``fine_from`` examples: the next power of two (≥ ``smallest``). Beyond it a
    compilation costs less than the padded work it would save, so the buckets are the next
    ``m·2^k`` with ``m ∈ {4, 5, 6, 7}`` — four sizes per octave, at most 25 % padding (a
    stream whose corrected set grows by 10 % per batch pads by ~7 % on average instead of
    ~30 %).
    """
    num = max(int(num), 1)
    if num <= fine_from:
        return int(max(smallest, 2 ** int(np.ceil(np.log2(num)))))
    octave = 2 ** int(np.floor(np.log2(num)))
    return int(next(m * octave // 4 for m in (4, 5, 6, 7, 8) if m * octave // 4 >= num))


def as_ids(ids):
    """Unique example ids as int64; anything that is not an integer array is refused, never rounded."""
    raw = np.asarray(ids)
    if raw.size == 0:
        return np.zeros(0, np.int64)
    if raw.dtype == np.bool_ or not np.issubdtype(raw.dtype, np.integer):
        raise InvalidIdsError(f"example ids must be integers; got {raw.ravel()[:5].tolist()} (dtype {raw.dtype}). "
                              "Ids are never rounded; for a boolean mask pass np.flatnonzero(mask).")
    return np.unique(raw.astype(np.int64).ravel())


def is_every_row(rows, num):
    """Whether host-side ``rows`` select all ``num`` rows in order (a take that need not copy)."""
    return isinstance(rows, np.ndarray) and rows.size == num and np.array_equal(rows, np.arange(num))
