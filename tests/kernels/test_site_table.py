"""Every correction as a pure function of a table of sites: equal to the host-side operations."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import linear_model, logistic_model, make_linear, make_logistic

import numpyro_pc as pc
from numpyro_pc.ops.diagnostics import count_compilations
from numpyro_pc.errors import ConvergenceError, InvalidOptionError, UnsupportedModelError
from numpyro_pc.model.likelihood import bind_model
from numpyro_pc.kernels.site_table_sag import stochastic_step
from numpyro_pc.kernels.site_table import (
    correct_step,
    forget_step,
    from_posterior,
    merge_tables,
    random_memory,
    refine_step,
    remove_step,
    table_residual,
    to_posterior,
)

TOL = 1e-11  # both paths solve to this; their answers then agree to ~1e-9 relative


def _batch(model, X, y):
    return bind_model(model, (X, y))[1]


def _rows_mask(capacity, rows):
    return jnp.zeros(capacity, bool).at[jnp.asarray(rows)].set(True)


@pytest.fixture
def logistic(x64):
    X, y = make_logistic(80, 3, seed=3)
    post = pc.fit(logistic_model, X[:50], y[:50], tol=TOL)
    return X, y, post


def _assert_same(table_post, host_post, rtol=1e-8):
    np.testing.assert_allclose(table_post.mean, host_post.mean, rtol=rtol, atol=1e-10)
    np.testing.assert_allclose(table_post.state.precision, host_post.state.precision, rtol=rtol, atol=1e-10)


@pytest.mark.parametrize("correction", ["none", "prior", "memory", "weighted", "exact"])
def test_every_correction_is_one_program_and_equals_the_host_update(logistic, correction):
    # The host driver (streaming.update) and the pure step solve the same corrected problem
    # (same cavity, same live terms) to residual 1e-11, so their posteriors agree to 1e-8.
    X, y, post = logistic
    memory = np.arange(0, 50, 5)  # ids == table rows for a first fit
    options = dict(memory=memory) if correction in ("memory", "weighted") else {}
    host = post.update(X[50:60], y[50:60], correction=correction, tol=TOL, **options)
    config, state = from_posterior(post, 64, tol=TOL)
    corrected = {"none": [], "prior": [], "memory": memory, "weighted": memory, "exact": np.arange(50)}[correction]
    weight = 50 / memory.size if correction == "weighted" else 1.0
    step = jax.jit(correct_step, static_argnums=0)
    new, info = step(config, state, _batch(logistic_model, X[50:60], y[50:60]), jnp.ones(10, bool),
                     _rows_mask(64, corrected) if len(corrected) else jnp.zeros(64, bool),
                     correction not in ("none",), weight)
    assert bool(info.converged) and not bool(info.overflow), info
    out = to_posterior(config, new, post)
    _assert_same(out, host)
    # the table's dual form holds: λ = offset + λ̂_0 + Σ λ̂_i over its (partly stale) sites
    assert float(table_residual(config, new)) < 1e-9
    np.testing.assert_allclose(out.residual, host.residual, atol=1e-9)
    # other corrections are other values of the same traced arguments: no new program
    args = (_batch(logistic_model, X[60:70], y[60:70]), jnp.ones(10, bool), _rows_mask(64, [1, 2]), False, 2.0)
    with count_compilations() as compiled:
        step(config, state, *args)
    assert compiled.count == 0


def test_a_memory_smaller_than_the_table_computes_only_its_rows(logistic):
    # work_size bounds the live rows: 10 new + 10 memory fit in 24; the answer is the same as
    # with the whole table as work space, and 30 live rows are refused as an overflow.
    X, y, post = logistic
    memory = _rows_mask(64, np.arange(10))
    batch = _batch(logistic_model, X[50:60], y[50:60])
    config, state = from_posterior(post, 64, work_size=24, tol=TOL)
    small, info = correct_step(config, state, batch, jnp.ones(10, bool), memory, True)
    wide_config, wide_state = from_posterior(post, 64, tol=TOL)
    wide, _ = correct_step(wide_config, wide_state, batch, jnp.ones(10, bool), memory, True)
    assert bool(info.converged)
    np.testing.assert_allclose(small.q.mean, wide.q.mean, rtol=1e-10, atol=1e-12)
    same, info = correct_step(config, state, batch, jnp.ones(10, bool), _rows_mask(64, np.arange(20)), True)
    assert bool(info.overflow) and not bool(info.converged)
    np.testing.assert_array_equal(same.q.mean, state.q.mean)


def test_a_scanned_stream_of_random_memory_updates_equals_the_host_loop(x64):
    # Memory corrections under lax.scan, each batch's memory drawn inside the trace; replaying
    # the same memories with post.update gives the same chain (1e-8). Conjugate model: every
    # correction is exact, so the chain also equals the batch posterior (closed form, 1e-9).
    X, y = make_linear(70, 3, seed=1)
    post = pc.fit(linear_model, X[:20], y[:20], tol=TOL)
    config, state = from_posterior(post, 72, tol=TOL)
    _, rest = bind_model(linear_model, (X[20:], y[20:]))
    batches = jax.tree.map(lambda x: x.reshape((5, 10) + x.shape[1:]), rest.per_example)

    @jax.jit
    def run(state, key):
        def body(state, xs):
            batch, k = xs
            memory = random_memory(k, state, 6)
            new, info = correct_step(config, state, type(rest)(batch, rest.shared), jnp.ones(10, bool), memory, True)
            return new, (info, memory)

        return jax.lax.scan(body, state, (batches, jax.random.split(key, 5)))

    final, (infos, memories) = run(state, jax.random.PRNGKey(0))
    assert bool(jnp.all(infos.converged)), infos
    host = post
    for k in range(5):
        ids = np.flatnonzero(np.asarray(memories[k]))  # table row == example id in this stream
        host = host.update(X[20 + 10 * k:30 + 10 * k], y[20 + 10 * k:30 + 10 * k], correction="memory",
                           memory=ids, tol=TOL)
    out = to_posterior(config, final, post)
    _assert_same(out, host)
    batch = pc.fit(linear_model, X, y, tol=1e-12)
    _assert_same(out, batch, rtol=1e-9)


def test_site_removal_and_corrected_deletion_equal_the_host_deletions(logistic):
    X, y, post = logistic
    config, state = from_posterior(post, 64, tol=TOL)
    rows = jnp.asarray([3, 17, 40, 0])
    valid = jnp.asarray([True, True, True, False])  # padding entry: row 0 stays
    removed, info = jax.jit(remove_step, static_argnums=0)(config, state, rows, valid)
    assert bool(info.converged) and float(info.residual) < 1e-9
    host = post.delete([3, 17, 40], method="remove_site")
    out = to_posterior(config, removed, post)
    _assert_same(out, host, rtol=1e-10)
    assert set(np.asarray(out.tombstones).tolist()) == {3, 17, 40} and out.num_examples == 47
    # every remaining row corrected: retraining without the rows
    forgot, info = forget_step(config, state, rows, valid)
    assert bool(info.converged)
    retrain = pc.fit(logistic_model, np.delete(X[:50], [3, 17, 40], 0), np.delete(y[:50], [3, 17, 40]), tol=TOL)
    _assert_same(to_posterior(config, forgot, post), retrain)
    # a row outside the table deletes nothing
    same, info = remove_step(config, state, jnp.asarray([70]))
    assert bool(info.overflow) and not bool(info.converged)
    np.testing.assert_array_equal(same.q.mean, state.q.mean)


def test_the_stochastic_step_converges_to_the_exact_update(logistic):
    # SAG over the table: once every row is fresh the step is the exact update's, so after
    # enough passes it reaches the exact answer (1e-8), as the host's stochastic correction.
    X, y, post = logistic
    config, state = from_posterior(post, 64, tol=1e-10)
    batch = _batch(logistic_model, X[50:60], y[50:60])
    new, info = jax.jit(stochastic_step, static_argnums=(0, 5, 6))(config, state, batch, jnp.ones(10, bool),
                                                                   jax.random.PRNGKey(1), 15, 60)
    assert bool(info.converged), info
    exact = post.update(X[50:60], y[50:60], correction="exact", tol=TOL)
    _assert_same(to_posterior(config, new, post), exact, rtol=1e-7)
    assert int(info.iterations) >= 2 * 4  # at least two passes over 60 rows in subsets of 15


def test_merged_tables_equal_pc_merge_and_refine_to_the_joint_posterior(x64):
    X, y = make_logistic(60, 3, seed=5)
    a = pc.fit(logistic_model, X[:25], y[:25], tol=TOL)
    b = pc.fit(logistic_model, X[25:], y[25:], tol=TOL)
    config, ta = from_posterior(a, 30, tol=TOL)
    _, tb = from_posterior(b, 40, tol=TOL)
    mconfig, merged = merge_tables(config, [ta, tb])
    host = pc.merge(None, [a, b])
    np.testing.assert_allclose(merged.q.mean, host.mean, rtol=1e-9)
    np.testing.assert_allclose(merged.q.precision, host.state.precision, rtol=1e-9)
    assert float(table_residual(mconfig, merged)) < 1e-9  # the merged dual form is the sites' product
    joint, info = refine_step(mconfig, merged)
    assert bool(info.converged) and mconfig.work_size == 70
    _assert_same(to_posterior(mconfig, joint, a), pc.fit(logistic_model, X, y, tol=TOL))


def test_refusals(logistic):
    X, y, post = logistic
    with pytest.raises(InvalidOptionError, match="capacity"):
        from_posterior(post, 10)
    with pytest.raises(InvalidOptionError, match="work_size"):
        from_posterior(post, 64, work_size=0)
    config, state = from_posterior(post, 64, tol=TOL)
    stuck, info = correct_step(replace(config, max_iters=1), state, _batch(logistic_model, X[50:60], y[50:60]),
                               jnp.ones(10, bool), state.has_data, True)
    assert not bool(info.converged)
    with pytest.raises(ConvergenceError):
        to_posterior(config, stuck, post)
    lowrank = pc.fit(logistic_model, X[:50], y[:50], family="lowrank", rank=1)
    with pytest.raises(UnsupportedModelError, match="projection"):
        from_posterior(lowrank, 64)
    diag = pc.fit(logistic_model, X[:50], y[:50], family="diagonal")
    dconfig, dstate = from_posterior(diag, 64)
    with pytest.raises(InvalidOptionError, match="full family"):
        stochastic_step(dconfig, dstate, _batch(logistic_model, X[50:60], y[50:60]), jnp.ones(10, bool),
                        jax.random.PRNGKey(0), 8)
