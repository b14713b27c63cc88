"""Saved posteriors as untrusted input: bounded reading, validation, model fingerprint, HMAC, fuzzing.

Every bad file here is made by editing a real save. "Re-signed" edits also update the
manifest's SHA-256 of the edited array, as someone editing the file on purpose would.
"""

import io as _io
import json
import math
import signal
import subprocess
import sys
import time
import tracemalloc
import warnings
import zipfile
from pathlib import Path

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax.scipy.stats import norm

import numpyro_pc as pc
from numpyro_pc import errors
from numpyro_pc.io import archive
from numpyro_pc.io import save_load as io

from models import logistic_model, make_logistic


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A small float64 posterior with a deleted example, saved once; tests copy its bytes."""
    with jax.enable_x64(True):
        X, y = make_logistic(10, 1, seed=3)
        post = pc.fit(logistic_model, X, y, family="full").delete([4], method="remove_site")
        path = post.save(tmp_path_factory.mktemp("saved") / "p")
    return post, path.read_bytes()


@pytest.fixture
def fresh(saved, tmp_path, x64):
    post, blob = saved
    path = tmp_path / "p"
    path.write_bytes(blob)
    return post, path


def _members(path):
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist()}


def _members_bytes(blob):
    with zipfile.ZipFile(_io.BytesIO(blob)) as z:
        return {n: z.read(n) for n in z.namelist()}


def _write(path, members, compress=None):
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data, compress_type=(compress or {}).get(name, zipfile.ZIP_STORED))


def _edit_manifest(path, edit):
    members = _members(path)
    manifest = json.loads(members["manifest.json"])
    edit(manifest)
    members["manifest.json"] = json.dumps(manifest).encode()
    _write(path, members)


def _edit_array(path, name, fn, add=False):
    """Replace (or add) array ``name`` by ``fn(old)`` and re-sign it in the manifest."""
    members = _members(path)
    manifest = json.loads(members["manifest.json"])
    old = None if add else np.load(_io.BytesIO(members[f"{name}.npy"]))
    new = np.asarray(fn(old))
    members[f"{name}.npy"] = archive.npy_bytes(new)
    manifest["arrays"][name] = {"sha256": io.digest(new), "dtype": str(new.dtype), "shape": list(new.shape)}
    members["manifest.json"] = json.dumps(manifest).encode()
    _write(path, members)


def _assert_same(a, b):
    for x, y in zip(jax.tree.leaves((a.state, a.sites, a.data, a.data_ids, a.offset)),
                    jax.tree.leaves((b.state, b.sites, b.data, b.data_ids, b.offset)), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert (a.tombstones, a.next_id, a.rule, a.family.name, a.curvature, a.sites.storage, a.chunk_size) == \
           (b.tombstones, b.next_id, b.rule, b.family.name, b.curvature, b.sites.storage, b.chunk_size)


# --------------------------------------------------------------------------- bounded reading


def test_a_compressed_bomb_is_refused_before_it_is_expanded(fresh):
    post, path = fresh
    members = _members(path)
    members["sites.grad.npy"] = bytes(64 * 2**20)  # 64 MiB of zeros deflate to ~64 KB
    _write(path, members, {"sites.grad.npy": zipfile.ZIP_DEFLATED})
    assert path.stat().st_size < 2**20
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(io.OversizedFileError, match="compressed"):
            pc.load(path, logistic_model)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20 and time.perf_counter() - start < 5.0


def test_a_compressed_manifest_is_refused(fresh):
    post, path = fresh
    members = _members(path)
    manifest = json.loads(members["manifest.json"])
    manifest["padding"] = " " * (16 * 2**20)
    members["manifest.json"] = json.dumps(manifest).encode()
    _write(path, members, {"manifest.json": zipfile.ZIP_DEFLATED})
    with pytest.raises(io.OversizedFileError):
        pc.load(path, logistic_model)


def test_members_declaring_more_than_the_file_holds_are_refused(fresh):
    _, path = fresh
    blob = bytearray(path.read_bytes())
    directory = blob.rfind(b"PK\x01\x02")  # last central directory entry: claim a huge member size
    blob[directory + 20:directory + 28] = (2**31).to_bytes(4, "little") * 2
    path.write_bytes(bytes(blob))
    with pytest.raises(io.CorruptFileError):
        pc.load(path, logistic_model)


@pytest.mark.parametrize("entries, name_length", [(25_000, 40), (70_000, 1)], ids=["zip32", "zip64"])
def test_a_huge_zip_directory_is_refused_before_it_is_parsed(fresh, entries, name_length):
    """A directory of many empty entries costs ~7x its bytes once parsed (1M entries: 90 MB file, +620 MB, 27 s)."""
    _, path = fresh
    with zipfile.ZipFile(path, "a") as z:  # more than 65535 entries: zipfile writes the Zip64 end record
        for k in range(entries):
            z.writestr(f"{k:0{name_length}d}", b"")
    assert path.stat().st_size > archive.MAX_DIRECTORY
    tracemalloc.start()
    try:
        with pytest.raises(io.OversizedFileError, match="directory"):
            pc.load(path, logistic_model)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20  # the end records only: 64 KiB of tail, never the directory (limit 1 MiB)


def test_an_oversized_stored_manifest_is_refused_before_it_is_read(fresh):
    _, path = fresh
    members = _members(path)
    manifest = json.loads(members["manifest.json"])
    manifest["plate"] = "x" * (archive.MAX_MANIFEST + 1)
    members["manifest.json"] = json.dumps(manifest).encode()
    _write(path, members)
    tracemalloc.start()
    try:
        with pytest.raises(io.OversizedFileError, match="manifest needs at most"):
            pc.load(path, logistic_model)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < archive.MAX_MANIFEST // 2  # refused from the directory entry, the bytes are never read


def test_the_manifest_allowance_covers_the_largest_deleted_ids():
    """Each deleted id is 8 bytes in the tombstones array and at most 23 in the indented manifest."""
    ids = np.full(5000, 2**62 - 1, np.int64)
    text = json.dumps({"tombstones": ids.tolist()}, indent=1).encode()
    allowance = archive.manifest_limit(len(archive.npy_bytes(ids))) - archive.MAX_MANIFEST
    assert len(text) <= allowance  # 115 kB against 120 kB; two bytes per byte would fail


def test_a_save_whose_manifest_would_be_refused_is_refused(saved, tmp_path, x64, monkeypatch):
    post, _ = saved
    monkeypatch.setattr(archive, "MAX_MANIFEST", 1000)
    with pytest.raises(io.PersistenceError, match="cannot be saved.*manifest needs"):
        post.save(tmp_path / "p")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("manifest_too", [False, True])
def test_an_npy_header_claiming_a_huge_shape_is_a_typed_error(fresh, manifest_too):
    _, path = fresh
    members = _members(path)
    header = _io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False, "shape": (10**12,)})
    members["mean.npy"] = header.getvalue() + np.zeros(2).tobytes()
    if manifest_too:
        manifest = json.loads(members["manifest.json"])
        manifest["arrays"]["mean"]["shape"] = [10**12]
        members["manifest.json"] = json.dumps(manifest).encode()
    _write(path, members)
    with pytest.raises(io.PersistenceError):
        pc.load(path, logistic_model)


def _with_header(member, text, version=b"\x01\x00"):
    """``member`` (an ``.npy``) with its header text replaced (length field updated, values kept)."""
    old = int.from_bytes(member[8:10], "little")
    size = len(text).to_bytes(2, "little") if version[0] == 1 else len(text).to_bytes(4, "little")
    return b"\x93NUMPY" + version + size + text + member[10 + old:]


@pytest.mark.parametrize("text, version", [
    (b"{'descr': '<f8', 'fortran_order': False, 'shape': (2,\xd3, }  \n", b"\x01\x00"),  # numpy: TokenError
    (b"{'descr': '<f8', 'fortran_order': False, 'shape': " + b"(" * 5000 + b"2," + b")" * 5000 + b", }\n",
     b"\x01\x00"),
    (b"{'descr': '<f8', 'fortran_order': False, 'shape': (2,), 'x': __import__('os'), }\n", b"\x01\x00"),
    (b"{'descr': [('a', '<f8')], 'fortran_order': False, 'shape': (1,), }\n", b"\x01\x00"),
    (b"{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }\n", b"\x09\x00"),
    (b"{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }\xff\n", b"\x01\x00"),
], ids=["unbalanced", "nested", "call", "structured", "version", "not-ascii"])
def test_a_damaged_npy_header_is_a_corrupt_file_error(fresh, text, version):
    """Headers are parsed with a pattern, never tokenised: numpy's reader raised ``tokenize.TokenError`` on the
    first (found by fuzzing members whose zip CRC was recomputed)."""
    _, path = fresh
    members = _members(path)
    members["mean.npy"] = _with_header(members["mean.npy"], text, version)
    _write(path, members)
    with pytest.raises(io.CorruptFileError, match="unreadable .npy header"):
        pc.load(path, logistic_model)


def test_a_big_endian_member_loads_with_its_values(fresh):
    """A file written on a big-endian machine: the header says '>f8' and the checksum is over those bytes."""
    post, path = fresh
    members = _members(path)
    manifest = json.loads(members["manifest.json"])
    mean = np.asarray(post.state.mean).astype(">f8")
    members["mean.npy"] = archive.npy_bytes(mean)
    assert b"'descr': '>f8'" in members["mean.npy"]
    manifest["arrays"]["mean"]["sha256"] = io.digest(mean)
    members["manifest.json"] = json.dumps(manifest).encode()
    _write(path, members)
    _assert_same(post, pc.load(path, logistic_model))


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("edit, error, match", [
    (lambda p: (_edit_array(p, "offset.linear", lambda _: np.full(2, 5.0), add=True),
                _edit_array(p, "offset.precision", lambda _: np.zeros((2, 2)), add=True)),
     io.InconsistentFileError, "residual"),
    (lambda p: _edit_array(p, "precision", lambda s: -np.eye(2)), io.InconsistentFileError, "positive definite"),
    (lambda p: _edit_array(p, "sites.grad", lambda g: np.where(np.arange(g.size).reshape(g.shape) == 3, np.nan, g)),
     io.InconsistentFileError, "finite"),
    (lambda p: _edit_manifest(p, lambda m: m["gaussian"].update(next_id=5)), io.InconsistentFileError, "next_id"),
    (lambda p: _edit_array(p, "sites.ids", lambda i: np.where(i == 1, 0, i)), io.InconsistentFileError, "unique"),
    (lambda p: _edit_array(p, "data_ids", lambda i: np.where(i == 1, 0, i)), io.InconsistentFileError, "unique"),
    (lambda p: _edit_array(p, "sites.ids", lambda i: np.where(i == 5, 4, i)), io.InconsistentFileError, "deleted"),
    (lambda p: _edit_array(p, "sites.loss", lambda m: m.astype(np.complex128)), io.CorruptFileError, "dtype"),
    (lambda p: _edit_array(p, "sites.grad", lambda m: m.astype(np.float16)), io.DtypeMismatchError, "float16"),
    (lambda p: _edit_array(p, "data.example.0", lambda x: x[:-1]), io.InconsistentFileError, "shape"),
    (lambda p: _edit_array(p, "sites.loss", lambda x: x[:-1]), io.InconsistentFileError, "shape"),
    (lambda p: (_edit_array(p, "offset.linear", lambda _: np.full(2, 5.0), add=True),
                _edit_array(p, "offset.precision", lambda _: np.zeros((2, 2)), add=True),
                _edit_manifest(p, lambda m: m.update(residual=math.nan))), io.CorruptFileError, "residual"),
    (lambda p: _edit_manifest(p, lambda m: m.update(residual=math.inf)), io.CorruptFileError, "residual"),
    (lambda p: (_edit_array(p, "data_ids", lambda i: i[:0]), _edit_array(p, "data.example.1", lambda y: y[:0]),
                _edit_array(p, "data.example.0", lambda x: np.zeros((0, 10**6, 10**6))),
                _edit_manifest(p, lambda m: m["example_shapes"][0].__setitem__(0, [10**6, 10**6]))),
     io.InconsistentFileError, "bytes per example"),
], ids=["offset", "negative-precision", "nan-grad", "next-id", "duplicate-site-ids", "duplicate-data-ids",
        "tombstoned-id", "complex", "float16", "data-rows", "site-rows", "nan-residual", "infinite-residual",
        "terabyte-example"])
def test_re_signed_inconsistent_contents_are_refused(fresh, edit, error, match):
    _, path = fresh
    edit(path)
    with pytest.raises(error, match=match):
        pc.load(path, logistic_model)


@pytest.mark.parametrize("mutate", [
    lambda m: m.pop("arrays"), lambda m: m.update(arrays=[]), lambda m: m["arrays"]["mean"].pop("dtype"),
    lambda m: m["arrays"]["mean"].update(shape="2"), lambda m: m["gaussian"].update(tombstones="4"),
    lambda m: m["gaussian"].update(tombstones=None), lambda m: m.update(latent=None), lambda m: m["latent"].pop("names"),
    lambda m: m["gaussian"].update(rule={"kind": "zz"}), lambda m: m["gaussian"].update(rule=[]), lambda m: m.update(arguments=[]),
    lambda m: m["arguments"]["args"].append(5), lambda m: m.update(example_shapes=[[2]]),
    lambda m: m["gaussian"].update(next_id="9"), lambda m: m.update(family="banana"),
    lambda m: m["gaussian"].update(storage=3), lambda m: m.update(plate=None), lambda m: m.update(observed="y"),
    lambda m: m["gaussian"].update(chunk_size=-1), lambda m: m.update(stale_sites=None),
    lambda m: m.update(kind="ef"), lambda m: m.pop("kind"), lambda m: m.pop("gaussian"),
    lambda m: m.update(rule=m["gaussian"]["rule"]),
    lambda m: m.update(dtype="complex128"), lambda m: m["arrays"].update(evil={"sha256": "0" * 64}),
    lambda m: m["arrays"].pop("sites.grad"), lambda m: m.update(residual="small"), lambda m: m.update(padding=""),
], ids=lambda f: "")
def test_malformed_manifests_raise_persistence_errors(fresh, mutate):
    _, path = fresh
    _edit_manifest(path, mutate)
    with pytest.raises(io.PersistenceError):
        pc.load(path, logistic_model)


def test_a_float32_posterior_loads_without_x64(tmp_path):
    X, y = make_logistic(10, 1, seed=3)
    post = pc.fit(logistic_model, X, y, family="diagonal").delete([2])
    back = pc.load(post.save(tmp_path / "p32"), logistic_model)
    _assert_same(post, back)
    assert back.state.mean.dtype == np.float32


def test_missing_file_is_a_persistence_error_and_file_not_found(tmp_path):
    with pytest.raises(io.MissingFileError) as info:
        pc.load(tmp_path / "nothing", logistic_model)
    assert isinstance(info.value, FileNotFoundError)


# --------------------------------------------------------------------------- model fingerprint


def probit_model(X, y=None):
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(probs=norm.cdf(X @ w + b)), obs=y)


def wide_prior_model(X, y=None):
    b = numpyro.sample("b", dist.Normal(0.0, 10.0))
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


@pytest.mark.parametrize("model, names", [(probit_model, "BernoulliProbs"), (wide_prior_model, "sites.b.params.scale")])
def test_a_file_does_not_load_into_another_model(fresh, model, names):
    _, path = fresh
    with pytest.raises(errors.ModelMismatchError, match=names) as info:
        pc.load(path, model)
    assert isinstance(info.value, io.PersistenceError) and isinstance(info.value, ValueError)
    assert info.value.differences


@pytest.mark.parametrize("shape", [(1,), (0,)], ids=["column", "empty"])
def test_observations_of_another_shape_do_not_load(fresh, shape):
    """``y`` re-signed as ``(N, 1)`` (broadcasts to N × N log densities) or ``(N, 0)`` (loaded, then a later
    update failed with numpy's ``ValueError`` on joining rows): the model binds, its fingerprint differs."""
    _, path = fresh

    def reshape(y):
        return y[:, None] if shape == (1,) else np.zeros((y.shape[0], 0))
    _edit_array(path, "data.example.1", reshape)
    _edit_manifest(path, lambda m: m["example_shapes"][1].__setitem__(0, list(shape)))
    with pytest.raises(io.SavedModelMismatchError, match=r"sites\.y\.value_shape"):
        pc.load(path, logistic_model)


def test_a_version_1_fingerprint_is_compared_on_its_fields(fresh):
    """Files saved before observed shapes were fingerprinted still load, and still refuse another model."""
    post, path = fresh

    def version_1(manifest):
        manifest["fingerprint"]["version"] = 1
        for site in manifest["fingerprint"]["sites"].values():
            site.pop("value_shape", None)
    _edit_manifest(path, version_1)
    _assert_same(post, pc.load(path, logistic_model))
    with pytest.raises(io.SavedModelMismatchError, match="BernoulliProbs"):
        pc.load(path, probit_model)


def test_a_file_from_the_previous_version_loads_with_a_warning(fresh):
    post, path = fresh

    def old(manifest):
        for key in ("fingerprint", "residual", "signed"):
            manifest.pop(key)
    _edit_manifest(path, old)
    with pytest.warns(UserWarning, match="could not be verified"):
        back = pc.load(path, logistic_model)
    _assert_same(post, back)


# --------------------------------------------------------------------------- HMAC


def test_a_signed_file_loads_only_with_its_key(saved, tmp_path, x64):
    post, _ = saved
    path = post.save(tmp_path / "signed", key=b"secret")
    _assert_same(post, pc.load(path, logistic_model, key=b"secret"))
    with pytest.raises(io.IntegrityError, match="does not match"):
        pc.load(path, logistic_model, key=b"guess")
    with pytest.warns(UserWarning, match="not checked"):
        pc.load(path, logistic_model)
    _edit_array(path, "mean", lambda m: m + 1e-3)  # re-signed checksum, but no key to redo the HMAC
    with pytest.raises(io.IntegrityError):
        pc.load(path, logistic_model, key=b"secret")
    members = _members(path)
    del members[archive.SIGNATURE]
    _write(path, members)
    with pytest.raises(io.IntegrityError, match="removed"):
        pc.load(path, logistic_model)
    unsigned = post.save(tmp_path / "unsigned")
    with pytest.raises(io.IntegrityError, match="no signature"):
        pc.load(unsigned, logistic_model, key=b"secret")


# --------------------------------------------------------------------------- temporaries


def test_stale_temporaries_are_removed_by_the_next_save(saved, tmp_path, x64):
    post, _ = saved
    path = post.save(tmp_path / "p")
    stale = tmp_path / ".p.abcd1234.tmp"
    stale.write_bytes(b"half a posterior")
    other = tmp_path / ".q.abcd1234.tmp"  # another destination's temporary
    other.write_bytes(b"x")
    live = tmp_path / ".p.live0000.tmp"  # a writer still at work holds its lock
    live.write_bytes(b"y")
    import fcntl

    with open(live, "rb") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        post.save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".p.live0000.tmp", ".q.abcd1234.tmp", "p"]


