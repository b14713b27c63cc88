r"""The model side of a saved posterior: its argument layout, and binding a model to it.

A file holds the data rows and a JSON description of how the model was called (which
arguments are per-example arrays, shared arrays, ``None`` or scalars); loading binds the
user's model to that layout and checks it is the saved model (latent and observed sites,
fingerprint). Both file kinds — Gaussian (:mod:`numpyro_pc.io.save_load`) and exponential-family
(:mod:`numpyro_pc.io.expfam`) — use it.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from numpyro_pc.errors import DataSupportError, InconsistentFileError, PersistenceError, SavedModelMismatchError
from numpyro_pc.model.data_support import check_support
from numpyro_pc.model.likelihood import ModelData, bind_model
from numpyro_pc.model.rows import to_device
from numpyro_pc.model.terms import ModelSpec

from .archive import manifest_limit, npy_bytes, write_atomic
from .fingerprint import compare_fingerprints, model_fingerprint

__all__ = ["argument_layout", "bind_saved_model", "digest", "with_data_arrays", "site_arrays", "binding_manifest",
           "write_checked"]


def digest(array) -> str:
    """SHA-256 (hex) of an array's C-ordered bytes, as recorded in a manifest."""
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()



def _json_static(value, name) -> bool | int | float | str | None:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise PersistenceError(f"argument {name!r} is a {type(value).__name__}; only arrays, None, bool, int, float "
                           "and str arguments can be saved")


class _Slot:
    def __init__(self, kind):
        self.kind = kind


def argument_layout(spec) -> dict[str, Any]:
    """JSON description of the model's top-level arguments (array slots, None and scalars).

    :raises PersistenceError: an argument that is neither an array, ``None`` nor a scalar.
    """
    n_ex, n_sh = spec.kinds.count("example"), spec.kinds.count("shared")
    args, kwargs = spec.build_args(tuple(_Slot("example") for _ in range(n_ex)),
                                   tuple(_Slot("shared") for _ in range(n_sh)))
    names = iter(spec.arg_names)

    def describe(value) -> dict[str, Any]:
        if value is None:
            return {"kind": "none"}
        name = next(names)
        if isinstance(value, _Slot):
            return {"kind": value.kind, "name": name.split("[")[0]}
        return {"kind": "static", "name": name, "value": _json_static(value, name)}

    try:
        return {"args": [describe(v) for v in args], "kwargs": {k: describe(kwargs[k]) for k in sorted(kwargs)}}
    except StopIteration:
        raise PersistenceError("only models whose arguments are arrays, None or scalars (no nested "
                               "containers) can be saved") from None


def bind_saved_model(path, model, manifest, arrays, allow_discrete=False) -> tuple[ModelSpec, ModelData]:
    """Bind ``model`` to the argument layout saved in ``manifest`` and check it is the saved
    model (latent sites, observed sites, fingerprint); ``allow_discrete`` for posteriors with
    discrete factors.

    :return: ``(spec, data)`` with the saved data rows.
    :raises SavedModelMismatchError:
    """
    per_example = [arrays[f"data.example.{k}"] for k in range(len(manifest["example_shapes"]))]
    shared = [arrays[f"data.shared.{k}"] for k in range(sum(1 for m in _entries(manifest["arguments"])
                                                            if m["kind"] == "shared"))]
    probe = [x[:1] if x.shape[0] else np.zeros((1, *x.shape[1:]), x.dtype) for x in per_example]
    args, kwargs = _rebuild_args(manifest["arguments"], probe, shared)
    try:
        spec, _ = bind_model(model, args, kwargs, data_plate=manifest["plate"], allow_discrete=allow_discrete,
                             shared=tuple(m["name"] for m in _entries(manifest["arguments"]) if m["kind"] == "shared"))
    except Exception as err:  # the model is user code run on the saved layout: any failure is a mismatch
        raise SavedModelMismatchError(f"the model cannot be bound to the argument layout saved in {path}: "
                                      f"{type(err).__name__}: {err}") from err
    if spec.latent.signature() != manifest["latent"] or list(spec.observed) != manifest["observed"]:
        raise SavedModelMismatchError(f"{path} was saved for latent sites {manifest['latent']['names']} with "
                                      f"observed {manifest['observed']}; the model has {list(spec.latent.names)} / "
                                      f"{list(spec.observed)}")
    spec = replace(spec, num_examples=int(per_example[0].shape[0]))
    data = ModelData(tuple(to_device(x) for x in per_example), tuple(to_device(x) for x in shared))
    try:
        check_support(spec, data, f"the data saved in {path}")
    except DataSupportError as err:  # written by fit/update, which check it: the file was altered
        raise InconsistentFileError(f"{err} The posterior was fitted to checked data, so the file was "
                                    "altered after it was written.") from err
    saved = manifest.get("fingerprint")
    if saved is None:
        warnings.warn(f"{path} was saved without a model fingerprint (an earlier numpyro_pc): the model could not "
                      "be verified beyond its latent sites", UserWarning, stacklevel=3)
        return spec, data
    differences = compare_fingerprints(saved, model_fingerprint(spec, data))
    if differences:
        raise SavedModelMismatchError(f"{path} was saved with another model: " + "; ".join(differences[:8])
                                      + (f"; … ({len(differences)} differences)" if len(differences) > 8 else ""),
                                      differences)
    return spec, data


