"""Scale-free defaults of :class:`StreamingSparseGP`: the first batch initialises the kernel, noise and
mean from the data, the optimiser's coordinates do not depend on the units, and the inducing policies
are scale-free. Each test fails on the code before ``init_from_data`` (lengthscale stuck at 1.0, RMSE
of the prior mean, or a zero lengthscale)."""

import gpjax as gpx
import numpy as np
import pytest

from numpyro_pc.errors import InvalidOptionError
from numpyro_pc.gp import StreamingSparseGP
from numpyro_pc.gp import inducing

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _data(n=120, seed=1):
    rng = np.random.default_rng(seed)
    X = rng.uniform(-3, 3, (n, 1))
    f = lambda x: np.sin(2 * x[:, 0]) + 0.3 * x[:, 0]  # noqa: E731
    y = f(X) + 0.1 * rng.standard_normal(n)
    Xt = np.linspace(-3, 3, 100)[:, None]
    return X, y, Xt, f(Xt)


def _rmse(sx, sy, **kw):
    X, y, Xt, ft = _data()
    m = StreamingSparseGP(gpx.kernels.RBF(), 10, max_iters=40, memory_size=0, **kw)
    m = m.update(X[:60] * sx, y[:60] * sy).update(X[60:] * sx, y[60:] * sy)
    mu, _ = m.predict(Xt * sx)
    return float(np.sqrt(np.mean((mu - ft * sy) ** 2))) / sy, m      # RMSE in the scaled units / output scale


def test_rmse_does_not_depend_on_input_or_output_scale():
    base, m0 = _rmse(1.0, 1.0)
    assert base < 0.1
    for sx, sy in [(1e-3, 1.0), (1e3, 1.0), (1e6, 1.0), (1.0, 1e-3), (1.0, 1e6), (1e6, 1e-3)]:
        r, m = _rmse(sx, sy)
        assert abs(r - base) <= 0.1 * base, (sx, sy, r, base)
        ls = m.history[-1]["hyperparameters"]["kernel.lengthscale"]
        assert 0.1 < ls / sx < 10, (sx, sy, ls)       # the lengthscale moved with the inputs
    assert set(m0.initialised_from_data) == {"kernel.lengthscale", "kernel.variance", "noise"}


def test_explicit_values_are_respected_and_false_keeps_defaults():
    X, y, _, _ = _data(40)
    m = StreamingSparseGP(gpx.kernels.RBF(lengthscale=0.3, variance=2.0), 5, noise_variance=0.05, max_iters=2,
                          memory_size=0).update(X, y)
    h0 = m.history[0]["initial_hyperparameters"]
    assert h0["kernel.lengthscale"] == pytest.approx(0.3) and h0["kernel.variance"] == pytest.approx(2.0)
    assert h0["noise"] == pytest.approx(0.05) and m.initialised_from_data == ()
    # only the parameters left at GPJax's defaults are initialised
    m = StreamingSparseGP(gpx.kernels.RBF(lengthscale=0.3), 5, max_iters=2, memory_size=0).update(X * 1e3, y)
    h0 = m.history[0]["initial_hyperparameters"]
    assert h0["kernel.lengthscale"] == pytest.approx(0.3) and set(m.initialised_from_data) == {"kernel.variance",
                                                                                                 "noise"}
    m = StreamingSparseGP(gpx.kernels.RBF(), 5, max_iters=2, memory_size=0, init_from_data=False).update(X, y)
    h0 = m.history[0]["initial_hyperparameters"]
    assert h0["kernel.lengthscale"] == pytest.approx(1.0) and h0["noise"] == pytest.approx(1.0)
    assert m.initialised_from_data == ()
    # True replaces explicit values too
    m = StreamingSparseGP(gpx.kernels.RBF(lengthscale=0.3), 5, noise_variance=0.05, max_iters=2, memory_size=0,
                          init_from_data=True).update(X * 1e3, y * 1e3)
    h0 = m.history[0]["initial_hyperparameters"]
    assert h0["kernel.lengthscale"] > 100 and h0["noise"] > 1.0
    with pytest.raises(InvalidOptionError):
        StreamingSparseGP(gpx.kernels.RBF(), 5, init_from_data="yes")


def test_ard_constant_column_composite_kernel_and_constant_mean():
    rng = np.random.default_rng(0)
    X = np.column_stack([rng.uniform(0, 1e4, 50), np.full(50, 7.0), rng.uniform(0, 1e-2, 50)])
    y = 1e3 + np.sin(X[:, 0] / 2e3) + rng.standard_normal(50) * 0.1
    k = gpx.kernels.RBF(lengthscale=[1.0, 1.0, 1.0]) + gpx.kernels.Matern32(active_dims=[2])
    m = StreamingSparseGP(k, 6, mean_function=gpx.mean_functions.Constant(), max_iters=2,
                          memory_size=0).update(X, y)
    h0 = m.history[0]["initial_hyperparameters"]
    ls = np.asarray(h0["kernel.kernels[0].lengthscale"])
    assert np.all(np.isfinite(ls)) and np.all(ls > 0)
    assert 1e3 < ls[0] < 1e4 and 1e-3 < ls[2] < 1e-2 and ls[1] > 0          # constant column: not 0 / NaN
    assert 1e-3 < h0["kernel.kernels[1].lengthscale"] < 1e-2
    assert h0["mean_function.constant"] == pytest.approx(np.mean(y))
    v = np.var(y)
    assert h0["kernel.kernels[0].variance"] == pytest.approx(v / 2) and h0["noise"] == pytest.approx(v / 100)
    assert np.all(np.isfinite(m.predict(X[:3])[0]))
    from numpyro_pc.gp import datainit

    s = datainit.input_scales(np.column_stack([np.zeros(5), np.full(5, 3.0)]))
    assert np.all(s > 0) and np.all(np.isfinite(s))


def test_bernoulli_gets_lengthscales_only():
    rng = np.random.default_rng(2)
    X = rng.uniform(0, 1e3, (40, 1))
    y = (np.sin(X[:, 0] / 200) > 0).astype(float)
    m = StreamingSparseGP(gpx.kernels.RBF(), 5, likelihood=gpx.likelihoods.Bernoulli(),
                          max_iters=2).update(X, y)
    assert m.initialised_from_data == ("kernel.lengthscale",)
    assert m.history[0]["initial_hyperparameters"]["kernel.lengthscale"] > 10


@pytest.mark.parametrize("policy", ["kmeans", "greedy"])
def test_inducing_policies_are_scale_free(policy):
    rng = np.random.default_rng(3)
    Z_old, X = rng.standard_normal((8, 2)), rng.standard_normal((30, 2))
    s = np.array([1e6, 1e-3])
    Z = inducing.next_inducing(Z_old, X, np.random.default_rng(0), policy)
    Zs = inducing.next_inducing(Z_old * s, X * s, np.random.default_rng(0), policy)
    np.testing.assert_allclose(Zs / s, Z, rtol=1e-9, atol=1e-12)