def test_a_save_killed_mid_write_leaves_the_old_file_and_the_next_save_cleans_up(saved, tmp_path, x64):
    post, _ = saved
    path = post.save(tmp_path / "p")
    code = ("import os, signal, sys, jax; sys.path.insert(0, 'tests'); jax.config.update('jax_enable_x64', True);"
            "import numpyro_pc as pc; from numpyro_pc import archive; from models import logistic_model;"
            f"post = pc.load({str(path)!r}, logistic_model);"
            "archive.os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL); post.save(" + repr(str(path)) + ")")
    result = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2], capture_output=True)
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()[-2000:]
    assert len(list(tmp_path.glob(".p.*.tmp"))) == 1
    _assert_same(post, pc.load(path, logistic_model))
    post.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["p"]


# --------------------------------------------------------------------------- fuzzing

_POOL = [None, True, -1, 0, 3, 2**63, 2**70, 1.5, -0.0, 1e308, math.inf, -math.inf, math.nan, "x", "", "float16",
         [], [1, -2], [[0]], {}, {"kind": "none"}]


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(node, list):
        for k, value in enumerate(node):
            yield from _paths(value, prefix + (k,))


def _mutate(manifest, rng):
    top = sorted(manifest)[rng.integers(len(manifest))]  # every field equally likely, then a node inside it
    paths = list(_paths(manifest[top], (top,)))
    path = paths[rng.integers(len(paths))]
    parent = manifest
    for step in path[:-1]:
        parent = parent[step]
    action = rng.integers(4)
    if action == 0 and isinstance(parent, dict):
        del parent[path[-1]]
    elif action == 0:
        parent.pop(path[-1])
    elif action == 1 and isinstance(parent[path[-1]], (int, float)) and not isinstance(parent[path[-1]], bool):
        parent[path[-1]] = parent[path[-1]] + int(rng.choice([-2, -1, 1, 7]))
    else:
        parent[path[-1]] = _POOL[rng.integers(len(_POOL))]


