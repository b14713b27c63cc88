"""Saving and loading a :class:`~numpyro_pc.DualPosterior` safely.

The file is one uncompressed zip archive (NumPy's ``.npz`` layout) holding every array
and a ``manifest.json`` in the one schema of :mod:`numpyro_pc.io.file_format` (format
version 2): format name and version, ``kind`` (``"gaussian"`` here), family, dtype, the
model's latent signature and :mod:`fingerprint <numpyro_pc.io.fingerprint>`, the argument
layout, the dual-form residual and a SHA-256 checksum of every array, and in
``manifest["gaussian"]`` the expectation rule, curvature, storage, chunk size and next id;
the ids of deleted examples are the array ``tombstones``. Files of version 1 load too (upgraded on reading, never
rewritten). Nothing is pickled and loading never executes code from the file.

Writes are atomic (see :mod:`numpyro_pc.io.archive`): a crash at any point leaves the
previous save intact, and temporaries of interrupted saves are removed by the next save.

A file may come from someone else, so :func:`load` treats it as untrusted input: reading
is bounded by the sizes the manifest declares (compressed members are refused), the
manifest and arrays are validated (:mod:`numpyro_pc.io.validation`), the residual is
recomputed, and the model's fingerprint is compared with the saved one. Every failure
raises a :class:`~numpyro_pc.errors.PersistenceError` subclass (re-exported here).
``save(..., key=...)`` adds an HMAC that ``load(..., key=...)`` checks (see the
documentation page on saving for the threat model).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import jax

from numpyro_pc.dual.base import DualPosteriorBase
from numpyro_pc.dual.expfam import EFPosterior
from numpyro_pc.errors import (
    CorruptFileError,
    DtypeMismatchError,
    FormatVersionError,
    InconsistentFileError,
    IntegrityError,
    MissingFileError,
    ModelMismatchError,
    OversizedFileError,
    PersistenceError,
    PosteriorCorrectionError,
    SavedModelMismatchError,
)
from numpyro_pc.families.registry import Gaussian, GaussianNatural, get_family
from numpyro_pc.model.rows import to_device
from numpyro_pc.options import check_path
from numpyro_pc.protocols.capabilities import site_curvature
from numpyro_pc.protocols.posterior import by_site_table, provides
from numpyro_pc.protocols.records import LoadInfo
from numpyro_pc.sites.expectations import ExpectationRule
from numpyro_pc.sites.expfam_table import EFSiteTable
from numpyro_pc.sites.gaussian import Sites
from numpyro_pc.solvers.site_problem import dual_residual

from .expfam import load_ef, save_ef
from .file_format import FORMAT, VERSION, build_manifest, check_file, check_read_archive, read_posterior_file
from .fingerprint import model_fingerprint
from .saved_model import (
    argument_layout,
    bind_saved_model,
    binding_manifest,
    digest,
    site_arrays,
    with_data_arrays,
    write_checked,
)
from .validation import DATA_DTYPES, TOMBSTONES, check_residual, read_tombstones, tombstones_member

__all__ = ["FORMAT", "VERSION", "PersistenceError", "MissingFileError", "CorruptFileError", "OversizedFileError",
           "InconsistentFileError", "IntegrityError", "FormatVersionError", "ModelMismatchError",
           "SavedModelMismatchError", "DtypeMismatchError", "save", "load", "digest", "argument_layout",
           "bind_saved_model", "check_read_archive"]


def _arrays(post) -> dict:
    arrays = {"mean": post.state.mean, "precision": post.state.precision, "data_ids": post.data_ids,
              TOMBSTONES: tombstones_member(post.tombstones)}
    if post.offset is not None:
        arrays["offset.linear"], arrays["offset.precision"] = post.offset.linear, post.offset.precision
    return with_data_arrays(arrays, post.data, DATA_DTYPES, post.sites)


@provides("save")
def save(post, path: str | os.PathLike, key: bytes | str | None = None) -> Path:
    """Write ``post`` to ``path`` atomically (see the module docstring for the format).

    The file is checked as :func:`load` would check it before anything is written, so a
    save that succeeds can be loaded back. An exponential-family
    :class:`~numpyro_pc.dual.expfam.EFPosterior` is written by :func:`numpyro_pc.io.expfam.save_ef`
    through the same container.

    :param key: optional HMAC key (``bytes`` or ``str``); :func:`load` with the same key
        then refuses any file not signed with it.
    :return: the :class:`~pathlib.Path` written.
    """
    check_path(path)
    return _save(post, path, key)


_save = by_site_table("pc.save", PersistenceError)


@_save.register(EFSiteTable)
def _save_ef(post, path, key) -> Path:
    return save_ef(post, path, key=key)


@_save.register(Sites)
def _save_gaussian(post, path, key) -> Path:
    arrays = _arrays(post)
    spec = post.spec
    dtype = str(arrays["mean"].dtype)
    with jax.enable_x64(dtype == "float64"):
        fingerprint = model_fingerprint(spec, post.data)
    part = {"rule": dict(vars(post.rule)), "curvature": post.curvature, "storage": post.sites.storage,
            "chunk_size": post.chunk_size, "next_id": post.next_id}
    binding = binding_manifest(spec, post.data, arrays, float(post.site_identity_residual), fingerprint,
                               key is not None)
    manifest = build_manifest("gaussian", post.family.name, dtype, part, binding, post.stale_sites)
    return write_checked(path, manifest, arrays, check_file, key=key)


def load(path: str | os.PathLike, model: Callable, key: bytes | str | None = None) -> DualPosteriorBase | EFPosterior:
    """Read a posterior saved by :func:`save` and bind it to ``model``, checking everything.

    A file saved from an :class:`~numpyro_pc.dual.expfam.EFPosterior` (manifest ``kind``
    ``"ef"``) is read and checked by the same code (:func:`numpyro_pc.io.file_format.read_posterior_file`)
    and bound to the model by :func:`numpyro_pc.io.expfam.load_ef`. Files of format version 1
    (either kind) are upgraded to the version-2 layout as they are read; the file is not changed.

    The file is untrusted input: what is read is bounded by the declared sizes, the
    manifest and arrays are validated, the dual-form residual is recomputed and compared
    with the saved one, and the model's fingerprint (latent sites, distribution types and
    fixed parameters, fixed arguments) must match the saved one. Files written before
    fingerprints were saved load with a warning that the model could not be verified.

    :param model: the NumPyro model the posterior was fitted with.
    :param key: the HMAC key given to :func:`save`; when given, an unsigned file or a
        wrong signature raises :class:`~numpyro_pc.errors.IntegrityError`.
    :raises ~numpyro_pc.errors.PersistenceError: itself when the file cannot be opened (permissions)
        or ``key`` is not a non-empty ``bytes``/``str``; otherwise one of its subclasses:
        :class:`~numpyro_pc.errors.MissingFileError`, :class:`~numpyro_pc.errors.CorruptFileError`
        (:class:`~numpyro_pc.errors.OversizedFileError`, :class:`~numpyro_pc.errors.InconsistentFileError`,
        :class:`~numpyro_pc.errors.IntegrityError`), :class:`~numpyro_pc.errors.FormatVersionError`,
        :class:`~numpyro_pc.errors.DtypeMismatchError` or :class:`~numpyro_pc.errors.SavedModelMismatchError`
        (also a :class:`~numpyro_pc.errors.ModelMismatchError`).
    """
    manifest, arrays = read_posterior_file(path, key=key)
    if manifest["kind"] == "ef":
        return load_ef(path, model, manifest, arrays)
    return _load_gaussian(path, model, manifest, arrays)


def _load_gaussian(path, model, manifest, arrays) -> DualPosteriorBase:
    """The Gaussian posterior of a file read and checked by :func:`~numpyro_pc.io.file_format.read_posterior_file`:
    the dual-form residual recomputed and compared, the model bound and its fingerprint compared."""
    dtype, part = manifest["dtype"], manifest["gaussian"]
    family = get_family(manifest["family"])
    with jax.enable_x64(dtype == "float64"):
        sites = Sites.from_arrays(site_arrays(arrays), storage=part["storage"], detail=site_curvature(family).detail)
        state = Gaussian(to_device(arrays["mean"]), to_device(arrays["precision"]))
        offset = None
        if "offset.linear" in arrays:
            offset = GaussianNatural(to_device(arrays["offset.linear"]), to_device(arrays["offset.precision"]))
        try:
            residual = dual_residual(family, state, sites, offset)[0]
        except PosteriorCorrectionError as err:
            raise InconsistentFileError(f"{path}: the sites cannot be combined ({err})") from err
        check_residual(manifest.get("residual"), residual, dtype)
        spec, data = bind_saved_model(path, model, manifest, arrays)
    return DualPosteriorBase(spec, data, family, state, sites, ExpectationRule(**part["rule"]),
                             part["curvature"], part["storage"], part["chunk_size"], (), None,
                             data_ids=to_device(arrays["data_ids"]), tombstones=read_tombstones(arrays),
                             next_id=part["next_id"], offset=offset, stale_sites=manifest["stale_sites"],
                             record=LoadInfo(residual=float(residual)))
