"""Beta/Gamma/Dirichlet posteriors through the adaptations written for Gaussian ones (issue 13):
save/load, ArviZ export, ``pc.handlers.posterior_prior`` and ``pc.merge``.

Oracles: the closed-form conjugate posterior (Beta–Bernoulli, Dirichlet–Categorical),
Bernoulli log-likelihoods in closed form at the exported draws, exact leave-one-out of the
Beta–Bernoulli model, and the original posterior for everything that is loaded back.
"""

import io as _io
import json
import warnings
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from scipy import special

import numpyro_pc as pc
from numpyro_pc import errors
from numpyro_pc.io import archive
from numpyro_pc.io import save_load as io
from numpyro_pc.dual.expfam import merge_ef

from models import logistic_model, make_logistic
from models import A0, B0, _bern, _cat, _pois, beta_bernoulli, beta_guide, dirichlet_categorical, flat_beta_bernoulli, lognormal_poisson, two_sites

RELEASE_PROGRAMS_EACH_TEST = True  # large programs, rarely shared: keeps a worker's memory bounded (conftest)


def renamed_bernoulli(y=None):
    q = numpyro.sample("q", dist.Beta(A0, B0))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Bernoulli(probs=q), obs=y)


def vector_bernoulli(y=None):  # p of shape (2,): another latent shape
    p = numpyro.sample("p", dist.Beta(A0, B0).expand([2]).to_event(1))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Bernoulli(probs=p[0]), obs=y)


def _args(post):
    return np.concatenate([np.ravel(v) for _, (_, a) in post.family.describe(post.natural).items() for v in a.values()])


