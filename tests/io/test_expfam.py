"""An exponential-family file is untrusted input too: the bounds and damage checks of
``tests/io/test_validation.py`` (Gaussian files), for ``"kind": "ef"`` files.

Oracles: the typed errors of :mod:`numpyro_pc.errors` (every damaged file raises a
:class:`~numpyro_pc.errors.PersistenceError`, never a builtin or NumPy error), the sizes the
reader promises not to exceed, and the saved posterior itself: a file that loads despite an
edit must be the posterior that was saved, array for array.
"""

import io as _io
import json
import tracemalloc
import warnings
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import numpyro_pc as pc
from numpyro_pc import errors
from numpyro_pc.io import archive

from models import _bern, beta_bernoulli

_FEW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A Beta-Bernoulli posterior with two deleted examples, saved once; tests copy its bytes."""
    with jax.enable_x64(True):
        post = pc.fit(beta_bernoulli, y=jnp.asarray(_bern(12, seed=4)), family={"p": "beta"}).delete([3, 7])
        path = pc.save(post, tmp_path_factory.mktemp("ef") / "p.npz")
    return post, path.read_bytes()


@pytest.fixture
def fresh(saved, tmp_path, x64):
    post, blob = saved
    path = tmp_path / "p.npz"
    path.write_bytes(blob)
    return post, path


def _members(blob):
    with zipfile.ZipFile(_io.BytesIO(blob)) as z:
        return {n: z.read(n) for n in z.namelist()}


def _zip(members, compress=None):
    buffer = _io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        for name, data in members.items():
            z.writestr(name, data, compress_type=(compress or {}).get(name, zipfile.ZIP_STORED))
    return buffer.getvalue()


def _load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pc.load(path, beta_bernoulli)


def _assert_same(a, b):
    assert (a.tombstones, a.next_id, a.conjugate_prior, a.stale_sites) == \
        (b.tombstones, b.next_id, b.conjugate_prior, b.stale_sites)
    for x, y in zip(jax.tree.leaves((a.natural, a.sites.arrays(), a.data)),
                    jax.tree.leaves((b.natural, b.sites.arrays(), b.data)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_the_saved_file_loads_as_saved(fresh):
    post, path = fresh
    back = _load(path)
    _assert_same(post, back)
    assert back.tombstones == (3, 7) and back.next_id == 12


# --------------------------------------------------------------------------- bounds


def test_a_compressed_bomb_is_refused_before_it_is_expanded(fresh):
    _, path = fresh
    members = _members(path.read_bytes())
    members["sites.grads.npy"] = bytes(64 * 2**20)  # 64 MiB of zeros deflate to ~64 KB
    path.write_bytes(_zip(members, {"sites.grads.npy": zipfile.ZIP_DEFLATED}))
    assert path.stat().st_size < 2**20
    tracemalloc.start()
    try:
        with pytest.raises(errors.OversizedFileError, match="compressed"):
            _load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20


def test_an_oversized_manifest_is_refused_before_it_is_read(fresh):
    _, path = fresh
    members = _members(path.read_bytes())
    manifest = json.loads(members["manifest.json"])
    manifest["padding"] = " " * (archive.MAX_MANIFEST + 1)
    members["manifest.json"] = json.dumps(manifest).encode()
    path.write_bytes(_zip(members))
    with pytest.raises(errors.OversizedFileError, match="manifest needs at most"):
        _load(path)


def test_a_large_tombstones_member_buys_no_manifest_allowance_for_an_ef_file(fresh):
    """A ``tombstones.npy`` of 3 MB would allow a 2 MiB + 9 MB manifest; an ``"ef"`` manifest lists no
    deleted ids, so once parsed it is held to 2 MiB."""
    _, path = fresh
    members = _members(path.read_bytes())
    manifest = json.loads(members["manifest.json"])
    ids = np.arange(12, 12 + 400_000, dtype=np.int64)
    members["tombstones.npy"] = archive.npy_bytes(ids)
    manifest["arrays"]["tombstones"].update(shape=[ids.size], sha256=pc.io.digest(ids))
    manifest["ef"]["next_id"] = 12 + ids.size
    manifest["padding"] = " " * (archive.MAX_MANIFEST + 1)
    members["manifest.json"] = json.dumps(manifest).encode()
    path.write_bytes(_zip(members))
    with pytest.raises(errors.OversizedFileError, match="lists no deleted ids"):
        _load(path)
    del manifest["padding"]  # the same deleted ids without the padding: a valid file
    members["manifest.json"] = json.dumps(manifest).encode()
    path.write_bytes(_zip(members))
    back = _load(path)  # the ids (3, 7) replaced by 400 000 others
    assert back.tombstones == tuple(range(12, 400_012)) and back.next_id == 400_012


@pytest.mark.parametrize("name", ["tombstones", "natural", "sites.grads", "data.example.0"])
def test_a_member_larger_than_its_manifest_declares_is_not_read(fresh, name):
    _, path = fresh
    members = _members(path.read_bytes())
    members[f"{name}.npy"] = archive.npy_bytes(np.zeros(200_000))  # 1.6 MB where a few bytes are declared
    path.write_bytes(_zip(members))
    with pytest.raises(errors.OversizedFileError, match=f"{name}.npy"):
        _load(path)


def test_members_declaring_more_than_the_file_holds_are_refused(fresh):
    _, path = fresh
    blob = bytearray(path.read_bytes())
    directory = blob.rfind(b"PK\x01\x02")  # last central directory entry: claim a huge member size
    blob[directory + 20:directory + 28] = (2**31).to_bytes(4, "little") * 2
    path.write_bytes(bytes(blob))
    with pytest.raises(errors.CorruptFileError):
        _load(path)


# --------------------------------------------------------------------------- fuzz: only typed errors

_POOL = [None, True, -1, 0, 2**63, 1e308, float("nan"), "", "beta", [], [0], {}, {"a": 1}, [[1, 2]], "sites.ids"]


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(node, list):
        for k, value in enumerate(node):
            yield from _paths(value, prefix + (k,))


@_FEW
@given(data=st.data())
def test_fuzz_damaged_bytes_give_a_typed_error_or_the_saved_posterior(saved, tmp_path, x64, data):
    post, blob = saved
    damaged = bytearray(blob)
    action = data.draw(st.sampled_from(["flip", "truncate", "zero"]))
    if action == "truncate":
        damaged = damaged[:data.draw(st.integers(0, len(blob) - 1))]
    else:
        for _ in range(data.draw(st.integers(1, 4))):
            at = data.draw(st.integers(0, len(blob) - 1))
            damaged[at] = 0 if action == "zero" else damaged[at] ^ (1 << data.draw(st.integers(0, 7)))
    path = tmp_path / "f.npz"
    path.write_bytes(bytes(damaged))
    try:
        back = _load(path)
    except errors.PersistenceError:
        return
    _assert_same(post, back)  # a flip the checks cannot see (zip metadata, header padding) changes nothing


@_FEW
@given(data=st.data())
def test_fuzz_edited_manifest_fields_give_a_typed_error_or_the_saved_posterior(saved, tmp_path, x64, data):
    post, blob = saved
    members = _members(blob)
    manifest = json.loads(members["manifest.json"])
    for _ in range(data.draw(st.integers(1, 2))):
        top = data.draw(st.sampled_from(sorted(manifest)))
        where = data.draw(st.sampled_from(list(_paths(manifest[top], (top,)))))
        parent = manifest
        for step in where[:-1]:
            parent = parent[step]
        if data.draw(st.booleans()):
            parent.pop(where[-1])
        else:
            parent[where[-1]] = data.draw(st.sampled_from(_POOL))
    members["manifest.json"] = json.dumps(manifest).encode()
    path = tmp_path / "f.npz"
    path.write_bytes(_zip(members))
    try:
        back = _load(path)
    except errors.PersistenceError:
        return
    for x, y in zip(jax.tree.leaves((post.natural, post.sites.arrays(), post.data)),
                    jax.tree.leaves((back.natural, back.sites.arrays(), back.data)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # the checksums keep the arrays


_ARRAYS = st.one_of(
    st.just(np.zeros((2, 2))), st.just(np.array([], np.int64)), st.just(np.array([3, 3], np.int64)),
    st.just(np.array([-1], np.int32)), st.just(np.array([2**62], np.int64)), st.just(np.array([np.nan])),
    st.just(np.array([1.5, 2.5])), st.just(np.zeros((0, 1))), st.just(np.ones(3, np.uint8)),
    st.just(np.array([True])), st.just(np.array(7, np.int64)))


@_FEW
@given(name=st.sampled_from(["tombstones", "sites.ids", "natural", "sites.prior", "sites.grads"]), value=_ARRAYS)
def test_fuzz_re_checksummed_arrays_give_a_typed_error_or_a_consistent_posterior(saved, tmp_path, x64, name, value):
    """Edits with recomputed checksums: refused with a typed error, or a posterior whose deleted ids
    are disjoint from its held ids and below its next id."""
    _, blob = saved
    members = _members(blob)
    manifest = json.loads(members["manifest.json"])
    members[f"{name}.npy"] = archive.npy_bytes(value)
    manifest["arrays"][name] = {"sha256": pc.io.digest(value), "dtype": str(value.dtype), "shape": list(value.shape)}
    members["manifest.json"] = json.dumps(manifest).encode()
    path = tmp_path / "f.npz"
    path.write_bytes(_zip(members))
    try:
        back = _load(path)
    except errors.PersistenceError:
        return
    held = set(np.asarray(back.ids).tolist())
    assert not held & set(back.tombstones) and max([*held, *back.tombstones], default=-1) < back.next_id
    assert np.all(np.isfinite(np.asarray(back.natural)))
