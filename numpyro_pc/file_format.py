"""The one manifest schema of a saved posterior, its versions, and reading a file of any version.

Every saved posterior — Gaussian (:mod:`numpyro_pc.io`) or exponential-family
(:mod:`numpyro_pc.ef_io`) — is one container (:mod:`numpyro_pc.archive`) whose
``manifest.json`` has, in format version :data:`VERSION` (2):

- a common header: ``format``, ``version``, ``kind`` (``"gaussian"`` or ``"ef"``), ``family``
  (the kind's description of its family), ``dtype``, the model binding of
  :func:`~numpyro_pc.saved_model.binding_manifest` (``latent``, ``plate``, ``observed``,
  ``arguments``, ``example_shapes``, ``fingerprint``, ``signed``), the ``arrays`` entries
  (SHA-256, dtype, shape), the dual-form ``residual`` and ``stale_sites``;
- the kind's own fields in one object named after the kind: ``"gaussian"``: ``rule``,
  ``curvature``, ``storage``, ``chunk_size``, ``next_id``, ``tombstones``; ``"ef"``:
  ``config``, ``conjugate_prior``, ``next_id`` (null in a file upgraded from version 1) and
  ``tombstones``.

The sites are stored as ``sites.<name>``, one member per entry of the site table's
:meth:`~numpyro_pc.site_protocol.SiteTable.arrays`; beside them a Gaussian file holds
``mean``, ``precision``, ``data_ids``, ``tombstones`` and optionally ``offset.*``, an
exponential-family file ``natural``, and both the data rows ``data.example.k`` and
``data.shared.k``.

:func:`check_manifest` checks the common header once and hands the kind's part to the
kind's checker (:func:`numpyro_pc.validation.check_gaussian_part`,
:func:`numpyro_pc.validation.check_ef_part`). Files of version 1 (two manifests: the
Gaussian one without ``kind``, and ``"kind": "ef"`` with unprefixed site arrays) are
mapped to the version-2 layout by :func:`upgrade` before any check, so every check sees
one schema; the file itself is never rewritten, and its checksums and signature are
verified on the bytes as written.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax

from .archive import read_archive
from .errors import CorruptFileError, DtypeMismatchError, FormatVersionError, IntegrityError
from .validation import (EF_FIELDS, FLOAT_DTYPES, GAUSSIAN_FIELDS, check_binding_fields, check_contents,
                         check_ef_contents, check_ef_part, check_gaussian_part, fail_field)

__all__ = ["FORMAT", "VERSION", "READ_VERSIONS", "COMMON_FIELDS", "build_manifest", "check_manifest", "check_file",
           "upgrade", "read_posterior_file", "check_read_archive"]

FORMAT = "numpyro_pc.dual_posterior"
VERSION = 2
READ_VERSIONS = (1, 2)  # version 1 is upgraded on reading
COMMON_FIELDS = frozenset({"format", "version", "kind", "family", "dtype", "latent", "plate", "observed", "arguments",
                           "example_shapes", "arrays", "residual", "fingerprint", "signed", "stale_sites"})


class _Kind(NamedTuple):
    fields: frozenset  # the fields of the kind's part
    check: Callable  # check(manifest, num_example, num_shared) -> declared arrays
    contents: Callable  # contents(manifest, arrays)
    v1_arrays: dict  # version-1 array name -> version-2 name
    v1_defaults: dict  # fields of the kind's part that version 1 did not write -> their upgraded value


_KINDS = {
    "gaussian": _Kind(GAUSSIAN_FIELDS, check_gaussian_part, check_contents, {}, {}),
    # version 1 kept no deleted ids for exponential-family posteriors: none are known, and the next id is
    # the one past the largest held (EFPosterior's floor)
    "ef": _Kind(EF_FIELDS, check_ef_part, check_ef_contents,
                {"grads": "sites.grads", "prior": "sites.prior", "ids": "sites.ids"},
                {"tombstones": [], "next_id": None}),
}


def build_manifest(kind: str, family, dtype: str, part: dict, binding: dict, stale_sites: bool) -> dict:
    """The version-2 manifest of a posterior of ``kind``: the common header, ``binding``
    (:func:`~numpyro_pc.saved_model.binding_manifest`) and ``part``, the kind's own fields."""
    return {"format": FORMAT, "version": VERSION, "kind": kind, "family": family, "dtype": dtype, kind: part,
            "stale_sites": bool(stale_sites), **binding}


