"""The per-batch optimiser: exact minima, reached stopping criteria, one evaluation site, aux output."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numpyro_pc.gp.optim import minimize


def _quadratic(seed=0, n=20, cond=1e3):
    rng = np.random.default_rng(seed)
    Q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    A = Q @ np.diag(np.logspace(0, np.log10(cond), n)) @ Q.T
    b = rng.normal(size=n)
    return jnp.asarray(A), jnp.asarray(b), np.linalg.solve(A, b)


@pytest.mark.parametrize("method", ["lbfgs"])
def test_quadratic_minimum_and_gradient_stop(x64, method):
    # ½xᵀAx − bᵀx, cond(A) = 1e3: the minimiser is A⁻¹b, reached before the cap. The Armijo search compares values
    # of f whose float64 rounding is ~ε·λ_max·‖x‖² ≈ 3e-13, so a decrease below that is invisible and the search
    # stops there: x is then known to √(2·3e-13/λ_min) ≈ 8e-7 (measured 1.4e-7 on an AMD EPYC, gradient 8e-7, the
    # line search's stop; other machines reached gtol first). atol 1e-6 is that bound, not a loosened oracle.
    A, b, x_star = _quadratic()
    fun = lambda p: 0.5 * p["x"] @ A @ p["x"] - b @ p["x"]  # noqa: E731
    res = jax.jit(lambda p: minimize(fun, p, method, max_iters=500, gtol=1e-9))({"x": jnp.zeros(20)})
    np.testing.assert_allclose(res.params["x"], x_star, atol=1e-6)
    assert 0 < int(res.iterations) < 500
    assert abs(float(res.value) - float(fun({"x": jnp.asarray(x_star)}))) < 1e-12


def test_rosenbrock_and_pytree_params(x64):
    def fun(p):
        x, y = p
        return (1 - x) ** 2 + 100 * (y - x ** 2) ** 2

    res = jax.jit(lambda p: minimize(fun, p, "lbfgs", max_iters=300, gtol=1e-10))((jnp.asarray(-1.2),
                                                                                   jnp.asarray(1.0)))
    np.testing.assert_allclose(np.array(res.params), [1.0, 1.0], atol=1e-6)
    assert int(res.iterations) < 300 and int(res.evaluations) >= int(res.iterations)


def test_relative_decrease_stop_is_reached(x64):
    # with ftol the loop ends on the decrease test before the cap (and before the gradient test), the looser
    # tolerance earlier; both stop above the minimum, the tighter one closer to it
    A, b, x_star = _quadratic(seed=1)
    fun = lambda x: 0.5 * x @ A @ x - b @ x  # noqa: E731
    f_star = float(fun(jnp.asarray(x_star)))
    full = minimize(fun, jnp.zeros(20), "lbfgs", max_iters=1000, gtol=1e-9)
    res = minimize(fun, jnp.zeros(20), "lbfgs", max_iters=1000, gtol=1e-9, ftol=1e-8)
    loose = minimize(fun, jnp.zeros(20), "lbfgs", max_iters=1000, gtol=1e-9, ftol=1e-4)
    assert int(loose.iterations) < int(res.iterations) < int(full.iterations) < 1000
    assert f_star <= float(res.value) <= float(loose.value)
    assert float(res.value) - f_star < 1e-5 and float(loose.value) - f_star > float(res.value) - f_star


def test_objective_is_traced_once_and_aux_is_the_final_iterates(x64):
    # the compile-time property of the default L-BFGS: ``fun`` appears at one place in the program
    # (optax's L-BFGS inlines it in the step and again in the zoom line search)
    A, b, x_star = _quadratic(seed=2, n=5, cond=10.0)
    traces = {"lbfgs": 0, "optax_lbfgs": 0}

    def make(method):
        def fun(x):
            traces[method] += 1
            return 0.5 * x @ A @ x - b @ x, 2.0 * x
        return fun

    res = jax.jit(lambda x: minimize(make("lbfgs"), x, "lbfgs", gtol=1e-10, has_aux=True))(jnp.ones(5))
    jax.jit(lambda x: minimize(make("optax_lbfgs"), x, "optax_lbfgs", gtol=1e-10, has_aux=True))(jnp.ones(5))
    assert traces["lbfgs"] == 2           # one trace for the output shapes of aux, one in the loop
    assert traces["optax_lbfgs"] > traces["lbfgs"]
    np.testing.assert_allclose(res.aux, 2.0 * res.params, rtol=1e-12)
    np.testing.assert_allclose(res.params, x_star, atol=1e-8)


def test_non_finite_values_never_leak(x64):
    # ½(x − 3)² is NaN from x = 1 on: the minimiser keeps stepping towards the boundary, every trial past it is
    # rejected, and the result is the last finite iterate, close to the boundary
    fun = lambda x: jnp.sum(jnp.where(x < 1.0, 0.5 * (x - 3.0) ** 2, jnp.nan))  # noqa: E731
    res = minimize(fun, jnp.zeros(1), "lbfgs", max_iters=200, gtol=1e-10)
    x = float(res.params[0])
    assert np.isfinite(float(res.value)) and 0.9 < x < 1.0
    assert abs(float(res.value) - 0.5 * (x - 3.0) ** 2) < 1e-12
