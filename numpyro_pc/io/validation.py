"""Checks of a saved posterior's manifest and arrays before they become a posterior.

A saved file may come from someone else, so :func:`numpyro_pc.io.save_load.load` trusts nothing in
it. :func:`numpyro_pc.io.file_format.check_manifest` checks the common header of the
manifest with the checks every kind shares (:func:`check_binding_fields`,
:func:`check_array_entries`) and hands the kind's part to the kind's checker here; each
returns the arrays the manifest declares, so that the reader can bound what it reads.

- The Gaussian kind (:class:`~numpyro_pc.DualPosterior`): :func:`check_gaussian_part`
  checks ``family`` and ``manifest["gaussian"]`` (every field's type and range);
  :func:`check_contents` checks that the arrays agree with each other and are usable:
  dtypes, shapes across state, sites, data and ids; ids unique, below ``next_id`` and
  disjoint from the deleted ids of the ``tombstones`` member (:func:`check_tombstones`, shared by both kinds); every value finite; the precision symmetric positive
  definite; one example no larger than the file's arrays (:func:`check_example_rows`: a
  file without data rows could otherwise declare examples of terabytes, and the model is
  traced on one).
- The exponential-family kind (:class:`~numpyro_pc.dual.expfam.EFPosterior`):
  :func:`check_ef_part` checks ``family`` (``{latent site: family name}`` in the model's
  latent order) and ``manifest["ef"]`` (the site computation's ``config``,
  ``conjugate_prior`` and ``next_id``); :func:`check_ef_contents` checks ``natural``, ``sites.grads``,
  ``sites.prior``, ``sites.ids``, ``tombstones`` and the data rows against the manifest and each other. The
  checks that need the model are made by :func:`numpyro_pc.io.expfam.load_ef`.

:func:`check_residual` compares the dual-form residual recomputed from the arrays with the
one recorded at save time (an edited site or offset changes it).

Each failure raises a :class:`~numpyro_pc.errors.CorruptFileError` (malformed manifest)
or :class:`~numpyro_pc.errors.InconsistentFileError` naming what was expected and what
was found.
"""

from __future__ import annotations

import math
import re
from typing import Any, NoReturn

import numpy as np

from numpyro_pc.curvature.stores import STORES
from numpyro_pc.errors import (CorruptFileError, DtypeMismatchError, InconsistentFileError, InvalidOptionError,
                               UnknownExampleError)
from numpyro_pc.families.registry import get_family, registered_families
from numpyro_pc.model.rows import positions
from numpyro_pc.options import is_choice
from numpyro_pc.protocols.capabilities import SiteCurvature, capability
from numpyro_pc.sites.expectations import MAX_MC_SUBSPACE_DIM, MAX_SUBSPACE_DIM

__all__ = ["GAUSSIAN_FIELDS", "EF_FIELDS", "SITE_ARRAYS", "FLOAT_DTYPES", "INT_DTYPES", "DATA_DTYPES", "MIN_EXAMPLE_BOUND",
           "check_gaussian_part", "check_binding_fields", "check_array_entries", "check_example_rows", "check_contents",
           "check_residual", "fail_field", "check_ef_part", "check_ef_contents", "TOMBSTONES", "check_tombstones",
           "read_tombstones", "tombstones_member"]

SITE_ARRAYS = ("grad", "curvature", "jac", "lam", "index", "nnz", "loss", "ids", "ref_index", "ref_means",
               "prior_grad", "prior_curvature", "prior_loss", "prior_ref")
_CURVATURE_ARRAYS = {name for store in STORES.values() for name in store.file_shapes(0, 0, 0)}
FLOAT_DTYPES = ("float32", "float64")
INT_DTYPES = ("int32", "int64")
DATA_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
               "float32", "float64")


def _family_storage(name=None) -> dict[str, tuple[str, ...]]:
    """``{family name: storages that hold what the family needs of the curvature}`` (registered families;
    a parametrised family's ``name``, e.g. ``"lowrank-5"``, is built and registered first)."""
    if isinstance(name, str) and len(name) <= 64:
        try:
            get_family(name)
        except InvalidOptionError:
            pass  # reported as an unknown family below
    needs = {name: capability(family, SiteCurvature) for name, family in registered_families().items()}
    return {name: tuple(s for s, store in STORES.items() if store.detail >= need.detail)
            for name, need in needs.items() if need is not None}  # a family without Gaussian sites has no file