def _versions() -> str:
    return " and ".join(str(v) for v in READ_VERSIONS)


def _check_format(manifest) -> int:
    if manifest.get("format") != FORMAT:
        raise CorruptFileError(f"not a saved posterior: format {manifest.get('format')!r}, expected {FORMAT!r}")
    version = manifest.get("version")
    if type(version) is not int or version not in READ_VERSIONS:
        raise FormatVersionError(f"format version {version!r}; this numpyro_pc reads versions {_versions()} "
                                 "(version 1 is upgraded on reading)")
    return version


def check_manifest(manifest: dict) -> dict:
    """Check a version-2 manifest: the common header, then the kind's part by the kind's checker.

    :return: ``{array name: (dtype, shape, sha256)}`` of the declared arrays.
    :raises CorruptFileError: a field is missing, unknown, of the wrong type or out of range.
    :raises FormatVersionError: a version other than :data:`VERSION` (upgrade version 1 first).
    """
    if _check_format(manifest) != VERSION:
        raise FormatVersionError(f"format version {manifest['version']!r} where version {VERSION} was expected "
                                 "(a version-1 manifest is upgraded before it is checked)")
    kind = manifest.get("kind")
    if not isinstance(kind, str) or kind not in _KINDS:
        fail_field("kind", f"one of {sorted(_KINDS)}", kind)
    unknown = sorted(set(manifest) - COMMON_FIELDS - {kind}, key=str)
    if unknown:
        if unknown[0] in _KINDS:
            fail_field("kind", f"{unknown[0]!r}, the kind whose fields the file holds", kind)
        fail_field(unknown[0], f"only the fields {sorted(COMMON_FIELDS | {kind})}", manifest[unknown[0]])
    schema, part = _KINDS[kind], manifest.get(kind)
    if not isinstance(part, dict) or set(part) != schema.fields:
        fail_field(kind, f"an object with the fields {sorted(schema.fields)}", part)
    if not isinstance(manifest.get("stale_sites"), bool):
        fail_field("stale_sites", "true or false", manifest.get("stale_sites"))
    if manifest.get("dtype") not in FLOAT_DTYPES:
        fail_field("dtype", f"one of {list(FLOAT_DTYPES)}", manifest.get("dtype"))
    num_example, num_shared = check_binding_fields(manifest)
    return schema.check(manifest, num_example, num_shared)


def check_file(manifest: dict, arrays: dict) -> None:
    """Check a version-2 manifest (:func:`check_manifest`) and the arrays against it (the kind's
    contents check: dtypes, shapes, ids, finite values).

    :raises CorruptFileError, InconsistentFileError, DtypeMismatchError, FormatVersionError:
    """
    check_manifest(manifest)
    _KINDS[manifest["kind"]].contents(manifest, arrays)


def upgrade(manifest: dict, arrays: dict) -> tuple[dict, dict]:
    """The manifest and arrays in the version-2 layout: as they are for version 2,
    :func:`_upgrade_v1` for version 1 (neither argument is modified).

    :raises CorruptFileError: another format, or a version-1 manifest with fields version 1 never wrote.
    :raises FormatVersionError: a version this release does not read.
    """
    if _check_format(manifest) == VERSION:
        return manifest, arrays
    return _upgrade_v1(manifest, arrays)


