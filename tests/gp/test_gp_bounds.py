"""Oracle tests of the collapsed and uncollapsed online bounds (float64, fixed seeds).

Oracles: the textbook dense SGPR (Titsias 2009) on the concatenated data, the exact GP
posterior, and the paper's form of the online bound with ``D_a`` formed explicitly.
"""

import jax.numpy as jnp
import numpy as np
import pytest

gpx = pytest.importorskip("gpjax")

from gpjax.parameters import PositiveReal  # noqa: E402

from numpyro_pc.gp import StreamingSparseGP, collapsed_fit, handover, paper_bound, prior_state  # noqa: E402
from numpyro_pc.gp.state import Hyper  # noqa: E402
from numpyro_pc.gp.uncollapsed import uncollapsed_bound, whiten  # noqa: E402

EPS = 1e-6


def _data(n=60, seed=0, sort=False):
    rng = np.random.default_rng(seed)
    X = rng.uniform(-3, 3, (n, 1))
    if sort:
        X = np.sort(X, 0)
    y = np.sin(2 * X[:, 0]) + 0.1 * rng.normal(size=n)
    return X, y


def _hyper(Z, lengthscale=0.9, variance=1.2, noise=0.05):
    return Hyper(kernel=gpx.kernels.RBF(lengthscale=jnp.array(lengthscale), variance=jnp.array(variance)),
                 mean_function=gpx.mean_functions.Zero(), noise=PositiveReal(jnp.array(noise)), likelihood=None,
                 Z=jnp.asarray(Z))


def _rbf(A, B, ls, var):
    return var * np.exp(-0.5 * ((A[:, None, 0] - B[None, :, 0]) / ls) ** 2)


def _dense_sgpr(X, y, Z, ls=0.9, var=1.2, noise=0.05, eps=EPS):
    """Titsias' SGPR, textbook form: bound and optimal q(u)."""
    Kuu = _rbf(Z, Z, ls, var) + eps * np.eye(len(Z))
    Kuf = _rbf(Z, X, ls, var)
    Qff = Kuf.T @ np.linalg.solve(Kuu, Kuf)
    C = Qff + noise * np.eye(len(X))
    F = (-0.5 * len(X) * np.log(2 * np.pi) - 0.5 * np.linalg.slogdet(C)[1] - 0.5 * y @ np.linalg.solve(C, y)
         - 0.5 * (len(X) * var - np.trace(Qff)) / noise)
    Sig = Kuu + Kuf @ Kuf.T / noise
    m = Kuu @ np.linalg.solve(Sig, Kuf @ y) / noise
    S = Kuu @ np.linalg.solve(Sig, Kuu)
    return F, m, S


@pytest.mark.parametrize("batches", [2, 3, 10])
def test_streaming_equals_batch_sgpr(x64, batches):
    # fixed θ and Z_b = Z_a: the online update is exact (docs/gp.md); 1e-8 leaves ~1e5 × float64 rounding
    X, y = _data(80)
    Z = np.linspace(-3, 3, 9)[:, None]
    sgp = StreamingSparseGP(gpx.kernels.RBF(lengthscale=0.9, variance=1.2), 9, noise_variance=0.05, Z_init=Z,
                            inducing="fixed", learn_hyperparameters=False, jitter=EPS)
    for idx in np.array_split(np.random.default_rng(1).permutation(80), batches):
        sgp = sgp.update(X[idx], y[idx])
    F, m, S = _dense_sgpr(X, y, Z)
    assert abs(sum(sgp.summary()["bound"]) - F) < 1e-8
    np.testing.assert_allclose(np.asarray(sgp.state.mean), m, atol=1e-8)
    np.testing.assert_allclose(np.asarray(sgp.state.cov), S, atol=1e-8)


def test_inducing_at_all_inputs_is_exact_gp(x64):
    # Z = X: SGPR is the exact GP; the only difference is the jitter ε = 1e-10 (error O(ε/σ²))
    X, y = _data(30, seed=2)
    Xs = np.linspace(-3.5, 3.5, 17)[:, None]
    sgp = StreamingSparseGP(gpx.kernels.RBF(lengthscale=0.9, variance=1.2), 30, noise_variance=0.05, Z_init=X,
                            inducing="fixed", learn_hyperparameters=False, jitter=1e-10)
    for idx in np.array_split(np.arange(30), 3):
        sgp = sgp.update(X[idx], y[idx])
    K = _rbf(X, X, 0.9, 1.2) + 0.05 * np.eye(30)
    Ks = _rbf(Xs, X, 0.9, 1.2)
    mean = Ks @ np.linalg.solve(K, y)
    var = 1.2 - np.sum(Ks * np.linalg.solve(K, Ks.T).T, 1)
    mu, v = sgp.predict(Xs)
    np.testing.assert_allclose(mu, mean, atol=1e-6)
    np.testing.assert_allclose(v, var, atol=1e-6)


