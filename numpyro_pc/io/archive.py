"""The container of a saved posterior: a zip of stored ``.npy`` members, read with bounds.

Writing: :func:`write_atomic` builds the archive in memory (members stored, never
compressed), writes it to a locked temporary file beside the destination, ``fsync``-s it
and renames it over the destination, so a crash at any point leaves the previous save
intact. Temporaries left behind by writers that died (``kill -9``, power loss) are
removed by the next save to the same path; a temporary still locked by a live writer is
left alone.

Reading: :func:`read_archive` treats the file as untrusted input. Before the zip
directory is parsed it checks the directory's size (at most :data:`MAX_DIRECTORY` bytes:
a posterior has a few dozen members, and a directory of a million empty entries would
cost far more memory than its bytes). Before any member is read it checks that members
are stored (not compressed), unencrypted, unique, that their sizes add up to no more than
the file, that the manifest is at most :data:`MAX_MANIFEST` bytes plus three bytes per
byte of the tombstones array (an allowance for the files written before that array held
the deleted ids alone, whose manifests list them too: a parsed manifest that lists none
and exceeds :data:`MAX_MANIFEST` is refused), and that each array member's size is the
one its manifest entry declares (shape × item size plus a bounded ``.npy`` header). A file therefore never makes the reader hold more than its own
size in member bytes, and the parsed manifest stays within a fixed allowance plus a
multiple of the tombstones' size. Every failure is a
:class:`~numpyro_pc.errors.PersistenceError` subclass.

An optional key adds an HMAC-SHA256 over the manifest and every array member
(:data:`SIGNATURE` member); see the documentation page on saving for what it protects.
With a key, :func:`read_archive` verifies the signature before the manifest is checked:
nothing in the file is interpreted (family names looked up, parametrised families built)
beyond the names of the members the signature covers.
"""

from __future__ import annotations

import hashlib
import hmac
import io as _io
import json
import os
import re
import struct
import tempfile
import time
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from numpyro_pc.errors import (
    CorruptFileError,
    DtypeMismatchError,
    IntegrityError,
    MissingFileError,
    OversizedFileError,
    PersistenceError,
)

try:  # POSIX: temporaries of live writers are recognised by their lock
    import fcntl
except ImportError:  # pragma: no cover - Windows: temporaries older than an hour are stale
    fcntl = None

__all__ = ["MANIFEST", "SIGNATURE", "MAX_HEADER", "MAX_DIRECTORY", "MAX_MANIFEST", "manifest_limit", "npy_bytes",
           "signature", "write_atomic", "read_archive", "remove_stale_temporaries"]

MANIFEST = "manifest.json"
SIGNATURE = "signature.hmac"
MAX_HEADER = 65536  # bytes of ``.npy`` header accepted beyond an array's declared data
MAX_DIRECTORY = 2**20  # bytes of zip central directory accepted (a posterior's members need ~100 bytes each)
MAX_MANIFEST = 2**21  # bytes of manifest accepted (~4000 sample sites), plus three per byte of the tombstones array
_TOMBSTONES = "tombstones.npy"
_EOCD = struct.Struct("<4s4H2LH")  # zip end of central directory record; field 5 is the directory size
_EOCD64_LOCATOR = struct.Struct("<4sLQL")
_EOCD64 = struct.Struct("<4sQ2H2L4Q")  # Zip64 end record; field 8 is the directory size
# the header numpy.save writes: {'descr': '<f8', 'fortran_order': False, 'shape': (3, 4), } padded with spaces
_NPY_HEADER = re.compile(r"\{'descr': '([<>|=][biuf][1-8])', 'fortran_order': (True|False), "
                         r"'shape': (\(\)|\(\d{1,19},\)|\(\d{1,19}(?:, \d{1,19})+,?\)), \} *\n")
_STALE_AGE = 3600.0  # seconds, only where file locks are unavailable
# what a zip parser may raise on a damaged archive (all turned into CorruptFileError)
_ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, struct.error,
               NotImplementedError, RuntimeError, OverflowError, zlib.error)


