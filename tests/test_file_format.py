"""The one manifest schema of format version 2 and the upgrade of version-1 files (issue 26, item 5).

Oracles: the version-1 files committed in ``tests/fixtures`` by the release that had two
manifests (never regenerated), the layout the format documents (common header, the kind's
fields in one object named after the kind, sites as ``sites.<name>``), and the typed error
each kind of damage must raise.
"""

import copy
import hashlib
import io as _io
import json
import zipfile

import jax.numpy as jnp
import numpy as np
import pytest

import numpyro_pc as pc
from numpyro_pc import errors, file_format

from test_ef_adapt import beta_bernoulli
from test_saved_files import FIXTURES, KEY, MODELS

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
    assert set(manifest[kind]) == ({"rule", "curvature", "storage", "chunk_size", "next_id", "tombstones"}
                                   if kind == "gaussian" else {"config", "conjugate_prior", "next_id", "tombstones"})
    assert manifest["stale_sites"] is False
    sites = {n for n in manifest["arrays"] if n.startswith("sites.")}
    assert {"sites.grads", "sites.prior", "sites.ids"} == sites if kind == "ef" else "sites.grad" in sites


@pytest.mark.parametrize("name", NAMES)
def test_a_version_1_file_round_trips_through_version_2_unchanged(v2_files, name, x64):
    """Load v1, save (v2), load: every array identical, only the site members renamed for "ef"."""
    old, new = _arrays(FIXTURES / f"{name}.npz"), _arrays(v2_files[name])
    renamed = {"grads": "sites.grads", "prior": "sites.prior", "ids": "sites.ids"} if name.startswith("ef") else {}
    assert {renamed.get(k, k) for k in old} == set(new)
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
    # version 1 kept no deleted ids of exponential-family posteriors: the upgrade has none and no next id
    # (the loaded posterior numbers new examples past its largest id), where a save writes both
    unknown = {"next_id": None, "tombstones": []} if kind == "ef" else {}
    assert set(upgraded[kind]) == set(written[kind]) and upgraded["arrays"].keys() == moved.keys()
    assert {k: v for k, v in upgraded[kind].items() if k not in unknown} == \
        {k: v for k, v in written[kind].items() if k not in unknown}
    assert all(upgraded[kind][k] == v for k, v in unknown.items())
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
    ("ef_beta", lambda m: m["ef"].update(tombstones=[1]), errors.InconsistentFileError, "none of them held"),
    ("ef_beta", lambda m: m["ef"].update(next_id=-1), errors.CorruptFileError, "ef.next_id"),
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
    """The values an upgrade fills in (an exponential-family file's deleted ids) are fresh per call:
    editing one upgraded manifest does not reach the next."""
    manifest, arrays = _manifest(FIXTURES / "ef_beta.npz"), _arrays(FIXTURES / "ef_beta.npz")
    first, _ = file_format.upgrade(manifest, arrays)
    first["ef"]["tombstones"].append(0)
    second, _ = file_format.upgrade(manifest, arrays)
    assert second["ef"]["tombstones"] == [] and second["ef"]["next_id"] is None
