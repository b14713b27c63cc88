"""Saving and loading a :class:`~numpyro_pc.DualPosterior` safely.

The file is one uncompressed zip archive (NumPy's ``.npz`` layout) holding every array
and a ``manifest.json``: format name and version, family, dtype, expectation rule, the
model's latent signature, the argument layout, ids and tombstones of deleted examples,
and a SHA-256 checksum of every array. Nothing is pickled (arrays are read with
``allow_pickle=False``).

Writes are atomic: the archive is written to a temporary file in the same folder,
flushed and ``fsync``-ed, then renamed over the destination, so a crash at any point
leaves the previous save intact. Loading verifies the format version, every checksum,
the dtype, and that the model given to :func:`load` has the saved latent signature; each
failure raises its own :class:`PersistenceError` subclass.
"""

from __future__ import annotations

import hashlib
import io as _io
import json
import os
import tempfile
import zipfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from .errors import PosteriorCorrectionError
from .expectations import ExpectationRule
from .families import Gaussian, GaussianNatural, get_family
from .likelihood import ModelData, bind_model
from .sites import Sites

__all__ = ["FORMAT", "VERSION", "PersistenceError", "CorruptFileError", "FormatVersionError", "ModelMismatchError",
           "DtypeMismatchError", "save", "load"]

FORMAT = "numpyro_pc.dual_posterior"
VERSION = 1
_SITE_ARRAYS = ("grad", "curvature", "jac", "lam", "loss", "ids", "ref_index", "ref_means", "prior_grad",
                "prior_curvature", "prior_loss", "prior_ref")


class PersistenceError(PosteriorCorrectionError, OSError):
    """A saved posterior cannot be read back as it was written."""


class CorruptFileError(PersistenceError):
    """The file is truncated, not an archive, or an array fails its checksum."""


class FormatVersionError(PersistenceError):
    """The file was written by an incompatible format version."""


class ModelMismatchError(PersistenceError):
    """The model given to :func:`load` does not have the saved latent signature."""


class DtypeMismatchError(PersistenceError):
    """The arrays' dtype disagrees with the manifest or cannot be represented now (x64 off)."""


def _digest(array):
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def _json_static(value, name):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise PersistenceError(f"argument {name!r} is a {type(value).__name__}; only arrays, None, bool, int, float "
                           "and str arguments can be saved")


def save(post, path):
    """Write ``post`` to ``path`` atomically (see the module docstring for the format).

    :return: the :class:`~pathlib.Path` written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {"mean": post.state.mean, "precision": post.state.precision, "data_ids": post.data_ids,
              "tombstones": np.asarray(post.tombstones, np.int64)}
    for name in _SITE_ARRAYS:
        value = getattr(post.sites, name)
        if value is not None:
            arrays[f"sites.{name}"] = value
    if post.offset is not None:
        arrays["offset.linear"], arrays["offset.precision"] = post.offset.linear, post.offset.precision
    for k, leaf in enumerate(post.data.per_example):
        arrays[f"data.example.{k}"] = leaf
    for k, leaf in enumerate(post.data.shared):
        arrays[f"data.shared.{k}"] = leaf
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    spec = post.spec
    layout = _argument_layout(spec)
    manifest = {
        "format": FORMAT, "version": VERSION, "family": post.family.name,
        "dtype": str(np.asarray(post.state.mean).dtype), "rule": dict(vars(post.rule)),
        "curvature": post.curvature, "storage": post.sites.storage, "chunk_size": post.chunk_size,
        "latent": post.latent.signature(), "plate": spec.plate, "observed": list(spec.observed),
        "arguments": layout, "next_id": post.next_id, "tombstones": list(post.tombstones),
        "example_shapes": [[list(np.shape(x)[1:]), str(np.asarray(x).dtype)] for x in post.data.per_example],
        "arrays": {k: {"sha256": _digest(v), "dtype": str(v.dtype), "shape": list(v.shape)} for k, v in arrays.items()},
    }
    buffer = _io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("manifest.json", json.dumps(manifest, indent=1))
        for key, value in arrays.items():
            member = _io.BytesIO()
            np.save(member, value, allow_pickle=False)
            archive.writestr(f"{key}.npy", member.getvalue())
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(buffer.getvalue())
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _fsync_dir(path.parent)
    return path


def _fsync_dir(folder):
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _Slot:
    def __init__(self, kind):
        self.kind = kind


def _argument_layout(spec):
    """JSON description of the model's top-level arguments (array slots, None and scalars)."""
    n_ex, n_sh = spec.kinds.count("example"), spec.kinds.count("shared")
    args, kwargs = spec.build_args(tuple(_Slot("example") for _ in range(n_ex)),
                                   tuple(_Slot("shared") for _ in range(n_sh)))
    names = iter(spec.arg_names)

    def describe(value):
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


