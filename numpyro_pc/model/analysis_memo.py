"""A memo of the binding's structural analyses, so that binding the same model again costs no retrace.

Two analyses of :func:`~numpyro_pc.model.likelihood.bind_model` read the model's jaxpr, not the data
values: which observed sites' supports can be checked without the latents
(:func:`~numpyro_pc.model.data_support.latent_free_supports`) and which distribution parameters
depend on the latents (the ``param_leaves`` masks). They trace the model several times (≈ 20 ms on a
small model, half of a warm exponential-family fit). They are kept per process, keyed by what decides
them: the binding without its size (the model, its latent space, argument structure and fixed
arguments, on which a model may branch in Python) and the shape and dtype of every array argument.
Array values cannot change a jaxpr's dependence structure: the package traces every array argument
(a model branching in Python on one fails to bind). A binding that does not hash (an unhashable fixed
argument) is analysed every time. Everything that reads data values — the support and identity
checks, the affine probe — still runs on every call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np

__all__ = ["structural_key", "memoised", "clear"]

_T = TypeVar("_T")
_CAPACITY = 64
_MEMO: OrderedDict[tuple, Any] = OrderedDict()


def structural_key(spec, data) -> tuple | None:
    """The key of ``spec``'s structural analyses on ``data``, or ``None`` when the binding does not hash."""
    sized = replace(spec, num_examples=0, support_sites=(), param_leaves=())
    try:
        hash(sized)
    except TypeError:
        return None
    rows = tuple((tuple(np.shape(x)[1:]), str(x.dtype)) for x in data.per_example)
    shared = tuple((tuple(np.shape(x)), str(x.dtype)) for x in data.shared)
    return sized, rows, shared


def memoised(kind: str, key: tuple | None, compute: Callable[[], _T]) -> _T:
    """``compute()``, or the value it gave for ``(kind, key)`` before (``key=None``: always computed)."""
    if key is None:
        return compute()
    entry = (kind, key)
    if entry in _MEMO:
        _MEMO.move_to_end(entry)
        return _MEMO[entry]
    value = compute()
    _MEMO[entry] = value
    while len(_MEMO) > _CAPACITY:
        _MEMO.popitem(last=False)
    return value


def clear() -> None:
    """Forget every memoised analysis."""
    _MEMO.clear()
