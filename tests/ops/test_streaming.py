"""Streaming updates against exact batch posteriors."""

import jax
import numpy as np
import pytest

import numpyro_pc as pc
from numpyro_pc.ops.diagnostics import count_compilations

from models import linear_model, logistic_model, make_linear, make_logistic


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


def test_exact_update_reuses_sites_computed_at_the_current_posterior(x64):
    X, y = make_logistic(160, 4, seed=31)
    first = pc.fit(logistic_model, X[:100], y[:100], family="full")
    batch = pc.fit(logistic_model, X, y, family="full", tol=1e-12)
    warm = first.update(X[100:130], y[100:130], correction="exact")
    assert warm.record["reused_sites"] == 100  # fitted sites sit at the fitted posterior
    warm = warm.update(X[130:], y[130:], correction="exact")
    assert warm.record["reused_sites"] == 130
    # after VCL the old sites belong to an older posterior: everything is recomputed
    cold = first.update(X[100:130], y[100:130], correction="none")
    cold = cold.update(X[130:], y[130:], correction="exact")
    assert cold.record["reused_sites"] == 0
    # reusing only saves the first pass; the answer is the batch posterior either way
    assert float(warm.kl(batch)) < 1e-10 and float(cold.kl(batch)) < 1e-10
    assert float(warm.kl(cold)) < 1e-10


def test_buckets_pad_by_at_most_a_quarter_above_2048_with_four_sizes_per_octave():
    from numpyro_pc.model.rows import bucket_size

    sizes = np.arange(1, 70000)
    buckets = np.array([bucket_size(n) for n in sizes])
    assert np.all(buckets >= sizes)
    small, large = sizes <= 2048, sizes > 2048
    assert set(buckets[small]) == {8, 16, 32, 64, 128, 256, 512, 1024, 2048}
    assert np.max(buckets[large] / sizes[large]) <= 1.25
    assert len(set(buckets[(sizes > 8192) & (sizes <= 16384)])) == 4


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
    # a fraction of the retained examples (was truncated by int() to a memory of 0, silently)
    fraction = first.update(*parts[1], correction="memory", memory=0.25, selection="curvature")
    counted = first.update(*parts[1], correction="memory", memory=25, selection="curvature")
    assert fraction.record["corrected"] == 25
    np.testing.assert_array_equal(np.asarray(fraction.mean), np.asarray(counted.mean))
    for bad in (1.5, -3, float("nan"), True):
        with pytest.raises(pc.errors.InvalidOptionError, match="memory"):
            first.update(*parts[1], correction="memory", memory=bad)
    # options that would be ignored are refused (they were ignored before, silently)
    with pytest.raises(pc.errors.InvalidOptionError, match="goes with correction='memory'"):
        first.update(*parts[1], correction="exact", memory=25)
    with pytest.raises(pc.errors.InvalidOptionError, match="chooses a memory of a given size"):
        first.update(*parts[1], correction="memory", memory=np.arange(5), selection="curvature")
    with pytest.raises(pc.errors.InvalidOptionError, match="epochs= caps the passes"):
        first.update(*parts[1], correction="memory", memory=25, epochs=2)


def test_keep_policies_and_frozen_sites(x64):
    X, y = make_logistic(120, 3, seed=4)
    parts = batches(X, y, 3)
    post = pc.fit(logistic_model, *parts[0], family="full")
    post = post.update(*parts[1], correction="exact", keep=30)
    assert post.num_retained == 30 and post.num_examples == 80
    post = post.update(*parts[2], correction="exact", keep="none")
    assert post.num_retained == 0 and post.num_examples == 120
    assert post.residual < 1e-7  # frozen sites still represent the posterior
    # no data row is kept: sampling traces the model on a template row (was NumPyro's plate AssertionError)
    draws = post.sample(jax.random.PRNGKey(0), 5)
    z = post.sample_unconstrained(jax.random.PRNGKey(0), 5)
    np.testing.assert_allclose(draws["w"], z[:, 1:], rtol=1e-12)
    with pytest.raises(pc.UnknownExampleError):
        post.update(*parts[2], correction="memory", memory=[3])