def _entries(layout) -> list[dict[str, Any]]:
    return list(layout["args"]) + list(layout["kwargs"].values())


def _rebuild_args(layout, per_example, shared) -> tuple[tuple[Any, ...], dict[str, Any]]:
    ex, sh = iter(per_example), iter(shared)

    def value(meta) -> Any:
        if meta["kind"] == "none":
            return None
        if meta["kind"] == "example":
            return to_device(next(ex))
        if meta["kind"] == "shared":
            return to_device(next(sh))
        return meta["value"]

    args = tuple(value(m) for m in layout["args"])
    kwargs = {k: value(m) for k, m in sorted(layout["kwargs"].items())}
    return args, kwargs


def with_data_arrays(arrays: dict, data: ModelData, allowed_dtypes, sites=None) -> dict[str, np.ndarray]:
    """``arrays``, the site table's arrays (``sites.<name>`` for each entry of ``sites.arrays()``)
    and the retained data rows (``data.example.k``, ``data.shared.k``) as NumPy arrays, the
    members of a saved posterior of either kind.

    :raises PersistenceError: an array whose dtype is not in ``allowed_dtypes`` (what a file may hold).
    """
    arrays = dict(arrays)
    if sites is not None:
        arrays.update({f"sites.{name}": value for name, value in sites.arrays().items()})
    for k, leaf in enumerate(data.per_example):
        arrays[f"data.example.{k}"] = leaf
    for k, leaf in enumerate(data.shared):
        arrays[f"data.shared.{k}"] = leaf
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    for name, value in arrays.items():
        if str(value.dtype) not in allowed_dtypes:
            raise PersistenceError(f"array {name!r} has dtype {value.dtype}; only {allowed_dtypes} can be saved")
    return arrays


def site_arrays(arrays: dict) -> dict:
    """The ``sites.<name>`` members of a file as ``{name: device array}``, the input of the site
    table's ``from_arrays``."""
    return {name[len("sites."):]: to_device(value) for name, value in arrays.items() if name.startswith("sites.")}


def binding_manifest(spec, data: ModelData, arrays: dict, residual: float, fingerprint, signed: bool) -> dict:
    """The manifest fields of every saved posterior, whatever its family: the model binding (latent
    signature, data plate, observed sites, argument layout, per-example shapes and dtypes, model
    fingerprint), a SHA-256, dtype and shape per array, the dual-form residual and whether the file
    is signed."""
    return {
        "latent": spec.latent.signature(), "plate": spec.plate, "observed": list(spec.observed),
        "arguments": argument_layout(spec),
        "example_shapes": [[list(np.shape(x)[1:]), str(np.asarray(x).dtype)] for x in data.per_example],
        "arrays": {k: {"sha256": digest(v), "dtype": str(v.dtype), "shape": list(v.shape)} for k, v in arrays.items()},
        "residual": float(residual), "fingerprint": fingerprint, "signed": bool(signed),
    }


def write_checked(path, manifest: dict, arrays: dict, check, key=None) -> Path:
    """Write ``manifest`` and ``arrays`` atomically after checking them as a load would.

    :param check: ``check(manifest, arrays)``, the load's checks of the file alone, run on the
        manifest exactly as it will be read back (through JSON).
    :raises PersistenceError: a posterior that cannot be saved in a form that loads back.
    """
    manifest = json.loads(json.dumps(manifest))  # exactly what load will see
    try:
        check(manifest, arrays)
    except PersistenceError as err:
        raise PersistenceError(f"the posterior cannot be saved in a form that loads back: {err}") from err
    # sorted keys: the same bytes whatever the hash seed; the members in the manifest's order of "arrays",
    # which is the order a load reads them in and checks a signature over
    text = json.dumps(manifest, indent=1, sort_keys=True).encode()
    members = [(f"{k}.npy", npy_bytes(arrays[k])) for k in sorted(arrays)]
    limit = manifest_limit(0)  # deleted ids are a member, not a list in the manifest
    if len(text) > limit:
        raise PersistenceError(f"the posterior cannot be saved in a form that loads back: its manifest needs "
                               f"{len(text)} bytes, more than the {limit} a load accepts (a model with very many "
                               "sample sites)")
    return write_atomic(path, text, members, key=key)