_MAX_ID = 2**62
MIN_EXAMPLE_BOUND = 2**24  # bytes one example may hold even when the file's arrays hold fewer
GAUSSIAN_FIELDS = frozenset({"rule", "curvature", "storage", "chunk_size", "next_id"})  # manifest["gaussian"]
TOMBSTONES = "tombstones"  # the member holding the ids of deleted examples, in files of either kind
_NAME = re.compile(r"(mean|precision|data_ids|tombstones|offset\.linear|offset\.precision|data\.(example|shared)\.\d+|"
                   rf"sites\.({'|'.join(SITE_ARRAYS)}))")


def fail_field(where, expected, found, error=CorruptFileError) -> NoReturn:
    """Raise ``error`` (:class:`~numpyro_pc.errors.CorruptFileError`) naming the manifest field, what was
    expected and what was found."""
    text = repr(found)
    raise error(f"manifest field {where!r}: expected {expected}, found {text if len(text) < 80 else text[:79] + '…'}")


_fail = fail_field


def _is_int(value, low=0, high=_MAX_ID) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < high


def _ints(value, where, low=0) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(v, low) for v in value):
        _fail(where, f"a list of integers ≥ {low}", value)
    return value


def _choice(manifest, key, options, prefix="") -> Any:
    value = manifest.get(key)
    if not is_choice(value, options):
        _fail(prefix + key, f"one of {list(options)}", value)
    return value


def _check_rule(rule) -> None:
    fields = {"kind": ("delta", "mc", "gh"), "num_samples": (1, 10**6), "seed": (0, 2**32), "num_nodes": (2, 10**4),
              "prior_mode": (None, "separable", "quadratic", "qmc"), "subspace_dim": (0, MAX_MC_SUBSPACE_DIM + 1),
              "num_prior_points": (1, 10**7), "mc_precision": ("hessian", "reparam")}
    if not isinstance(rule, dict) or not set(rule) <= set(fields) or "kind" not in rule:
        _fail("gaussian.rule", f"an object with 'kind' and some of {sorted(fields)}", rule)
    for key, value in rule.items():
        allowed = fields[key]
        ok = _is_int(value, *allowed) if isinstance(allowed[0], int) else value in allowed and (
            value is None or isinstance(value, str))
        if not ok:
            _fail(f"gaussian.rule.{key}", f"{allowed[0]} ≤ integer < {allowed[1]}" if isinstance(allowed[0], int)
                  else f"one of {list(allowed)}", value)
    limit = {"gh": MAX_SUBSPACE_DIM, "mc": MAX_MC_SUBSPACE_DIM}.get(rule["kind"], 0)  # tensor rules grow as n^r
    if rule.get("subspace_dim", 0) > limit:
        _fail("gaussian.rule.subspace_dim", f"an integer ≤ {limit} for the {rule['kind']!r} rule", rule["subspace_dim"])


def _check_layout(layout) -> tuple[int, int]:
    def entry(value, where) -> str:
        kind = value.get("kind") if isinstance(value, dict) and isinstance(value.get("kind"), str) else None
        keys = {"none": {"kind"}, "example": {"kind", "name"}, "shared": {"kind", "name"},
                "static": {"kind", "name", "value"}}.get(kind)
        if keys is None or set(value) != keys or ("name" in keys and not isinstance(value["name"], str)) or (
                kind == "static" and not (value["value"] is None or isinstance(value["value"], (bool, int, float, str)))):
            _fail(where, "an argument entry (kind none/example/shared/static with its name and value)", value)
        return kind

    if not isinstance(layout, dict) or set(layout) != {"args", "kwargs"} or not isinstance(layout["args"], list) \
            or not isinstance(layout["kwargs"], dict):
        _fail("arguments", "an object with 'args' (list) and 'kwargs' (object)", layout)
    kinds = [entry(v, f"arguments.args[{k}]") for k, v in enumerate(layout["args"])]
    kinds += [entry(v, f"arguments.kwargs.{k}") for k, v in layout["kwargs"].items()]
    return kinds.count("example"), kinds.count("shared")


