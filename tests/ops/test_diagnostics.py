"""Information gain identity and correction magnitudes."""

import numpy as np
import pytest

import numpyro_pc as pc
from numpyro_pc.ops import diagnostics

from models import linear_model, logistic_model, make_linear, make_logistic


@pytest.mark.parametrize("family", ["full", "diagonal"])
def test_information_gain_parts_add_up_to_the_kl(x64, family):
    X, y = make_logistic(160, 3, seed=12)
    old = pc.fit(logistic_model, X[:80], y[:80], family=family, tol=1e-12)
    for correction in ["none", "exact"]:
        new = old.update(X[80:], y[80:], correction=correction, tol=1e-12)
        gain = diagnostics.information_gain(old, new)
        assert gain["kl"] > 1e-3
        assert abs(gain["identity_error"]) < 1e-8 * max(1.0, abs(gain["new_data"]))
        if correction == "none":
            assert gain["correction"] == 0.0 or abs(gain["correction"]) < 1e-12
        else:
            assert abs(gain["correction"]) > 1e-6
    removed = old.delete([0, 1, 2], method="corrected", tol=1e-12)
    gain = diagnostics.information_gain(old, removed)
    assert abs(gain["identity_error"]) < 1e-8 * max(1.0, abs(gain["removed"]))


@pytest.mark.parametrize("family", ["full", "diagonal"])
def test_information_gain_counts_the_offset_of_a_weighted_correction(x64, family):
    # the weighted correction leaves natural parameters no site holds (λ = offset + Σ λ̂_i): their
    # expected value and their share of log Z belong to the parts, or the parts miss the KL by O(0.1)
    X, y = make_logistic(60, 3, seed=2)
    old = pc.fit(logistic_model, X[:40], y[:40], family=family, tol=1e-12)
    new = old.update(X[40:], y[40:], correction="weighted", memory=8, seed=1, tol=1e-12)
    assert new.record["fallback"] is None and new.offset is not None
    assert float(np.max(np.abs(np.asarray(new.offset.linear)))) > 1e-2  # an offset the parts would miss
    gain = diagnostics.information_gain(old, new)
    assert gain["kl"] > 1e-2 and abs(gain["identity_error"]) < 1e-9, gain


def test_correction_magnitude_vanishes_for_conjugate_full_gaussian(x64):
    """Linear-Gaussian sites do not depend on q: no interference, whatever the new data."""
    X, y = make_linear(90, 3, seed=13)
    post = pc.fit(linear_model, X[:60], y[:60], family="full")
    mags = diagnostics.correction_magnitude(post, X[60:], y[60:])
    assert mags["magnitude"].shape == (60,)
    assert mags["total"] < 1e-9


def test_correction_magnitude_finds_interfering_examples(x64):
    X, y = make_logistic(200, 3, seed=14)
    post = pc.fit(logistic_model, X[:100], y[:100], family="full")
    mags = diagnostics.correction_magnitude(post, X[100:], y[100:])
    assert mags["total"] > 1e-3 and np.all(mags["magnitude"] >= 0)
    # memory chosen by largest interference corrects more than a random memory of the same size
    batch = pc.fit(logistic_model, X, y, family="full", tol=1e-12)
    top = mags["ids"][np.argsort(-mags["magnitude"])[:20]]
    rand = np.random.default_rng(0).choice(mags["ids"], 20, replace=False)
    kl_top = float(post.update(X[100:], y[100:], correction="memory", memory=top).kl(batch))
    kl_rand = float(post.update(X[100:], y[100:], correction="memory", memory=rand).kl(batch))
    assert kl_top < kl_rand


@pytest.mark.parametrize("shared_jacobian", [False, True])
@pytest.mark.parametrize("family", ["full", "diagonal"])
def test_factorised_mismatch_equals_the_dense_formula(x64, family, shared_jacobian):
    from numpyro_pc.ops.diagnostics import site_mismatch

    X, y = make_logistic(60, 3, seed=24)
    post = pc.fit(logistic_model, X[:40], y[:40], family=family)
    new = post.update(X[40:], y[40:], correction="exact")
    stale = post.sites
    fresh = new.sites.take(np.arange(40))
    assert post.spec.affine  # logistic regression: J_i = x_i at every z, so the fast path applies
    fast = site_mismatch(stale, fresh, new.state, new.family, shared_jacobian)
    cov = np.asarray(new.family.dense_covariance(new.state))
    dh = np.asarray(fresh.dense_curvature() - stale.dense_curvature())
    dg = np.asarray(fresh.grad - stale.grad_at(new.state.mean))
    dense = np.sqrt(np.einsum("nd,de,ne->n", dg, cov, dg)
                    + 0.5 * np.einsum("nde,ef,nfg,gd->n", dh, cov, dh, cov))
    np.testing.assert_allclose(fast[0], dense, rtol=1e-10)
