"""Streaming updates against exact batch posteriors."""

import jax.numpy as jnp
import numpy as np
import pytest

import numpyro_pc as pc

from conftest import linear_model, logistic_model, make_linear, make_logistic


def batches(X, y, k, order=None):
    idx = np.arange(X.shape[0]) if order is None else order
    return [(X[part], y[part]) for part in np.array_split(idx, k)]


@pytest.mark.parametrize("family", ["full", "diagonal"])
@pytest.mark.parametrize("k", [2, 3, 5])
def test_exact_streaming_equals_the_batch_posterior(x64, family, k):
    X, y = make_logistic(150, 4, seed=11)
    order = np.random.default_rng(k).permutation(150)  # shuffled batch order
    parts = batches(X, y, k, order)
    post = pc.fit(logistic_model, *parts[0], family=family)
    for Xb, yb in parts[1:]:
        post = post.update(Xb, yb, correction="exact")
    batch = pc.fit(logistic_model, X[order], y[order], family=family, tol=1e-12)
    assert float(post.kl(batch)) < 1e-10
    assert post.residual < 1e-8
    # ids are stable and contiguous across batches
    np.testing.assert_array_equal(np.sort(np.asarray(post.ids)), np.arange(150))


def test_vcl_is_exact_for_full_gaussian_linear_regression_but_not_diagonal(x64):
    X, y = make_linear(90, 3, seed=2)
    parts = batches(X, y, 3)
    results = {}
    for family in ["full", "diagonal"]:
        batch = pc.fit(linear_model, X, y, family=family, tol=1e-12)
        for correction in ["none", "exact"]:
            post = pc.fit(linear_model, *parts[0], family=family)
            for Xb, yb in parts[1:]:
                post = post.update(Xb, yb, correction=correction)
            results[family, correction] = float(post.kl(batch))
    assert results["full", "none"] < 1e-10  # conjugate: VCL is exact Bayes
    assert results["diagonal", "none"] > 1e-4  # mean-field VCL is not
    assert results["diagonal", "exact"] < 1e-10  # the correction fixes it


def test_memory_policies_interpolate_between_vcl_and_exact(x64):
    X, y = make_logistic(200, 4, seed=3)
    parts = batches(X, y, 2)
    batch = pc.fit(logistic_model, X, y, family="diagonal", tol=1e-12)
    first = pc.fit(logistic_model, *parts[0], family="diagonal")
    kl = {}
    for name, opts in [("none", {}), ("prior", {}), ("memory", dict(memory=50, selection="curvature")),
                       ("exact", {})]:
        post = first.update(*parts[1], correction=name, **opts)
        kl[name] = float(post.kl(batch))
        assert post.record["corrected"] == {"none": 0, "prior": 0, "memory": 50, "exact": 100}[name]
        assert post.residual < 1e-7  # every policy keeps an exact dual form over its sites
    assert kl["exact"] < 1e-10 < kl["memory"] < kl["none"]
    explicit = first.update(*parts[1], correction="memory", memory=np.arange(0, 100, 2))
    assert explicit.record["corrected"] == 50


def test_keep_policies_and_frozen_sites(x64):
    X, y = make_logistic(120, 3, seed=4)
    parts = batches(X, y, 3)
    post = pc.fit(logistic_model, *parts[0], family="full")
    post = post.update(*parts[1], correction="exact", keep=30)
    assert post.num_retained == 30 and post.num_examples == 80
    post = post.update(*parts[2], correction="exact", keep="none")
    assert post.num_retained == 0 and post.num_examples == 120
    assert post.residual < 1e-7  # frozen sites still represent the posterior
    with pytest.raises(pc.UnknownExampleError):
        post.update(*parts[2], correction="memory", memory=[3])


def test_bad_batches_are_rejected(x64):
    X, y = make_logistic(40, 3)
    post = pc.fit(logistic_model, X, y, family="full")
    with pytest.raises(pc.DataShapeError):
        post.update(X[:, :2], y)
    with pytest.raises(ValueError, match="correction"):
        post.update(X, y, correction="sometimes")
    with pytest.raises(ValueError, match="memory="):
        post.update(X, y, correction="memory")