def check_gaussian_part(manifest: dict, num_example: int, num_shared: int) -> dict:
    """Check the Gaussian part of a version-2 manifest (its header already checked by
    :func:`numpyro_pc.io.file_format.check_manifest`): ``family`` and the fields of
    ``manifest["gaussian"]`` (:data:`GAUSSIAN_FIELDS`), then the declared arrays.

    :return: ``{array name: (dtype, shape, sha256)}`` of the declared arrays.
    :raises CorruptFileError: a field of the wrong type or out of range.
    """
    part = manifest["gaussian"]
    storages = _family_storage(manifest.get("family"))
    family = _choice(manifest, "family", tuple(storages))
    _choice(part, "curvature", ("hessian", "ggn"), "gaussian.")
    storage = _choice(part, "storage", storages[family], "gaussian.")
    _check_rule(part["rule"])
    if not (part["chunk_size"] is None or _is_int(part["chunk_size"], 1)):
        _fail("gaussian.chunk_size", "null or a positive integer", part["chunk_size"])
    if not _is_int(part["next_id"]):
        _fail("gaussian.next_id", "an integer ≥ 0", part["next_id"])
    required = {"mean", "precision", "data_ids", TOMBSTONES} | {f"sites.{n}" for n in SITE_ARRAYS}
    required -= {f"sites.{n}" for n in _CURVATURE_ARRAYS - set(STORES[storage].file_shapes(0, 0, 0))}
    return check_array_entries(manifest, _NAME, required, num_example, num_shared,
                               optional={"offset.linear", "offset.precision"}, what="a dual posterior")


def check_binding_fields(manifest: dict) -> tuple[int, int]:
    """Check the fields that bind a saved posterior to its model: ``latent``, ``plate``,
    ``observed``, ``arguments``, ``example_shapes``, ``fingerprint``, ``signed`` and ``residual``
    (shared by every kind of saved posterior).

    :return: ``(number of per-example arguments, number of shared arguments)``.
    :raises CorruptFileError: a field is missing, of the wrong type or out of range.
    """
    latent = manifest.get("latent")
    if not isinstance(latent, dict) or set(latent) not in ({"names", "unconstrained_shapes"}, {
            "names", "unconstrained_shapes", "discrete_names", "discrete_shapes"}) \
            or not isinstance(latent["names"], list) or not all(isinstance(n, str) for n in latent["names"]) \
            or not isinstance(latent["unconstrained_shapes"], list) \
            or len(latent["names"]) != len(latent["unconstrained_shapes"]):
        _fail("latent", "an object with 'names' and 'unconstrained_shapes' of equal length", latent)
    for k, shape in enumerate(latent["unconstrained_shapes"]):
        _ints(shape, f"latent.unconstrained_shapes[{k}]")
    if "discrete_names" in latent:  # posteriors with discrete factors (numpyro_pc.families.discrete)
        names, shapes = latent["discrete_names"], latent["discrete_shapes"]
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or not isinstance(shapes, list) \
                or len(names) != len(shapes) or not names:
            _fail("latent", "'discrete_names' and 'discrete_shapes' lists of equal, non-zero length", latent)
        for k, shape in enumerate(shapes):
            _ints(shape, f"latent.discrete_shapes[{k}]")
    if not isinstance(manifest.get("plate"), str):
        _fail("plate", "a string", manifest.get("plate"))
    observed = manifest.get("observed")
    if not isinstance(observed, list) or not all(isinstance(n, str) for n in observed):
        _fail("observed", "a list of site names", observed)
    num_example, num_shared = _check_layout(manifest.get("arguments"))
    shapes = manifest.get("example_shapes")
    if not isinstance(shapes, list) or len(shapes) != num_example or not all(
            isinstance(s, list) and len(s) == 2 and s[1] in DATA_DTYPES for s in shapes):
        _fail("example_shapes", f"{num_example} pairs [shape, dtype] (one per per-example argument)", shapes)
    for k, (shape, _) in enumerate(shapes):
        _ints(shape, f"example_shapes[{k}]")
    for key in ("fingerprint", "signed"):
        value = manifest.get(key)
        kind = {"fingerprint": dict, "signed": bool}[key]
        if key in manifest and not isinstance(value, kind):
            _fail(key, f"a {kind.__name__}", value)
    residual = manifest.get("residual", 0.0)  # JSON admits NaN and Infinity, which would disable the comparison
    if not isinstance(residual, float) or not (math.isfinite(residual) and residual >= 0.0):
        _fail("residual", "a finite float ≥ 0", residual)
    return num_example, num_shared


