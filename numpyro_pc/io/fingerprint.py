"""Fingerprint of a bound model: what must agree for a posterior to belong to a model.

A posterior's sites are losses of one particular model. Loading them into another model
with the same latent names (a probit instead of a logistic likelihood, a prior
``N(0, 10)`` instead of ``N(0, 1)``) would give wrong answers without any error, so a
saved posterior carries the fingerprint of its model and :func:`numpyro_pc.io.save_load.load`
compares it with the model it is given.

:func:`model_fingerprint` describes a model bound by
:func:`~numpyro_pc.model.likelihood.bind_model` as plain JSON data:

- the latent sites: names, constrained and unconstrained shapes (trace order);
- every sample site (latent, per-example likelihood, other observed sites and factors):
  its distribution classes (wrappers included, e.g. ``Independent`` of an
  ``ExpandedDistribution`` of a ``Normal``), batch and event shapes, and each
  distribution parameter (and the factors of ``scale`` and ``mask`` handlers), labelled by
  its field name: ``{"depends_on": "latent"}`` when it
  is computed from the latent variables, ``{"depends_on": "data"}`` when it is computed
  from a per-example argument, otherwise its value (numbers when small, a SHA-256 of the
  values when it has more than 16 elements);
- for an observed site, the shape of its observed value on one example (an observation of
  another shape broadcasts against the distribution without an error: ``y`` saved as
  ``(N, 1)`` against ``Bernoulli`` logits of shape ``(N,)`` gives ``N × N`` log densities);
- the fixed (non-array) arguments of the model and the data plate.

The dependence of a parameter on latents or data is read from the model's jaxpr (one
trace of one example), so the fingerprint does not depend on the data values, on the
order in which NumPyro flattens distributions, or on hash randomisation. Computing it
traces the model twice on one example.

:func:`compare_fingerprints` lists the differences between two fingerprints in words.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pc.model.likelihood import LOG_DET_PREFIX, output_dependence, trace_at

__all__ = ["FINGERPRINT_VERSION", "model_fingerprint", "compare_fingerprints"]

FINGERPRINT_VERSION = 2  # 2: observed sites record the shape of their value
_INLINE = 16  # parameters with at most this many values are stored as numbers, larger ones as a hash
_RTOL = 1e-6  # relative tolerance of numeric comparisons (float32 and float64 traces of one constant agree)


def model_fingerprint(spec, data) -> dict[str, Any]:
    """JSON-able description of a bound model (see the module docstring).

    Parameter values are computed in the current floating precision; compare
    fingerprints computed in the same precision (``jax.enable_x64`` on or off).

    :param spec: the :class:`~numpyro_pc.model.likelihood.ModelSpec` from :func:`~numpyro_pc.model.likelihood.bind_model`.
    :param data: the :class:`~numpyro_pc.model.likelihood.ModelData` (only its first example and
        the shared arrays are used; a dataset without rows is probed with zeros).
    :return: a ``dict`` of lists, strings and numbers.
    """
    example = tuple(np.asarray(x[:1]) if x.shape[0] else np.zeros((1, *x.shape[1:]), x.dtype)
                    for x in data.per_example)
    shared = tuple(data.shared)
    z = jnp.zeros(spec.latent.dim, jnp.result_type(float))

    def site_fns(zz, ex, sh) -> dict[str, dict[str, Any]]:
        trace = trace_at(spec, zz, ex, sh)
        return {name: site for name, site in trace.items()
                if site["type"] == "sample" and not name.startswith(LOG_DET_PREFIX)}

    sites = site_fns(z, example, shared)
    jaxpr = jax.make_jaxpr(lambda zz, ex, sh: [leaf for s in site_fns(zz, ex, sh).values()
                                               for _, leaf in _site_leaves(s)[1]])(z, example, shared)
    on_latent = iter(output_dependence(jaxpr, [0]))
    on_data = iter(output_dependence(jaxpr, list(range(1, 1 + len(example)))))
    described = {}
    for name, site in sites.items():
        role = ("latent" if not site["is_observed"] else "likelihood" if name in spec.observed else "observed")
        classes, leaves = _site_leaves(site)
        params = {label: _describe_leaf(leaf, next(on_latent), next(on_data)) for label, leaf in leaves}
        described[name] = {"role": role, "distribution": classes, "params": params,
                           "batch_shape": list(site["fn"].batch_shape), "event_shape": list(site["fn"].event_shape)}
        if site["is_observed"]:
            described[name]["value_shape"] = list(np.shape(site["value"]))
    latent = spec.latent
    statics = {name: _describe_static(value) for name, value in
               zip((n for n, k in zip(spec.arg_names, spec.kinds) if k == "static"), spec.statics)}
    return {"version": FINGERPRINT_VERSION, "plate": spec.plate,
            "latent": [{"name": n, "shape": list(s), "unconstrained_shape": list(u)}
                       for n, s, u in zip(latent.names, latent.shapes, latent.unconstrained_shapes)],
            "sites": described, "arguments": statics}


def compare_fingerprints(saved, current) -> list[str]:
    """Differences between two fingerprints, as sentences (empty when they agree).

    Numbers are compared with a relative tolerance of ``1e-6``; everything else exactly. A
    version-1 ``saved`` fingerprint (before observed shapes were recorded) is compared on the
    fields it has.

    :param dict saved: the reference fingerprint (e.g. read from a file).
    :param dict current: the fingerprint of the model at hand.
    :return: a list of strings such as ``"sites.y.distribution: BernoulliLogits, now BernoulliProbs"``.
    """
    if not isinstance(saved, dict) or not isinstance(current, dict):
        return [f"fingerprint version {_short(_get(saved, 'version'))} cannot be compared with version "
                f"{_short(_get(current, 'version'))}"]
    if saved.get("version") == 1 and current.get("version") == 2:  # version 1 did not record observed shapes
        current = {**current, "version": 1, "sites": {name: {k: v for k, v in site.items() if k != "value_shape"}
                                                      for name, site in current.get("sites", {}).items()}}
    elif saved.get("version") != current.get("version"):
        return [f"fingerprint version {_short(saved.get('version'))} cannot be compared with version "
                f"{_short(current.get('version'))}"]
    out: list[str] = []
    _diff(saved, current, "", out)
    return out


def _get(value, key) -> Any:
    return value.get(key) if isinstance(value, dict) else value


def _diff(a, b, path, out) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            where = f"{path}.{key}" if path else str(key)
            if key not in b:
                out.append(f"{where}: present when saved, absent now")
            elif key not in a:
                out.append(f"{where}: absent when saved, present now ({_short(b[key])})")
            else:
                _diff(a[key], b[key], where, out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for k, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{path}[{k}]", out)
    elif not _same_value(a, b):
        out.append(f"{path}: {_short(a)} when saved, {_short(b)} now")


def _same_value(a, b) -> bool:
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and not isinstance(b, bool):
        return math.isclose(a, b, rel_tol=_RTOL, abs_tol=0.0)
    return type(a) is type(b) and a == b


def _short(value, limit=80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _qualname(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _child_names(cls, aux, count) -> list[str]:
    """Field names of a pytree node's children: NumPyro's data fields, a transform's field
    tuple, a dict's keys, or positions."""
    fields = getattr(cls, "gather_pytree_data_fields", None)
    if fields is not None and len(fields()) == count:
        return [str(f) for f in fields()]
    for candidate in (aux, aux[0] if isinstance(aux, tuple) and aux else None):
        if isinstance(candidate, (tuple, list)) and len(candidate) == count and all(
                isinstance(c, str) for c in candidate):
            return list(candidate)
    return [str(k) for k in range(count)]