def test_bad_batches_are_rejected(x64):
    X, y = make_logistic(40, 3)
    post = pc.fit(logistic_model, X, y, family="full")
    with pytest.raises(pc.DataShapeError):
        post.update(X[:, :2], y)
    with pytest.raises(pc.DataShapeError):  # per-example arguments of different lengths
        post.update(X[:10], y[:9])
    with pytest.raises(pc.NonFiniteDataError):
        post.update(X[:10].at[3, 1].set(np.nan), y[:10])
    with pytest.raises(ValueError, match="correction"):
        post.update(X, y, correction="sometimes")
    with pytest.raises(ValueError, match="memory="):
        post.update(X, y, correction="memory")


def test_stochastic_correction_converges_to_exact_touching_a_tenth(x64):
    X, y = make_logistic(300, 3, seed=21)
    first = pc.fit(logistic_model, X[:200], y[:200], family="full")
    exact = first.update(X[200:], y[200:], correction="exact", tol=1e-12)
    stoch = first.update(X[200:], y[200:], correction="stochastic", batch_fraction=0.1, tol=1e-10)
    assert float(stoch.kl(exact)) < 1e-6
    per_iteration = stoch.record["past_examples_touched"] / stoch.record["iterations"]
    assert per_iteration <= 0.1 * 200
    vcl = first.update(X[200:], y[200:], correction="none")
    assert float(stoch.kl(exact)) < 1e-3 * float(vcl.kl(exact))


def test_weighted_memory_beats_unweighted_and_keeps_a_dual_form(x64):
    X, y = make_logistic(300, 3, seed=22)
    order = np.argsort(np.asarray(X[:, 0]))  # a drifting stream
    X, y = X[order], y[order]
    first = pc.fit(logistic_model, X[:200], y[:200], family="diagonal")
    exact = first.update(X[200:], y[200:], correction="exact", tol=1e-12)
    plain = first.update(X[200:], y[200:], correction="memory", memory=20, seed=1)
    weighted = first.update(X[200:], y[200:], correction="weighted", memory=20, seed=1)
    assert weighted.record["weight"] == pytest.approx(10.0)
    assert weighted.record["fallback"] is None
    assert float(weighted.kl(exact)) < float(plain.kl(exact))
    assert weighted.residual < 1e-7  # the offset keeps λ = offset + Σ sites exact
    again = weighted.update(X[:10], y[:10], correction="exact")  # later exact updates stay consistent
    assert again.residual < 1e-7


def test_a_stream_of_random_batch_sizes_does_not_recompile_every_batch(x64):
    from numpyro_pc.sites.gaussian import trace_count

    X, y = make_logistic(700, 3, seed=23)
    post = pc.fit(logistic_model, X[:20], y[:20], family="full")
    sizes = np.random.default_rng(0).integers(3, 30, size=20)
    before, start = trace_count(), 20
    for size in sizes:
        post = post.update(X[start:start + size], y[start:start + size], correction="none")
        start += size
    traces = trace_count() - before
    assert traces <= 3, f"{traces} traces for 20 batches (sizes {sizes.tolist()})"  # buckets 8, 16, 32
    batch = pc.fit(logistic_model, X[:start], y[:start], family="full")
    assert np.all(np.isfinite(np.asarray(post.mean))) and float(post.kl(batch)) < 0.5


@pytest.mark.parametrize("correction", ["none", "exact"])
def test_a_stream_in_warm_buckets_compiles_no_xla_program(x64, correction):
    # Every update changes the number of stored sites and rows. Row bookkeeping runs on the
    # host and the compiled sums see bucket shapes, so once a stream's buckets have been
    # compiled, updates with new totals and new batch sizes compile nothing. (Before, each
    # update compiled ~40 small programs for concatenations and gathers of the new shapes.)
    X, y = (np.asarray(a) for a in make_logistic(400, 3, seed=29))  # NumPy: slicing it compiles nothing
    fit = lambda n: pc.fit(logistic_model, X[:n], y[:n], family="full")  # noqa: E731

    def stream(post, start, sizes):
        for size in sizes:
            post = post.update(X[start:start + size], y[start:start + size], correction=correction)
            start += size
        return post

    stream(fit(40), 40, [5] * 16)  # totals 45..120: site buckets 64 and 128, batch bucket 8
    post = fit(43)
    with count_compilations() as compiled:
        post = stream(post, 43, [6, 7] * 5)  # totals 49..108, none of them seen before
    assert compiled.count == 0, f"{compiled.count} compilations in 10 updates inside warm buckets"
    assert post.num_examples == 108
    if correction == "exact":  # host bookkeeping changed nothing: still the batch posterior (solver tol 1e-8)
        assert float(post.kl(pc.fit(logistic_model, X[:108], y[:108], family="full", tol=1e-12))) < 1e-10