def npy_bytes(array) -> bytes:
    """The ``.npy`` serialisation of ``array`` (no pickling)."""
    buffer = _io.BytesIO()
    np.save(buffer, np.asarray(array), allow_pickle=False)
    return buffer.getvalue()


def manifest_limit(tombstones_bytes) -> int:
    """The largest manifest (bytes) accepted beside a tombstones member of ``tombstones_bytes``
    bytes: :data:`MAX_MANIFEST` plus three bytes per byte (a deleted id is 8 bytes in the
    array and at most 23 characters in the manifest's list)."""
    return MAX_MANIFEST + 3 * tombstones_bytes


def _key_bytes(key) -> bytes:
    if isinstance(key, str):
        key = key.encode()
    if not isinstance(key, (bytes, bytearray)) or not key:
        raise PersistenceError(f"the signing key must be non-empty bytes or str, got {type(key).__name__}")
    return bytes(key)


def signature(key, manifest, members) -> str:
    """HMAC-SHA256 (hex) over the manifest bytes and the ``(name, bytes)`` array members in order."""
    mac = hmac.new(_key_bytes(key), b"numpyro_pc.dual_posterior\0", hashlib.sha256)
    mac.update(len(manifest).to_bytes(8, "little") + manifest)
    for name, data in members:
        mac.update(name.encode() + b"\0" + len(data).to_bytes(8, "little"))
        mac.update(data)
    return mac.hexdigest()


# --------------------------------------------------------------------------- writing


def write_atomic(path, manifest, members, key=None) -> Path:
    """Write the archive ``manifest`` (bytes) + ``members`` (``(name, bytes)``) to ``path`` atomically.

    :return: the :class:`~pathlib.Path` written.
    :raises PersistenceError: ``path`` is a directory, or the operating system refuses the write
        (a read-only folder, a full disk, a parent that is a file), naming the path and the cause.
    """
    path = Path(path)
    if path.is_dir():
        raise PersistenceError(f"cannot save to {str(path)!r}: it is a directory; expected the path of a file "
                               "(e.g. a name inside that directory)")
    buffer = _io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr(MANIFEST, manifest)
        for name, data in members:
            archive.writestr(name, data)
        if key is not None:
            archive.writestr(SIGNATURE, signature(key, manifest, members))
    try:
        return _replace_atomically(path, buffer)
    except PersistenceError:
        raise
    except OSError as err:
        cause = f"{type(err).__name__}: {err.strerror or err}"
        where = f" ({err.filename})" if err.filename and str(err.filename) != str(path) else ""
        raise PersistenceError(f"cannot save to {str(path)!r}: {cause}{where}; expected a writable file path "
                               "(check the folder's permissions and free space)") from err


