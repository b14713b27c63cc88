r"""Checks of the data against the model before it becomes sites.

A label outside its likelihood's support does not always show as an error: a Bernoulli
label of 50 gives a finite log-density (NumPyro evaluates ``y·logit − softplus(logit)``
for any ``y``), a Poisson count of 2.5 as well, and the fixed point of such a batch is
reached at a tiny residual — a posterior of data the model cannot have produced. So every
path that takes data checks each observed value with the observed distribution's own
support, on every row, in one compiled pass (:func:`check_support`), and refuses a
violation with a :class:`~numpyro_pc.errors.DataSupportError` that names the site, the
argument that holds the values, the first offending rows and values, and the support.

The support is evaluated at a fixed point of the latent space. A support that depends on
the latents (``Uniform(0, θ)`` observations) cannot be decided there and is left to the
likelihood; which supports are free of the latents is found once, when the model is bound
(:func:`latent_free_supports`), from the dependence graph of the compiled check.

:func:`as_data_array` turns what users pass as data (pandas objects, lists, anything with
``__array__``) into NumPy arrays when that is lossless, and refuses the rest by type.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.distributions import constraints
from numpyro.distributions.distribution import ExpandedDistribution, Independent, MaskedDistribution

from numpyro_pc.errors import DataSupportError, DataTypeError

from .rows import take_rows
from .terms import ModelData, ModelSpec, example_args, is_array, output_dependence, trace_at

__all__ = ["as_data_array", "latent_free_supports", "check_support", "support_table", "MAX_REPORTED_ROWS"]

MAX_REPORTED_ROWS = 5  # offending rows named in a message
_MIN_BUCKET = 64  # rows of the smallest compiled check; batches are padded to powers of two above it
_BLOCK = 1024  # rows checked per compiled pass


def as_data_array(name: str, leaf) -> object:
    """``leaf`` as an array when it is array-like data, unchanged otherwise.

    pandas ``Series``/``DataFrame`` and other objects with ``__array__`` are converted with
    :func:`numpy.asarray` when the result has a numeric or boolean dtype; a result of
    ``object`` or string dtype (mixed columns, text) is refused, since converting it would
    change the data.

    :param str name: the argument's name, for the message.
    :raises DataTypeError: array-like data that has no numeric or boolean dtype.
    """
    if isinstance(leaf, np.ndarray) and leaf.dtype == object:
        array = _from_objects(leaf)
    elif isinstance(leaf, (jax.Array, np.ndarray)):
        array = leaf
    elif hasattr(leaf, "__array__") and not isinstance(leaf, (str, bytes)):
        array = np.asarray(leaf)
    elif isinstance(leaf, (list, tuple)) or not is_array(leaf):
        return leaf
    else:
        array = leaf
    dtype = np.dtype(array.dtype) if not isinstance(array, jax.Array) else array.dtype
    if not (jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)):
        columns = getattr(leaf, "dtypes", None)
        found = f"dtypes {dict(columns.items())}" if hasattr(columns, "items") else f"dtype {dtype}"
        raise DataTypeError(f"argument {name!r} ({type(leaf).__name__}) has {found}; data arguments must be "
                            "numeric or boolean arrays (encode labels and categories as numbers first).")
    return array


def _from_objects(leaf: np.ndarray) -> np.ndarray:
    """An ``object`` array of numbers as the numeric array NumPy infers for them (unchanged otherwise,
    and then refused by type)."""
    try:
        converted = np.array(leaf.tolist())
    except (TypeError, ValueError):
        return leaf
    return converted if converted.shape == leaf.shape else leaf


def _support_ok(site) -> jax.Array:
    """Whether every value of an observed site lies in its distribution's support; entries
    masked out (``handlers.mask`` or ``Distribution.mask``, also under ``to_event`` or
    ``expand``) pass.

    The wrappers are unwrapped down to the distribution that holds the support, so that the
    test is elementwise over the masked dimensions. A mask covers the batch dimensions of its
    level; the dimensions reinterpreted as events by the wrappers below it follow them.
    """
    fn = site["fn"]
    levels = [(site.get("mask"), tuple(fn.batch_shape))]  # (mask, batch shape it covers) per level
    reinterpreted = [0]  # event dims reinterpreted below each level, filled in as the chain is walked
    while isinstance(fn, (MaskedDistribution, Independent, ExpandedDistribution)):
        if isinstance(fn, MaskedDistribution):
            levels.append((fn._mask, tuple(fn.batch_shape)))
            reinterpreted.append(0)
        elif isinstance(fn, Independent):
            reinterpreted = [r + fn.reinterpreted_batch_ndims for r in reinterpreted]
        fn = fn.base_dist
    ok = jnp.asarray(fn.support(site["value"]))
    for (mask, batch), below in zip(levels, reinterpreted):
        if mask is None or mask is True:
            continue
        mask = jnp.broadcast_to(jnp.asarray(mask), batch)
        mask = jnp.reshape(mask, batch + (1,) * below)
        ok = jnp.logical_or(ok, jnp.logical_not(jnp.broadcast_to(mask, ok.shape)))
    return jnp.all(ok)


def _checkable(site) -> bool:
    support = site["fn"].support
    return not constraints.is_dependent(support)


def _example_support(spec: ModelSpec, names: tuple, z, example, shared, discrete=None, local=None) -> tuple:
    trace = trace_at(spec, z, example_args(example), shared, discrete, local)
    return tuple(_support_ok(trace[name]) for name in names)


def latent_free_supports(spec: ModelSpec, data: ModelData, z0) -> tuple:
    """Names of the observed sites whose support can be checked without the latents.

    A site is left out when its support is NumPyro's ``dependent`` placeholder or when the
    test ``support(value)`` depends on ``z`` (found on the first example from the
    dependence graph of its jaxpr). A model that cannot run on one example gets no site
    here: :func:`~numpyro_pc.model.likelihood.verify_binding` then says why.
    """
    first = tuple(take_rows(x, 0) for x in data.per_example)
    try:
        trace = trace_at(spec, z0, example_args(first), data.shared)
    except Exception:  # noqa: BLE001 - a model that fails on one example is diagnosed by verify_binding
        return ()
    discrete = {n: trace[n]["value"] for n in spec.latent.discrete_names}
    free = []
    for name in spec.observed:
        if not _checkable(trace[name]):
            continue
        local = None if spec.local is None else jnp.zeros((spec.local.dim,), jnp.result_type(z0))
        try:  # every latent — continuous, discrete, local — is a jaxpr input: a support that reads one is left out
            jaxpr = jax.make_jaxpr(lambda z, d, u, name=name: _example_support(spec, (name,), z, first, data.shared, d,
                                                                               u))(z0, discrete, local)
        except Exception:  # noqa: BLE001 - a support test that cannot be traced is left to the likelihood
            continue
        if not any(output_dependence(jaxpr)):
            free.append(name)
    return tuple(free)


@partial(jax.jit, static_argnums=(0, 1))
def _support_rows(spec, names, z, per_example, shared) -> jax.Array:
    return jax.vmap(lambda ex: jnp.stack(_example_support(spec, names, z, ex, shared)))(per_example)


def _bucket(n: int) -> int:
    return max(_MIN_BUCKET, 1 << max(0, int(n) - 1).bit_length())


def support_table(spec: ModelSpec, names: tuple, data: ModelData) -> np.ndarray:
    """``(N, len(names))`` booleans: row ``i``'s values of each site lie in the site's support.

    Compiled passes over blocks of at most :data:`_BLOCK` rows, the last padded (by repeating its first
    row) to the block's size, a power of two, so that batches of other sizes reuse the program and no
    copy of all ``N`` rows is made (a dense ``N × d`` design: 1.3 GB at ``d = 20,000`` in float32).
    """
    n = int(data.per_example[0].shape[0])
    size = min(_bucket(n), _BLOCK)
    z = jnp.zeros(spec.latent.dim, jnp.result_type(float))
    tables = []
    for start in range(0, n, size):  # host-side blocks: one copy of `size` rows at a time, not of all N
        block = np.arange(start, min(start + size, n))
        pad = np.concatenate([block, np.full(size - block.size, start, np.int64)])
        rows = tuple(take_rows(x, pad) for x in data.per_example)
        table = _support_rows(_static_spec(spec, size), names, z, rows, tuple(data.shared))
        tables.append(np.asarray(table)[:block.size])
    return np.concatenate(tables, 0)


def _static_spec(spec: ModelSpec, size: int) -> ModelSpec:
    """The fields the check depends on (the parameter analysis that binding adds later does not
    change a trace), so that the check at binding and on every later batch share one program."""
    return replace(spec, num_examples=size, param_leaves=(), num_params=0, affine=False)


def check_support(spec: ModelSpec, data: ModelData, where: str = "the data") -> None:
    """Refuse data with observed values outside their distribution's support.

    Checks the sites in ``spec.support_sites`` (see :func:`latent_free_supports`) on
    every row of ``data``.

    :param str where: what the rows are, for the message (``"the new batch"``, a file).
    :raises DataSupportError: naming the site, the argument that holds its values, the first
        offending rows and values, and the support.
    """
    names = tuple(spec.support_sites)
    if not names or not data.per_example or int(data.per_example[0].shape[0]) == 0:
        return
    table = support_table(spec, names, data)
    if table.all():
        return
    column = int(np.argmin(table.all(0)))
    name = names[column]
    rows = np.flatnonzero(~table[:, column])
    z = jnp.zeros(spec.latent.dim, jnp.result_type(float))
    shown = []
    for row in rows[:MAX_REPORTED_ROWS]:
        example = tuple(take_rows(x, int(row)) for x in data.per_example)
        value = np.asarray(trace_at(spec, z, example_args(example), data.shared)[name]["value"])
        shown.append(f"row {int(row)}: {value.squeeze().tolist()}")
    example = tuple(take_rows(x, int(rows[0])) for x in data.per_example)
    site = trace_at(spec, z, example_args(example), data.shared)[name]
    holder = _holding_argument(spec, data, int(rows[0]), np.asarray(site["value"]))
    raise DataSupportError(
        f"the observed site {name!r}{holder} has {len(rows)} of {table.shape[0]} row(s) of {where} outside the "
        f"support of its distribution {type(site['fn']).__name__} ({site['fn'].support}); first: {'; '.join(shown)}. "
        "A likelihood evaluated outside its support is meaningless even where it is finite: correct or drop "
        "these rows, or use a distribution whose support holds them.")


def _holding_argument(spec: ModelSpec, data: ModelData, row: int, value: np.ndarray) -> str:
    """`` (argument 'y')`` for the per-example argument whose row ``row`` equals ``value``."""
    names = [n for n, k in zip(spec.arg_names, spec.kinds) if k == "example"]
    for name, leaf in zip(names, data.per_example):
        candidate = np.asarray(take_rows(leaf, row))
        if candidate.size == value.size and np.array_equal(candidate.ravel(), value.ravel()):
            return f" (argument {name!r})"
    return ""
