"""Functional core: a whole stream under ``lax.scan``, the JAX reservoir, missing-output masks."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

gpx = pytest.importorskip("gpjax")

from gpjax.parameters import PositiveReal  # noqa: E402

from numpyro_pc.gp import StreamingSparseGP  # noqa: E402
from numpyro_pc.gp.core import GPStreamConfig, empty_memory_state, init_state, reservoir_update, step  # noqa: E402
from numpyro_pc.gp.state import Hyper, predict_from_q  # noqa: E402

EPS = 1e-6


def _data(n, seed):
    rng = np.random.default_rng(seed)
    X = rng.uniform(-3, 3, (n, 1))
    return X, np.sin(2 * X[:, 0]) + 0.1 * rng.normal(size=n)


def _rbf(A, B, ls=0.9, var=1.2):
    return var * np.exp(-0.5 * ((A[:, None, 0] - B[None, :, 0]) / ls) ** 2)


@pytest.mark.parametrize("memory_size", [0, 64])
def test_stream_under_scan_equals_batch_sgpr(x64, memory_size):
    # fixed θ and keep_fraction = 1 (Z_b is a permutation of Z_a): the online update is exact, so 4 batches
    # under lax.scan (one traced step, state carried as a pytree, memory included) give Titsias' q(u)
    X, y = _data(64, 0)
    Z = np.linspace(-3, 3, 9)[:, None]
    hyper = Hyper(kernel=gpx.kernels.RBF(lengthscale=jnp.array(0.9), variance=jnp.array(1.2)),
                  mean_function=gpx.mean_functions.Zero(), noise=PositiveReal(jnp.array(0.05)), likelihood=None,
                  Z=jnp.asarray(Z))
    cfg = GPStreamConfig(learn_hyperparameters=False, learn_inducing=False, keep_fraction=1.0, jitter=EPS,
                       memory_size=memory_size)
    state = eqx.filter_jit(init_state)(hyper, jnp.asarray(Z), cfg, jax.random.PRNGKey(3))    # init is pure too
    batches = (jnp.asarray(X).reshape(4, 16, 1), jnp.asarray(y).reshape(4, 16), jnp.ones((4, 16)))
    state, info = jax.lax.scan(lambda s, b: step(cfg, s, *b), state, batches)
    assert bool(jnp.all(info["finite"]["bound"])) and int(state.batch) == 4
    Xs = np.linspace(-3, 3, 13)[:, None]
    g = state.gp
    mu, var = predict_from_q(g.hyper, g.Z, g.mean, g.cov, g.chol_Kzz, jnp.asarray(Xs))
    Kuu, Kuf, Ksu = _rbf(Z, Z) + EPS * np.eye(9), _rbf(Z, X), _rbf(Xs, Z)
    Sig = Kuu + Kuf @ Kuf.T / 0.05
    m = Kuu @ np.linalg.solve(Sig, Kuf @ y) / 0.05
    S = Kuu @ np.linalg.solve(Sig, Kuu)
    W = np.linalg.solve(Kuu, Ksu.T)
    np.testing.assert_allclose(mu, W.T @ m, atol=1e-7)
    np.testing.assert_allclose(var, 1.2 - np.sum(Ksu.T * W, 0) + np.sum(W * (S @ W), 0), atol=1e-7)
    assert float(state.noise_rows) == 64
    if memory_size:
        assert int(state.memory.seen) == 64 and float(state.memory.mask.sum()) == 64


def test_reservoir_is_uniform_over_the_stream(x64):
    # 3 batches of 40 rows (some masked) into a memory of 30: every real row is kept with probability 30 / 100
    mask = np.ones((3, 40))
    mask[1, ::2] = 0                                         # 20 missing outputs: 100 real rows
    ids = jnp.arange(120.0).reshape(3, 40)

    def run(key):
        mem = empty_memory_state(30, 1)
        for b in range(3):
            key, k = jax.random.split(key)
            mem = reservoir_update(mem, ids[b][:, None], ids[b], jnp.asarray(mask[b]), ids[b], k)
        return mem

    mems = jax.vmap(run)(jax.random.split(jax.random.PRNGKey(0), 2000))
    kept = np.zeros(120)
    for row in np.asarray(mems.y):
        assert len(set(row.tolist())) == 30                  # no duplicates
        kept[row.astype(int)] += 1
    freq = kept / 2000
    real = mask.reshape(-1) > 0
    assert np.all(freq[~real] == 0) and np.all(np.asarray(mems.seen) == 100)
    # binomial sd of a frequency: sqrt(0.3·0.7/2000) ≈ 0.0102; 5 sd over 100 rows
    assert np.max(np.abs(freq[real] - 0.3)) < 0.052


def test_missing_outputs_are_ignored(x64):
    X, y = _data(50, 1)
    obs = np.ones(50, bool)
    obs[::5] = False
    y_nan = np.where(obs, y, np.nan)
    kw = dict(noise_variance=0.05, Z_init=np.linspace(-3, 3, 7)[:, None], inducing="fixed",
              learn_hyperparameters=False, jitter=EPS)
    a = StreamingSparseGP(gpx.kernels.RBF(lengthscale=0.9, variance=1.2), 7, **kw).update(X, y_nan, mask=obs)
    b = StreamingSparseGP(gpx.kernels.RBF(lengthscale=0.9, variance=1.2), 7, **kw).update(X[obs], y[obs])
    assert abs(a.history[0]["bound"] - b.history[0]["bound"]) < 1e-9
    np.testing.assert_allclose(a.state.mean, b.state.mean, atol=1e-9)
    assert a.summary()["noise_statistics"]["rows"] == 40
