"""The one fixed-point engine (numpyro_pc.solvers.fixed_point): Anderson, damping, the natural-parameter
iteration's host and traced drivers, stagnation and the tolerance rule.

Oracles: the fixed point of an affine map in closed form, ``(I − A)⁻¹ b``; Anderson type II
with a full history is GMRES on an affine map, so it must land on it in at most ``n + 1``
steps while the plain iteration needs hundreds (the spectral radius is 0.95); the host driver
(:func:`numpyro_pc.solvers.expfam.blr_solve`) and the traced one (:func:`natural_solve`) run the same
pieces, so their iterates agree to rounding. All in float64.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpyro_pc as pc
from numpyro_pc.dual import expfam as ef_posterior
from numpyro_pc.solvers import expfam as ef_solve
from numpyro_pc.solvers import fixed_point
from numpyro_pc.solvers import gaussian as solvers
from numpyro_pc.errors import ConvergenceError, OutOfDomainError, StagnationError
from models import logistic_model, make_logistic
from numpyro_pc.solvers.fixed_point import (anderson_init, anderson_mix, anderson_push, anderson_restart, damping_init,
                                    damping_observe, natural_solve)


def _affine(n, seed, radius=0.95):
    """``T(x) = A x + b`` with A symmetric, spectral radius ``radius`` (slow for the plain iteration)."""
    rng = np.random.default_rng(seed)
    basis, _ = np.linalg.qr(rng.normal(size=(n, n)))
    eig = np.linspace(-radius, radius, n)
    a = basis @ np.diag(eig) @ basis.T
    b = rng.normal(size=n)
    return jnp.asarray(a), jnp.asarray(b), np.linalg.solve(np.eye(n) - a, b)


def test_anderson_with_full_memory_solves_an_affine_map_in_n_plus_one_steps():
    with jax.enable_x64(True):
        n = 6
        a, b, exact = _affine(n, 0)
        target = lambda x: (a @ x + b, None)  # noqa: E731
        inside = lambda x: jnp.asarray(True)  # noqa: E731
        lam, _, its, res, ok = natural_solve(target, inside, jnp.zeros(n), 1e-13, 200, memory=n)
        assert bool(ok) and float(res) <= 1e-13
        assert int(its) <= n + 1  # GMRES on an n-dimensional affine map
        np.testing.assert_allclose(lam, exact, rtol=1e-11, atol=1e-12)
        _, _, plain_its, _, _ = natural_solve(target, inside, jnp.zeros(n), 1e-13, 2000, memory=0)
        assert int(plain_its) > 20 * n  # the acceleration is what made the difference


def test_host_and_traced_drivers_take_the_same_iterates():
    # a nonlinear map on the positive orthant: λ ↦ c + 0.5·log(λ) (fixed point where λ = c + 0.5 log λ)
    with jax.enable_x64(True):
        c = jnp.asarray([2.0, 3.0, 1.5])
        target = jax.jit(lambda x: (c + 0.5 * jnp.log(x), x))
        inside = lambda x: jnp.all(x > 0)  # noqa: E731
        start = jnp.asarray([1.0, 1.0, 1.0])
        lam_h, aux_h, info = ef_solve.blr_solve(target, inside, start, tol=1e-12, max_iters=100)
        lam_t, aux_t, its, res, ok = natural_solve(target, inside, start, 1e-12, 100)
        assert info.converged and bool(ok)
        assert info.iterations == int(its)
        np.testing.assert_allclose(lam_h, lam_t, rtol=1e-14)
        np.testing.assert_allclose(aux_h, lam_h)  # aux belongs to the returned λ
        np.testing.assert_allclose(lam_h, c + 0.5 * np.log(np.asarray(lam_h)), rtol=1e-11)


def test_proposals_stay_inside_the_domain():
    # the plain step of λ ↦ −1 + 0.1 λ from λ = 1 leaves λ > 0 at once; the fixed point (−1/0.9) is outside, so
    # the iteration must stop inside the domain, unconverged, never propose an outside point
    with jax.enable_x64(True):
        seen = []

        def target(x):
            seen.append(x)
            return -1.0 + 0.1 * x, None

        inside = lambda x: jnp.all(x > 0)  # noqa: E731
        with pytest.raises(Exception) as err:
            ef_solve.blr_solve(target, inside, jnp.asarray([1.0]), tol=1e-12, max_iters=30)
        assert isinstance(err.value, (OutOfDomainError, ef_solve.ConvergenceError))
        assert all(float(x[0]) > 0 for x in seen)
        lam, _, _, _, ok = jax.jit(lambda s: natural_solve(lambda x: (-1.0 + 0.1 * x, None), inside, s, 1e-12, 30))(
            jnp.asarray([1.0]))
        assert float(lam[0]) > 0 and not bool(ok)


def test_damping_halves_on_a_worse_plain_step_only_and_recovers():
    with jax.enable_x64(True):
        d = damping_init(1.0, jnp.float64)
        for r in (1.0, 0.5, 0.4):
            d, worse = damping_observe(d, r, False, 1.0)
            assert not bool(worse)
        d, worse = damping_observe(d, 2.0, True, 1.0)  # worse, but the step was accelerated: no damping
        assert bool(worse) and float(d.step) == 1.0
        d, worse = damping_observe(d, 3.0, False, 1.0)  # worse after a plain step: halve
        assert bool(worse) and float(d.step) == 0.5
        d, _ = damping_observe(d, 4.0, False, 1.0)
        assert float(d.step) == 0.25
        d, worse = damping_observe(d, 0.1, False, 1.0)  # below the last three: double again, capped at ρ
        assert not bool(worse) and float(d.step) == 0.5
        d, _ = damping_observe(d, 0.05, False, 1.0)
        d, _ = damping_observe(d, 0.01, False, 1.0)
        assert float(d.step) == 1.0


def test_anderson_history_masks_what_is_not_filled():
    with jax.enable_x64(True):
        h = anderson_init(jnp.zeros(3), 4)
        x, f = jnp.asarray([1.0, 2.0, 3.0]), jnp.asarray([0.5, -1.0, 0.25])
        h = anderson_push(h, x, f)
        np.testing.assert_array_equal(anderson_mix(h, 0.5), x + 0.5 * f)  # one pair: the plain step
        h = anderson_push(h, x + f, 0.3 * f)
        assert int(h.count) == 2
        assert int(anderson_restart(h, keep=1).count) == 1
        np.testing.assert_array_equal(anderson_mix(anderson_restart(h, keep=1)), x + 1.3 * f)
        # two pairs on the line x + t·f with residual (1 − 0.7 t)·f: the secant root t = 1/0.7
        np.testing.assert_allclose(anderson_mix(h), x + f / 0.7, rtol=1e-14)


def test_natural_solve_vmaps_over_independent_problems():
    with jax.enable_x64(True):
        a, _, _ = _affine(4, 1, radius=0.8)
        bs = jnp.asarray(np.random.default_rng(2).normal(size=(5, 4)))

        def one(b):
            lam, _, _, res, ok = natural_solve(lambda x: (a @ x + b, None), lambda x: jnp.asarray(True), jnp.zeros(4),
                                               1e-12, 50)
            return lam, ok

        lams, oks = jax.jit(jax.vmap(one))(bs)
        assert bool(jnp.all(oks))
        exact = np.linalg.solve(np.eye(4) - np.asarray(a), np.asarray(bs).T).T
        np.testing.assert_allclose(lams, exact, rtol=1e-10, atol=1e-11)


def test_one_tolerance_rule_per_dtype():
    assert solvers.default_tol is fixed_point.default_tol is ef_posterior.default_tol
    assert fixed_point.default_tol(jnp.float64) == 1e-8 and fixed_point.default_tol(jnp.float32) == 1e-5


def test_stagnation_rule():
    assert fixed_point.stagnation([1.0] * 30, [1.0] * 29).startswith("stagnant: the best residual")
    assert "damped" in fixed_point.stagnation([1.0, 0.9], [1e-4] * 8)
    assert fixed_point.stagnation([0.5 ** k for k in range(40)], [1.0] * 39) is None
    # a flat residual with an objective that keeps falling (0.05 nats per iteration) is progress; 0.001 is not
    flat = [0.03] * 40
    assert fixed_point.stagnation(flat, [1.0] * 39, [600.0 - 0.05 * k for k in range(40)]) is None
    assert "did not halve" in fixed_point.stagnation(flat, [1.0] * 39, [600.0 - 0.001 * k for k in range(40)])


def test_backtrack_returns_the_longest_accepted_halving():
    with jax.enable_x64(True):
        accept_below = lambda limit: (lambda r: r <= limit)  # noqa: E731
        assert float(fixed_point.backtrack(accept_below(0.3), 1.0, 2.0**-20)) == 0.25
        assert float(fixed_point.backtrack(accept_below(2.0), 1.0, 2.0**-20)) == 1.0
        assert float(fixed_point.backtrack(accept_below(-1.0), 1.0, 2.0**-20)) < 2.0**-20  # none accepted
        traced = jax.jit(lambda limit: fixed_point.backtrack(lambda r: r <= limit, 1.0, 2.0**-20))
        assert float(traced(0.1)) == 0.0625


def _logistic_problem(n=60, d=3):

    from numpyro_pc.sites.expectations import ExpectationRule
    from numpyro_pc.families.registry import get_family
    from numpyro_pc.model.likelihood import bind_model
    from numpyro_pc.solvers.site_problem import SiteProblem

    X, y = make_logistic(n, d)
    spec, data = bind_model(logistic_model, (X, y))
    problem = SiteProblem(spec, data, get_family("full"), ExpectationRule("delta"), "hessian", "auto", None,
                          jnp.arange(n))
    return problem, (X, y)


def test_gaussian_host_solve_is_its_init_and_step(x64):
    # solvers.solve is the host driver of solve_init/solve_step: stepping the carry by hand must
    # give the same iterates (same arithmetic, so equal to the last bit), and a step never
    # mutates the carry it was given. Oracle for the end point: the delta rule's fixed point is
    # the MAP, so the mean equals pc.fit's MAP/Laplace posterior on the same data to 1e-8.
    import numpyro_pc as pc

    from numpyro_pc.families.registry import Gaussian

    problem, (X, y) = _logistic_problem()
    start = Gaussian(jnp.zeros(4), jnp.eye(4))  # the intercept and three weights
    q, _, history = solvers.solve(problem, start, tol=1e-10)
    state = solvers.solve_init(problem, start)
    first = state
    while not solvers.solve_converged(state, 1e-10) and state.iteration < 100:
        state = solvers.solve_step(problem, state, solvers.SolveOptions())
        assert not state.stalled
    assert len(first.history) == 1 and first.iteration == 0  # the carry is never mutated
    assert [h["residual"] for h in state.history] == [h["residual"] for h in history]
    np.testing.assert_array_equal(state.point.q.mean, q.mean)
    laplace = pc.fit(logistic_model, X, y, expectation="delta", tol=1e-10)
    np.testing.assert_allclose(q.mean, laplace.mean, rtol=1e-8, atol=1e-10)


def test_traced_gaussian_iterate_is_its_init_and_step(x64):
    # stream_state.iterate is one lax.while_loop over iterate_step: the same steps taken one by one
    # from the host give the same iterate (rtol 1e-12: the two are compiled separately, so fusion
    # may reorder sums), and the end point is pc.fit's fixed point on all the data (KL-level 1e-8).
    import numpyro_pc as pc

    from numpyro_pc.model.likelihood import bind_model
    from numpyro_pc.kernels.stream_state import from_posterior, iterate, iterate_init, iterate_step

    X, y = make_logistic(60, 3)
    post = pc.fit(logistic_model, X[:20], y[:20])
    config, state = from_posterior(post, 64)
    _, data = bind_model(logistic_model, (X, y))
    args = (data, jnp.arange(60), jnp.ones(60), None, True)
    q, _, residual, iterations = jax.jit(lambda q0: iterate(config, q0, *args))(state.q)
    step = jax.jit(lambda carry: iterate_step(config, carry, *args))
    carry = iterate_init(config, state.q, *args)
    while float(carry.residual) > config.tol and int(carry.iteration) < config.max_iters and not bool(carry.stalled):
        carry = step(carry)
    assert int(carry.iteration) == int(iterations) > 0 and float(residual) <= config.tol
    np.testing.assert_allclose(carry.q.mean, q.mean, rtol=1e-12)
    np.testing.assert_allclose(carry.q.precision, q.precision, rtol=1e-12)
    batch = pc.fit(logistic_model, X, y, tol=1e-12)
    np.testing.assert_allclose(q.mean, batch.mean, rtol=1e-7, atol=1e-9)


def test_a_float32_stall_is_blamed_on_the_dtype_and_float64_reaches_the_tolerance():
    """Issue 32: a float32 run that stalls at its rounding level must say so, not blame the model.

    Unscaled covariates (×30) make the site sums large, so float32 stalls near 1e-8; the same
    problem in float64 reaches tol 1e-9 — which is what the message tells the user to try.
    """
    X, y = make_logistic(400, 3, seed=3)
    X32, y32 = np.asarray(X, np.float32) * 30, np.asarray(y, np.float32)
    with pytest.raises(StagnationError) as info:
        pc.fit(logistic_model, X32, y32, tol=1e-9)
    text = str(info.value)
    assert "the dtype: in float32" in text and "Rerun in float64" in text
    assert "non-log-concave" not in text
    with jax.enable_x64(True):
        post = pc.fit(logistic_model, np.asarray(X32, np.float64), np.asarray(y32, np.float64), tol=1e-9)
        assert post.residual <= 1e-9


def test_the_iteration_budget_follows_the_observed_linear_rate():
    """Closed form: residuals 0.9^k reach 1e-8 from 0.9^100 in log(1e-8 / 0.9^100) / log 0.9 = 74.8 more
    iterations; the budget grants 1.5 × that (+5). No budget without measurable progress, for a
    non-finite residual, or beyond the cap."""
    residuals = [0.9**k for k in range(101)]
    n = np.log(1e-8 / 0.9**100) / np.log(0.9)
    assert fixed_point.iteration_budget(residuals, 1e-8, 100) == int(np.ceil(1.5 * n)) + 5
    assert fixed_point.iteration_budget([1.0] * 101, 1e-8, 100) == 0
    assert fixed_point.iteration_budget(residuals[:-1] + [float("nan")], 1e-8, 100) == 0
    assert fixed_point.iteration_budget(residuals, 1e-8, 100, cap=150) == 0
    assert fixed_point.iteration_budget(residuals, 1e-2, 100) == 0  # already below tol: nothing to add


def test_an_automatic_budget_lets_a_linearly_converging_fit_finish(x64, monkeypatch):
    """A fit from the prior needs 12 iterations here: with a base budget of 11 the automatic
    budget finishes it (at the tolerance), an explicit max_iters=11 stops it."""
    X, y = make_logistic(300, 4, seed=3)
    monkeypatch.setattr(solvers, "BASE_ITERATIONS", 11)
    post = pc.fit(logistic_model, X * 3, y, init="prior")
    assert post.residual <= 1e-8 and len(post.history) - 1 > 11
    with pytest.raises(ConvergenceError, match="max_iters=11 reached"):
        pc.fit(logistic_model, X * 3, y, init="prior", max_iters=11)


def test_non_strict_damping_damps_a_constant_two_cycle():
    # an iteration alternating between two iterates repeats its residuals a, b, a, b, ...: the strict rule never
    # sees a residual above the largest of the last three, the non-strict one (federated local solves) halves
    def steps(strict):
        damping = fixed_point.damping_init(1.0, jnp.float32)
        for residual in (0.2, 0.05, 0.2, 0.05, 0.2, 0.05, 0.2):
            damping, _ = fixed_point.damping_observe(damping, jnp.float32(residual), jnp.asarray(False), 1.0,
                                                     strict=strict)
        return float(damping.step)

    assert steps(strict=True) == 1.0
    assert steps(strict=False) < 0.5
