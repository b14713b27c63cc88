"""Data retention (``update(keep=...)``) of exponential-family posteriors: the sites of examples
whose data is dropped stay, frozen, as on Gaussian posteriors (issue 26 item 2).

Oracles: the closed-form conjugate posterior and leave-one-out of Beta–Bernoulli (sites exact, so a
frozen site is as good as a recomputed one, to rounding); for a prior that is not conjugate-form, two
code paths that must agree (an exact update with no data retained recomputes exactly what the
``"prior"`` correction recomputes); the Gaussian posterior's reservoir under the same seed; the
original posterior for a saved and loaded one.
"""

import io
import json
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpyro_pc as pc
from numpyro_pc import errors
from numpyro_pc.io.validation import check_ef_contents

from models import A0, B0, _bern, _pois, beta_bernoulli, linear_model, lognormal_poisson, misclassified


Y = _bern(90, seed=5)


def _beta_args(post):
    (_, args), = post.family.describe(post.natural).values()
    return np.array([float(v) for v in args.values()])


def _closed_form(y):
    return np.array([A0 + y.sum(), B0 + (1 - y).sum()])


def _stream(keep, correction="exact"):
    post = pc.fit(beta_bernoulli, y=jnp.asarray(Y[:30]), family={"p": "beta"})
    for seed, batch in ((3, Y[30:60]), (4, Y[60:])):
        options = dict(correction=correction)
        if correction == "memory":  # a memory of retained examples; with none retained, no correction
            options = dict(correction="memory", memory=5) if post.num_retained else dict(correction="none")
        post = post.update(y=jnp.asarray(batch), keep=keep, seed=seed, **options)
    return post


@pytest.mark.parametrize("keep", ["none", 25], ids=["none", "reservoir"])
@pytest.mark.parametrize("correction", ["exact", "memory", "none"])
def test_a_conjugate_stream_keeps_the_closed_form_whatever_data_it_drops(x64, keep, correction):
    post = _stream(keep, correction)
    # conjugate sites are exact constants, so frozen ones lose nothing: the closed form to rounding
    np.testing.assert_allclose(_beta_args(post), _closed_form(Y), rtol=1e-10)
    assert post.num_examples == 90 and post.num_retained == (0 if keep == "none" else 25)
    np.testing.assert_array_equal(np.sort(np.asarray(post.ids)), np.arange(90))  # frozen sites first, as Gaussian
    assert post.site_identity_residual < 1e-10 and post.residual < 1e-10
    if keep != "none":  # each retained row holds its own example's data
        kept = np.asarray(post.data_ids)
        assert np.setdiff1d(kept, np.asarray(post.ids)).size == 0
        np.testing.assert_array_equal(np.asarray(post.data.per_example[0]), Y[kept])


@pytest.mark.slow  # compiles a Gaussian fit and update (7 s)
def test_the_reservoir_is_the_gaussian_posterior_s_under_the_same_seed(x64):
    X = np.random.default_rng(0).normal(size=(90, 2))
    gauss = pc.fit(linear_model, X[:30], Y[:30], family="diagonal")
    gauss = gauss.update(X[30:60], Y[30:60], keep=25, seed=3).update(X[60:], Y[60:], keep=25, seed=4)
    np.testing.assert_array_equal(np.asarray(_stream(25).data_ids), np.asarray(gauss.data_ids))


NOT_EXACT = [  # a prior that is not conjugate-form (sites exact); a likelihood that is not conjugate (prior exact)
    (lognormal_poisson, {"rate": "gamma"}, _pois(60)),
    (misclassified, {"p": "beta"}, _bern(60, seed=2)),
]