def _replace_atomically(path, buffer) -> Path:
    """Write ``buffer`` to a locked temporary beside ``path``, fsync it and rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    fd, tmp = _locked_temporary(path)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(buffer.getbuffer())
            handle.flush()
            os.fsync(handle.fileno())
            os.replace(tmp, path)  # still locked: a concurrent cleaner never takes it for stale
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _fsync_dir(path.parent)
    return path


def _locked_temporary(path) -> tuple[int, str]:
    """A new temporary file beside ``path``, locked against :func:`remove_stale_temporaries`."""
    while True:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        if fcntl is None:
            return fd, tmp
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.fstat(fd).st_nlink:  # not removed by a cleaner between creation and lock
            return fd, tmp
        os.close(fd)


def remove_stale_temporaries(path) -> list[Path]:
    """Delete the temporaries of earlier, interrupted saves to ``path``.

    A temporary is stale when no live process holds its lock (POSIX), or, where locks
    are unavailable, when it is older than an hour.

    :return: the list of removed paths.
    """
    path = Path(path)
    pattern = re.compile(rf"\.{re.escape(path.name)}\.[a-z0-9_]{{8}}\.tmp")
    removed = []
    try:
        candidates = [p for p in path.parent.iterdir() if pattern.fullmatch(p.name)]
    except OSError:
        return removed
    for candidate in candidates:
        try:
            fd = os.open(candidate, os.O_RDONLY)
        except OSError:
            continue
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue  # a live writer holds it
            elif time.time() - os.fstat(fd).st_mtime < _STALE_AGE:
                continue
            os.unlink(candidate)
            removed.append(candidate)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _fsync_dir(folder) -> None:
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


# --------------------------------------------------------------------------- reading


def read_archive(path, check_manifest, key=None) -> tuple[dict[str, Any], dict[str, np.ndarray], bool]:
    """Read a saved archive with bounds.

    :param path: the file.
    :param check_manifest: called with the parsed manifest (a ``dict``); raises on a
        malformed manifest and returns ``{name: (dtype string, shape tuple, sha256)}`` of
        the arrays the manifest declares.
    :param key: HMAC key; when given the file must carry a matching signature.
    :return: ``(manifest, arrays, signed)`` with ``arrays`` read-only NumPy arrays.
    :raises MissingFileError, CorruptFileError, OversizedFileError, IntegrityError, DtypeMismatchError:
    """
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"no saved posterior at {path}")
    try:
        handle = open(path, "rb")
    except OSError as err:
        raise PersistenceError(f"{path} cannot be opened: {err}") from err
    with handle:
        size = os.fstat(handle.fileno()).st_size
        try:
            directory = _directory_size(handle, size)
            if directory is not None and directory > MAX_DIRECTORY:
                raise OversizedFileError(f"{path}: its zip directory holds {directory} bytes, more than the "
                                         f"{MAX_DIRECTORY} a saved posterior needs")
            handle.seek(0)
            archive = zipfile.ZipFile(handle)
            infos = _checked_members(archive, size, path)
            if MANIFEST not in infos:
                raise CorruptFileError(f"{path} has no {MANIFEST}: not a saved numpyro_pc posterior")
            tombstones = infos[_TOMBSTONES].file_size if _TOMBSTONES in infos else 0
            manifest_bytes = _read_member(archive, infos[MANIFEST], path, manifest_limit(tombstones),
                                          f"with {tombstones} bytes of deleted ids, a manifest needs")
        except PersistenceError:
            raise
        except _ZIP_ERRORS as err:
            raise CorruptFileError(f"{path} is not a readable numpyro_pc archive (truncated or corrupted: "
                                   f"{type(err).__name__}: {err})") from err
        try:
            manifest = json.loads(manifest_bytes)
        except (ValueError, RecursionError) as err:
            raise CorruptFileError(f"{path}: the manifest is not valid JSON ({err})") from err
        if not isinstance(manifest, dict):
            raise CorruptFileError(f"{path}: the manifest is a JSON {type(manifest).__name__}, expected an object")
        if len(manifest_bytes) > MAX_MANIFEST and not _lists_deleted_ids(manifest):
            raise OversizedFileError(f"{path}: its manifest holds {len(manifest_bytes)} bytes; a manifest that lists "
                                     f"no deleted ids needs at most {MAX_MANIFEST}")
        signed = SIGNATURE in infos
        raw = None
        if key is not None:  # verified before anything else in the file is interpreted (checks, family names)
            raw = _read_signed(archive, infos, manifest, path)
            _verify_signature(archive, infos, key, manifest_bytes, list(raw.items()), path)
        declared = check_manifest(manifest)
        expected = {MANIFEST} | {f"{name}.npy" for name in declared}
        extra = sorted(set(infos) - expected - {SIGNATURE})
        if extra:
            raise CorruptFileError(f"{path} holds members the manifest does not declare: {extra[:5]}")
        arrays = {}
        for name, (dtype, shape, digest) in declared.items():
            member = infos.get(f"{name}.npy")
            if member is None:
                raise CorruptFileError(f"{path} lacks the array {name!r} its manifest declares")
            limit = _npy_limit(dtype, shape)
            data = _read_member(archive, member, path, limit) if raw is None else raw[f"{name}.npy"]
            if len(data) > limit:
                raise OversizedFileError(f"{path}: member {member.filename!r} holds {len(data)} bytes; the manifest "
                                         f"declares at most {limit}")
            arrays[name] = _parse_npy(data, name, dtype, shape, digest, path)
    return manifest, arrays, signed


def _lists_deleted_ids(manifest) -> bool:
    """Whether ``manifest`` lists deleted ids, as files written before the ``tombstones`` member did
    (version 1 at the top level, the first version-2 files in the kind's object): only such a
    manifest may use the allowance of :func:`manifest_limit` beyond :data:`MAX_MANIFEST`."""
    kind = manifest.get("kind")
    part = manifest.get(kind) if isinstance(kind, str) and kind in ("gaussian", "ef") else None
    return isinstance(manifest.get("tombstones"), list) or (
        isinstance(part, dict) and isinstance(part.get("tombstones"), list))


def _read_signed(archive, infos, manifest, path) -> dict[str, bytes]:
    """``{member name: bytes}`` of the arrays the manifest names, in its order (the order the
    signature covers), read before the manifest is checked so that the signature is verified
    first; each read is bounded by the file's size (:func:`_checked_members`)."""
    entries = manifest.get("arrays")
    if not isinstance(entries, dict):
        raise CorruptFileError(f"{path}: manifest field 'arrays': expected an object naming the arrays, found "
                               f"{type(entries).__name__}")
    raw = {}
    for name in entries:
        member = infos.get(f"{name}.npy")
        if member is None:
            raise CorruptFileError(f"{path} lacks the array {name!r} its manifest declares")
        raw[member.filename] = _read_member(archive, member, path, member.file_size)
    return raw


def _checked_members(archive, size, path) -> dict[str, zipfile.ZipInfo]:
    infos, total = {}, 0
    for info in archive.infolist():
        if info.filename in infos:
            raise CorruptFileError(f"{path} holds the member {info.filename!r} twice")
        if info.flag_bits & 0x1:
            raise CorruptFileError(f"{path}: member {info.filename!r} is encrypted")
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise OversizedFileError(f"{path}: member {info.filename!r} is compressed ({info.compress_size} bytes "
                                     f"expanding to {info.file_size}); numpyro_pc writes stored members only")
        total += info.file_size
        infos[info.filename] = info
    if total > size:
        raise OversizedFileError(f"{path}: its members declare {total} bytes, more than the file's {size}")
    return infos


def _directory_size(handle, size) -> int | None:
    """Size in bytes of the zip central directory, read from the end record found where
    :mod:`zipfile` looks for it (the last 22 bytes, else the last end signature in the final
    64 KiB; then the Zip64 end record when its locator precedes it); ``None`` when there is
    no end record (:mod:`zipfile` then refuses the file)."""
    start = max(size - (1 << 16) - _EOCD.size, 0)
    handle.seek(start)
    tail = handle.read()
    end = len(tail) - _EOCD.size
    if end < 0:
        return None
    if not (tail[end:end + 4] == b"PK\x05\x06" and tail[-2:] == b"\0\0"):
        end = tail.rfind(b"PK\x05\x06")
        if end < 0 or len(tail) - end < _EOCD.size:
            return None
    directory = _EOCD.unpack_from(tail, end)[5]
    locator = start + end - _EOCD64_LOCATOR.size
    if locator - _EOCD64.size < 0:
        return directory
    handle.seek(locator)
    if _EOCD64_LOCATOR.unpack(handle.read(_EOCD64_LOCATOR.size))[0] != b"PK\x06\x07":
        return directory
    handle.seek(locator - _EOCD64.size)
    record = _EOCD64.unpack(handle.read(_EOCD64.size))
    return record[8] if record[0] == b"PK\x06\x06" else directory


def _npy_limit(dtype, shape) -> int:
    count = 1
    for n in shape:
        count *= n
    return count * np.dtype(dtype).itemsize + MAX_HEADER


def _read_member(archive, info, path, limit, bound="the manifest declares") -> bytes:
    if info.file_size > limit:
        raise OversizedFileError(f"{path}: member {info.filename!r} holds {info.file_size} bytes; {bound} at most "
                                 f"{limit}")
    try:
        return archive.read(info)
    except _ZIP_ERRORS as err:
        raise CorruptFileError(f"{path}: member {info.filename!r} cannot be read ({type(err).__name__}: {err})") \
            from err


def _npy_header(data) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """``(shape, fortran_order, dtype, start of the values)`` of a ``.npy`` member, parsed strictly.

    The header is read with a regular expression of the dictionary :func:`numpy.save`
    writes, not with NumPy's reader (which tokenises and ``literal_eval``-s the text and
    raises whatever the tokeniser raises on damaged input).

    :raises ValueError: a header of any other form (TypeError: a kind code and size that are no dtype).
    """
    if data[:6] != b"\x93NUMPY" or len(data) < 10:
        raise ValueError("no .npy magic string")
    major = data[6]
    if major == 1:
        length, start = int.from_bytes(data[8:10], "little"), 10
    elif major in (2, 3) and len(data) >= 12:
        length, start = int.from_bytes(data[8:12], "little"), 12
    else:
        raise ValueError(f".npy format version {major} is not supported")
    if length > MAX_HEADER or start + length > len(data):
        raise ValueError(f"a header of {length} bytes in a member of {len(data)}")
    try:
        text = data[start:start + length].decode("ascii")
    except UnicodeDecodeError:
        raise ValueError("a header that is not ASCII") from None
    match = _NPY_HEADER.fullmatch(text)
    if match is None:
        raise ValueError(f"a header that is not a numpy.save dictionary: {text[:80]!r}")
    descr, fortran, dims = match.groups()
    dtype = np.dtype(descr)  # the pattern admits the byte order and kind codes of plain numbers only
    shape = tuple(int(n) for n in re.findall(r"\d+", dims))
    return shape, fortran == "True", dtype, start + length


def _parse_npy(data, name, dtype, shape, digest, path) -> np.ndarray:
    try:
        found_shape, fortran, found_dtype, start = _npy_header(data)
    except (ValueError, TypeError, OverflowError) as err:
        raise CorruptFileError(f"array {name!r} in {path} has an unreadable .npy header ({err})") from err
    if found_dtype.name != dtype or found_shape != tuple(shape):
        raise DtypeMismatchError(f"array {name!r} in {path} is {found_dtype}{list(found_shape)}, the manifest "
                                 f"says {dtype}{list(shape)}")
    nbytes = _npy_limit(dtype, shape) - MAX_HEADER
    if len(data) - start != nbytes:
        raise CorruptFileError(f"array {name!r} in {path} holds {len(data) - start} bytes of values; its shape "
                               f"{list(shape)} and dtype {dtype} need {nbytes}")
    values = memoryview(data)[start:]
    value = np.frombuffer(values, found_dtype).reshape(shape, order="F" if fortran else "C")
    contiguous = values if not fortran else np.ascontiguousarray(value).tobytes()
    if hashlib.sha256(contiguous).hexdigest() != digest:
        raise CorruptFileError(f"array {name!r} in {path} fails its checksum (the file was altered)")
    if not found_dtype.isnative:  # written on a machine of the other byte order
        value = value.astype(found_dtype.newbyteorder("="))
    return value


def _verify_signature(archive, infos, key, manifest_bytes, raw, path) -> None:
    info = infos.get(SIGNATURE)
    if info is None:
        raise IntegrityError(f"{path} carries no signature but a key was given: it was saved without a key, "
                             "or the signature was removed")
    stored = _read_member(archive, info, path, 64, "an HMAC-SHA256 signature holds")
    expected = signature(key, manifest_bytes, raw).encode()
    if not hmac.compare_digest(stored, expected):
        raise IntegrityError(f"{path}: the signature does not match (the file was altered, or the key is wrong)")
