"""The one manifest schema of format version 2 and the upgrade of version-1 files (issue 26, item 5).

Oracles: the version-1 files committed in ``tests/fixtures`` by the release that had two
manifests (never regenerated), the layout the format documents (common header, the kind's
fields in one object named after the kind, sites as ``sites.<name>``), and the typed error
each kind of damage must raise.

Files written by an earlier release still load (issue 26, item 5, formerly ``tests/test_saved_files.py``).

``tests/fixtures`` holds posteriors saved by the release that had two file kinds (the
Gaussian archive and the exponential-family ``"kind": "ef"`` archive), written once by
``tests/fixtures/write_fixtures.py`` and never regenerated. Oracle: the numbers recorded
beside them when they were written (``expected.json``), exactly — a file read back is the
posterior that was saved, bit for bit — and the operations a user runs next.
"""

import copy
import hashlib
import io as _io
import json
import zipfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import numpyro_pc as pc
from numpyro_pc import errors
from numpyro_pc.io import file_format

from models import logistic_model, make_logistic
from models import _bern, beta_bernoulli
from models import _regression_data, regression

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
KEY = b"fixture-signing-key"
MODELS = {"gaussian_full": logistic_model, "gaussian_diagonal": logistic_model, "ef_beta": beta_bernoulli,
          "ef_mixed": regression}