def _second_batch_state(alpha):
    X, y = _data(40, seed=3)
    h1 = _hyper(np.linspace(-3, 3, 7)[:, None])
    st = prior_state(h1, EPS)
    fit = collapsed_fit(h1, st, jnp.asarray(X[:20]), jnp.asarray(y[:20]), jnp.ones(20), alpha)
    st = handover(h1, fit.mean, fit.cov, EPS)
    h2 = _hyper(np.linspace(-2.5, 3.2, 8)[:, None], lengthscale=1.1, variance=0.8, noise=0.07)
    return st, h2, jnp.asarray(X[20:]), jnp.asarray(y[20:])


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_stable_form_equals_paper_form(x64, alpha):
    # changed θ, noise and Z_b (7 → 8 points); D_a is well conditioned here, so the dense
    # paper form is accurate to ~1e-10 and the two must agree to 1e-8
    st, h2, X, y = _second_batch_state(alpha)
    stable = collapsed_fit(h2, st, X, y, jnp.ones(20), alpha).bound
    assert abs(float(stable) - float(paper_bound(h2, st, X, y, alpha))) < 1e-8


def test_power_ep_tends_to_vfe(x64):
    st, h2, X, y = _second_batch_state(0.0)
    vfe = collapsed_fit(h2, st, X, y, jnp.ones(20), 0.0)
    pep = collapsed_fit(h2, st, X, y, jnp.ones(20), 1e-6)
    assert abs(float(vfe.bound) - float(pep.bound)) < 1e-6
    np.testing.assert_allclose(pep.mean, vfe.mean, atol=1e-6)
    np.testing.assert_allclose(pep.cov, vfe.cov, atol=1e-6)


def test_uncollapsed_at_collapsed_optimum(x64):
    # Gaussian likelihood: the uncollapsed bound is maximised by the collapsed q(b) and equals F there
    st, h2, X, y = _second_batch_state(0.0)
    fit = collapsed_fit(h2, st, X, y, jnp.ones(20), 0.0)
    q = whiten(fit.chol_Kbb, fit.mean, fit.cov)
    at_opt = uncollapsed_bound(h2, st, X, y, jnp.ones(20), q)
    assert abs(float(at_opt) - float(fit.bound)) < 1e-8
    rng = np.random.default_rng(4)
    for _ in range(5):
        q2 = q._replace(mean=q.mean + 0.05 * rng.normal(size=q.mean.shape),
                        chol=q.chol + 0.01 * np.tril(rng.normal(size=q.chol.shape)))
        assert float(uncollapsed_bound(h2, st, X, y, jnp.ones(20), q2)) < float(fit.bound)


def test_padding_does_not_change_the_bound(x64):
    st, h2, X, y = _second_batch_state(0.5)
    Xp = jnp.concatenate([X, jnp.full((12, 1), 7.0)])
    yp = jnp.concatenate([y, jnp.full(12, 3.0)])
    mask = jnp.concatenate([jnp.ones(20), jnp.zeros(12)])
    a = collapsed_fit(h2, st, X, y, jnp.ones(20), 0.5)
    b = collapsed_fit(h2, st, Xp, yp, mask, 0.5)
    assert abs(float(a.bound) - float(b.bound)) < 1e-10
    np.testing.assert_allclose(a.mean, b.mean, atol=1e-10)


def test_sorted_batches_ill_conditioned(x64):
    # batches sorted by input: the old posterior is prior-like far from past data, so
    # S_a⁻¹ − K'_aa⁻¹ is numerically singular; the stable form must stay finite and match batch
    X, y = _data(200, seed=5, sort=True)
    Z = np.linspace(-3, 3, 25)[:, None]
    sgp = StreamingSparseGP(gpx.kernels.RBF(lengthscale=0.5, variance=1.0), 25, noise_variance=0.01, Z_init=Z,
                            inducing="fixed", learn_hyperparameters=False, jitter=EPS)
    conds = []
    for idx in np.array_split(np.arange(200), 10):
        if sgp.state is not None:
            s = sgp.state
            conds.append(np.linalg.cond(np.linalg.inv(np.asarray(s.cov)) - np.linalg.inv(np.asarray(s.Kzz))))
        sgp = sgp.update(X[idx], y[idx])
    assert max(conds) > 1e12                        # the regime the stable form exists for
    Xs = np.linspace(-3, 3, 50)[:, None]
    mu, var = sgp.predict(Xs)
    assert np.all(np.isfinite(mu)) and np.all(np.isfinite(var))
    _, m, S = _dense_sgpr(X, y, Z, ls=0.5, var=1.0, noise=0.01)
    Kzs = _rbf(Z, Xs, 0.5, 1.0)
    W = np.linalg.solve(_rbf(Z, Z, 0.5, 1.0) + EPS * np.eye(25), Kzs)
    np.testing.assert_allclose(mu, W.T @ m, atol=1e-5)   # rounding amplified by cond(K_ZZ) ~ 1e8