def test_stochastic_with_an_epoch_budget_stops_there_and_beats_vcl(x64):
    X, y = make_logistic(300, 3, seed=21)
    first = pc.fit(logistic_model, X[:200], y[:200], family="full")
    exact = first.update(X[200:], y[200:], correction="exact", tol=1e-12)
    vcl = first.update(X[200:], y[200:], correction="none")
    one = first.update(X[200:], y[200:], correction="stochastic", batch_fraction=0.1, epochs=1)
    # 200 retained examples, 20 per step: one pass is 10 steps, and no ConvergenceError
    assert one.record["iterations"] == 10
    assert one.record["past_examples_touched"] == 200
    assert one.history[-1]["residual"] > 1e-8
    assert float(one.kl(exact)) < 0.1 * float(vcl.kl(exact))  # measured 0.07×
    # the returned sites keep one reference mean per step (≤ 10 + q_t + the fit's), not one per
    # example, and still represent q: λ = Σ sites (full steps) up to the rounding of the step's
    # incremental sums (measured 2.7e-10, the same as with one reference row per example)
    assert one.sites.ref_means.shape[0] <= 12
    assert one.residual_parts["precision"] < 1e-8
    with pytest.raises(ValueError, match="epochs"):
        first.update(X[200:], y[200:], correction="stochastic", epochs=0)


def test_stochastic_steps_reuse_compiled_shapes_across_a_stream(x64):
    from numpyro_pc.ops.diagnostics import count_compilations
    from numpyro_pc.ops.stochastic import subset_bucket

    assert [subset_bucket(n) for n in (1, 8, 9, 10, 11, 13, 16, 17, 100, 129)] == [8, 8, 10, 10, 12, 14, 16, 20,
                                                                                   112, 160]
    X, y = make_logistic(420, 3, seed=23)
    post = pc.fit(logistic_model, X[:300], y[:300], family="full")
    with count_compilations() as compiled:
        for lo, hi in [(300, 340), (340, 375), (375, 420)]:  # new batches of 40, 35, 45; retained 300..375
            post = post.update(X[lo:hi], y[lo:hi], correction="stochastic", epochs=1)
    # new batches pad to 64, tables to 512 and subsets (30..38 rows) to 32/40: at most 2 shapes of the step
    assert sum("_sag_step" in name for name in compiled.names) <= 2, compiled.names


def test_a_batch_shaped_like_the_fitted_data_binds_without_tracing_the_model(x64):
    from numpyro_pc.model.likelihood import bind_model
    from numpyro_pc.model.batches import bind_batch

    X, y = make_logistic(60, 3, seed=32)
    post = pc.fit(logistic_model, X[:40], y[:40], family="full")
    fast = bind_batch(post, (X[40:55], y[40:55]), {})
    full = bind_model(logistic_model, (X[40:55], y[40:55]))[1]
    assert len(fast.per_example) == len(full.per_example) == 2 and fast.shared == full.shared == ()
    for a, b in zip(fast.per_example, full.per_example):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.dtype == b.dtype
    calls = []
    counting = lambda X, y=None: (calls.append(1), logistic_model(X, y))[1]  # noqa: E731
    post = pc.fit(counting, X[:40], y[:40], family="full")
    traced = len(calls)
    bind_batch(post, (X[40:55], y[40:55]), {})
    assert len(calls) == traced  # the fast path ran no model code
