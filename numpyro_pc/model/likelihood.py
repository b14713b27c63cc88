r"""Binding a NumPyro model to its data: ``bind_model`` and the checks of the binding.

:func:`bind_model` inspects a model with its arguments, finds the data plate, decides
which arguments are per-example, builds the latent space and returns a static
:class:`~numpyro_pc.model.terms.ModelSpec` with a :class:`~numpyro_pc.model.terms.ModelData`
pytree; :func:`verify_binding` checks at probe points that the per-example losses add up to
the model's log density (docs/models.md, "What binding checks"). The losses themselves —
``ℓ_0(z)``, ``ℓ_i(z)`` — are in :mod:`numpyro_pc.model.terms` and re-exported here.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from numpyro import handlers

from numpyro_pc.errors import (
    DataShapeError,
    DataTypeError,
    ModelBindingError,
    NonFiniteDataError,
    UnsupportedModelError,
)
from numpyro_pc.options import check_name, check_names

from . import probes
from .analysis_memo import memoised, structural_key
from .data_support import as_data_array, check_support, latent_free_supports
from .latent import LatentSpace
from .local_binding import bind_locals, check_local_modes, split_local_latents
from .locals import stack_rows
from .rows import all_finite, take_rows, to_device
from .terms import (  # noqa: F401  (re-exported: the package imports them from here)
    IMPLICIT_PLATE,
    LOG_DET_PREFIX,
    ModelData,
    ModelSpec,
    constrain,
    example_args,
    example_joint_loss,
    example_loss,
    example_params,
    example_site_log_likelihoods,
    in_plate,
    is_array,
    losses,
    output_dependence,
    prior_loss,
    trace_at,
)
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["IMPLICIT_PLATE", "ModelSpec", "ModelData", "bind_model", "verify_binding", "prior_loss", "example_loss", "example_params",
           "example_site_log_likelihoods", "losses", "constrain", "is_array", "check_finite_argument"]

# --------------------------------------------------------------------------- binding


def _describe_leading_sizes(names, leaves) -> str:
    return ", ".join(f"{n}: {tuple(np.shape(x))}" for n, x in zip(names, leaves) if is_array(x))


def check_finite_argument(name, leaf) -> None:
    """Raise :class:`NonFiniteDataError` if a floating array argument holds NaN or infinite values."""
    if is_array(leaf) and jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
        if not all_finite(leaf):
            bad = int(np.sum(~np.isfinite(np.asarray(leaf))))
            raise NonFiniteDataError(f"argument {name!r} contains {bad} NaN or infinite value(s); "
                                     "clean or mask the data before fitting.")


def bind_model(model, args=(), kwargs=None, data_plate=None, shared=(), allow_discrete=False) -> tuple[Any, ModelData]:
    """Inspect a model with its data and return ``(spec, data)``.

    **Models without a plate.** When no observed site lies inside a plate, the rows are an
    *implicit* data plate (named :data:`~numpyro_pc.model.terms.IMPLICIT_PLATE`) if every
    observed site's log-density has a leading batch dimension, these dimensions agree,
    and they equal the common leading length ``N`` of the array arguments not named in
    ``shared``. ``ℓ_i`` is then the log-density of row ``i`` summed over any trailing
    dimensions, exactly as under ``numpyro.plate(…, N)``; every observed site belongs to
    ``ℓ_i`` and none to ``ℓ_0``. A scalar observation (or rows folded into one event by
    ``to_event``), disagreeing leading dimensions, a leading dimension that is no
    argument's length, or arguments of different lengths are refused as ambiguous.

    No plate handler is put around the model: a plate would broadcast every site inside
    it, latents included, and so change the model. None is needed, because each example is
    evaluated by running the model on its row's slice of the per-example arguments
    (:mod:`numpyro_pc.model.terms`), where the observed sites have one row and their
    summed log-density is ``ℓ_i``; the implicit plate only decides which observed sites
    make up ``ℓ_i``, and :func:`verify_binding` checks the result as for any plate.

    :param callable model: a NumPyro model with global latent sites and a plate over the
        data, or observed sites vectorised over the rows (see above).
    :param tuple args: positional arguments of the model (the data).
    :param dict kwargs: keyword arguments of the model.
    :param str data_plate: name of the data plate when several plates hold all
        observed sites; by default the unique such plate (or the implicit one).
    :param tuple shared: names of array arguments that are *not* per-example (e.g. a
        vector of prior scales); every other array argument with at least one axis must
        have the data plate's size as its leading dimension.
    :param bool allow_discrete: accept global discrete latents (kept in
        ``spec.latent.discrete_names``, outside ``z``) for exponential-family posteriors.
    :raises NonFiniteDataError: NaN or infinite values in a float argument.
    :raises DataShapeError: an argument's leading size disagrees with the data plate.
    :raises UnsupportedModelError: no data plate (and no implicit one), ambiguous plates,
        subsampled plates, discrete latents (local ones, or global ones beside local latents),
        a model whose every latent is local.

    **Local latents.** Continuous latent sites inside the data plate are *local*: the unit
    of the plate is the example, and its loss integrates the unit's local latents by
    Laplace's method given the global ones (:mod:`numpyro_pc.model.locals`); ``spec.latent``
    then holds the global sites and ``spec.local`` the local ones.
    """
    data_plate = check_name(data_plate, "data_plate")
    shared = check_names(shared, "shared")
    kwargs = dict(kwargs or {})
    try:
        bound = inspect.signature(model).bind(*args, **kwargs)
        names_by_position = list(bound.arguments)
    except (TypeError, ValueError):
        names_by_position = [f"args[{i}]" for i in range(len(args))] + list(kwargs)
    leaves, treedef = jax.tree.flatten((tuple(args), kwargs))
    leaf_names = _leaf_names(args, kwargs, names_by_position)
    leaves = [as_data_array(name, leaf) for name, leaf in zip(leaf_names, leaves)]
    args, kwargs = jax.tree.unflatten(treedef, leaves)

    for name, leaf in zip(leaf_names, leaves):
        check_finite_argument(name, leaf)
        if is_array(leaf) and np.ndim(leaf) >= 1 and np.shape(leaf)[0] == 0:
            raise DataShapeError(f"argument {name!r} is empty (shape {tuple(np.shape(leaf))}); a batch needs at "
                                 "least one example.")
    try:
        with handlers.block():
            trace = handlers.trace(handlers.substitute(handlers.seed(model, 0), substitute_fn=probes.prototype_value)
                                   ).get_trace(*args, **kwargs)
    except Exception as err:  # the user's model failed on these arguments: say so with their shapes
        text = f"{type(err).__name__}: {err}"
        shapes = _describe_leading_sizes(leaf_names, leaves)
        if any(w in text.lower() for w in ("shape", "broadcast", "incompatible", "index", "dimension", "axis")):
            raise DataShapeError(
                f"the model failed on the given data with a shape error ({text}); argument shapes: {shapes}. "
                "Every per-example argument must have the data plate's size as its leading dimension (a single "
                "example is a batch of one: pass x[None] rather than a 1-D row)."
            ) from err
        raise ModelBindingError(f"the model raised {text} when called with the given arguments (shapes: "
                                f"{shapes}).") from err

    latent = LatentSpace.from_trace(trace, allow_discrete)  # first: a discrete "latent" is often a forgotten observation
    plate, size, observed = _find_data_plate(trace, data_plate, leaf_names, leaves, shared)
    _check_rows_observed(trace, plate, size, observed, leaves)
    local_names = split_local_latents(trace, plate, latent)
    global_latent = latent.select([n for n in latent.names if n not in local_names]) if local_names else latent

    kinds, statics = [], []
    for name, leaf in zip(leaf_names, leaves):
        base = _base_name(name)
        if not is_array(leaf):
            kinds.append("static")
            statics.append(leaf)
        elif np.ndim(leaf) == 0 or base in shared:
            kinds.append("shared")
        elif np.shape(leaf)[0] == size:
            kinds.append("example")
        else:
            raise DataShapeError(
                f"argument {name!r} has leading size {np.shape(leaf)[0]} but the data plate {plate!r} has "
                f"size {size}; per-example arguments need the plate size as leading dimension (pass "
                f"shared=({base!r},) if this argument is not per-example)."
            )
    if "example" not in kinds:
        raise UnsupportedModelError("no argument of the model has the data plate's size as leading dimension; "
                                    "pass the data to the model as arguments.")
    spec = ModelSpec(model=model, latent=global_latent, plate=plate, num_examples=int(size), treedef=treedef,
                     kinds=tuple(kinds), statics=tuple(statics), observed=observed,
                     arg_names=tuple(leaf_names))
    data = ModelData(
        per_example=tuple(to_device(leaf) for leaf, k in zip(leaves, kinds) if k == "example"),
        shared=tuple(to_device(leaf) for leaf, k in zip(leaves, kinds) if k == "shared"),
    )
    if local_names:
        spec = bind_locals(spec, data, local_names)
    z0 = global_latent.unconstrain({n: trace[n]["value"] for n in global_latent.names})
    key = structural_key(spec, data)
    spec = replace(spec, support_sites=memoised("supports", key, lambda: latent_free_supports(spec, data, z0)))
    check_support(spec, data)  # first: a label outside the support can also break the binding's identity check
    verify_binding(spec, data, z0)
    return _analyse_params(spec, data, z0, key), data


def _check_rows_observed(trace, plate, size, observed, leaves) -> None:
    """Refuse an argument given as an observation that is broadcast along the data plate.

    ``fit(model, X, np.array(1.0))`` passes one label, which NumPyro broadcasts to every row:
    the model is then fitted to ``N`` copies of it, which is never what was meant. Only values
    passed in as arguments are refused; a constant written in the model (the "zeros trick",
    ``obs=0.0``) is the model's own. An observation given as a Python list is refused by type.
    """
    for name in observed:
        site = trace[name]
        value = site["value"]
        if isinstance(value, (list, tuple)):
            raise DataTypeError(f"the observed site {name!r} was given a {type(value).__name__}; observed values "
                                "must be arrays (e.g. np.asarray(y)).")
        if size <= 1 or not any(value is leaf for leaf in leaves):
            continue
        full = tuple(site["fn"].batch_shape) + tuple(site["fn"].event_shape)
        frame = next((f for f in site["cond_indep_stack"] if f.name == plate), None)
        position = 0 if frame is None else len(site["fn"].batch_shape) + frame.dim
        shape = tuple(np.shape(value))
        padded = (1,) * (len(full) - len(shape)) + shape
        if 0 <= position < len(padded) and padded[position] == 1 and full[position] == size:
            raise DataShapeError(
                f"the observed site {name!r} has a value of shape {shape} while its distribution has shape {full} "
                f"with the data plate {plate!r} (size {size}) at axis {position}: one observation would be "
                f"broadcast to every row. Pass one value per row (e.g. y of shape ({size},)).")


def _leaf_names(args, kwargs, names_by_position) -> list[Any]:
    names: list[Any] = []
    for i, a in enumerate(args):
        base = names_by_position[i] if i < len(names_by_position) else f"args[{i}]"
        sub = jax.tree.leaves(a)
        names.extend([base] if len(sub) == 1 else [f"{base}[{j}]" for j in range(len(sub))])
    for key in sorted(kwargs):  # jax flattens dicts in sorted key order
        sub = jax.tree.leaves(kwargs[key])
        names.extend([key] if len(sub) == 1 else [f"{key}[{j}]" for j in range(len(sub))])
    return names


def _find_data_plate(trace, data_plate, leaf_names, leaves, shared):
    """The data plate's name, its size and the observed sites it holds (``ℓ_i``'s sites)."""
    observed = [s for s in trace.values() if s["type"] == "sample" and s["is_observed"]]
    in_plates = [s for s in observed if s["cond_indep_stack"]]
    if not in_plates:
        if data_plate not in (None, IMPLICIT_PLATE):
            raise UnsupportedModelError(f"data_plate={data_plate!r} is not a plate of any observed site; no "
                                        "observed site of the model lies inside a plate.")
        size = _implicit_rows(observed, leaf_names, leaves, shared)
        return IMPLICIT_PLATE, size, tuple(s["name"] for s in observed)
    common = None
    for s in in_plates:
        names = {f.name for f in s["cond_indep_stack"]}
        common = names if common is None else common & names
    frames = {f.name: f for s in in_plates for f in s["cond_indep_stack"]}
    if data_plate is not None:
        if data_plate not in frames:
            raise UnsupportedModelError(f"data_plate={data_plate!r} is not a plate of any observed site; "
                                        f"plates found: {sorted(frames)}")
        plate = data_plate
    elif len(common) == 1:
        plate = next(iter(common))
    elif not common:
        raise UnsupportedModelError(
            f"the observed sites do not share a plate (plates found: {sorted(frames)}); put every "
            "per-example observation inside one data plate."
        )
    else:
        raise UnsupportedModelError(f"several plates hold every observed site ({sorted(common)}); "
                                    "pass data_plate= to say which one indexes the examples.")
    plate_site = trace.get(plate)
    if plate_site is not None and plate_site["type"] == "plate":
        full, sub = plate_site["args"][0], plate_site["args"][1]
        if sub is not None and sub != full:
            raise UnsupportedModelError(f"plate {plate!r} is subsampled ({sub} of {full}); bind the full data "
                                        "without subsample_size.")
    names = tuple(s["name"] for s in observed if in_plate(s, plate))
    return plate, frames[plate].size, names


def _base_name(leaf_name) -> str:
    """The argument a leaf belongs to (``"data[0]"`` → ``"data"``), the name ``shared=`` uses."""
    return leaf_name.split("[")[0].split(".")[0]


def _log_prob_shape(site) -> tuple[Any, ...]:
    """Shape of an observed site's log-density (batch shape broadcast with the value's and the mask's)."""
    fn, value = site["fn"], site["value"]
    value_batch = np.shape(value)[:max(np.ndim(value) - len(fn.event_shape), 0)]
    return tuple(np.broadcast_shapes(tuple(fn.batch_shape), value_batch, np.shape(site.get("mask"))))