@pytest.mark.parametrize("model, family, y", NOT_EXACT, ids=["lognormal-prior", "misclassified"])
def test_with_no_data_an_exact_update_recomputes_what_the_prior_correction_does(x64, model, family, y):
    post = pc.fit(model, y=jnp.asarray(y[:20]), family=family, tol=1e-12)
    post = post.update(y=jnp.asarray(y[20:40]), keep="none", tol=1e-12)
    assert post.num_retained == 0
    exact = post.update(y=jnp.asarray(y[40:]), correction="exact", tol=1e-12)
    prior = post.update(y=jnp.asarray(y[40:]), correction="prior", tol=1e-12)
    # two solves to a 1e-12 relative residual of the same fixed point
    np.testing.assert_allclose(np.asarray(exact.natural), np.asarray(prior.natural), rtol=1e-10)
    np.testing.assert_allclose(np.asarray(exact.sites.grads), np.asarray(prior.sites.grads), rtol=1e-9, atol=1e-12)
    # the frozen sites are the stored ones, bit for bit
    np.testing.assert_array_equal(np.asarray(exact.sites.grads[:40]), np.asarray(post.sites.grads))
    assert exact.num_retained == 20 and exact.record.corrected == 0 and exact.residual < 1e-10
    if model is misclassified:  # sites that depend on q: keeping the data would have recomputed them
        full = pc.fit(model, y=jnp.asarray(y[:20]), family=family, tol=1e-12)
        full = full.update(y=jnp.asarray(y[20:40]), tol=1e-12).update(y=jnp.asarray(y[40:]), tol=1e-12)
        assert float(jnp.max(jnp.abs(full.natural - exact.natural))) > 1e-6


def test_deletions_of_frozen_and_retained_examples_are_the_closed_form(x64):
    post = _stream(25)
    kept = np.asarray(post.data_ids)
    frozen = np.setdiff1d(np.arange(90), kept)
    gone = [int(frozen[0]), int(kept[0])]
    rest = np.delete(Y, gone)
    for method in ("remove_site", "corrected"):
        out = post.delete(gone, method=method)
        np.testing.assert_allclose(_beta_args(out), _closed_form(rest), rtol=1e-10)
        assert out.num_examples == 88 and out.num_retained == 24
        assert int(kept[0]) not in np.asarray(out.data_ids).tolist()
    with pytest.raises(errors.UnknownExampleError, match="retrain needs the data of every remaining example"):
        post.delete(gone, method="retrain")
    np.testing.assert_allclose(_beta_args(post.delete(gone).refine()), _closed_form(rest), rtol=1e-10)


@pytest.mark.slow  # 8 s: LOO's compiled predictive
def test_refine_and_loo_use_the_retained_examples(x64):
    post = _stream(25)
    kept = np.asarray(post.data_ids)
    a, b = _closed_form(Y)
    loo = pc.loo(post)
    np.testing.assert_array_equal(loo.ids, kept)
    y = Y[kept]
    exact = np.where(y == 1, np.log((a - 1) / (a + b - 1)), np.log((b - 1) / (a + b - 1)))
    np.testing.assert_allclose(loo.pointwise, exact, rtol=0, atol=1e-10)  # Gauss rule: exact to rounding
    none = _stream("none")
    # no data left: a refine has only the (conjugate, constant) prior term and the frozen sites, so nothing moves
    np.testing.assert_allclose(_beta_args(none.refine()), _closed_form(Y), rtol=1e-10)
    with pytest.raises(errors.InvalidOptionError, match="reservoir size"):
        none.update(y=jnp.asarray(Y[:3]), keep=2.5)


@pytest.mark.slow  # 9 s: two saves and a load
def test_a_file_records_the_retained_ids_only_when_data_was_dropped(x64, tmp_path):
    post = _stream(25)
    path = pc.save(post, tmp_path / "kept")
    with zipfile.ZipFile(path) as z:
        assert "data_ids.npy" in z.namelist()
    back = pc.load(path, beta_bernoulli)
    np.testing.assert_array_equal(np.asarray(back.data_ids), np.asarray(post.data_ids))
    np.testing.assert_array_equal(np.asarray(back.sites.grads), np.asarray(post.sites.grads))
    np.testing.assert_array_equal(np.asarray(back.natural), np.asarray(post.natural))
    # the loaded posterior goes on as the original does
    np.testing.assert_array_equal(np.asarray(back.update(y=jnp.asarray(Y[:5]), keep=25, seed=9).data_ids),
                                  np.asarray(post.update(y=jnp.asarray(Y[:5]), keep=25, seed=9).data_ids))
    every = pc.save(_stream("all"), tmp_path / "all")  # as before this change: readable by the last release
    with zipfile.ZipFile(every) as z:
        assert "data_ids.npy" not in z.namelist()


