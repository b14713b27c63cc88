"""Pure streaming steps under jax.lax.scan: exact updates equal the batch fit on all data."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import linear_model, logistic_model, make_linear, make_logistic

import numpyro_pc as pc
from numpyro_pc.ops.diagnostics import count_compilations
from numpyro_pc.errors import ConvergenceError, InvalidOptionError
from numpyro_pc.model.likelihood import bind_model
from numpyro_pc.kernels.stream_state import (
    delete_step,
    from_posterior,
    run_stream,
    split_batches,
    stream_step,
    to_posterior,
)


def _stream(model, X, y, first, batch_size, capacity, **fit_options):
    post = pc.fit(model, X[:first], y[:first], **fit_options)
    config, state = from_posterior(post, capacity)
    _, rest = bind_model(model, (X[first:], y[first:]))
    batches, masks = split_batches(rest, batch_size)
    final, infos = run_stream(config, state, batches, masks)
    return post, config, final, infos


def test_a_scanned_stream_of_a_conjugate_model_equals_the_closed_form(x64):
    # Linear-Gaussian model: every exact update is the conjugate posterior, so the scanned
    # stream must equal pc.fit on all data to rounding (1e-10 relative; both are one solve
    # of the same normal equations). The last batch is padded: its masked rows must not count.
    X, y = make_linear(103, 3)
    post, config, final, infos = _stream(linear_model, X, y, 13, 10, 120)
    assert infos.residual.shape == (9,) and bool(jnp.all(infos.converged)) and not bool(jnp.any(infos.overflow))
    batch = pc.fit(linear_model, X, y, tol=1e-12)
    np.testing.assert_allclose(final.q.mean, batch.mean, rtol=1e-10)
    np.testing.assert_allclose(final.q.precision, batch.state.precision, rtol=1e-10)
    assert int(final.count) == 13 + 90 and float(jnp.sum(final.weights)) == 103.0
    back = to_posterior(config, final, post)
    assert type(back) is type(post) and back.num_examples == 103 and back.residual < 1e-10


def test_a_scanned_stream_of_logistic_regression_reaches_the_batch_fixed_point(x64):
    # Non-conjugate (Gauss–Hermite rule): the exact correction recomputes every site, so the
    # stream's fixed point is the batch fit's; Newton steps end at residual < 1e-10 and the
    # two posteriors agree to 1e-8 (KL < 1e-14).
    X, y = make_logistic(90, 3)
    post, config, final, infos = _stream(logistic_model, X, y, 30, 20, 96, tol=1e-10)
    assert bool(jnp.all(infos.converged)), infos
    batch = pc.fit(logistic_model, X, y, tol=1e-12)
    np.testing.assert_allclose(final.q.mean, batch.mean, rtol=1e-8, atol=1e-10)
    back = to_posterior(config, final, post)
    assert float(back.kl(batch)) < 1e-14


def test_a_stream_compiles_once_and_refuses_what_does_not_fit(x64):
    X, y = make_linear(40, 2)
    post = pc.fit(linear_model, X[:10], y[:10])
    config, state = from_posterior(post, 30)
    _, rest = bind_model(linear_model, (X[10:], y[10:]))
    batches, masks = split_batches(rest, 10)
    with pytest.raises(InvalidOptionError, match="free rows"):
        run_stream(config, state, batches, masks)  # 30 rows into 20 free ones
    with pytest.raises(InvalidOptionError, match="capacity"):
        from_posterior(post, 5)
    # inside a trace nothing can raise: the step reports the overflow and leaves the state unchanged
    step = jax.jit(stream_step, static_argnums=0)
    parts = [(jax.tree.map(lambda x: x[k], batches), masks[k]) for k in range(3)]  # sliced before counting
    full, _ = step(config, state, *parts[0])
    with count_compilations() as compiled:
        full, _ = step(config, full, *parts[1])
        after, info = step(config, full, *parts[2])
    assert compiled.count == 0  # every batch had the same shapes: the first call's program serves them all
    assert bool(info.overflow) and not bool(info.converged)
    np.testing.assert_array_equal(after.q.mean, full.q.mean)
    assert int(after.count) == 30
    with pytest.raises(ConvergenceError):
        to_posterior(config, after, post)


def test_a_stream_needs_every_site_with_its_data(x64):
    X, y = make_linear(30, 2)
    post = pc.fit(linear_model, X[:20], y[:20]).update(X[20:], y[20:], keep="none")
    with pytest.raises(InvalidOptionError, match="keeps data"):
        from_posterior(post, 40)


def test_a_pure_deletion_equals_the_fit_without_the_rows(x64):
    # delete_step zeroes the rows' weights and solves: the result must be the batch fit on the
    # remaining examples — the closed form for the linear model (1e-10), the batch fixed point
    # for logistic regression (1e-8). Padding entries (valid=False) must delete nothing, and
    # deletions of different sizes padded to one length compile once.
    X, y = make_linear(60, 3)
    post, config, state, _ = _stream(linear_model, X, y, 20, 20, 60)
    step = jax.jit(delete_step, static_argnums=0)
    gone = np.array([3, 17, 41, 0])
    after, info = step(config, state, jnp.asarray(gone), jnp.array([True, True, True, False]))
    assert bool(info.converged) and not bool(info.overflow)
    keep = np.setdiff1d(np.arange(60), gone[:3])
    oracle = pc.fit(linear_model, X[keep], y[keep], tol=1e-12)
    np.testing.assert_allclose(after.q.mean, oracle.mean, rtol=1e-10)
    np.testing.assert_allclose(after.q.precision, oracle.state.precision, rtol=1e-10)
    rows, valid = jnp.asarray([5, 6, 7, 8]), jnp.ones(4, bool)
    with count_compilations() as compiled:
        again, _ = step(config, after, rows, valid)
    assert compiled.count == 0  # a deletion of another size, padded to the same length, reuses the program
    assert to_posterior(config, again, post).num_examples == 60 - 3 - 4
    outside, info = step(config, state, jnp.asarray([60, 1, 2, 3]), jnp.ones(4, bool))
    assert bool(info.overflow) and not bool(info.converged)
    np.testing.assert_array_equal(outside.weights, state.weights)  # nothing deleted

    X, y = make_logistic(80, 3)
    post, config, state, _ = _stream(logistic_model, X, y, 40, 20, 80, tol=1e-10)
    after, info = jax.jit(delete_step, static_argnums=0)(config, state, jnp.arange(10, 25))
    assert bool(info.converged)
    keep = np.setdiff1d(np.arange(80), np.arange(10, 25))
    oracle = pc.fit(logistic_model, X[keep], y[keep], tol=1e-12)
    np.testing.assert_allclose(after.q.mean, oracle.mean, rtol=1e-8, atol=1e-10)
    corrected = post.update(X[40:], y[40:]).delete(np.arange(10, 25), method="corrected", tol=1e-12)
    np.testing.assert_allclose(after.q.mean, corrected.mean, rtol=1e-8, atol=1e-10)


def test_a_scanned_sliding_window_is_the_fit_on_the_last_rows(x64):
    # A window of 30 rows over 100 examples in batches of 10: each step past the third adds a
    # batch and forgets the oldest one, so the final posterior must be the conjugate fit on
    # examples 70..99 alone (1e-10), reached under one scan.
    X, y = make_linear(100, 2)
    post = pc.fit(linear_model, X[:30], y[:30])
    config, state = from_posterior(post, 30)
    _, rest = bind_model(linear_model, (X[30:], y[30:]))
    batches, masks = split_batches(rest, 10)
    final, infos = run_stream(config, state, batches, masks, window=True)
    assert infos.residual.shape == (7,) and bool(jnp.all(infos.converged))
    oracle = pc.fit(linear_model, X[70:], y[70:], tol=1e-12)
    np.testing.assert_allclose(final.q.mean, oracle.mean, rtol=1e-10)
    np.testing.assert_allclose(final.q.precision, oracle.state.precision, rtol=1e-10)
    with pytest.raises(InvalidOptionError, match="cannot hold"):
        run_stream(config, state, *split_batches(rest, 40), window=True)


def test_a_scanned_stream_of_the_low_rank_family_equals_its_batch_fit(x64):
    # The low-rank family through the same pure kernels: its mean step is a CG solve with the
    # unprojected target and its precision the projection Π_r; the exact stream's fixed point is the
    # batch fit's in the family (both to residual 1e-10; means agree to 1e-7 relative).
    X, y = make_logistic(80, 5, seed=2)
    options = dict(family="lowrank", rank=2, tol=1e-10)
    post, config, final, infos = _stream(logistic_model, X, y, 30, 10, 80, **options)
    assert bool(jnp.all(infos.converged)), infos
    batch = pc.fit(logistic_model, X, y, **options)
    np.testing.assert_allclose(final.q.mean, batch.mean, rtol=1e-7, atol=1e-9)
    back = to_posterior(config, final, post)
    # rebuilt with sites recomputed outside the trace (the randomized projection and CG re-run):
    # within the float64 default tolerance, and the same member as the batch fit
    assert back.residual < 1e-8 and float(back.kl(batch)) < 1e-10