def _implicit_rows(observed, leaf_names, leaves, shared) -> int:
    """The size ``N`` of the implicit data plate of a model whose observed sites lie in no plate.

    The rule of :func:`bind_model`: the leading dimension of every observed site's
    log-density is the data axis when all these dimensions agree and equal the common
    leading length of the array arguments not named in ``shared``.

    :raises UnsupportedModelError: naming the shapes and lengths found when the rule does not apply.
    """
    lengths = {name: int(np.shape(leaf)[0]) for name, leaf in zip(leaf_names, leaves)
               if is_array(leaf) and np.ndim(leaf) >= 1 and _base_name(name) not in shared}
    shapes = {s["name"]: _log_prob_shape(s) for s in observed}
    found = ", ".join(f"{n}: {sh}" for n, sh in shapes.items())
    described = ", ".join(f"{n}: {k}" for n, k in lengths.items())
    leading = sorted({sh[0] for sh in shapes.values() if sh})
    reason = None
    if not shapes:
        reason = "the model has no observed site (was the data passed, e.g. as y=...?)"
    elif any(not sh for sh in shapes.values()):
        scalar = [n for n, sh in shapes.items() if not sh]
        reason = (f"observed site(s) {scalar} have no batch dimension (log-density shapes {found}), so one row "
                  "cannot be told from another; a `.to_event(1)` over the rows makes them one event")
    elif len(leading) > 1:
        reason = f"the observed sites' leading batch dimensions disagree (log-density shapes {found})"
    elif not lengths:
        reason = f"no array argument has a leading dimension to match the observed sites' {leading[0]} rows"
    elif len(set(lengths.values())) > 1:
        reason = (f"the array arguments have different leading lengths ({described}); pass shared=(...) with "
                  "the names of those that are not per-example")
    elif leading[0] != next(iter(lengths.values())):
        reason = (f"the observed sites' leading batch dimension is {leading[0]} (log-density shapes {found}) but "
                  f"the per-example arguments have length {next(iter(lengths.values()))} ({described})")
    if reason is not None:
        raise UnsupportedModelError(
            f"no observed site of the model lies inside a plate, and its rows cannot be inferred: {reason}. "
            "Without a plate the data axis is the leading batch dimension of the observed sites, taken only when "
            "every observed site has one, they agree, and it equals the common leading length of the array "
            "arguments not named in shared=. Otherwise declare the data in a plate, e.g. "
            "`with numpyro.plate('data', X.shape[0]): numpyro.sample('y', ..., obs=y)`.")
    return leading[0]