def _upgrade_v1(manifest: dict, arrays: dict) -> tuple[dict, dict]:
    """Map a version-1 manifest and its arrays (either kind) to the version-2 layout.

    Version 1 wrote the Gaussian manifest without ``kind`` and the kind's fields at the top
    level, ``stale_sites`` only when true, and the exponential-family sites as ``grads``,
    ``prior`` and ``ids``. Only the layout changes: every value is kept as read, and the
    checks of version 2 then apply. A field version 1 never wrote (a version-2 field, say) is
    refused rather than carried over.

    :raises CorruptFileError:
    """
    kind = "ef" if "kind" in manifest else "gaussian"
    if manifest.get("kind", "ef") != "ef":
        fail_field("kind", "'ef' or no kind (a Gaussian posterior) in a version-1 file", manifest["kind"])
    schema = _KINDS[kind]
    allowed = COMMON_FIELDS - ({"kind"} if kind == "gaussian" else set()) | (schema.fields - set(schema.v1_defaults))
    unknown = sorted(set(manifest) - allowed, key=str)
    if unknown:
        fail_field(unknown[0], f"only the fields of a version-1 {kind!r} file {sorted(allowed)}",
                   manifest[unknown[0]])
    if "stale_sites" in manifest and manifest["stale_sites"] is not True:
        fail_field("stale_sites", "true (version 1 wrote it only for a posterior whose sites are stale)",
                   manifest["stale_sites"])
    renames = schema.v1_arrays
    entries = manifest.get("arrays")
    if isinstance(entries, dict):
        clash = sorted(name for name in entries if name in renames.values())
        if clash:
            fail_field("arrays", f"the version-1 names {sorted(renames)}", clash)
        entries = {renames.get(name, name): meta for name, meta in entries.items()}
    upgraded = {k: v for k, v in manifest.items() if k not in schema.fields}
    upgraded.update(version=VERSION, kind=kind, stale_sites="stale_sites" in manifest, arrays=entries)
    upgraded[kind] = {k: manifest[k] for k in sorted(schema.fields) if k in manifest}
    upgraded[kind].update(copy.deepcopy(schema.v1_defaults))  # fresh values: callers may edit the result
    return upgraded, {renames.get(name, name): value for name, value in arrays.items()}


def read_posterior_file(path, key=None) -> tuple[dict, dict]:
    """Read a saved posterior of any kind and readable version, as untrusted input.

    The manifest is upgraded to version 2 and checked before any array is read, the
    arrays are read with the bounds it declares and their checksums (and, with ``key``,
    the signature over the file as written) verified, then manifest and arrays are
    upgraded together and the arrays checked against the manifest.

    :return: ``(manifest, arrays)`` in the version-2 layout.
    :raises PersistenceError: one of its subclasses (see :func:`numpyro_pc.io.load`).
    """
    def declared(manifest):
        version = _check_format(manifest)
        upgraded, _ = upgrade(manifest, {})
        entries = check_manifest(upgraded)
        renames = _KINDS[upgraded["kind"]].v1_arrays if version == 1 else {}
        return {name: entries[renames.get(name, name)] for name in manifest["arrays"]}  # the file's names

    manifest, arrays, signed = read_archive(path, declared, key=key)
    manifest, arrays = upgrade(manifest, arrays)
    check_read_archive(path, manifest, arrays, signed, key)
    _KINDS[manifest["kind"]].contents(manifest, arrays)
    return manifest, arrays


def check_read_archive(path, manifest: dict, arrays: dict, signed: bool, key) -> None:
    """Checks common to every kind of saved posterior once the archive is read: a signature
    that was removed, a signed file read without a key (a warning), 64-bit arrays without x64.

    :raises IntegrityError, DtypeMismatchError:
    """
    if manifest.get("signed") and not signed:
        raise IntegrityError(f"{path} was signed when saved but its signature member was removed")
    if signed and key is None:
        warnings.warn(f"{Path(path)} is signed but no key was given: its signature was not checked", UserWarning,
                      stacklevel=4)
    if any(not _representable(v.dtype) for k, v in arrays.items() if k != "tombstones"):  # tombstones stay on the host
        raise DtypeMismatchError(f"{path} holds a {manifest['dtype']} posterior with 64-bit arrays; enable x64 "
                                 "(jax.enable_x64()) to load it without losing precision")


def _representable(dtype) -> bool:
    return jax.dtypes.canonicalize_dtype(dtype) == dtype