def _assert_same(a, b):
    for x, y in zip(jax.tree.leaves((a.state, a.data)), jax.tree.leaves((b.state, b.data)), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert (a.config.rule, a.config.num_nodes, a.config.num_samples, a.config.seed, a.conjugate_prior) == \
           (b.config.rule, b.config.num_nodes, b.config.num_samples, b.config.seed, b.conjugate_prior)
    assert [(f.site, f.family_name, f.shape) for f in a.family.factors] == \
           [(f.site, f.family_name, f.shape) for f in b.family.factors]


# ---------------------------------------------------------------- save / load


CASES = [  # model, family, first batch, second batch (the kwargs of the model)
    (beta_bernoulli, {"p": "beta"}, dict(y=jnp.asarray(_bern()[:40])), dict(y=jnp.asarray(_bern()[40:]))),
    (dirichlet_categorical, {"pi": "dirichlet"}, dict(y=jnp.asarray(_cat()[:40], jnp.int32)),
     dict(y=jnp.asarray(_cat()[40:], jnp.int32))),
    (lognormal_poisson, {"rate": "gamma"}, dict(y=jnp.asarray(_pois()[:15])), dict(y=jnp.asarray(_pois()[15:]))),
    (two_sites, {"p": "beta", "rate": "gamma"}, dict(y=jnp.asarray(_bern(30)[:20]), c=jnp.asarray(_pois(30)[:20])),
     dict(y=jnp.asarray(_bern(30)[20:]), c=jnp.asarray(_pois(30)[20:]))),
]


@pytest.mark.parametrize("model, family, first, second", CASES, ids=["beta", "dirichlet", "gamma-nonconj", "two"])
def test_round_trip_updates_and_deletes_like_the_original(x64, tmp_path, model, family, first, second):
    post = pc.fit(model, family=family, **first).delete([3, 5], method="remove_site")
    path = pc.save(post, tmp_path / "ef" / "post")
    back = pc.load(path, model)
    assert isinstance(back, pc.EFPosterior) and back.guide_map is None and back.record["operation"] == "load"
    _assert_same(post, back)
    for correction in ("exact", "none"):
        a, b = post.update(correction=correction, **second), back.update(correction=correction, **second)
        np.testing.assert_allclose(np.asarray(b.natural), np.asarray(a.natural), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(np.asarray(b.state.grads), np.asarray(a.state.grads), rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(np.asarray(b.ids), np.asarray(a.ids))
    for method in ("remove_site", "corrected"):
        a, b = post.delete([0, 7], method=method), back.delete([0, 7], method=method)
        np.testing.assert_allclose(np.asarray(b.natural), np.asarray(a.natural), rtol=1e-12, atol=1e-12)
    with pytest.raises(pc.UnknownExampleError):
        back.delete([3])  # deleted examples stay deleted


def test_conjugate_round_trip_keeps_the_closed_form(x64, tmp_path):
    y = _bern()
    post = pc.fit(beta_bernoulli, y=jnp.asarray(y[:30]), family={"p": "beta"})
    back = pc.load(pc.save(post, tmp_path / "p"), beta_bernoulli).update(y=jnp.asarray(y[30:]))
    np.testing.assert_allclose(_args(back), [A0 + y.sum(), B0 + (1 - y).sum()], rtol=1e-10)


def test_a_posterior_without_examples_round_trips(x64, tmp_path):
    y = _bern(10)
    post = pc.fit(beta_bernoulli, y=jnp.asarray(y), family={"p": "beta"})
    empty = post.delete(np.asarray(post.ids), method="remove_site")  # back to the prior, no data rows
    back = pc.load(pc.save(empty, tmp_path / "p"), beta_bernoulli)
    _assert_same(empty, back)
    np.testing.assert_allclose(_args(back), [A0, B0], rtol=1e-12)
    np.testing.assert_allclose(_args(back.update(y=jnp.asarray(y))), _args(post), rtol=1e-12)


def test_the_guide_is_not_saved_but_can_be_passed_after_load(x64, tmp_path):
    y = jnp.asarray(_bern())
    post = pc.dual_form(beta_bernoulli, beta_guide, {"a": 3.0, "b": 4.0}, y=y)
    assert post.guide_map is not None
    back = pc.load(pc.save(post, tmp_path / "p"), beta_bernoulli)
    with pytest.raises(errors.InvalidOptionError, match="pass guide="):
        back.to_guide_params()
    want = post.to_guide_params()
    got = back.to_guide_params(guide=beta_guide)
    assert set(got) == {"a", "b"}
    np.testing.assert_allclose([got["a"], got["b"]], [want["a"], want["b"]], rtol=1e-12)
    np.testing.assert_allclose([got["a"], got["b"]], [A0 + float(y.sum()), B0 + float((1 - y).sum())], rtol=1e-8)


@pytest.fixture
def saved(x64, tmp_path):
    post = pc.fit(beta_bernoulli, y=jnp.asarray(_bern()), family={"p": "beta"})
    return post, pc.save(post, tmp_path / "p")


def _members(path):
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist()}


def _write(path, members):
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)


def _edit_manifest(path, edit):
    members = _members(path)
    manifest = json.loads(members["manifest.json"])
    edit(manifest)
    members["manifest.json"] = json.dumps(manifest).encode()
    _write(path, members)


def _edit_arrays(path, **edits):
    """Replace arrays by ``fn(old arrays)`` and re-sign them in the manifest (a deliberate edit); the
    site arrays ``sites.grads``, ``sites.prior``, ``sites.ids`` are named without their prefix."""
    members = _members(path)
    manifest = json.loads(members["manifest.json"])
    old = {n[:-4].removeprefix("sites."): np.load(_io.BytesIO(d)) for n, d in members.items() if n.endswith(".npy")}
    for short, fn in edits.items():
        name = f"sites.{short}" if short in ("grads", "prior", "ids") else short
        new = np.asarray(fn(old))
        members[f"{name}.npy"] = archive.npy_bytes(new)
        manifest["arrays"][name] = {"sha256": io.digest(new), "dtype": str(new.dtype), "shape": list(new.shape)}
    members["manifest.json"] = json.dumps(manifest).encode()
    _write(path, members)


def test_a_flipped_byte_fails_the_checksum(saved):
    _, path = saved
    members = _members(path)
    raw = bytearray(members["natural.npy"])
    raw[-1] ^= 0x10
    members["natural.npy"] = bytes(raw)
    _write(path, members)
    with pytest.raises(errors.CorruptFileError, match="checksum"):
        pc.load(path, beta_bernoulli)


@pytest.mark.parametrize("edits, error, match", [
    (dict(grads=lambda a: a["grads"] * 1.01), errors.InconsistentFileError, "residual"),
    (dict(natural=lambda a: np.append(a["natural"], 1.0), prior=lambda a: np.append(a["prior"], -1.0),
          grads=lambda a: np.hstack([a["grads"], np.zeros((a["grads"].shape[0], 1))])),
     errors.InconsistentFileError, "3.*natural parameters|natural parameters.*3"),
    (dict(grads=lambda a: a["grads"][:-1]), errors.InconsistentFileError, "grads"),
    (dict(prior=lambda a: np.array([np.nan, 1.0])), errors.InconsistentFileError, "finite"),
    (dict(ids=lambda a: np.zeros_like(a["ids"])), errors.InconsistentFileError, "unique"),
    (dict(ids=lambda a: a["ids"].astype(float)), errors.InconsistentFileError, "integer"),
    (dict(natural=lambda a: a["natural"].astype(np.float32)), errors.DtypeMismatchError, "float64"),
    # λ out of the domain with g_0 moved to keep λ = -g_0 - Σ g_i: caught by the domain check
    (dict(natural=lambda a: np.array([-5.0, 1.0]), prior=lambda a: -np.array([-5.0, 1.0]) - a["grads"].sum(0)),
     errors.InconsistentFileError, "domain"),
    # λ and g_0 moved together (residual unchanged, still inside): the prior is no longer the model's
    (dict(natural=lambda a: a["natural"] + 0.5, prior=lambda a: a["prior"] - 0.5),
     errors.InconsistentFileError, "conjugate-form prior"),
])
def test_re_signed_inconsistent_arrays_are_refused(saved, edits, error, match):
    _, path = saved
    _edit_arrays(path, **edits)
    with pytest.raises(error, match=match):
        pc.load(path, beta_bernoulli)


@pytest.mark.parametrize("edit, error, match", [
    (lambda m: m.update(family={"p": "gamma"}), errors.SavedModelMismatchError, "cannot carry"),
    (lambda m: m.update(family={"q": "beta"}), errors.CorruptFileError, "family"),
    (lambda m: m.update(kind="gaussian"), errors.CorruptFileError, "kind"),
    (lambda m: m.update(extra=1), errors.CorruptFileError, "only the fields"),
    (lambda m: m["ef"]["config"].update(rule="simpson"), errors.InconsistentFileError, "configuration"),
    (lambda m: m["ef"]["config"].update(seed=-1), errors.CorruptFileError, "ef.config.seed"),
    (lambda m: m["ef"].update(conjugate_prior="yes"), errors.CorruptFileError, "ef.conjugate_prior"),
    (lambda m: m.update(conjugate_prior=True), errors.CorruptFileError, "only the fields"),  # a version-1 place
    (lambda m: m.update(residual=float("nan")), errors.CorruptFileError, "residual"),
    (lambda m: m.update(residual=0.0) or m["arrays"].pop("sites.grads"), errors.CorruptFileError, "arrays"),
    (lambda m: m.update(version=99), errors.FormatVersionError, "version"),
])
def test_malformed_manifests_are_refused(saved, edit, error, match):
    _, path = saved
    _edit_manifest(path, edit)
    with pytest.raises(error, match=match):
        pc.load(path, beta_bernoulli)


@pytest.mark.parametrize("model", [flat_beta_bernoulli, renamed_bernoulli, vector_bernoulli, logistic_model])
def test_a_file_does_not_load_into_another_model(saved, model):
    _, path = saved
    with pytest.raises(errors.SavedModelMismatchError):
        pc.load(path, model)


def test_a_non_conjugate_prior_cannot_pass_for_conjugate(x64, tmp_path):
    post = pc.fit(lognormal_poisson, y=jnp.asarray(_pois()), family={"rate": "gamma"})
    assert not post.conjugate_prior
    path = pc.save(post, tmp_path / "p")
    _edit_manifest(path, lambda m: m["ef"].update(conjugate_prior=True))
    with pytest.raises(errors.InconsistentFileError, match="conjugate-form prior"):
        pc.load(path, lognormal_poisson)


def test_signed_files_and_precision(saved, tmp_path):
    post, _ = saved
    path = pc.save(post, tmp_path / "signed", key="secret")
    _assert_same(post, pc.load(path, beta_bernoulli, key="secret"))
    with pytest.raises(errors.IntegrityError, match="does not match"):
        pc.load(path, beta_bernoulli, key="guess")
    with pytest.warns(UserWarning, match="not checked"):
        pc.load(path, beta_bernoulli)
    with jax.enable_x64(False):
        with pytest.raises(errors.DtypeMismatchError, match="x64"):
            pc.load(path, beta_bernoulli, key="secret")


def test_a_float32_posterior_round_trips_without_x64(tmp_path):
    with jax.enable_x64(False):
        post = pc.fit(beta_bernoulli, y=jnp.asarray(_bern(), jnp.float32), family={"p": "beta"})
        assert post.natural.dtype == jnp.float32
        back = pc.load(pc.save(post, tmp_path / "p"), beta_bernoulli)
        _assert_same(post, back)


def test_a_gaussian_file_still_loads_and_the_kinds_do_not_mix(x64, tmp_path, saved):
    X, y = make_logistic(20, 2, seed=1)
    gauss = pc.fit(logistic_model, X, y, family="diagonal")
    back = pc.load(gauss.save(tmp_path / "g"), logistic_model)
    assert isinstance(back, pc.DualPosterior)
    np.testing.assert_array_equal(np.asarray(back.state.mean), np.asarray(gauss.state.mean))
    _, path = saved
    with pytest.raises(errors.SavedModelMismatchError):
        pc.load(path, logistic_model)


def test_fuzz_damaged_files_give_a_typed_error_or_the_same_posterior(saved, tmp_path):
    post, path = saved
    blob = path.read_bytes()
    rng = np.random.default_rng(13)
    target = tmp_path / "f"
    outcomes = {"error": 0, "same": 0}
    for k in range(300):
        raw = bytearray(blob)
        if k % 3:
            raw[int(rng.integers(len(raw)))] ^= int(rng.integers(1, 256))
        else:
            raw = raw[:int(rng.integers(len(raw)))]
        target.write_bytes(bytes(raw))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                back = pc.load(target, beta_bernoulli)
        except errors.PersistenceError:
            outcomes["error"] += 1
            continue
        _assert_same(post, back)
        outcomes["same"] += 1
    assert outcomes["error"] > 150, outcomes


# ---------------------------------------------------------------- ArviZ


def test_to_arviz_log_likelihood_is_bernoulli_and_loo_runs(x64):
    import arviz as az

    y = _bern()
    post = pc.fit(beta_bernoulli, y=jnp.asarray(y), family={"p": "beta"})
    idata = post.to_arviz(jax.random.PRNGKey(1), num_samples=4000)
    p = np.asarray(idata.posterior["p"])  # (1, 4000)
    assert p.shape == (1, 4000)
    want = y[None, None, :] * np.log(p[..., None]) + (1 - y[None, None, :]) * np.log1p(-p[..., None])
    np.testing.assert_allclose(np.asarray(idata.log_likelihood["y"]), want, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(np.asarray(idata.observed_data["y"]), y)
    a, b = A0 + y.sum(), B0 + (1 - y).sum()
    np.testing.assert_allclose(p.mean(), a / (a + b), rtol=2e-2)  # the draws are the posterior's
    loo = az.loo(idata, pointwise=True)
    # exact leave-one-out: p(y_i | y_-i) = (a - y_i)/(a + b - 1) for y_i = 1, (b - 1 + y_i)/(a + b - 1) for 0
    exact = np.where(y == 1, np.log((a - 1) / (a + b - 1)), np.log((b - 1) / (a + b - 1)))
    assert np.all(np.asarray(loo.pareto_k) < 0.5)
    np.testing.assert_allclose(float(loo.elpd_loo), exact.sum(), rtol=2e-3)


def test_to_arviz_joint_of_two_observed_sites(x64):
    y, c = _bern(30), _pois(30)
    post = pc.fit(two_sites, y=jnp.asarray(y), c=jnp.asarray(c), family={"p": "beta", "rate": "gamma"})
    idata = post.to_arviz(jax.random.PRNGKey(2), num_samples=50)
    ll = idata.log_likelihood
    p, rate = np.asarray(idata.posterior["p"])[0], np.asarray(idata.posterior["rate"])[0]
    want_c = c * np.log(rate[:, None]) - rate[:, None] - special.gammaln(c + 1)
    np.testing.assert_allclose(np.asarray(ll["c"])[0], want_c, rtol=1e-10)
    want_y = y * np.log(p[:, None]) + (1 - y) * np.log1p(-p[:, None])
    np.testing.assert_allclose(np.asarray(ll["y"])[0], want_y, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.asarray(ll["joint"]), np.asarray(ll["y"]) + np.asarray(ll["c"]), rtol=1e-12)


# ---------------------------------------------------------------- handlers


@pytest.mark.parametrize("model, family, data", [
    (beta_bernoulli, {"p": "beta"}, jnp.asarray(_bern())),
    (dirichlet_categorical, {"pi": "dirichlet"}, jnp.asarray(_cat(), jnp.int32)),
], ids=["beta", "dirichlet"])
def test_posterior_as_prior_is_exact_bayes_for_conjugate_models(x64, model, family, data):
    first = pc.fit(model, y=data[:25], family=family)
    sequential = pc.fit(pc.handlers.posterior_prior(model, first), y=data[25:], family=family)
    batch = pc.fit(model, y=data, family=family)
    assert sequential.conjugate_prior
    np.testing.assert_allclose(_args(sequential), _args(batch), rtol=1e-10)


def test_posterior_prior_replaces_each_site_by_its_factor(x64):
    post = pc.fit(beta_bernoulli, y=jnp.asarray(_bern()), family={"p": "beta"})
    tr = numpyro.handlers.trace(numpyro.handlers.seed(pc.handlers.posterior_prior(beta_bernoulli, post), 0)
                                ).get_trace(y=jnp.ones(3))
    a, b = _args(post)
    assert isinstance(tr["p"]["fn"], dist.Beta) and "_pc_posterior_prior" not in tr
    np.testing.assert_allclose([tr["p"]["fn"].concentration1, tr["p"]["fn"].concentration0], [a, b], rtol=1e-12)


def test_posterior_prior_refuses_another_model(x64):
    post = pc.fit(beta_bernoulli, y=jnp.asarray(_bern()), family={"p": "beta"})
    y = jnp.ones(3)
    with pytest.raises(pc.ModelMismatchError, match="'q'"):
        numpyro.handlers.seed(pc.handlers.posterior_prior(renamed_bernoulli, post), 0)(y=y)
    with pytest.raises(pc.ModelMismatchError, match="shape"):
        numpyro.handlers.seed(pc.handlers.posterior_prior(vector_bernoulli, post), 0)(y=y)
    # the corrected models accept it (tests/families/test_expfam_gaussian.py checks their densities, and
    # tests/criticism/test_ef_cavity.py the correction factor in the factors' coordinates)
    assert callable(pc.handlers.update(beta_bernoulli, post)) and callable(pc.handlers.forget(beta_bernoulli, post, [0]))
    with pytest.raises(pc.UnsupportedGuideError, match="found str"):
        pc.handlers.correction_factor("a posterior")


# ---------------------------------------------------------------- merge


def test_pc_merge_of_shards_is_the_batch_posterior(x64):
    y = _bern(90, seed=4)
    shards = [pc.fit(beta_bernoulli, y=jnp.asarray(part), family={"p": "beta"}) for part in np.array_split(y, 3)]
    merged = pc.merge(None, shards)
    assert isinstance(merged, pc.EFPosterior) and merged.record["operation"] == "merge"
    np.testing.assert_allclose(_args(merged), [A0 + y.sum(), B0 + (1 - y).sum()], rtol=1e-10)
    chained = shards[0].merge(shards[1]).merge(shards[2])
    np.testing.assert_allclose(np.asarray(chained.natural), np.asarray(merged.natural), rtol=1e-14)
    assert merged.num_examples == y.size and merged.residual < 1e-10
    np.testing.assert_array_equal(np.asarray(shards[0].merge(*shards[1:]).natural), np.asarray(merged.natural))
    with pytest.warns(FutureWarning, match="a.merge"):  # the former function, an alias for one release
        aliased = merge_ef(shards[0], shards[1])
    np.testing.assert_array_equal(np.asarray(aliased.natural), np.asarray(shards[0].merge(shards[1]).natural))


def test_pc_merge_refuses_mixed_kinds_and_gaussian_options(x64):
    y = _bern(40)
    ef = pc.fit(beta_bernoulli, y=jnp.asarray(y), family={"p": "beta"})
    X, yl = make_logistic(20, 2, seed=1)
    gauss = pc.fit(logistic_model, X, yl, family="full")
    with pytest.raises(pc.IncompatiblePosteriorsError, match="one kind"):
        pc.merge(None, [ef, gauss])
    with pytest.raises(pc.IncompatiblePosteriorsError, match="one kind"):
        pc.merge(gauss, [ef])
    with pytest.raises(errors.InvalidOptionError, match="Gaussian means, Hessians or precisions"):
        pc.merge(None, [ef, ef], method="hessian")
    with pytest.raises(pc.IncompatiblePosteriorsError, match="lacks base examples"):
        pc.merge(ef, [ef.delete([0])])
    with pytest.raises(errors.InvalidOptionError, match="list of posteriors"):
        pc.merge(ef, ef)


# ---------------------------------------------------------------- update and delete options


def test_update_options_read_as_on_gaussian_posteriors(x64):
    y = _bern(30, seed=5)
    post = pc.fit(beta_bernoulli, y=jnp.asarray(y[:20]), family={"p": "beta"})
    batch = dict(y=jnp.asarray(y[20:]))
    # an integer memory is a count of examples (as for a Gaussian posterior), never an example id
    counted = post.update(**batch, correction="memory", memory=4, seed=3)
    assert counted.record["corrected"] == 4
    assert post.update(**batch, correction="memory", memory=1.0).record["corrected"] == 20  # a fraction: all
    with pytest.raises(errors.InvalidOptionError, match="neither a whole number"):
        post.update(**batch, correction="memory", memory=3.5)
    with pytest.raises(errors.InvalidOptionError, match="goes with correction='memory'"):
        post.update(**batch, correction="exact", memory=4)  # ignored before: now refused, for every family
    with pytest.raises(errors.MissingCapabilityError, match="without a separate curvature"):
        post.update(**batch, correction="memory", memory=4, selection="curvature")
    with pytest.raises(errors.MissingCapabilityError, match="depends on the parametrisation"):
        post.update(**batch, correction="memory", memory=4, selection="residual")
    with pytest.raises(errors.InvalidOptionError, match="unknown selection"):
        post.update(**batch, correction="memory", memory=4, selection="largest")
    with pytest.raises(errors.InvalidOptionError, match="chooses a memory of a given size"):
        post.update(**batch, correction="memory", memory=[0, 1], selection="leverage")  # ids: nothing to choose
    with pytest.raises(errors.InvalidOptionError, match="chooses a memory of a given size"):
        post.update(**batch, correction="exact", selection="leverage")
    with pytest.raises(errors.InvalidOptionError, match="epochs= caps the passes"):
        post.update(**batch, correction="exact", epochs=3)
    with pytest.raises(errors.InvalidOptionError, match="reservoir size"):
        post.update(**batch, keep="nope")
    with pytest.raises(errors.InvalidOptionError, match="reservoir size"):
        post.update(**batch, keep=-1)
    with pytest.raises(errors.InvalidOptionError, match="progress"):
        post.update(**batch, progress="yes")
    shown = post.update(**batch, correction="stochastic", batch_fraction=0.5, progress=True)
    np.testing.assert_allclose(_args(shown), [A0 + y.sum(), B0 + (1 - y).sum()], rtol=1e-10)  # conjugate: exact


def test_site_removal_with_damping_stops_inside_the_domain(x64):
    # a stale posterior (its natural parameters put back at the prior's) whose three y = 1 sites (1, 0)
    # cannot all be removed: a - 1 = A0 - 1 - 3α stays above -1 only for α < A0 / 3
    from numpyro_pc.dual.expfam import EFState

    post = pc.fit(beta_bernoulli, y=jnp.ones(10), family={"p": "beta"})
    stale = post.evolve(state=EFState(jnp.asarray([A0 - 1.0, B0 - 1.0]), post.sites), stale_sites=True)
    with pytest.raises(errors.OutOfDomainError, match="damping=True"):
        stale.delete([0, 1, 2])
    damped = stale.delete([0, 1, 2], damping=True)
    alpha = damped.record["damping"]
    assert alpha == pytest.approx(0.99 * A0 / 3, rel=1e-9)  # the bisection's boundary, 1 % inside
    np.testing.assert_allclose(np.asarray(damped.natural), [A0 - 1.0 - 3 * alpha, B0 - 1.0], rtol=1e-12)
    assert damped.stale_sites and damped.num_examples == 7 and damped.tombstones == (0, 1, 2)
    assert post.delete([0, 1, 2], damping=True).record["damping"] == 1.0  # inside: the whole removal
    with pytest.warns(RuntimeWarning, match=r"refine\(\) it first"):  # its sites no longer add up to it
        damped.update(y=jnp.ones(2), correction="none")


def test_refine_brings_stale_sites_to_the_refit_or_says_how_far_it_got(x64):
    y = jnp.asarray(_pois(30, seed=3))
    family = {"rate": "gamma"}
    stale = pc.fit(lognormal_poisson, y=y, family=family, tol=1e-12).delete([0, 1], method="remove_site")
    assert stale.stale_sites  # the prior term (not conjugate-form) was computed at the old q
    with pytest.raises(errors.ConvergenceError, match="did not reach") as caught:
        stale.refine(tol=1e-14, max_iters=1)
    assert isinstance(caught.value.posterior, pc.EFPosterior) and caught.value.posterior.record["iterations"] == 1
    with pytest.warns(RuntimeWarning, match="did not reach"):
        assert not stale.refine(tol=1e-14, max_iters=1, raise_on_failure=False).record["converged"]
    with pytest.warns(RuntimeWarning, match="did not reach"):  # a stopped solve is never silent
        assert not stale.update(y=y[:3], tol=1e-14, max_iters=1, raise_on_failure=False).record["converged"]
    refined = stale.refine(tol=1e-12, step_size=0.5)
    assert not refined.stale_sites and refined.record["operation"] == "refine"
    assert float(refined.kl(pc.fit(lognormal_poisson, y=y[2:], family=family, tol=1e-12))) < 1e-9
    with pytest.raises(errors.InvalidOptionError, match="step_size"):
        stale.refine(step_size=0.0)