def _analyse_params(spec, data, z0, key=None):
    """Find which distribution leaves depend on ``z``, their count and whether affine (the masks memoised
    under ``key``, :mod:`numpyro_pc.model.analysis_memo`; the affine probe reads the data every time).

    A model with local latents has the marginal of :mod:`numpyro_pc.model.locals` as ``ℓ_i``,
    whose parameter is ``z`` itself (:func:`~numpyro_pc.model.terms.example_params`).
    """
    if spec.local is not None:
        return replace(spec, num_params=spec.latent.dim, affine=True)
    first = tuple(take_rows(x, 0) for x in data.per_example)
    spec = replace(spec, param_leaves=memoised("param_leaves", key, lambda: _param_leaf_masks(spec, first, data, z0)))
    theta, _ = example_params(spec, z0, first, data.shared)

    k = int(theta.shape[0])
    affine = False
    if k > 0:
        n_probe = min(8, spec.num_examples)
        probe = tuple(take_rows(x, np.arange(n_probe)) for x in data.per_example)
        z1 = z0 + probes.normal(17, z0.shape, z0.dtype)
        j0, j1 = _param_jacobians(replace(spec, num_examples=n_probe), jnp.stack([z0, z1]), probe, data.shared)
        affine = bool(jnp.all(jnp.isfinite(j0))) and bool(jnp.allclose(j0, j1, rtol=1e-12, atol=0.0))
    return replace(spec, num_params=k, affine=affine)