def test_fuzz_every_damaged_file_gives_a_typed_error_or_the_same_posterior(saved, tmp_path, x64):
    post, blob = saved
    rng = np.random.default_rng(2026)
    path = tmp_path / "f"
    members = _members_bytes(blob)
    manifest = json.loads(members["manifest.json"])
    outcomes = {"error": 0, "same": 0}
    cases = []
    for _ in range(1500):  # byte flips
        raw = bytearray(blob)
        pos = int(rng.integers(len(raw)))
        raw[pos] ^= int(rng.integers(1, 256))
        cases.append(("flip", bytes(raw)))
    for _ in range(300):  # truncations
        cases.append(("cut", blob[:int(rng.integers(len(blob)))]))
    for _ in range(700):  # a byte flipped inside one member, zip CRC recomputed: reaches the .npy and JSON parsers
        name = sorted(members)[rng.integers(len(members))]
        raw = bytearray(members[name])
        pos = int(rng.integers(min(len(raw), 160) if rng.integers(2) else len(raw)))  # headers half the time
        raw[pos] ^= int(rng.integers(1, 256))
        buffer = _io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as z:
            for other, data in members.items():
                z.writestr(other, bytes(raw) if other == name else data)
        cases.append(("member", buffer.getvalue()))
    for _ in range(700):  # manifest mutations (array checksums untouched)
        mutated = json.loads(json.dumps(manifest))
        for _ in range(int(rng.integers(1, 3))):
            _mutate(mutated, rng)
        buffer = _io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as z:
            for name, data in members.items():
                z.writestr(name, json.dumps(mutated).encode() if name == "manifest.json" else data)
        cases.append(("manifest", buffer.getvalue()))
    start, slowest = time.perf_counter(), 0.0
    for kind, data in cases:
        path.write_bytes(data)
        began = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                back = pc.load(path, logistic_model)
        except io.PersistenceError:
            outcomes["error"] += 1
            continue
        finally:
            slowest = max(slowest, time.perf_counter() - began)
        if kind in ("manifest", "member"):  # edits the checksums cannot see; the arrays must still be the saved ones
            for x, y in zip(jax.tree.leaves((post.state, post.sites, post.data, post.data_ids)),
                            jax.tree.leaves((back.state, back.sites, back.data, back.data_ids)), strict=True):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        else:
            _assert_same(post, back)
        outcomes["same"] += 1
    elapsed = time.perf_counter() - start
    print(f"fuzz: {len(cases)} cases, {outcomes}, {elapsed:.1f} s, slowest load {slowest:.2f} s")
    # no damaged file makes load hang or expand it (the bound is per file, so a loaded machine does not fail it)
    assert outcomes["error"] > len(cases) // 2 and slowest < 10.0