@pytest.mark.parametrize("signed", [False, True], ids=["plain", "signed"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_file_of_the_earlier_release_loads_bit_for_bit(x64, name, signed):
    post = pc.load(FIXTURES / f"{name}{'_signed' if signed else ''}.npz", MODELS[name], key=KEY if signed else None)
    want = EXPECTED[name]
    if want["kind"] == "gaussian":
        assert post.family.name == want["family"]
        np.testing.assert_array_equal(np.asarray(post.mean), want["mean"])
        np.testing.assert_array_equal(np.asarray(post.precision), want["precision"])
        np.testing.assert_array_equal(np.asarray(post.sites.ids), want["ids"])
    else:
        np.testing.assert_array_equal(np.asarray(post.natural), want["natural"])
        np.testing.assert_array_equal(np.asarray(post.ids), want["ids"])
    assert post.residual < 1e-8  # the dual form it was saved in


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_fixtures_are_files_of_format_version_1(name):
    """The files above are version 1 (the two manifests), so loading them exercises the upgrade; a save
    writes version 2 (``tests/io/test_file_format.py``)."""
    import zipfile
    for suffix in ("", "_signed"):
        with zipfile.ZipFile(FIXTURES / f"{name}{suffix}.npz") as archive:
            manifest = json.loads(archive.read("manifest.json"))
            assert ("signature.hmac" in archive.namelist()) == bool(suffix)
        assert manifest["version"] == 1 and manifest.get("kind") == ("ef" if name.startswith("ef") else None)


def test_loaded_files_keep_working(x64):
    X, y = make_logistic(6, 2, seed=12)
    post = pc.load(FIXTURES / "gaussian_full.npz", logistic_model)
    grown = post.update(X, y, correction="exact", tol=1e-12)
    assert grown.num_examples == post.num_examples + 6 and grown.residual < 1e-10
    ef = pc.load(FIXTURES / "ef_beta.npz", beta_bernoulli)
    more = ef.update(y=jnp.asarray(_bern(5, seed=6)))
    a, b = (float(v) for v in more.family.describe(more.natural)["p"][1].values())
    a0, b0 = (float(v) for v in ef.family.describe(ef.natural)["p"][1].values())
    extra = _bern(5, seed=6)
    np.testing.assert_allclose([a, b], [a0 + extra.sum(), b0 + (1 - extra).sum()], rtol=1e-12)  # conjugate


def test_a_file_of_the_draws_design_keeps_its_design(x64):
    """``ef_mixed`` was written by 72a601e, whose Gaussian blocks beside Gauss-ruled factors were
    integrated by 64 moment-matched draws; today's default for that family is the cubature. The
    loaded posterior keeps the design it was saved with (its sites are recomputed with the same
    points), and an exact update is the batch fit of the conjugate regression under either design
    (1e-8: both are exact for a loss quadratic in the block)."""
    X, y = _regression_data()
    family = {"tau": "gamma", "w": "full"}
    post = pc.load(FIXTURES / "ef_mixed.npz", regression)
    assert post.config.rule == "mixed" and post.config.num_samples == 64
    grown = post.update(jnp.asarray(X[30:]), y=jnp.asarray(y[30:]), tol=1e-12)
    assert grown.config.rule == "mixed"
    batch = pc.fit(regression, jnp.asarray(X), y=jnp.asarray(y), family=family, tol=1e-12)
    assert batch.config.rule == "cubature"
    np.testing.assert_allclose(np.asarray(grown.natural), np.asarray(batch.natural), rtol=1e-8, atol=1e-8)
    # merging it with a posterior of the other design would join sites of two designs: refused
    shard = pc.fit(regression, jnp.asarray(X[30:]), y=jnp.asarray(y[30:]), family=family, tol=1e-12)
    with pytest.raises(errors.IncompatiblePosteriorsError, match="another design"):
        pc.merge(None, [post, shard])
    with pytest.raises(errors.IncompatiblePosteriorsError, match="another design"):  # one code path, one message
        post.merge(shard)


def test_a_signed_file_of_the_earlier_release_refuses_another_key(x64):
    for name in sorted(MODELS):
        with pytest.raises(errors.IntegrityError, match="signature does not match"):
            pc.load(FIXTURES / f"{name}_signed.npz", MODELS[name], key=b"another key")
        with pytest.raises(errors.IntegrityError, match="carries no signature"):
            pc.load(FIXTURES / f"{name}.npz", MODELS[name], key=KEY)


_SAVE_IN_A_FRESH_PROCESS = """
import sys, zipfile
import jax, jax.numpy as jnp
jax.config.update("jax_enable_x64", True)
import numpyro_pc as pc
from models import _bern, beta_bernoulli
from models import _regression_data, regression
X, y = _regression_data()
pc.fit(beta_bernoulli, y=jnp.asarray(_bern()), family={"p": "beta"}).save(sys.argv[1] + "/beta.npz")
pc.fit(regression, X, y, family={"w": "normal", "tau": "gamma"}).save(sys.argv[1] + "/mixed.npz")
for name in ("beta", "mixed"):
    with zipfile.ZipFile(sys.argv[1] + f"/{name}.npz") as archive:
        sys.stdout.write(archive.read("manifest.json").hex() + "\\n")
"""


def test_the_same_posterior_saved_in_two_processes_gives_the_same_manifest(tmp_path):
    # Python's hash seed orders sets: the model description of a distribution's parameters came out in
    # another order in another process, so the file (and its signature) differed. Oracle: byte equality of the
    # manifests written under three hash seeds (without sorted keys the three were not all equal: checked).
    import os
    import subprocess
    import sys

    outputs = []
    for seed in ("1", "2", "3"):
        folder = tmp_path / seed
        folder.mkdir()
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        done = subprocess.run([sys.executable, "-c", _SAVE_IN_A_FRESH_PROCESS, str(folder)], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        outputs.append(done.stdout.split())
    assert len(outputs[0]) == 2 and outputs[0] == outputs[1] == outputs[2]


NAMES = sorted(MODELS)


def _members(path):
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist()}


def _manifest(path):
    return json.loads(_members(path)["manifest.json"])


def _write(path, members):
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)


def _edit(source, target, edit, rename=None):
    """Copy ``source`` to ``target`` with its manifest edited by ``edit`` and members renamed by
    ``rename`` (``{old: new}``, array names without ``.npy``), checksums untouched."""
    members, rename = _members(source), rename or {}
    manifest = json.loads(members["manifest.json"])
    edit(manifest)
    manifest["arrays"] = {rename.get(k, k): v for k, v in manifest["arrays"].items()}
    members = {f"{rename[n[:-4]]}.npy" if n[:-4] in rename else n: d for n, d in members.items()}
    members["manifest.json"] = json.dumps(manifest).encode()
    _write(target, members)
    return target


def _arrays(path):
    return {n[:-4]: np.load(_io.BytesIO(d)) for n, d in _members(path).items() if n.endswith(".npy")}


@pytest.fixture(scope="module")
def v2_files(tmp_path_factory):
    """Each version-1 fixture loaded and saved again: the same posteriors as version-2 files."""
    import jax
    folder = tmp_path_factory.mktemp("v2")
    with jax.enable_x64(True):
        return {name: pc.save(pc.load(FIXTURES / f"{name}.npz", MODELS[name]), folder / f"{name}.npz")
                for name in NAMES}


# --------------------------------------------------------------------------- the written layout


@pytest.mark.parametrize("name", NAMES)
def test_a_saved_file_has_version_2_one_header_and_its_kind_part(v2_files, name):
    manifest = _manifest(v2_files[name])
    kind = "gaussian" if name.startswith("gaussian") else "ef"
    assert manifest["version"] == file_format.VERSION == 2 and manifest["kind"] == kind
    assert set(manifest) == file_format.COMMON_FIELDS | {kind}  # one header, one kind-specific object
    assert set(manifest[kind]) == ({"rule", "curvature", "storage", "chunk_size", "next_id"}
                                   if kind == "gaussian" else {"config", "conjugate_prior", "next_id"})
    assert manifest["arrays"]["tombstones"]["dtype"] == "int64"  # deleted ids: a member in both kinds
    assert manifest["stale_sites"] is False
    sites = {n for n in manifest["arrays"] if n.startswith("sites.")}
    assert {"sites.grads", "sites.prior", "sites.ids"} == sites if kind == "ef" else "sites.grad" in sites


@pytest.mark.parametrize("name", NAMES)
def test_a_version_1_file_round_trips_through_version_2_unchanged(v2_files, name, x64):
    """Load v1, save (v2), load: every array identical, only the site members renamed for "ef"."""
    old, new = _arrays(FIXTURES / f"{name}.npz"), _arrays(v2_files[name])
    renamed = {"grads": "sites.grads", "prior": "sites.prior", "ids": "sites.ids"} if name.startswith("ef") else {}
    added = {"tombstones"} if name.startswith("ef") else set()  # version 1 kept no deleted ids of these
    assert {renamed.get(k, k) for k in old} | added == set(new)
    if added:
        assert new["tombstones"].shape == (0,)
    for key, value in old.items():
        assert new[renamed.get(key, key)].dtype == value.dtype
        np.testing.assert_array_equal(new[renamed.get(key, key)], value)
    a, b = pc.load(FIXTURES / f"{name}.npz", MODELS[name]), pc.load(v2_files[name], MODELS[name])
    for x, y in zip(a.sites.arrays().values(), b.sites.arrays().values(), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --------------------------------------------------------------------------- the upgrade


@pytest.mark.parametrize("name", NAMES)
def test_the_upgrade_is_pure_and_gives_the_layout_a_save_writes(v2_files, name):
    manifest, arrays = _manifest(FIXTURES / f"{name}.npz"), _arrays(FIXTURES / f"{name}.npz")
    before = copy.deepcopy(manifest), dict(arrays)
    upgraded, moved = file_format.upgrade(manifest, arrays)
    assert manifest == before[0] and arrays.keys() == before[1].keys()  # neither argument is modified
    written = _manifest(v2_files[name])
    assert set(upgraded) == set(written) and upgraded["version"] == 2
    kind = upgraded["kind"]
    # version 1 kept no deleted ids of exponential-family posteriors: the upgrade has none, and the next id
    # past the largest held id (the fixtures deleted nothing, so a save writes the same)
    assert set(upgraded[kind]) == set(written[kind]) and upgraded["arrays"].keys() == moved.keys()
    assert upgraded[kind] == written[kind]
    if kind == "ef":
        assert upgraded["ef"]["next_id"] == int(arrays["ids"].max()) + 1 > 0
    assert moved["tombstones"].dtype == np.int64 and moved["tombstones"].ndim == 1
    np.testing.assert_array_equal(moved["tombstones"], _arrays(v2_files[name])["tombstones"])
    assert upgraded["arrays"]["tombstones"] == written["arrays"]["tombstones"]  # the same entry, checksum included
    file_format.check_file(upgraded, moved)  # every check after the upgrade sees one schema


@pytest.mark.parametrize("name", NAMES)
def test_loading_a_version_1_file_never_rewrites_it(name, x64):
    for path in (FIXTURES / f"{name}.npz", FIXTURES / f"{name}_signed.npz"):
        digest, stat = hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns
        assert _manifest(path)["version"] == 1
        pc.load(path, MODELS[name], key=KEY if "signed" in path.name else None)
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digest and path.stat().st_mtime_ns == stat


@pytest.mark.parametrize("name", ["gaussian_full", "ef_beta"])
def test_a_signed_version_1_file_is_verified_on_its_bytes_as_written(name, tmp_path, x64):
    """An edit the upgrade would make anyway (a v1 ``stale_sites: true`` would only be moved) still breaks
    the signature: the HMAC is over the original manifest bytes, not the upgraded manifest."""
    path = _edit(FIXTURES / f"{name}_signed.npz", tmp_path / "f", lambda m: m.update(stale_sites=True))
    with pytest.raises(errors.IntegrityError, match="does not match"):
        pc.load(path, MODELS[name], key=KEY)


@pytest.mark.parametrize("version", [0, 3, 99, "2", True, 2.0, None])
def test_another_version_is_refused_naming_the_versions_read(v2_files, tmp_path, version):
    path = _edit(v2_files["ef_beta"], tmp_path / "f", lambda m: m.update(version=version))
    with pytest.raises(errors.FormatVersionError, match="reads versions 1 and 2"):
        pc.load(path, MODELS["ef_beta"])


_V1_WITH_V2_FIELDS = [
    ("gaussian_full", lambda m: m.update(kind="gaussian"), {}, "kind"),
    ("gaussian_full", lambda m: m.update(gaussian={k: m[k] for k in ("rule", "curvature")}), {}, "version-1"),
    ("gaussian_full", lambda m: m.update(stale_sites=False), {}, "stale_sites"),
    ("ef_beta", lambda m: m.update(ef={"config": m["config"], "conjugate_prior": True}), {}, "version-1"),
    ("ef_beta", lambda m: m.update(next_id=99), {}, "version-1"),
    ("ef_beta", lambda m: None, {"grads": "sites.grads"}, "version-1 names"),
    ("ef_beta", lambda m: m.update(kind="gaussian"), {}, "kind"),
]


@pytest.mark.parametrize("name, edit, rename, match", _V1_WITH_V2_FIELDS,
                         ids=["kind", "gaussian-part", "stale-false", "ef-part", "ef-next-id", "ef-site-names", "ef-kind"])
def test_a_version_1_header_with_version_2_fields_is_refused(name, edit, rename, match, tmp_path):
    path = _edit(FIXTURES / f"{name}.npz", tmp_path / "f", edit, rename)
    with pytest.raises(errors.CorruptFileError, match=match):
        pc.load(path, MODELS[name])


def _as_v1(manifest):
    manifest["version"] = 1


_V2_WITH_V1_FIELDS = [
    ("gaussian_full", _as_v1, {}, "kind|only the fields"),  # a v2 manifest claiming version 1
    ("ef_beta", _as_v1, {}, "only the fields"),
    ("gaussian_full", lambda m: m.update(next_id=m["gaussian"]["next_id"]), {}, "only the fields"),
    ("ef_beta", lambda m: m.update(config=m["ef"]["config"]), {}, "only the fields"),
    ("ef_beta", lambda m: None, {"sites.grads": "grads"}, "arrays"),
    ("gaussian_full", lambda m: m.pop("stale_sites"), {}, "stale_sites"),
]


@pytest.mark.parametrize("name, edit, rename, match", _V2_WITH_V1_FIELDS,
                         ids=["gaussian-v1", "ef-v1", "gaussian-top-level", "ef-top-level", "ef-site-names",
                              "no-stale-sites"])
def test_a_version_2_header_with_version_1_fields_is_refused(v2_files, name, edit, rename, match, tmp_path):
    path = _edit(v2_files[name], tmp_path / "f", edit, rename)
    with pytest.raises(errors.CorruptFileError, match=match):
        pc.load(path, MODELS[name])


_TAMPERED_PARTS = [
    ("gaussian_full", lambda m: m["gaussian"].update(curvature="newton"), errors.CorruptFileError,
     "gaussian.curvature"),
    ("gaussian_full", lambda m: m["gaussian"].update(storage="banana"), errors.CorruptFileError, "gaussian.storage"),
    ("gaussian_full", lambda m: m["gaussian"]["rule"].update(num_nodes=10**9), errors.CorruptFileError,
     "gaussian.rule.num_nodes"),
    ("gaussian_full", lambda m: m["gaussian"].update(extra=1), errors.CorruptFileError, "'gaussian'"),
    ("gaussian_full", lambda m: m["gaussian"].update(next_id=3), errors.InconsistentFileError, "next_id"),
    ("gaussian_full", lambda m: m.update(kind="ef"), errors.CorruptFileError, "kind"),
    ("ef_beta", lambda m: m["ef"]["config"].update(num_nodes=0), errors.CorruptFileError, "ef.config.num_nodes"),
    ("ef_beta", lambda m: m["ef"].pop("conjugate_prior"), errors.CorruptFileError, "'ef'"),
    ("ef_beta", lambda m: m["ef"]["config"].update(rule="simpson"), errors.InconsistentFileError, "configuration"),
    ("ef_beta", lambda m: m["ef"].update(next_id=1), errors.InconsistentFileError, "next_id"),
    ("ef_beta", lambda m: m["ef"].update(tombstones=[1]), errors.InconsistentFileError, "ef.tombstones"),
    ("ef_beta", lambda m: m["ef"].update(next_id=-1), errors.CorruptFileError, "ef.next_id"),
    # null was the value of an upgrade from version 1: a version-2 file records its next id
    ("ef_beta", lambda m: m["ef"].update(next_id=None), errors.CorruptFileError, "ef.next_id"),
    ("ef_beta", lambda m: m["arrays"].pop("tombstones"), errors.CorruptFileError, "arrays"),
    ("ef_beta", lambda m: m.update(kind="gaussian"), errors.CorruptFileError, "kind"),
]


@pytest.mark.parametrize("name, edit, error, match", _TAMPERED_PARTS, ids=lambda v: "")
def test_a_tampered_kind_specific_field_is_refused_with_its_typed_error(v2_files, name, edit, error, match, tmp_path,
                                                                        x64):
    path = _edit(v2_files[name], tmp_path / "f", edit)
    with pytest.raises(error, match=match):
        pc.load(path, MODELS[name])


def test_an_exponential_family_file_keeps_its_deleted_ids(x64, tmp_path):
    """Deleted ids survive a save and a load, so an update after loading never gives them again
    (version 1 kept none: an upgraded file numbers new examples past its largest held id)."""
    y = jnp.asarray(np.array([1, 0, 1, 1, 0, 1], np.float64))
    post = pc.fit(beta_bernoulli, y=y[:4], family={"p": "beta"}).delete([2, 3])
    path = pc.save(post, tmp_path / "ef.npz")
    back = pc.load(path, beta_bernoulli)
    assert back.tombstones == (2, 3) and back.next_id == 4
    np.testing.assert_array_equal(np.asarray(back.update(y=y[4:]).ids), [0, 1, 4, 5])


def test_each_upgrade_gets_its_own_defaults():
    """The values an upgrade fills in (an exponential-family file's next id and deleted ids) are fresh
    per call: editing one upgraded manifest does not reach the next."""
    manifest, arrays = _manifest(FIXTURES / "ef_beta.npz"), _arrays(FIXTURES / "ef_beta.npz")
    first, moved = file_format.upgrade(manifest, arrays)
    first["ef"]["next_id"] = 10**6
    first["arrays"]["tombstones"]["shape"].append(1)
    moved["tombstones"] = np.arange(3)
    second, again = file_format.upgrade(manifest, arrays)
    assert second["ef"]["next_id"] == int(arrays["ids"].max()) + 1
    assert second["arrays"]["tombstones"]["shape"] == [0] and again["tombstones"].shape == (0,)


# --------------------------------------------------------------------------- deleted ids: the tombstones member


def _with_member(source, target, name, value):
    """Copy ``source`` to ``target`` with the array ``name`` replaced by ``value`` and its manifest entry
    (checksum, dtype, shape) made to agree: damage that only the checks of the values can find."""
    members = _members(source)
    manifest = json.loads(members["manifest.json"])
    value = np.asarray(value)
    buffer = _io.BytesIO()
    np.save(buffer, value, allow_pickle=False)
    members[f"{name}.npy"] = buffer.getvalue()
    manifest["arrays"][name] = {"sha256": hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest(),
                                "dtype": str(value.dtype), "shape": list(value.shape)}
    members["manifest.json"] = json.dumps(manifest).encode()
    _write(target, members)
    return target


def test_an_exponential_family_posterior_with_very_many_deleted_ids_saves_and_loads(x64, tmp_path):
    """250 000 deleted ids (the manifest's list stopped near 175 000: its 2 MiB cap): the ids are a
    member, the manifest stays small, and every id comes back, so an update after loading numbers past them."""
    y = jnp.asarray(np.array([1, 0, 1, 1, 0, 1], np.float64))
    many = pc.fit(beta_bernoulli, y=y[:4], family={"p": "beta"}).evolve(tombstones=range(4, 250_004))
    assert len(many.tombstones) == 250_000 and many.next_id == 250_004
    path = pc.save(many, tmp_path / "many.npz")
    assert len(_members(path)["manifest.json"]) < 16_384
    back = pc.load(path, beta_bernoulli)
    assert back.tombstones == many.tombstones and back.next_id == 250_004
    np.testing.assert_array_equal(np.asarray(back.natural), np.asarray(many.natural))
    np.testing.assert_array_equal(np.asarray(back.update(y=y[4:]).ids), [0, 1, 2, 3, 250_004, 250_005])


_BAD_TOMBSTONES = [
    (lambda ids, nxt: np.array([float(nxt)]), "integer dtype"),
    (lambda ids, nxt: np.array([[nxt - 1]], np.int64), "one dimension"),
    (lambda ids, nxt: np.array([nxt], np.int64), "next_id"),
    (lambda ids, nxt: np.array([-1], np.int64), "next_id"),
    (lambda ids, nxt: np.array([ids[0]], np.int64), "none of them held"),
    (lambda ids, nxt: np.array([nxt - 1, nxt - 1], np.int32), "unique"),
]


@pytest.mark.parametrize("name", ["ef_beta", "gaussian_full"])
@pytest.mark.parametrize("make, match", _BAD_TOMBSTONES, ids=["float", "2d", "at-next-id", "negative", "held",
                                                              "duplicate"])
def test_a_damaged_tombstones_member_is_refused_with_its_typed_error(v2_files, name, make, match, tmp_path, x64):
    manifest, arrays = _manifest(v2_files[name]), _arrays(v2_files[name])
    kind = manifest["kind"]
    held, next_id = arrays["sites.ids"], manifest[kind]["next_id"]
    if match == "unique":  # an id free in both kinds: the file's next id raised past the held ones
        next_id = int(held.max()) + 3
        path = _edit(v2_files[name], tmp_path / "next", lambda m: m[kind].update(next_id=next_id))
    else:
        path = v2_files[name]
    path = _with_member(path, tmp_path / "f", "tombstones", make(held, next_id))
    with pytest.raises(errors.InconsistentFileError, match=match):
        pc.load(path, MODELS[name])


@pytest.mark.parametrize("name", ["ef_beta", "gaussian_full"])
def test_a_tombstones_member_larger_than_declared_is_not_read(v2_files, name, tmp_path):
    path = _with_member(v2_files[name], tmp_path / "f", "tombstones", np.arange(10**5, dtype=np.int64))
    _edit(path, path, lambda m: m["arrays"]["tombstones"].update(shape=[1]))
    with pytest.raises(errors.CorruptFileError, match="tombstones"):  # OversizedFileError is one
        pc.load(path, MODELS[name])


# --------------------------------------------------------------------------- version-2 files that list deleted ids

# written by tests/fixtures/write_v2_listed_fixtures.py with the release that listed deleted ids in the manifest
_LISTED = {"ef_beta_v2_listed": ("ef", (2, 5), 8, [0, 1, 3, 4, 6, 7]),
           "gaussian_full_v2_listed": ("gaussian", (1, 7), 12, [0, 2, 3, 4, 5, 6, 8, 9, 10, 11])}


def _listed_model(name):
    from models import logistic_model
    return beta_bernoulli if name.startswith("ef") else logistic_model


@pytest.mark.parametrize("name", sorted(_LISTED))
def test_a_version_2_file_that_lists_its_deleted_ids_loads_and_saves_them_as_a_member(name, tmp_path, x64):
    kind, tombstones, next_id, ids = _LISTED[name]
    manifest = _manifest(FIXTURES / f"{name}.npz")
    assert manifest["version"] == 2 and manifest[kind]["tombstones"] == list(tombstones)
    post = pc.load(FIXTURES / f"{name}.npz", _listed_model(name))
    assert post.tombstones == tombstones and post.next_id == next_id
    np.testing.assert_array_equal(np.asarray(post.sites.ids), ids)
    again = pc.save(post, tmp_path / "again.npz")
    assert "tombstones" not in _manifest(again)[kind]
    np.testing.assert_array_equal(_arrays(again)["tombstones"], tombstones)
    back = pc.load(again, _listed_model(name))
    assert back.tombstones == tombstones and back.next_id == next_id
    for x, y in zip(post.sites.arrays().values(), back.sites.arrays().values(), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_signed_version_2_file_that_lists_its_deleted_ids_is_verified_as_written(x64):
    post = pc.load(FIXTURES / "ef_beta_v2_listed_signed.npz", beta_bernoulli, key=KEY)
    assert post.tombstones == (2, 5)
    with pytest.raises(errors.IntegrityError, match="does not match"):
        pc.load(FIXTURES / "ef_beta_v2_listed_signed.npz", beta_bernoulli, key=b"another key")


_BAD_LISTS = [
    ("ef_beta_v2_listed", lambda m: m["ef"].update(tombstones=[-1]), errors.CorruptFileError, "ef.tombstones"),
    ("ef_beta_v2_listed", lambda m: m["ef"].update(tombstones="2,5"), errors.CorruptFileError, "ef.tombstones"),
    ("ef_beta_v2_listed", lambda m: m["ef"].update(tombstones=[2, True]), errors.CorruptFileError, "ef.tombstones"),
    ("ef_beta_v2_listed", lambda m: m["ef"].update(tombstones=[2, 3]), errors.InconsistentFileError, "held"),
    ("ef_beta_v2_listed", lambda m: m["ef"].update(tombstones=[2, 2]), errors.InconsistentFileError, "unique"),
    ("ef_beta_v2_listed", lambda m: m["ef"].update(tombstones=[8]), errors.InconsistentFileError, "next_id"),
    ("ef_beta_v2_listed", lambda m: m["ef"].update(next_id=None), errors.CorruptFileError, "ef.next_id"),
    ("gaussian_full_v2_listed", lambda m: m["gaussian"].update(tombstones=[1, 8]), errors.InconsistentFileError,
     "gaussian.tombstones"),
]


@pytest.mark.parametrize("name, edit, error, match", _BAD_LISTS, ids=lambda v: "")
def test_a_damaged_list_of_deleted_ids_is_refused_with_its_typed_error(name, edit, error, match, tmp_path, x64):
    path = _edit(FIXTURES / f"{name}.npz", tmp_path / "f", edit)
    with pytest.raises(error, match=match):
        pc.load(path, _listed_model(name))


# --------------------------------------------------------------------------- the former names of the checks

# under the module names of the flat layout, as users wrote them (the modules also warn that they moved)
_FORMER = [("numpyro_pc.validation", "check_manifest", "numpyro_pc.io.file_format.check_manifest"),
           ("numpyro_pc.ef_io", "check_ef_manifest", "numpyro_pc.io.file_format.check_manifest"),
           ("numpyro_pc.ef_io", "check_ef_contents", "numpyro_pc.io.validation.check_ef_contents")]


@pytest.mark.parametrize("module, name, new", _FORMER, ids=[n for _, n, _ in _FORMER])
def test_a_former_check_still_works_for_one_release_with_a_warning_naming_its_replacement(v2_files, module, name,
                                                                                          new):
    import importlib
    with pytest.warns(FutureWarning, match=new.replace(".", r"\.")):
        check = getattr(importlib.import_module(module), name)
    path = v2_files["ef_beta"]
    manifest, arrays = _manifest(path), _arrays(path)
    if name == "check_ef_contents":
        check(manifest, arrays)  # the saved file passes
        arrays["sites.ids"] = arrays["sites.ids"][::-1].copy()
        arrays["sites.ids"][0] = arrays["sites.ids"][1]
        with pytest.raises(errors.InconsistentFileError, match="unique ids"):
            check(manifest, arrays)
    else:
        assert set(check(manifest)) == set(manifest["arrays"])  # the declared arrays
        manifest["ef"]["next_id"] = None
        with pytest.raises(errors.CorruptFileError, match="ef.next_id"):
            check(manifest)
    with pytest.raises(AttributeError, match="no attribute"):
        getattr(importlib.import_module(module), name + "_never_defined")


# --------------------------------------------------------------------------- read order and bounds


def test_a_signed_file_is_verified_before_its_family_name_is_interpreted(tmp_path, x64):
    """A parametrised family name is built and registered when the manifest is checked; with a key, the
    signature is verified first, so an altered name registers nothing (the process's family registry is
    not for the file's author to extend)."""
    from numpyro_pc.families.registry import registered_families
    assert "lowrank-37" not in registered_families()
    path = _edit(FIXTURES / "gaussian_full_signed.npz", tmp_path / "f", lambda m: m.update(family="lowrank-37"))
    with pytest.raises(errors.IntegrityError, match="does not match"):
        pc.load(path, MODELS["gaussian_full"], key=KEY)
    assert "lowrank-37" not in registered_families()
    with pytest.raises(errors.CorruptFileError):  # unsigned reading still refuses it, after the checks
        pc.load(path, MODELS["gaussian_full"])


def test_the_manifest_allowance_of_a_tombstones_member_is_for_manifests_that_list_deleted_ids(v2_files, tmp_path,
                                                                                            monkeypatch, x64):
    """Only files that list their deleted ids in the manifest (written before the member held them alone)
    need more than MAX_MANIFEST bytes of manifest; another manifest using the allowance that any
    ``tombstones.npy`` grants before the kind is known is refused once parsed."""
    from numpyro_pc.io import archive
    listed = FIXTURES / "gaussian_full_v2_listed.npz"
    current = _with_member(v2_files["gaussian_full"], tmp_path / "f", "tombstones", np.arange(0))
    for path in (listed, current):
        size = len(_members(path)["manifest.json"])
        monkeypatch.setattr(archive, "MAX_MANIFEST", size - 64)  # within the member's allowance (3 × 128 bytes)
        assert size <= archive.manifest_limit(len(_members(path)["tombstones.npy"]))
        if path == listed:
            assert pc.load(path, MODELS["gaussian_full"]).tombstones == (1, 7)
        else:
            with pytest.raises(errors.OversizedFileError, match="lists no deleted ids"):
                pc.load(path, MODELS["gaussian_full"])