def check_array_entries(manifest, pattern, required, num_example, num_shared, optional=(),
                        what="a dual posterior") -> dict:
    """Check the manifest's ``arrays`` entries: names matching ``pattern``, each with a SHA-256, a
    numeric dtype and a shape; exactly ``required`` plus the data arguments' arrays, and of
    ``optional`` all or none.

    :return: ``{array name: (dtype, shape, sha256)}``.
    :raises CorruptFileError:
    """
    entries = manifest.get("arrays")
    if not isinstance(entries, dict):
        _fail("arrays", "an object", entries)
    declared = {}
    for name, meta in entries.items():
        where = f"arrays.{name}"
        if not pattern.fullmatch(name):
            _fail("arrays", f"only the arrays of {what}", name)
        if not isinstance(meta, dict) or set(meta) != {"sha256", "dtype", "shape"} or meta["dtype"] not in DATA_DTYPES \
                or not isinstance(meta["sha256"], str) or not re.fullmatch(r"[0-9a-f]{64}", meta["sha256"]):
            _fail(where, "an object with a sha256 (64 hex digits), a numeric dtype and a shape", meta)
        declared[name] = (meta["dtype"], tuple(_ints(meta["shape"], f"{where}.shape")), meta["sha256"])
    required = set(required) | {f"data.example.{k}" for k in range(num_example)} \
        | {f"data.shared.{k}" for k in range(num_shared)}
    optional = set(optional)
    if not required <= set(declared) or not set(declared) <= required | optional:
        extra = " (plus, optionally, both offset arrays)" if optional else ""
        _fail("arrays", f"the arrays {sorted(required)}{extra}", sorted(declared))
    if len(optional & set(declared)) not in (0, len(optional)):
        _fail("arrays", "both offset arrays or neither", sorted(optional & set(declared)))
    return declared


def check_contents(manifest: dict, arrays: dict) -> None:
    """Check that the arrays agree with the manifest and with each other (see the module docstring).

    :raises InconsistentFileError:
    """
    dtype, family, part = manifest["dtype"], manifest["family"], manifest["gaussian"]
    floats = ["mean", "precision"] + [f"sites.{n}" for n in ("grad", "curvature", "jac", "lam", "loss", "ref_means",
                                                             "prior_grad", "prior_curvature", "prior_loss",
                                                             "prior_ref")] + ["offset.linear", "offset.precision"]
    for name in floats:
        if name in arrays and str(arrays[name].dtype) != dtype:
            raise DtypeMismatchError(f"array {name!r}: expected dtype {dtype} (the manifest's), found "
                                     f"{arrays[name].dtype}")
    for name in ("data_ids", "sites.ids", "sites.ref_index"):
        if str(arrays[name].dtype) not in INT_DTYPES:
            _inconsistent(name, f"an integer dtype {INT_DTYPES}", arrays[name].dtype)
    d = sum(math.prod(s) for s in manifest["latent"]["unconstrained_shapes"])
    n = arrays["sites.ids"].shape[0] if arrays["sites.ids"].ndim == 1 else -1
    refs = arrays["sites.ref_means"].shape[0] if arrays["sites.ref_means"].ndim == 2 else -1
    k = arrays["sites.jac"].shape[1] if arrays.get("sites.jac") is not None and arrays["sites.jac"].ndim == 3 else 0
    precision = get_family(family).precision_shape(d)
    rows = arrays["data_ids"].shape[0] if arrays["data_ids"].ndim == 1 else -1
    store = STORES[part["storage"]]
    width = arrays["sites.index"].shape[1] if store.sparse_rows and arrays["sites.index"].ndim == 2 else 0
    # a separable prior's curvature may be held as its diagonal (numpyro_pc.sites.prior)
    prior = (d,) if arrays["sites.prior_curvature"].ndim == 1 else (d, d)
    shapes = {"mean": (d,), "precision": precision, "offset.linear": (d,), "offset.precision": precision,
              "sites.grad": store.grad_shape(n, d, width), "sites.loss": (n,), "sites.ids": (n,),
              "sites.ref_index": (n,), "sites.ref_means": (refs, d), "sites.prior_grad": (d,),
              "sites.prior_curvature": prior, "sites.prior_loss": (), "sites.prior_ref": (d,), "data_ids": (rows,)}
    file_shapes = store.file_shapes(n, k, d, width) if store.sparse_rows else store.file_shapes(n, k, d)
    shapes.update({f"sites.{name}": shape for name, shape in file_shapes.items()})
    for name, shape in shapes.items():
        if name in arrays and arrays[name].shape != shape:
            _inconsistent(name, f"shape {shape} (d={d} latents, N={n} sites, {rows} data rows)", arrays[name].shape)
    check_example_rows(manifest, arrays, rows)
    _check_ids(manifest, arrays, refs)
    if store.sparse_rows:
        _check_sparse(arrays, d, width)
    _check_precision(family, arrays["precision"])