_DTYPES = ["bool", "int8", "int32", "int64", "uint8", "uint64", "float16", "float32", "float64", "complex128"]


def _mutate_array(a, rng):
    """A random edit of one array: dtype, shape, rows, or a few values (NaN, inf, huge, negative)."""
    a = np.zeros(2) if a is None else a
    action = int(rng.integers(10))
    if action == 0:
        return a.astype(_DTYPES[rng.integers(len(_DTYPES))])
    if action == 1 and a.ndim:
        return a[:-1]
    if action == 2 and a.ndim:
        return np.concatenate([a, a[-1:]])
    if action == 3:
        return a.reshape(-1)[:, None]
    if action == 4:
        return np.zeros((0, *a.shape[1:]), a.dtype)
    if action == 5:
        return a.reshape(-1)[:1].reshape(())
    if action == 6 and a.size:
        values = [np.nan, np.inf, -1.0, 1e308, 0.0] if a.dtype.kind in "fc" else [-1, 0, 2**31 - 1, 5]
        b = a.copy().reshape(-1)
        b[rng.integers(b.size)] = values[rng.integers(len(values))]
        return b.reshape(a.shape)
    if action == 7 and a.dtype.kind in "fiu":
        return a * [-1, 0, 10**9][rng.integers(3)]
    if action == 8 and a.size:
        return rng.permutation(a.reshape(-1)).reshape(a.shape)
    return a.T.copy()


