"""The one manifest schema of a saved posterior, its versions, and reading a file of any version.

Every saved posterior — Gaussian (:mod:`numpyro_pc.io.save_load`) or exponential-family
(:mod:`numpyro_pc.io.expfam`) — is one container (:mod:`numpyro_pc.io.archive`) whose
``manifest.json`` has, in format version :data:`VERSION` (2):

- a common header: ``format``, ``version``, ``kind`` (``"gaussian"`` or ``"ef"``), ``family``
  (the kind's description of its family), ``dtype``, the model binding of
  :func:`~numpyro_pc.io.saved_model.binding_manifest` (``latent``, ``plate``, ``observed``,
  ``arguments``, ``example_shapes``, ``fingerprint``, ``signed``), the ``arrays`` entries
  (SHA-256, dtype, shape), the dual-form ``residual`` and ``stale_sites``;
- the kind's own fields in one object named after the kind: ``"gaussian"``: ``rule``,
  ``curvature``, ``storage``, ``chunk_size``, ``next_id``; ``"ef"``: ``config``,
  ``conjugate_prior``, ``next_id`` (an integer in every version-2 file; an upgrade from
  version 1 sets it past the largest held id).

The sites are stored as ``sites.<name>``, one member per entry of the site table's
:meth:`~numpyro_pc.protocols.sites.SiteTable.arrays`; beside them a Gaussian file holds
``mean``, ``precision``, ``data_ids`` and optionally ``offset.*``, an exponential-family
file ``natural``, and both the ids of deleted examples ``tombstones`` (``int64``, checked by
:func:`numpyro_pc.io.validation.check_tombstones`) and the data rows ``data.example.k`` and
``data.shared.k``. Files of version 1 and the first version-2 files listed the deleted ids in
the kind's part instead (``tombstones``); :func:`upgrade` moves such a list to the member.

:func:`check_manifest` checks the common header once and hands the kind's part to the
kind's checker (:func:`numpyro_pc.io.validation.check_gaussian_part`,
:func:`numpyro_pc.io.validation.check_ef_part`). Files of version 1 (two manifests: the
Gaussian one without ``kind``, and ``"kind": "ef"`` with unprefixed site arrays) are
mapped to the version-2 layout by :func:`upgrade` before any check, so every check sees
one schema; the file itself is never rewritten, and its checksums and signature are
verified on the bytes as written.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

from numpyro_pc.errors import (
    CorruptFileError,
    DtypeMismatchError,
    FormatVersionError,
    InconsistentFileError,
    IntegrityError,
)

from .archive import read_archive
from .validation import (
    EF_FIELDS,
    FLOAT_DTYPES,
    GAUSSIAN_FIELDS,
    TOMBSTONES,
    check_binding_fields,
    check_contents,
    check_ef_contents,
    check_ef_part,
    check_gaussian_part,
    fail_field,
)

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
    v1_fields: frozenset  # the fields of the kind's part that version 1 wrote (at the top level)
    v1_defaults: Callable  # v1_defaults(upgraded arrays) -> {field version 1 did not write: its upgraded value}


def _past_largest(ids) -> int:
    """The id past the largest of ``ids`` (0 for none, or for ids that are no integers: refused later)."""
    if ids is None or not ids.size or ids.dtype.kind not in "iu":
        return 0
    return max(int(ids.max()) + 1, 0)


_KINDS = {
    "gaussian": _Kind(GAUSSIAN_FIELDS, check_gaussian_part, check_contents, {}, GAUSSIAN_FIELDS | {"tombstones"},
                      lambda arrays: {}),
    # version 1 kept no deleted ids for exponential-family posteriors: none are known, and the next id is
    # the one past the largest held (EFPosterior's floor)
    "ef": _Kind(EF_FIELDS, check_ef_part, check_ef_contents,
                {"grads": "sites.grads", "prior": "sites.prior", "ids": "sites.ids"},
                frozenset({"config", "conjugate_prior"}),
                lambda arrays: {"tombstones": [], "next_id": _past_largest(arrays.get("sites.ids"))}),
}


def build_manifest(kind: str, family, dtype: str, part: dict, binding: dict, stale_sites: bool) -> dict:
    """The version-2 manifest of a posterior of ``kind``: the common header, ``binding``
    (:func:`~numpyro_pc.io.saved_model.binding_manifest`) and ``part``, the kind's own fields."""
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
    """The manifest and arrays in the version-2 layout: :func:`_upgrade_v1` for version 1, then
    :func:`_listed_tombstones` for a file that lists its deleted ids in the manifest (neither
    argument is modified).

    :raises CorruptFileError: another format, a version-1 manifest with fields version 1 never wrote,
        or a malformed list of deleted ids.
    :raises InconsistentFileError: a list of deleted ids that is not the ``tombstones`` member's.
    :raises FormatVersionError: a version this release does not read.
    """
    if _check_format(manifest) != VERSION:
        manifest, arrays = _upgrade_v1(manifest, arrays)
    return _listed_tombstones(manifest, arrays)