def check_example_rows(manifest: dict, arrays: dict, rows: int) -> None:
    """Check the data arrays against ``example_shapes`` (``rows`` rows each, the declared dtypes,
    one example no larger than the file's arrays) and that every float array is finite.

    :raises InconsistentFileError:
    """
    for j, (shape, _) in enumerate(manifest["example_shapes"]):
        name = f"data.example.{j}"
        if arrays[name].shape != (rows, *shape):
            _inconsistent(name, f"shape {(rows, *shape)} ({rows} data rows)", arrays[name].shape)
    declared = max(sum(value.nbytes for value in arrays.values()), MIN_EXAMPLE_BOUND)
    for j, (shape, data_dtype) in enumerate(manifest["example_shapes"]):
        if str(arrays[f"data.example.{j}"].dtype) != data_dtype:
            _inconsistent(f"data.example.{j}", f"dtype {data_dtype}", arrays[f"data.example.{j}"].dtype)
        row = math.prod(shape) * np.dtype(data_dtype).itemsize
        if row > declared:  # only possible without rows: the model is traced on one such (zero) example
            _inconsistent(f"data.example.{j}", f"examples of at most {declared} bytes (the file's arrays)",
                          f"{row} bytes per example")
    for name, value in arrays.items():
        if value.dtype.kind == "f" and not np.all(np.isfinite(value)):
            _inconsistent(name, "finite values", f"{int(np.sum(~np.isfinite(value)))} NaN or infinite value(s)")


def _inconsistent(name, expected, found) -> NoReturn:
    raise InconsistentFileError(f"array {name!r}: expected {expected}, found {found}")


def _check_sparse(arrays, d, width) -> None:
    """A sparse store's columns are integers in ``[0, d)`` and its counts in ``[0, width]``."""
    for name, top in (("sites.index", d - 1), ("sites.nnz", width)):
        value = arrays[name]
        if str(value.dtype) not in INT_DTYPES:
            _inconsistent(name, f"an integer dtype {INT_DTYPES}", value.dtype)
        if value.size and (value.min() < 0 or value.max() > top):
            _inconsistent(name, f"values in [0, {top}]", f"{value.min()}..{value.max()}")


def _check_ids(manifest, arrays, refs) -> None:
    next_id = manifest["gaussian"]["next_id"]
    ids, data_ids = arrays["sites.ids"], arrays["data_ids"]
    for name, values in (("sites.ids", ids), ("data_ids", data_ids)):
        if values.size and (values.min() < 0 or values.max() >= next_id):
            _inconsistent(name, f"ids in [0, next_id={next_id})", f"ids from {values.min()} to {values.max()}")
        if np.unique(values).size != values.size:
            _inconsistent(name, "unique ids", f"{values.size - np.unique(values).size} duplicate(s)")
    check_tombstones(arrays, next_id, ids, data_ids)
    if np.setdiff1d(data_ids, ids).size:
        _inconsistent("data_ids", "ids that have a site", f"{np.setdiff1d(data_ids, ids).size} id(s) without a site")
    index = arrays["sites.ref_index"]
    if index.size and (index.min() < 0 or index.max() >= refs):
        _inconsistent("sites.ref_index", f"rows of sites.ref_means in [0, {refs})", f"{index.min()}..{index.max()}")


def _check_precision(family, precision) -> None:
    verdict = get_family(family).saved_precision_problem(np.asarray(precision))
    if verdict is None:
        return
    if verdict == "asymmetric":
        _inconsistent("precision", "a symmetric matrix", "an asymmetric one")
    _inconsistent("precision", "a positive definite precision", "a matrix that is not (a Cholesky factor or "
                  "a variance fails)")