def _labelled(fn) -> tuple[dict[str, str], list[tuple[str, Any]]]:
    """``({node path: class}, [(leaf path, leaf), ...])`` of a distribution pytree."""
    leaves, treedef = jax.tree.flatten(fn)
    remaining, classes, labelled = iter(leaves), {}, []

    def walk(node, path) -> None:
        data = node.node_data()
        if data is None:
            labelled.append((path, next(remaining)))
            return
        cls, aux = data
        classes[path or "self"] = _qualname(cls)
        children = node.children()
        for name, child in zip(_child_names(cls, aux, len(children)), children):
            walk(child, f"{path}.{name}" if path else name)

    walk(treedef, "")
    return classes, labelled


def _site_leaves(site) -> tuple[dict[str, str], list[tuple[str, Any]]]:
    """The distribution's classes and labelled leaves, then the site's ``scale`` and ``mask``
    (set by the ``scale`` and ``mask`` handlers) when present."""
    classes, leaves = _labelled(site["fn"])
    for handler in ("scale", "mask"):
        if site.get(handler) is not None:
            leaves += [(f"{handler}_handler.{k}" if k else f"{handler}_handler", leaf)
                       for k, (_, leaf) in enumerate(_labelled(site[handler])[1])]
    return classes, leaves


def _describe_leaf(leaf, on_latent, on_data) -> dict[str, Any]:
    if on_latent:
        return {"depends_on": "latent"}
    if on_data:
        return {"depends_on": "data"}
    value = np.asarray(leaf)
    if value.dtype.kind not in "biuf":
        return {"kind": str(value.dtype)}
    kind = {"b": "bool", "i": "int", "u": "int", "f": "float"}[value.dtype.kind]
    if value.size > _INLINE:
        digest = hashlib.sha256(np.ascontiguousarray(value.astype(np.float64)).tobytes()).hexdigest()
        return {"kind": kind, "shape": list(value.shape), "sha256": digest}
    return {"kind": kind, "shape": list(value.shape), "values": [_number(v) for v in value.ravel().tolist()]}


def _number(v) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _describe_static(value) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return _number(value)
    return {"type": _qualname(type(value)), "name": getattr(value, "__qualname__", None)}