def test_fuzz_re_signed_arrays_give_a_typed_error_or_a_finite_posterior(saved, tmp_path, x64):
    """Edits with recomputed checksums cannot all be detected (a permutation of ids stays consistent),
    but each must be refused with a PersistenceError or load into a posterior with a finite mean,
    precision and residual, which a later update and delete either use or refuse with a typed error
    (a ``y`` of shape ``(N, 0)`` once loaded and broke the next update with numpy's ``ValueError``)."""
    _, blob = saved
    X_new, y_new = make_logistic(4, 1, seed=8)
    rng = np.random.default_rng(17)
    path = tmp_path / "f"
    base = _members_bytes(blob)
    names = [n[:-4] for n in base if n.endswith(".npy")] + ["offset.linear", "offset.precision"]
    outcomes = {"error": 0, "loaded": 0}
    start = time.perf_counter()
    for _ in range(300):
        members = dict(base)
        manifest = json.loads(members["manifest.json"])
        for _ in range(int(rng.integers(1, 3))):
            name = names[rng.integers(len(names))]
            old = np.load(_io.BytesIO(members[f"{name}.npy"])) if f"{name}.npy" in members else None
            new = np.asarray(_mutate_array(old, rng))
            members[f"{name}.npy"] = archive.npy_bytes(new)
            manifest["arrays"][name] = {"sha256": io.digest(new), "dtype": str(new.dtype), "shape": list(new.shape)}
            if name.startswith("data.example.") and new.ndim and rng.integers(2):  # the manifest's shape too
                manifest["example_shapes"][int(name[-1])] = [list(new.shape[1:]), str(new.dtype)]
        members["manifest.json"] = json.dumps(manifest).encode()
        _write(path, members)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                back = pc.load(path, logistic_model)
        except io.PersistenceError:
            outcomes["error"] += 1
            continue
        outcomes["loaded"] += 1
        assert math.isfinite(back.residual)
        assert np.all(np.isfinite(np.asarray(back.state.mean)))
        assert np.all(np.isfinite(np.asarray(back.state.precision)))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                assert np.all(np.isfinite(np.asarray(back.update(X_new, y_new).state.mean)))
                if back.num_retained:
                    back.delete([int(back.data_ids[0])])
        except errors.PosteriorCorrectionError:
            outcomes["refused later"] = outcomes.get("refused later", 0) + 1
    elapsed = time.perf_counter() - start
    print(f"re-signed fuzz: 300 cases, {outcomes}, {elapsed:.1f} s")
    assert outcomes["error"] > 200 and elapsed < 60