def check_residual(saved, recomputed, dtype) -> None:
    """Compare the dual-form residual recomputed on load with the one recorded at save time.

    Recomputing on the same arrays gives the same value up to rounding; an edited site,
    prior site or offset moves it.

    :raises InconsistentFileError:
    """
    slack = 10 * math.sqrt(float(np.finfo(np.dtype(dtype)).eps))
    if not math.isfinite(recomputed) or (saved is not None and recomputed > max(2 * saved, saved + slack)):
        raise InconsistentFileError(f"the dual-form residual of the saved arrays is {recomputed:.3g}, but "
                                    f"{saved:.3g} was recorded when saving: the sites, prior site or offset were "
                                    "altered" if saved is not None else
                                    f"the dual-form residual of the saved arrays is {recomputed}")


# --------------------------------------------------------------------------- the exponential-family kind

EF_FIELDS = frozenset({"config", "conjugate_prior", "next_id"})  # manifest["ef"]
_EF_NAME = re.compile(r"(natural|tombstones|data_ids|sites\.(grads|prior|ids)|data\.(example|shared)\.\d+)")
_IDENTIFIER = re.compile(r"[a-z][a-z0-9_]{0,31}")
_CONFIG = {"num_nodes": (1, 10**4), "num_samples": (1, 10**7), "seed": (0, 2**32)}



def check_ef_part(manifest: dict, num_example: int, num_shared: int) -> dict:
    """Check the exponential-family part of a version-2 manifest (its header already checked).

    :return: ``{array name: (dtype, shape, sha256)}`` of the declared arrays.
    :raises CorruptFileError: a field of the wrong type or out of range.
    """
    part = manifest["ef"]
    if not _is_int(part["next_id"], 0, _MAX_ID):  # null included: every version-2 file records its next id
        fail_field("ef.next_id", f"an integer in [0, {_MAX_ID})", part["next_id"])
    if not isinstance(part["conjugate_prior"], bool):
        fail_field("ef.conjugate_prior", "true or false", part["conjugate_prior"])
    config = part["config"]
    if not isinstance(config, dict) or set(config) != {"rule", *_CONFIG}:
        fail_field("ef.config", f"an object with the fields {sorted({'rule', *_CONFIG})}", config)
    if not isinstance(config["rule"], str) or not _IDENTIFIER.fullmatch(config["rule"]):
        fail_field("ef.config.rule", "the name of an expectation rule (e.g. 'quadrature' or 'mc')", config["rule"])
    for name, (low, high) in _CONFIG.items():
        if not _is_int(config[name], low, high):
            fail_field(f"ef.config.{name}", f"{low} ≤ integer < {high}", config[name])
    family = manifest.get("family")
    names = manifest["latent"]["names"] + manifest["latent"].get("discrete_names", [])
    if not isinstance(family, dict) or list(family) != names or not all(
            isinstance(v, str) and _IDENTIFIER.fullmatch(v) for v in family.values()):
        fail_field("family", f"an object naming the family of each latent site {names}, in that order", family)
    required = {"natural", "sites.grads", "sites.prior", "sites.ids", TOMBSTONES}
    if isinstance(manifest.get("arrays"), dict) and "data_ids" in manifest["arrays"]:
        required.add("data_ids")  # written when an update dropped the data of some examples
    return check_array_entries(manifest, _EF_NAME, required, num_example, num_shared,
                               what="an exponential-family posterior")