def _listed_tombstones(manifest: dict, arrays: dict) -> tuple[dict, dict]:
    """Move the deleted ids listed in the kind's part (``tombstones``: version 1 and the first
    version-2 files, whose manifests a load parses whole, so that a posterior with very many deleted
    ids could not be read) to the ``tombstones`` member, where every file keeps them now.

    A file that holds the member too (Gaussian files wrote both) must list the same ids; one without
    it (exponential-family files) gets the member built from the list, ``int64`` in the listed order,
    and its manifest an entry for it. Other manifests are returned as they are.

    :raises CorruptFileError: a list that is not of integers in ``[0, 2**62)``.
    :raises InconsistentFileError: a list other than the member's ids.
    """
    kind = manifest.get("kind")
    part = manifest.get(kind) if isinstance(kind, str) and kind in _KINDS else None
    if not isinstance(part, dict) or "tombstones" not in part:
        return manifest, arrays
    listed = part["tombstones"]
    if not isinstance(listed, list) or not all(type(t) is int and 0 <= t < 2**62 for t in listed):
        fail_field(f"{kind}.tombstones", "a list of integers in [0, 2**62) (the ids of deleted examples)", listed)
    member = np.asarray(listed, np.int64).reshape(-1)
    entries = manifest.get("arrays")
    manifest = {**manifest, kind: {k: v for k, v in part.items() if k != "tombstones"}}
    if isinstance(entries, dict) and TOMBSTONES in entries:  # the file holds the member: the two must agree
        if TOMBSTONES in arrays:
            found = np.asarray(arrays[TOMBSTONES]).reshape(-1)
            if found.shape != member.shape or not np.array_equal(np.sort(found), np.sort(member)):
                raise InconsistentFileError(f"array {TOMBSTONES!r}: expected the {member.size} deleted ids listed in "
                                            f"the manifest field '{kind}.tombstones', found {found.size} other ids")
        return manifest, arrays
    if isinstance(entries, dict):
        manifest["arrays"] = {**entries, TOMBSTONES: {"sha256": hashlib.sha256(member.tobytes()).hexdigest(),
                                                      "dtype": str(member.dtype), "shape": list(member.shape)}}
    return manifest, {**arrays, TOMBSTONES: member}


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
    allowed = COMMON_FIELDS - ({"kind"} if kind == "gaussian" else set()) | schema.v1_fields
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
    upgraded = {k: v for k, v in manifest.items() if k not in schema.v1_fields}
    upgraded.update(version=VERSION, kind=kind, stale_sites="stale_sites" in manifest, arrays=entries)
    arrays = {renames.get(name, name): value for name, value in arrays.items()}
    upgraded[kind] = {k: manifest[k] for k in sorted(schema.v1_fields) if k in manifest}
    upgraded[kind].update(schema.v1_defaults(arrays))  # fresh values per call: callers may edit the result
    return upgraded, arrays


def read_posterior_file(path, key=None) -> tuple[dict, dict]:
    """Read a saved posterior of any kind and readable version, as untrusted input.

    The manifest is upgraded to version 2 and checked before any array is read, the
    arrays are read with the bounds it declares and their checksums (and, with ``key``,
    the signature over the file as written) verified, then manifest and arrays are
    upgraded together and the arrays checked against the manifest.

    :return: ``(manifest, arrays)`` in the version-2 layout.
    :raises PersistenceError: one of its subclasses (see :func:`numpyro_pc.io.save_load.load`).
    """
    def declared(manifest) -> dict[str, tuple[str, tuple[int, ...], str]]:
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