def _param_leaf_masks(spec, first, data, z0) -> tuple:
    """Per observed site, which float leaves of its distribution depend on ``z`` (from the jaxpr)."""
    trace = trace_at(spec, z0, example_args(first), data.shared)
    masks = []
    for name in spec.observed:
        site_leaves = jax.tree.leaves(trace[name]["fn"])
        float_leaf = [jnp.issubdtype(jnp.result_type(leaf), jnp.inexact) for leaf in site_leaves]

        def leaves_of(z, name=name) -> list[Any]:
            t = trace_at(spec, z, example_args(first), data.shared)
            return jax.tree.leaves(t[name]["fn"])

        dep = output_dependence(jax.make_jaxpr(leaves_of)(z0))
        masks.append(tuple(bool(d and f) for d, f in zip(dep, float_leaf)))
    return tuple(masks)


# --------------------------------------------------------------------------- verification

_PROBE_ROWS = 6  # examples in the subset on which the identity is checked


def verify_binding(spec, data, z0, num_probes=3) -> None:
    r"""Check that the per-example evaluation reproduces the model's log density.

    On the first few examples (the identity holds on any subset of the data plate) and at
    ``num_probes`` points around ``z0``, ``ℓ_0(z) + Σ_i ℓ_i(z)`` must equal NumPyro's
    ``potential_energy`` of the model called on that subset. Every example is evaluated by
    running the model on its slice of the per-example arguments, so a plate whose size
    does not come from the data (a fixed ``n`` argument, a global ``N``) or a latent
    vector of the plate's size used without a per-example index gives per-example losses
    that do not add up to the log likelihood — a wrong posterior with a tiny residual.

    :raises ModelBindingError: naming the plate or argument that is not tied to the data.
    """
    num = min(_PROBE_ROWS, spec.num_examples)
    sub = ModelData(tuple(take_rows(x, np.arange(num)) for x in data.per_example), data.shared)
    dtype = jnp.result_type(z0)
    rtol = 1e-6 if dtype == jnp.float64 else 1e-3
    noise = probes.normal(20261123, (num_probes - 1,) + z0.shape, dtype)
    points = jnp.concatenate([z0[None], z0[None] + 0.5 * noise], 0)
    local = None if spec.local is None else probes.normal(20261128, (num_probes, num, spec.local.dim), dtype)
    try:
        full, prior, per = _identity_terms(replace(spec, num_examples=num), sub, points, local)
    except Exception as err:  # the model cannot run on a subset of its data plate
        raise ModelBindingError(_binding_diagnosis(spec, data, z0, f"the model fails when called on the first "
                                                   f"{num} examples ({type(err).__name__}: {err})")) from err
    full, prior, per = np.asarray(full), np.asarray(prior), np.asarray(per)
    total = prior + per.sum(1)
    scale = 1.0 + np.abs(full) + np.abs(prior) + np.abs(per).sum(1)
    finite = np.isfinite(full) & np.isfinite(total) & np.isfinite(scale)  # outside the support: the others decide
    gap = np.abs(np.where(finite, total, 0.0) - np.where(finite, full, 0.0))
    bad = finite & (gap > rtol * np.where(finite, scale, 1.0))
    if not finite.any():
        raise ModelBindingError(
            f"the model's log density is not finite at any of {len(finite)} probe points on its first {num} examples "
            f"(negative log joint {full.tolist()}, per-example sum {total.tolist()}), so the per-example evaluation "
            "cannot be verified; check the supports of the priors and likelihood against the data.")
    if bad.any():
        j = int(np.argmax(bad))
        raise ModelBindingError(_binding_diagnosis(
            spec, data, z0, f"on the first {num} examples the per-example losses add up to {total[j]:.6g} "
            f"(prior term included) but the model's negative log joint is {full[j]:.6g}"))
    if spec.local is not None:
        check_local_modes(spec, data, z0)