def check_ef_contents(manifest: dict, arrays: dict) -> None:
    """Check that the arrays agree with the manifest and with each other: dtypes, shapes
    (``natural (P,)``, ``sites.prior (P,)``, ``sites.grads (N, P)``, ``sites.ids (N,)``,
    ``N`` data rows), finite values, unique non-negative ids. The family's size ``P`` is
    checked on load, once the model is bound.

    :raises InconsistentFileError, DtypeMismatchError:
    """
    dtype = manifest["dtype"]
    for name in ("natural", "sites.grads", "sites.prior"):
        if str(arrays[name].dtype) != dtype:
            raise DtypeMismatchError(f"array {name!r}: expected dtype {dtype} (the manifest's), found "
                                     f"{arrays[name].dtype}")
    ids = arrays["sites.ids"]
    if str(ids.dtype) not in INT_DTYPES:
        _inconsistent("sites.ids", f"an integer dtype {INT_DTYPES}", ids.dtype)
    if arrays["natural"].ndim != 1:
        _inconsistent("natural", "a vector (P,)", f"shape {arrays['natural'].shape}")
    size = arrays["natural"].shape[0]
    rows = ids.shape[0] if ids.ndim == 1 else -1
    for name, shape in (("sites.prior", (size,)), ("sites.grads", (rows, size)), ("sites.ids", (rows,))):
        if arrays[name].shape != shape:
            _inconsistent(name, f"shape {shape} (P={size} natural parameters, N={rows} sites)", arrays[name].shape)
    if "data_ids" in arrays:
        data_ids = arrays["data_ids"]
        if str(data_ids.dtype) not in INT_DTYPES or data_ids.ndim != 1:
            _inconsistent("data_ids", f"a vector of ids, an integer dtype {INT_DTYPES}",
                          f"dtype {data_ids.dtype}, shape {data_ids.shape}")
        try:  # each id's row among the sites
            where = positions(ids, data_ids) if ids.ndim == 1 else np.full(data_ids.size, -1)
        except UnknownExampleError:
            where = np.full(data_ids.size, -1)
        if data_ids.size >= ids.size or np.any(where < 0) or np.any(np.diff(where) <= 0):
            _inconsistent("data_ids", "fewer ids than sites, each with a site, in the sites' order",
                          f"{data_ids.size} id(s) for {ids.size} sites, {int(np.sum(where < 0))} without a site or "
                          "out of order")
        rows = data_ids.shape[0]
    check_example_rows(manifest, arrays, rows)
    if ids.size and (ids.min() < 0 or ids.max() >= _MAX_ID):
        _inconsistent("sites.ids", f"ids in [0, {_MAX_ID})", f"ids from {ids.min()} to {ids.max()}")
    if np.unique(ids).size != ids.size:
        _inconsistent("sites.ids", "unique ids", f"{ids.size - np.unique(ids).size} duplicate(s)")
    next_id = manifest["ef"]["next_id"]
    if ids.size and ids.max() >= next_id:
        _inconsistent("sites.ids", f"ids below next_id={next_id}", f"ids up to {ids.max()}")
    check_tombstones(arrays, next_id, ids)


def check_tombstones(arrays: dict, next_id: int, *held) -> None:
    """Check the ``tombstones`` member (the ids of deleted examples) of a file of either kind: an
    integer dtype, one dimension, unique ids in ``[0, next_id)``, none of them among the ``held``
    id arrays (a deleted id never comes back).

    :raises InconsistentFileError:
    """
    value = arrays[TOMBSTONES]
    if str(value.dtype) not in INT_DTYPES:
        _inconsistent(TOMBSTONES, f"an integer dtype {INT_DTYPES}", value.dtype)
    if value.ndim != 1:
        _inconsistent(TOMBSTONES, "a vector of ids (one dimension)", f"shape {value.shape}")
    if value.size and (value.min() < 0 or value.max() >= next_id):
        _inconsistent(TOMBSTONES, f"ids in [0, next_id={next_id})", f"ids from {value.min()} to {value.max()}")
    unique = np.unique(value)
    if unique.size != value.size:
        _inconsistent(TOMBSTONES, "unique ids of deleted examples", f"{value.size - unique.size} duplicate(s)")
    for ids in held:
        back = np.intersect1d(unique, ids)
        if back.size:
            _inconsistent(TOMBSTONES, "ids of deleted examples, none of them held",
                          f"{back.size} held id(s), e.g. {back[:5].tolist()}")


def read_tombstones(arrays: dict) -> tuple[int, ...]:
    """The deleted ids of a file's ``tombstones`` member (checked by :func:`check_tombstones`), in the
    order written."""
    return tuple(int(t) for t in arrays[TOMBSTONES].tolist())


def tombstones_member(tombstones) -> np.ndarray:
    """The ``tombstones`` member written for a posterior's deleted ids: ``int64``, one dimension, in
    the posterior's order (what :func:`read_tombstones` gives back)."""
    return np.asarray(tuple(int(t) for t in tombstones), np.int64).reshape(-1)


