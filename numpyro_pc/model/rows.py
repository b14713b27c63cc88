"""Rows of the data plate: take and join examples, find examples by id, pad to buckets.

Generic bookkeeping shared by fitting, updates, deletion, merging and diagnostics, and
:class:`RowSelection`, rows gathered lazily on first use. Row
selections given as host (NumPy) arrays are applied on the host where the data live there
(:mod:`numpyro_pc.model.rowops`), so a stream of batches of changing sizes does not compile a
gather per size.
"""

from __future__ import annotations

import numpy as np

from numpyro_pc.errors import InvalidOptionError, UnknownExampleError

from .likelihood import ModelData
from .rowops import as_ids, bucket_size, filled, is_every_row, join_rows, pad_last_row, take_rows

__all__ = ["concat_data", "take_data", "positions", "pad_to_bucket"]


def concat_data(a, b):
    """Examples of ``a`` followed by those of ``b`` (shared arguments from ``a``)."""
    return ModelData(tuple(join_rows(x, y) for x, y in zip(a.per_example, b.per_example)), a.shared)


def take_data(data, rows):
    """The examples at ``rows``."""
    if is_every_row(rows, int(data.per_example[0].shape[0])):
        return data  # no copy
    return ModelData(tuple(take_rows(x, rows) for x in data.per_example), data.shared)


def positions(ids, wanted, what="example"):
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


def pad_to_bucket(data, weights, ids, dtype=None):
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


def memory_ids(memory, held, removed=()):
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
    def of(cls, current, rows):
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
