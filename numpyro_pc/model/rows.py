"""Rows of the data plate: per-example arrays and the model's examples, taken, joined, padded, found by id.

**Arrays** (:func:`take_rows`, :func:`join_rows`, :func:`pad_last_row`, :func:`bucket_size`, …): streaming
changes the number of examples at every update, so the arrays that hold sites and data change shape every
time. An eager ``jnp`` operation compiles one small XLA program per distinct input shape (10–20 ms each); a
small-batch update made about forty of them (concatenations, gathers, ``jnp.full``) and spent most of its
time compiling. Arrays that live in host memory (NumPy arrays, JAX arrays on the CPU backend) are therefore
rearranged with NumPy — a memory copy, nothing compiled — and put back with ``jax.device_put``
(``jnp.asarray`` would compile a conversion per shape). Arrays on an accelerator, tracers, and 64-bit arrays
while 64-bit mode is off (``device_put`` would narrow them) take the ``jnp`` path, whose compilations are
cached per shape as before. The compiled site and solver computations do not see these shapes: they run on
bucket-padded inputs.

**Examples** (:func:`take_data`, :func:`concat_data`, :func:`positions`, :func:`pad_to_bucket`,
:class:`RowSelection`): the same bookkeeping over a model's :class:`~numpyro_pc.model.likelihood.ModelData`,
shared by fitting, updates, deletion, merging and diagnostics; :class:`RowSelection` gathers rows lazily on
first use.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.errors import InvalidIdsError, InvalidOptionError, UnknownExampleError

from .terms import ModelData
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["all_finite", "row_sum", "bucket_size", "on_host", "to_device", "take_rows", "join_rows", "pad_last_row", "shifted",
           "filled", "is_every_row", "concat_data", "take_data", "positions", "pad_to_bucket", "stand_in_row", "check_keep",
           "retain"]


# --------------------------------------------------------------------------- arrays

def on_host(x) -> bool:
    """Whether ``x`` is in host memory (a NumPy array or a JAX array on the CPU backend)."""
    if isinstance(x, np.ndarray):
        return True
    if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
        return False
    return x.is_fully_addressable and all(device.platform == "cpu" for device in x.devices())


def _representable(dtype) -> bool:
    return jax.dtypes.canonicalize_dtype(dtype) == np.dtype(dtype)


def _host_path(*arrays) -> bool:
    return all(on_host(a) for a in arrays) and all(_representable(a.dtype) for a in arrays)


def to_device(x) -> jax.Array:
    """``jnp.asarray(x)`` for host data, without compiling a conversion for each new shape."""
    if isinstance(x, jax.Array):
        return x
    host = np.asarray(x)
    if _representable(host.dtype):
        return jax.device_put(host)
    return jnp.asarray(host)


def row_sum(x) -> jax.Array:
    """The sum over the rows of ``x`` (axis 0), with NumPy for host data (nothing compiled for a new
    number of rows), else with ``jnp``."""
    if _host_path(x):
        return jax.device_put(np.sum(np.asarray(x), 0))
    return jnp.sum(x, 0)


def all_finite(x) -> bool:
    """Whether every value of ``x`` is finite, checked with NumPy for host data (nothing compiled)."""
    if on_host(x) or not isinstance(x, jax.Array):
        return bool(np.all(np.isfinite(np.asarray(x))))
    return bool(jnp.all(jnp.isfinite(x)))


def take_rows(x, rows) -> Any:
    """``x[rows]`` along the first axis (``None`` stays ``None``)."""
    if x is None:
        return None
    if _host_path(x) and not isinstance(rows, jax.core.Tracer) and (not isinstance(rows, jax.Array) or on_host(rows)):
        return jax.device_put(np.take(np.asarray(x), np.asarray(rows, np.int64), axis=0))
    return x[jnp.asarray(rows, jnp.int32)]


def join_rows(*arrays) -> jax.Array | None:
    """Concatenation along the first axis (``None`` if the first array is ``None``)."""
    if arrays[0] is None:
        return None
    if _host_path(*arrays):
        return jax.device_put(np.concatenate([np.asarray(a) for a in arrays], 0))
    return jnp.concatenate(arrays, 0)


def pad_last_row(x, pad) -> jax.Array:
    """``x`` followed by ``pad`` copies of its last row."""
    if pad == 0:
        return x
    if _host_path(x):
        host = np.asarray(x)
        return jax.device_put(np.concatenate([host, np.repeat(host[-1:], pad, 0)], 0))
    return jnp.concatenate([x, jnp.repeat(x[-1:], pad, 0)], 0)


def shifted(x, by) -> jax.Array:
    """``x + by`` for an integer array (row numbers moved past ``by`` earlier rows)."""
    if _host_path(x):
        return jax.device_put(np.asarray(x) + np.asarray(by, np.asarray(x).dtype))
    return x + by


def filled(parts, dtype) -> jax.Array:
    """A vector made of ``(count, value)`` runs, e.g. ``[(3, 1.0), (2, 0.0)]`` → ``[1, 1, 1, 0, 0]``."""
    if _representable(dtype) and jax.default_backend() == "cpu":
        return jax.device_put(np.concatenate([np.full(int(n), v, dtype) for n, v in parts] or [np.zeros(0, dtype)]))
    return jnp.concatenate([jnp.full(int(n), v, dtype) for n, v in parts])


def bucket_size(num, smallest=8, fine_from=2048) -> int:
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


def materialise_ids(ids: Any) -> Any:
    """Sets, dict views, iterators and other iterables as a list (NumPy would read them as one object);
    arrays, lists, tuples, strings and scalars unchanged. An iterator is consumed: call this once."""
    if isinstance(ids, (str, bytes, list, tuple)) or hasattr(ids, "__array__") or not isinstance(ids, Iterable):
        return ids
    return list(ids)


def as_ids(ids) -> np.ndarray:
    """Unique example ids as int64 from an integer, an integer array or any iterable of integers (a
    sequence, a set, a dict view, an iterator: see :func:`materialise_ids`); anything that is not integers
    is refused, never rounded."""
    raw = np.asarray(materialise_ids(ids))
    if raw.size == 0:
        return np.zeros(0, np.int64)
    if raw.dtype == np.bool_ or not np.issubdtype(raw.dtype, np.integer):
        raise InvalidIdsError(f"example ids must be integers; got {raw.ravel()[:5].tolist()} (dtype {raw.dtype}). "
                              "Ids are never rounded; for a boolean mask pass np.flatnonzero(mask).")
    return np.unique(raw.astype(np.int64).ravel())


def is_every_row(rows, num) -> bool:
    """Whether host-side ``rows`` select all ``num`` rows in order (a take that need not copy)."""
    return isinstance(rows, np.ndarray) and rows.size == num and np.array_equal(rows, np.arange(num))


# --------------------------------------------------------------------------- examples of the model's data

def concat_data(a, b) -> ModelData:
    """Examples of ``a`` followed by those of ``b`` (shared arguments from ``a``)."""
    return ModelData(tuple(join_rows(x, y) for x, y in zip(a.per_example, b.per_example)), a.shared)


def take_data(data, rows) -> ModelData:
    """The examples at ``rows``."""
    if is_every_row(rows, int(data.per_example[0].shape[0])):
        return data  # no copy
    return ModelData(tuple(take_rows(x, rows) for x in data.per_example), data.shared)


def positions(ids, wanted, what="example") -> np.ndarray:
    """Row of each id of ``wanted`` inside ``ids`` (raises :class:`UnknownExampleError`).

    Vectorised: a binary search in ``ids`` (sorted once with ``argsort`` unless already
    increasing, which is the usual case since ids are handed out in order).
    """
    ids = np.asarray(ids, dtype=np.int64).ravel()
    wanted = np.asarray(wanted, dtype=np.int64).ravel()
    increasing = ids.size < 2 or bool(np.all(ids[1:] > ids[:-1]))
    order = None if increasing else np.argsort(ids, kind="stable")
    ordered = ids if order is None else ids[order]
    slot = np.minimum(np.searchsorted(ordered, wanted), max(ids.size - 1, 0))
    found = (ordered[slot] == wanted) if ids.size else np.zeros(wanted.shape, bool)
    if not np.all(found):
        missing = wanted[~found].tolist()
        raise UnknownExampleError(f"no {what} with id(s) {missing[:10]}{' …' if len(missing) > 10 else ''}")
    return (slot if order is None else order[slot]).astype(np.int64)


def stand_in_row(data) -> ModelData:
    """One row of zeros shaped like ``data``'s examples: the site machinery traces the model on a row,
    so a problem with no example left (every row dropped or deleted) is solved on this one at weight 0,
    which leaves the prior term and the fixed sites alone."""
    return ModelData(tuple(jnp.zeros((1, *x.shape[1:]), x.dtype) for x in data.per_example), data.shared)


def pad_to_bucket(data, weights, ids, dtype=None) -> tuple[ModelData, jax.Array, np.ndarray]:
    """Pad examples to :func:`bucket_size` by repeating the last one with weight 0 and id −1.

    Batches of varying size then reuse a few compiled site computations instead of
    recompiling for every size. ``weights=None`` gives every example weight 1 (in
    ``dtype``); an empty set is returned unpadded.
    """
    num = int(np.asarray(ids).size)
    if num == 0:
        return data, weights, np.asarray(ids)
    if weights is None:
        weights = filled([(num, 1.0)], dtype)
    pad = bucket_size(num) - num
    if pad == 0:
        return data, weights, np.asarray(ids)
    per_example = tuple(pad_last_row(x, pad) for x in data.per_example)
    weights = join_rows(weights, filled([(pad, 0.0)], weights.dtype))
    return ModelData(per_example, data.shared), weights, np.concatenate([np.asarray(ids), -np.ones(pad, np.int64)])


def check_keep(keep) -> None:
    """Refuse a data-retention option that is not ``"all"``, ``"none"`` or a reservoir size (an integer ≥ 0).

    :raises InvalidOptionError:
    """
    if isinstance(keep, str) and keep in ("all", "none"):
        return
    if isinstance(keep, (int, np.integer)) and not isinstance(keep, (bool, np.bool_)) and keep >= 0:
        return
    raise InvalidOptionError(f"keep must be 'all', 'none' or a reservoir size (an integer ≥ 0), got {keep!r}")


def retain(data, data_ids, new_data, new_ids, keep, seen, seed) -> tuple[ModelData, np.ndarray]:
    """The examples whose data an update keeps, and their ids (sorted as held, new ones last).

    :param data: the retained examples before the update, with ids ``data_ids``.
    :param new_data: the batch, with ids ``new_ids``.
    :param keep: ``"all"`` (every example), ``"none"`` (no data: every site is frozen) or a reservoir
        size: a uniform sample of that many examples over the whole stream (algorithm R), of which
        ``seen`` came before this batch.
    :param int seed: the reservoir's seed.
    """
    check_keep(keep)
    old_ids = np.asarray(data_ids, np.int64)
    new_ids = np.asarray(new_ids, np.int64)
    if isinstance(keep, str) and keep == "all":
        return concat_data(data, new_data), np.concatenate([old_ids, new_ids])
    if isinstance(keep, str):  # "none"
        return take_data(data, np.zeros(0, np.int64)), np.zeros(0, np.int64)
    kept = _reservoir(old_ids, new_ids, int(keep), seen, seed)
    rows = positions(np.concatenate([old_ids, new_ids]), kept)
    return take_data(concat_data(data, new_data), rows), kept


def _reservoir(ids_old, ids_new, size, seen_before, seed) -> np.ndarray:
    """Reservoir sampling (algorithm R) of ``size`` ids over the whole stream."""
    rng = np.random.default_rng(seed)
    old = np.asarray(ids_old)
    # a reservoir that shrinks (its first use, or a smaller size) keeps a uniform subset of what it held
    kept = list(old if old.size <= size else np.sort(rng.choice(old, size, replace=False)))
    for k, new in enumerate(np.asarray(ids_new)):
        seen = seen_before + k + 1
        if len(kept) < size:
            kept.append(int(new))
        else:
            slot = rng.integers(0, seen)
            if slot < size:
                kept[slot] = int(new)
    return np.asarray(sorted(kept), dtype=np.int64)


def memory_ids(memory, held, removed=()) -> np.ndarray:
    """The example ids a correction covers: ``"all"`` held ids, ``"none"``, or the given ids,
    less ``removed``.

    :raises InvalidOptionError: another string.
    """
    if isinstance(memory, str):
        if memory not in ("all", "none"):
            raise InvalidOptionError(f"memory must be 'all', 'none' or a list of ids, got {memory!r}")
        ids = np.asarray(held) if memory == "all" else np.asarray(held)[:0]
    else:
        ids = as_ids(memory)
    return np.setdiff1d(ids, np.asarray(removed, dtype=np.int64))


class RowSelection:
    """Rows ``rows`` of ``source`` (:class:`~numpyro_pc.sites.gaussian.Sites` or
    :class:`~numpyro_pc.model.likelihood.ModelData`), gathered on first use.

    Deleting examples by site removal touches only the removed sites; copying the
    remaining ``N`` sites and data rows is deferred until something reads them, and
    consecutive deletions compose their row lists instead of copying every time.
    """

    __slots__ = ("source", "rows", "_value")

    def __init__(self, source, rows):
        self.source, self.rows, self._value = source, np.asarray(rows, dtype=np.int64), None

    @classmethod
    def of(cls, current, rows) -> RowSelection:
        """``rows`` of ``current`` (a value or a selection; selections compose)."""
        if isinstance(current, RowSelection):
            return cls(current.source, current.rows[np.asarray(rows, dtype=np.int64)])
        return cls(current, rows)

    def value(self):
        if self._value is None:
            if hasattr(self.source, "take"):
                self._value = self.source.take(self.rows)
            else:

                self._value = take_data(self.source, self.rows)
        return self._value
