"""Binding the local latents of a model: which latent sites are local, their layout, their modes.

A continuous latent site inside the data plate is *local* to the example (one ability per
player in the players plate): :func:`split_local_latents` finds them and refuses what
cannot be integrated, :func:`bind_locals` records how one example sees them, and
:func:`check_local_modes` refuses a model whose local latents have no conditional mode.
The integral itself is :mod:`numpyro_pc.model.locals`; the binding as a whole is
:func:`numpyro_pc.model.likelihood.bind_model`.
"""

from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np
from numpyro import handlers

from numpyro_pc.errors import ModelBindingError, UnsupportedModelError

from . import probes
from .latent import LatentSpace
from .terms import in_plate, losses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .terms import ModelData, ModelSpec

__all__ = ["split_local_latents", "bind_locals", "check_local_modes", "refuse_guide_over_locals"]


def split_local_latents(trace, plate, latent: LatentSpace) -> tuple[str, ...]:
    """The names of the continuous latent sites of ``trace`` inside the data plate ``plate``.

    :raises UnsupportedModelError: a discrete latent inside the plate, global discrete latents
        beside local ones, or a model whose every latent is local.
    """
    for name in latent.discrete_names:
        if in_plate(trace[name], plate):
            raise UnsupportedModelError(
                f"discrete latent site {name!r} lies inside the data plate {plate!r} (a local discrete latent, "
                "e.g. a mixture assignment); local latents are integrated by Laplace's method, which needs "
                "continuous ones: enumerate it out of the model (sum its values in a factor).")
    names = tuple(n for n in latent.names if in_plate(trace[n], plate))
    if names and len(names) == len(latent.names):
        raise UnsupportedModelError(
            f"every latent site of the model ({list(names)}) lies inside the data plate {plate!r}: the units "
            "share no global latent, so there is no posterior over shared quantities to keep; give the local "
            "latents a prior with a global parameter, or fit each unit on its own.")
    if names and latent.discrete_names:
        raise UnsupportedModelError(
            f"the model has local latents {list(names)} inside the data plate {plate!r} and global discrete "
            f"latents {list(latent.discrete_names)}; local latents are integrated given continuous globals only: "
            "enumerate the discrete latents out of the model, or move the local ones out of the data plate.")
    return names


def bind_locals(spec: ModelSpec, data: ModelData, names) -> ModelSpec:
    """``spec`` with its local latents: their shapes as one example sees them and the axis the
    data plate indexes in each (``spec.local``, ``spec.local_axes``).

    :raises ModelBindingError: a local latent without exactly one value per example when the
        model runs on one example (a plate whose size is not the data's).
    """
    args, kwargs = spec.build_args(tuple(x[:1] for x in data.per_example), data.shared)
    try:
        with handlers.block():
            trace = handlers.trace(handlers.substitute(handlers.seed(spec.model, 0),
                                                       substitute_fn=probes.prototype_value)).get_trace(*args, **kwargs)
    except Exception as err:  # the user's model fails on one example: say so
        raise ModelBindingError(
            f"the model fails when called on its first example alone ({type(err).__name__}: {err}); every example is "
            "evaluated by calling the model on its slice of the per-example arguments, so the data plate's size and "
            "every per-example quantity must come from those arguments.") from err
    local = LatentSpace.from_trace({n: trace[n] for n in names})
    axes = []
    for name, shape in zip(names, local.shapes):
        frame = next(f for f in trace[name]["cond_indep_stack"] if f.name == spec.plate)
        axis = len(trace[name]["fn"].batch_shape) + frame.dim
        if frame.size != 1 or not 0 <= axis < len(shape):
            raise ModelBindingError(
                f"the local latent {name!r} does not have one value per example when the model runs on one example "
                f"(the plate {spec.plate!r} has size {frame.size} there, value shape {tuple(shape)}); the data "
                "plate's size must come from the data arguments, e.g. numpyro.plate(name, x.shape[0]).")
        axes.append(axis)
    return replace(spec, local=local, local_axes=tuple(axes))


def check_local_modes(spec: ModelSpec, data: ModelData, z0) -> None:
    """Refuse a model whose local latents have no conditional mode, for some example, at the
    binding's probe point ``z0`` (every example: one batched pass). Elsewhere a unit without a
    mode gives a non-finite loss, which the solvers and :func:`~numpyro_pc.model.terms.local_draws`
    refuse.

    :raises ModelBindingError: naming the examples whose Laplace integral is undefined.
    """
    marginal = np.asarray(jax.jit(losses, static_argnums=0)(spec, z0, data))
    if not np.all(np.isfinite(marginal)):
        bad = np.flatnonzero(~np.isfinite(marginal)).tolist()
        rows = str(bad) if len(bad) <= 10 else f"{bad[:10]} … ({len(bad)} in all)"
        names = list(spec.local.names) if spec.local is not None else []
        raise ModelBindingError(
            f"the local latents {names} have no conditional mode for example(s) {rows} at the "
            "binding's probe point (Newton's search did not reach a point with a positive-definite Hessian), so "
            "their Laplace integral is undefined; give each local latent a proper prior (a density that decays "
            "in its unconstrained coordinates).")


def refuse_guide_over_locals(spec: ModelSpec) -> None:
    """Refuse to read a fitted guide for a model with local latents.

    The dual form of such a model is over its global latents, each unit's local latents
    integrated in its loss; a guide fitted to the model covers the local latents too, and its
    Gaussian over the globals is not what the dual form's fixed point starts from.

    :raises UnsupportedModelError: when ``spec`` has local latents.
    """
    if spec.local is not None:
        raise UnsupportedModelError(
            f"the model has local latents {list(spec.local.names)} inside the data plate {spec.plate!r}; the dual form "
            f"is over the global latents {list(spec.latent.names)} with each unit's local latents integrated in its "
            "loss, while a guide fitted to the model also covers the local ones. Fit it with pc.fit(model, *data), "
            "which needs no guide (docs/hierarchical.md, 'Local latent variables').")
