"""Persistence: bit-exact round trips, atomic writes, and a typed error for every corruption."""

import json
import os
import stat
import zipfile

import jax
import numpy as np
import pytest

import numpyro_pc as pc
from numpyro_pc.io import archive
from numpyro_pc.io import save_load as io
from numpyro_pc.errors import PersistenceError

from models import logistic_model, make_logistic, scale_model, make_linear


@pytest.fixture
def streamed(x64):
    X, y = make_logistic(90, 3, seed=20)
    post = pc.fit(logistic_model, X[:40], y[:40], family="full")
    post = post.update(X[40:70], y[40:70], correction="memory", memory=10, keep=50)
    post = post.delete([2, 45], method="remove_site")
    return post, X, y


def _same(a, b):
    for x, y in zip(jax.tree.leaves((a.state, a.sites, a.data, a.data_ids)),
                    jax.tree.leaves((b.state, b.sites, b.data, b.data_ids))):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_is_bit_exact_and_keeps_working(streamed, tmp_path):
    post, X, y = streamed
    path = post.save(tmp_path / "run" / "posterior")
    back = pc.load(path, logistic_model)
    _same(post, back)
    assert back.tombstones == post.tombstones and back.next_id == post.next_id
    assert back.rule == post.rule and back.family.name == post.family.name
    a = post.update(X[70:], y[70:], correction="exact")
    b = back.update(X[70:], y[70:], correction="exact")
    np.testing.assert_array_equal(np.asarray(a.state.mean), np.asarray(b.state.mean))
    with pytest.raises(pc.UnknownExampleError):
        back.delete([2])  # deleted ids stay deleted after a load


def test_a_crash_before_the_rename_leaves_the_previous_save(streamed, tmp_path, monkeypatch):
    post, X, y = streamed
    path = post.save(tmp_path / "posterior")
    newer = post.update(X[70:], y[70:], correction="none")

    def crash(src, dst):
        raise OSError("simulated power cut between write and rename")

    monkeypatch.setattr(archive.os, "replace", crash)
    with pytest.raises(OSError, match="power cut"):
        newer.save(path)
    monkeypatch.undo()
    _same(post, pc.load(path, logistic_model))
    assert [p.name for p in tmp_path.iterdir()] == ["posterior"]  # no temporary file left behind


def _rewrite(path, edit):
    with zipfile.ZipFile(path) as archive:
        members = {n: archive.read(n) for n in archive.namelist()}
    edit(members)
    with zipfile.ZipFile(path, "w") as archive:
        for n, data in members.items():
            archive.writestr(n, data)


def test_every_corruption_has_its_error(streamed, tmp_path):
    post, _, _ = streamed
    path = post.save(tmp_path / "p")
    blob = path.read_bytes()

    path.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(io.CorruptFileError, match="truncated"):
        pc.load(path, logistic_model)

    path.write_bytes(blob)

    def flip(members):
        raw = bytearray(members["mean.npy"])
        raw[-1] ^= 0x01
        members["mean.npy"] = bytes(raw)
    _rewrite(path, flip)
    with pytest.raises(io.CorruptFileError, match="checksum"):
        pc.load(path, logistic_model)

    path.write_bytes(blob)

    def bump(members):
        manifest = json.loads(members["manifest.json"])
        manifest["version"] = 99
        members["manifest.json"] = json.dumps(manifest).encode()
    _rewrite(path, bump)
    with pytest.raises(io.FormatVersionError, match="version 99"):
        pc.load(path, logistic_model)

    path.write_bytes(blob)

    def as_float32(members):
        manifest = json.loads(members["manifest.json"])
        manifest["dtype"] = "float32"
        members["manifest.json"] = json.dumps(manifest).encode()
    _rewrite(path, as_float32)
    with pytest.raises(io.DtypeMismatchError):
        pc.load(path, logistic_model)

    path.write_bytes(blob)
    X, y = make_linear(5, 3)
    with pytest.raises(io.ModelMismatchError):
        pc.load(path, scale_model)


def test_float64_file_needs_x64(streamed, tmp_path):
    post, _, _ = streamed
    path = post.save(tmp_path / "p")
    with jax.enable_x64(False):
        with pytest.raises(io.DtypeMismatchError, match="x64"):
            pc.load(path, logistic_model)


def test_no_pickle_in_the_archive(streamed, tmp_path):
    post, _, _ = streamed
    path = post.save(tmp_path / "p")
    with zipfile.ZipFile(path) as archive:
        for name in archive.namelist():
            if name.endswith(".npy"):
                with archive.open(name) as handle:
                    np.load(handle, allow_pickle=False)  # would raise on object arrays


def test_saving_to_a_directory_is_a_persistence_error(tmp_path):
    # before: the builtin IsADirectoryError from os.replace
    X, y = make_logistic(20, 2, seed=0)
    post = pc.fit(logistic_model, X, y, family="diagonal")
    with pytest.raises(PersistenceError, match=r"is a directory; expected the path of a file") as err:
        post.save(tmp_path)
    assert str(tmp_path) in str(err.value)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="root ignores folder permissions (and they are POSIX ones)")
def test_saving_into_a_read_only_folder_is_a_persistence_error(tmp_path):
    # before: the builtin PermissionError from the temporary file's creation
    X, y = make_logistic(20, 2, seed=0)
    post = pc.fit(logistic_model, X, y, family="diagonal")
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        with pytest.raises(PersistenceError, match=r"cannot save to .*PermissionError") as err:
            post.save(folder / "post.npc")
        assert str(folder / "post.npc") in str(err.value)
    finally:
        folder.chmod(stat.S_IRWXU)