def _file(path):
    with zipfile.ZipFile(path) as z:
        manifest = json.loads(z.read("manifest.json"))
        return manifest, {n[:-4]: np.load(io.BytesIO(z.read(n))) for n in z.namelist() if n.endswith(".npy")}


def test_retained_ids_out_of_the_sites_order_are_refused(x64, tmp_path):
    post = _stream(25)
    manifest, arrays = _file(pc.save(post, tmp_path / "kept"))
    check_ef_contents(manifest, arrays)  # as written: accepted
    swapped = dict(arrays, data_ids=arrays["data_ids"][[1, 0, *range(2, 25)]])
    with pytest.raises(errors.InconsistentFileError, match="in the sites' order"):
        check_ef_contents(manifest, swapped)
    with pytest.raises(errors.InconsistentFileError, match="fewer ids than sites"):
        check_ef_contents(manifest, dict(arrays, data_ids=arrays["sites.ids"]))
    full = pc.fit(beta_bernoulli, y=jnp.asarray(Y[:6]), family={"p": "beta"})
    with pytest.raises(errors.DataShapeError, match="in the sites' order"):  # a permutation of every id
        full.evolve(data_ids=np.array([1, 0, 2, 3, 4, 5]))


def test_tree_round_trip_and_the_none_file_keep_the_retained_ids(x64, tmp_path):
    post = _stream(25)
    config, state, data = post.tree()
    back = type(post).from_tree(config, state, data, conjugate_prior=post.conjugate_prior)
    np.testing.assert_array_equal(np.asarray(back.data_ids), np.asarray(post.data_ids))
    none = _stream("none")
    loaded = pc.load(pc.save(none, tmp_path / "none"), beta_bernoulli)
    assert loaded.num_retained == 0 and loaded.num_examples == 90
    np.testing.assert_array_equal(np.asarray(loaded.natural), np.asarray(none.natural))


def test_a_stochastic_update_corrects_the_retained_examples(x64):
    post = _stream(25)
    out = post.update(y=jnp.asarray(Y[:6]), correction="stochastic", batch_fraction=0.1, keep=25, seed=2)
    # ten blocks over 25 retained examples, and fewer retained than blocks below: both exact (conjugate)
    np.testing.assert_allclose(_beta_args(out), _closed_form(np.concatenate([Y, Y[:6]])), rtol=1e-10)
    assert out.record.corrected == 25 and out.num_retained == 25 and out.num_examples == 96
    few = _stream("none").update(y=jnp.asarray(Y[:3]), correction="stochastic", batch_fraction=0.1)
    np.testing.assert_allclose(_beta_args(few), _closed_form(np.concatenate([Y, Y[:3]])), rtol=1e-10)


def test_a_stale_prior_term_shows_without_data_and_refine_recomputes_it(x64):
    c = _pois(60)
    post = pc.fit(lognormal_poisson, y=jnp.asarray(c[:30]), family={"rate": "gamma"}, tol=1e-12)
    post = post.update(y=jnp.asarray(c[30:]), keep="none", tol=1e-12)
    removed = post.delete(list(range(10)))
    # the lognormal prior's term was computed at the old q: the fresh residual sees it with no data left
    assert float(removed.residual) > 1e-6
    refined = removed.refine(tol=1e-12)
    corrected = post.delete(list(range(10)), method="corrected", tol=1e-12)
    assert float(refined.residual) < 1e-10
    # two solves to a 1e-12 relative residual of the same fixed point (only the prior term is live)
    np.testing.assert_allclose(np.asarray(refined.natural), np.asarray(corrected.natural), rtol=1e-10)


@pytest.mark.slow  # 10 s: ArviZ's LOO-PIT
def test_loo_pit_weights_the_retained_examples(x64):
    post = _stream(25)
    pit = pc.criticism.loo_pit(post, jax.random.PRNGKey(0), num_samples=200)
    assert np.shape(pit) == (25,) and np.all((pit >= 0) & (pit <= 1))