def _read(path):
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no saved posterior at {path}")
    try:
        archive = zipfile.ZipFile(path)
        names = set(archive.namelist())
        manifest = json.loads(archive.read("manifest.json"))
    except (zipfile.BadZipFile, KeyError, json.JSONDecodeError, OSError, EOFError) as err:
        raise CorruptFileError(f"{path} is not a readable numpyro_pc archive (truncated or corrupted: {err})") from err
    if manifest.get("format") != FORMAT:
        raise CorruptFileError(f"{path} is not a saved dual posterior (format {manifest.get('format')!r})")
    if manifest.get("version") != VERSION:
        raise FormatVersionError(f"{path} has format version {manifest.get('version')}; this numpyro_pc reads "
                                 f"version {VERSION}")
    arrays = {}
    for key, meta in manifest["arrays"].items():
        if f"{key}.npy" not in names:
            raise CorruptFileError(f"{path} lacks the array {key!r}")
        try:
            value = np.load(_io.BytesIO(archive.read(f"{key}.npy")), allow_pickle=False)
        except (ValueError, OSError, zipfile.BadZipFile) as err:
            raise CorruptFileError(f"array {key!r} in {path} cannot be read: {err}") from err
        if str(value.dtype) != meta["dtype"] or list(value.shape) != meta["shape"]:
            raise DtypeMismatchError(f"array {key!r} in {path} is {value.dtype}{list(value.shape)}, the manifest "
                                     f"says {meta['dtype']}{meta['shape']}")
        if _digest(value) != meta["sha256"]:
            raise CorruptFileError(f"array {key!r} in {path} fails its checksum (the file was altered)")
        arrays[key] = value
    return manifest, arrays


def load(path, model):
    """Read a posterior saved by :func:`save` and bind it to ``model``.

    :raises CorruptFileError, FormatVersionError, ModelMismatchError, DtypeMismatchError:
    """
    from .posterior import DualPosterior

    manifest, arrays = _read(path)
    dtype = np.dtype(manifest["dtype"])
    if dtype != arrays["mean"].dtype:
        raise DtypeMismatchError(f"{path}: the manifest says {dtype} but the arrays are {arrays['mean'].dtype}")
    if dtype == np.float64 and jnp.zeros(()).dtype != jnp.float64:
        import jax

        if not jax.config.jax_enable_x64:
            raise DtypeMismatchError(f"{path} holds a float64 posterior; enable x64 (jax.enable_x64()) to load it "
                                     "without losing precision")
    tombstones = set(manifest["tombstones"])
    ids = set(arrays["sites.ids"].tolist()) | set(arrays["data_ids"].tolist())
    if tombstones & ids or sorted(tombstones) != sorted(arrays["tombstones"].tolist()):
        raise CorruptFileError(f"{path}: deleted example ids reappear in the saved sites or data")

    per_example = [arrays[f"data.example.{k}"] for k in range(len(manifest["example_shapes"]))]
    shared = [arrays[k] for k in sorted((k for k in arrays if k.startswith("data.shared.")),
                                        key=lambda k: int(k.rsplit(".", 1)[1]))]
    probe = [x[:1] if x.shape[0] else np.zeros((1, *shape), dt) for x, (shape, dt) in
             zip(per_example, manifest["example_shapes"])]
    args, kwargs = _rebuild_args(manifest["arguments"], probe, shared)
    try:
        spec, _ = bind_model(model, args, kwargs, data_plate=manifest["plate"],
                             shared=tuple(m["name"] for m in _entries(manifest["arguments"]) if m["kind"] == "shared"))
    except PosteriorCorrectionError as err:
        raise ModelMismatchError(f"the model cannot be bound to the saved argument layout: {err}") from err
    if spec.latent.signature() != manifest["latent"] or list(spec.observed) != manifest["observed"]:
        raise ModelMismatchError(f"{path} was saved for latent sites {manifest['latent']['names']} with observed "
                                 f"{manifest['observed']}; the model has {list(spec.latent.names)} / "
                                 f"{list(spec.observed)}")
    from dataclasses import replace

    spec = replace(spec, num_examples=int(per_example[0].shape[0]) if per_example else 0)
    family = get_family(manifest["family"])
    rule = ExpectationRule(**manifest["rule"])
    site_fields = {name: (jnp.asarray(arrays[f"sites.{name}"]) if f"sites.{name}" in arrays else None)
                   for name in _SITE_ARRAYS}
    sites = Sites(storage=manifest["storage"], **site_fields)
    data = ModelData(tuple(jnp.asarray(x) for x in per_example), tuple(jnp.asarray(x) for x in shared))
    state = Gaussian(jnp.asarray(arrays["mean"]), jnp.asarray(arrays["precision"]))
    offset = None
    if "offset.linear" in arrays:
        offset = GaussianNatural(jnp.asarray(arrays["offset.linear"]), jnp.asarray(arrays["offset.precision"]))
    return DualPosterior(spec, data, family, state, sites, rule, manifest["curvature"], manifest["storage"],
                         manifest["chunk_size"], (), None, data_ids=jnp.asarray(arrays["data_ids"]),
                         tombstones=manifest["tombstones"], next_id=manifest["next_id"], offset=offset)


def _entries(layout):
    return list(layout["args"]) + list(layout["kwargs"].values())


def _rebuild_args(layout, per_example, shared):
    ex, sh = iter(per_example), iter(shared)

    def value(meta):
        if meta["kind"] == "none":
            return None
        if meta["kind"] == "example":
            return jnp.asarray(next(ex))
        if meta["kind"] == "shared":
            return jnp.asarray(next(sh))
        return meta["value"]

    args = tuple(value(m) for m in layout["args"])
    kwargs = {k: value(m) for k, m in sorted(layout["kwargs"].items())}
    return args, kwargs