@partial(jax.jit, static_argnums=0)
def _identity_terms(spec, sub, probes, local=None):
    """NumPyro's potential energy on the subset, the prior term and the per-example losses at each probe.

    With local latents the identity is the joint one: ``ℓ_0(z) + Σ_i f_i(z, u_i)`` against the
    potential energy at ``(z, u)``, with ``local`` the probe values ``(probes, rows, m)``.
    """
    args, kwargs = spec.build_args(sub.per_example, sub.shared)

    def at(point) -> tuple[Any, Any, Any]:
        z, u = point
        params = spec.latent.unravel(z)
        if u is not None:
            params = {**params, **stack_rows(spec.local, spec.local_axes, u)}
        with handlers.block():
            full = numpyro.infer.util.potential_energy(handlers.seed(spec.model, 0), args, kwargs, params)
        if u is None:
            per = jax.vmap(lambda ex: example_loss(spec, z, ex, sub.shared))(sub.per_example)
        else:
            per = jax.vmap(lambda ex, ui: example_joint_loss(spec, z, ui, ex, sub.shared))(sub.per_example, u)
        return full, prior_loss(spec, z, sub), per

    return jax.lax.map(at, (probes, local))


def _binding_diagnosis(spec, data, z0, finding) -> str:
    """A message that says which plate or argument is not tied to the data, and how to fix it."""
    example = tuple(take_rows(x, 0) for x in data.per_example)
    hint = ("Every example is evaluated by calling the model on its slice of the per-example arguments, so "
            "the data plate's size and every per-example quantity must come from those arguments.")
    try:
        trace = trace_at(spec, z0, example_args(example), data.shared)
    except Exception:  # noqa: BLE001 - the finding already says the model fails
        return f"{finding}. {hint}"
    frame = next((f for s in trace.values() if s["type"] == "sample" for f in s["cond_indep_stack"]
                  if f.name == spec.plate), None)
    if frame is not None and frame.size != 1:
        fixed = [f"{n}={v!r}" for n, v, k in zip(spec.arg_names, _static_values(spec), spec.kinds)
                 if k == "static" and isinstance(v, (int, np.integer)) and v == frame.size]
        source = (f"it comes from the fixed argument {', '.join(fixed)}" if fixed
                  else "it comes from a constant or a global variable")
        return (f"the data plate {spec.plate!r} keeps size {frame.size} when the model runs on one example "
                f"({source}). {hint} Write `numpyro.plate({spec.plate!r}, x.shape[0])` with x a data array. "
                f"(Found: {finding}.)")
    for name in spec.observed:
        try:
            size = int(np.size(trace[name]["fn"].log_prob(trace[name]["value"])))
        except Exception:  # noqa: BLE001 - the finding already says the model fails
            return f"{finding}. {hint}"
        if size != 1:
            return (f"the observed site {name!r} gives {size} log-densities for one example, so a latent vector or "
                    f"array of the plate's size enters it without a per-example index. {hint} Pass an index array "
                    f"as a per-example argument and use e.g. `theta[idx]` inside the plate. (Found: {finding}.)")
    return f"{finding}. {hint}"


def _static_values(spec) -> list[Any]:
    statics = iter(spec.statics)
    return [next(statics) if k == "static" else None for k in spec.kinds]


@partial(jax.jit, static_argnums=0)
def _param_jacobians(spec, points, examples, shared) -> jax.Array:
    """``∂θ_i/∂z`` of each example at each point, ``(points, examples, k, d)``: ``k`` reverse passes (``jacfwd``
    would push ``d`` tangents, a ``(d, d)`` identity)."""
    def at(z) -> jax.Array:
        return jax.vmap(lambda ex: jax.jacrev(lambda zz: example_params(spec, zz, ex, shared)[0])(z))(examples)

    return jax.vmap(at)(points)
