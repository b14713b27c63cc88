"""Binding a new batch to a fitted posterior's model: the same arguments, shapes and fixed values.

Used by updates and by diagnostics of new data. A batch shaped like the fitted data is bound
without re-tracing the model; anything else goes through
:func:`~numpyro_pc.model.likelihood.bind_model` and must match the fitted binding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.errors import DataShapeError, ModelMismatchError

from .data_support import as_data_array, check_support
from .likelihood import ModelData, bind_model, check_finite_argument, is_array
from .rows import to_device
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["bind_batch"]


def _shared_names(spec) -> tuple[Any, ...]:
    return tuple(n.split("[")[0] for n, k in zip(spec.arg_names, spec.kinds) if k == "shared")


def _bind_like_fitted(post, args, kwargs) -> ModelData | None:
    """The new batch's :class:`ModelData` without re-tracing the model, or ``None``.

    Applies when the arguments have the fitted data's structure: the same pytree, equal
    non-array arguments, per-example arrays with the fitted trailing shapes and dtypes and
    one common leading size, shared arrays equal to the fitted ones. Anything else goes
    through the full :func:`~numpyro_pc.model.likelihood.bind_model` (and its error messages).
    """
    leaves, treedef = jax.tree.flatten((tuple(args), dict(kwargs)))
    spec = post.spec
    if treedef != spec.treedef or len(leaves) != len(spec.kinds):
        return None
    statics, fitted = iter(spec.statics), post.data
    old_examples, old_shared = iter(fitted.per_example), iter(fitted.shared)
    per_example, shared, sizes = [], [], set()
    for name, leaf, kind in zip(spec.arg_names, leaves, spec.kinds):
        if kind == "static":
            if is_array(leaf) or not _same_static(leaf, next(statics)):
                return None
            continue
        if not is_array(leaf) and not np.isscalar(leaf):
            return None
        array = to_device(as_data_array(name, leaf))
        old = next(old_shared) if kind == "shared" else next(old_examples)
        if array.dtype != old.dtype or (kind == "example" and (array.ndim != old.ndim or array.ndim == 0
                                                                 or array.shape[1:] != old.shape[1:])):
            return None
        if kind == "shared":
            if array.shape != old.shape or not bool(jnp.all(array == old)):
                return None
            shared.append(old)
            continue
        check_finite_argument(name, array)
        sizes.add(int(array.shape[0]))
        per_example.append(array)
    if len(sizes) != 1 or 0 in sizes:
        return None
    return ModelData(tuple(per_example), tuple(shared))


def _check_fixed_arguments(spec, args, kwargs) -> None:
    """Refuse a batch whose non-array model arguments differ from the fitted ones.

    A posterior is the posterior of the model *with* its fixed arguments (a noise level, a
    prior scale, a number of categories); silently keeping the old values would answer
    another question than the one asked.
    """
    leaves, treedef = jax.tree.flatten((tuple(args), dict(kwargs)))
    if treedef != spec.treedef or len(leaves) != len(spec.kinds):
        return  # structural differences get bind_model's own messages
    statics = iter(spec.statics)
    for name, leaf, kind in zip(spec.arg_names, leaves, spec.kinds):
        if kind != "static":
            continue
        old = next(statics)
        if is_array(leaf) or not _same_static(leaf, old):
            raise ModelMismatchError(
                f"the fixed model argument {name!r} was {old!r} when the posterior was fitted and is {leaf!r} now; "
                "a posterior belongs to the model with its fixed arguments. Refit with the new value (pc.fit), or "
                "pass the fitted value.")


def _same_static(a, b) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except (TypeError, ValueError):
        return False


_KIND_WORDS = {"example": "a per-example array", "shared": "a shared array", "static": "a fixed value"}


def _argument_difference(fitted, new) -> str:
    """Which arguments a batch omits, adds or passes as another kind than the fitted data."""
    old = dict(zip(fitted.arg_names, fitted.kinds))
    now = dict(zip(new.arg_names, new.kinds))
    parts = [f"{what} " + ", ".join(f"{n!r} ({_KIND_WORDS.get(table[n], table[n])})" for n in names)
             for what, names, table in (
                 ("missing", [n for n in old if n not in now], old),
                 ("added", [n for n in now if n not in old], now),
                 ("fitted as another kind", [n for n in old if n in now and old[n] != now[n]], old))
             if names]
    return "; ".join(parts) if parts else (f"fitted as {list(old.items())}, passed as {list(now.items())}")


def bind_batch(post, args, kwargs) -> ModelData:
    """Bind a new batch to the posterior's model and check it is compatible.

    A batch shaped like the fitted data is bound without re-tracing the model (tracing on
    every batch cost ~0.4 s per update, mostly compiling for the new shapes); any other
    batch is inspected in full. Either way every observed value is checked against its
    distribution's support (:func:`~numpyro_pc.model.data_support.check_support`: one compiled
    program per power-of-two bucket of rows, shared with the check made at fitting).
    """
    data = _bind_like_fitted(post, args, kwargs)
    if data is not None:
        check_support(post.spec, data, "the new batch")
        return data
    _check_fixed_arguments(post.spec, args, kwargs)
    spec, data = bind_model(post.spec.model, args, kwargs, data_plate=post.spec.plate, shared=_shared_names(post.spec))
    if spec.latent.signature() != post.latent.signature() or spec.observed != post.spec.observed:
        def describe(s) -> dict[Any, tuple[Any, ...]]:
            return {n: tuple(shape) for n, shape in zip(s.latent.names, s.latent.unconstrained_shapes)}
        raise DataShapeError(
            "the new batch gives the model different latent or observed sites: latent (unconstrained shapes) "
            f"{describe(spec)} and observed {spec.observed} where the posterior has {describe(post.spec)} and "
            f"{post.spec.observed}; was another model called, or a per-example argument passed with other "
            "trailing dimensions?")
    if spec.kinds != post.spec.kinds or spec.treedef != post.spec.treedef:
        raise DataShapeError("the new batch passes the model's arguments differently from the fitted data: "
                             f"{_argument_difference(post.spec, spec)}. Pass the arguments the posterior was fitted "
                             "with (an omitted one takes the model's default, which is another model).")
    for old, new in zip(post.data.shared, data.shared):
        if old.shape != new.shape or not bool(jnp.all(old == new)):
            raise DataShapeError("a shared (not per-example) argument changed between batches")
    return data
