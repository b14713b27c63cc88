"""Hierarchical models from the default start (issue "Hierarchical models").

A centred hierarchy has no MAP: its joint density grows without bound as a group scale goes
to 0 with the group effects on their mean. The old default start (MAP/Laplace) followed that
ridge and the solver stagnated at residual ~1 (objective falling 15.6 nats per step down
the funnel). The fit now compares the MAP start with a mean-field ELBO start on fixed draws
and starts from the better one.

Oracles: the exact update of half the data by the other half equals the batch fit (KL ≤ 1e-8:
both are the same fixed point, reached from different starts); the mean-field ELBO start of a
Gaussian model has the exact posterior mean (antithetic draws integrate a quadratic's gradient
exactly); the log joint along the collapse ridge rises without bound (the MAP does not exist).
"""

import jax.numpy as jnp
import numpy as np
import pytest

import numpyro_pc as pc
from models import linear_model
from numpyro_pc.errors import InvalidOptionError
from numpyro_pc.families.registry import get_family
from numpyro_pc.posteriordb.suite import eight_schools, suite, varying_regression
from numpyro_pc.model.likelihood import bind_model
from numpyro_pc.solvers.start import map_laplace, mean_field_elbo, negative_log_joint


def _halves(problem):
    n = problem.args[0].shape[0]
    return [a[: n // 2] for a in problem.args], [a[n // 2:] for a in problem.args]


def test_the_joint_density_of_a_centred_hierarchy_has_no_maximum(x64):
    """The premise of the ELBO start: along the ridge a_j = μ_a, τ_a → 0 the negative log joint
    falls without bound (J − 1 nats per unit of log τ), so any MAP search drifts to the boundary."""
    problem = varying_regression(10, 200, "normal", centred=True, slopes=False, seed=1)
    spec, data = bind_model(problem.model, problem.args, {})
    labels = spec.latent.labels()
    z = jnp.zeros(spec.latent.dim)
    tau = labels.index("tau_a")
    values = [float(negative_log_joint(spec, z.at[tau].set(log_tau), data, jnp.ones(spec.num_examples)))
              for log_tau in (-5.0, -10.0, -20.0)]
    # a_j = μ_a = 0 exactly: the J normal normalisers give J·log τ, the Jacobian −log τ, so the loss
    # falls by J − 1 = 9 per unit of log τ (the HalfNormal's τ²/2 moves it by < 3e-5: rel 1e-5)
    assert values[0] - values[1] == pytest.approx(9 * 5.0, rel=1e-5)
    assert values[1] - values[2] == pytest.approx(9 * 10.0, rel=1e-5)
    found = map_laplace(spec, data, get_family("full"), z)
    assert not found.converged


def test_the_mean_field_elbo_start_of_a_gaussian_model_has_the_exact_posterior_mean(x64):
    """For a quadratic negative log joint the antithetic fixed-draw objective's mean gradient is
    exactly ∇f(m): its optimum is the posterior mean (to L-BFGS's tolerance), for any draws."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(40, 3))
    y = X @ np.array([1.0, -0.5, 0.25]) + 0.5 * rng.normal(size=40)
    spec, data = bind_model(linear_model, (X, y), {})
    found = mean_field_elbo(spec, data, get_family("full"), jnp.zeros(3))
    precision = np.eye(3) / 2.0**2 + X.T @ X / 0.5**2
    exact_mean = np.linalg.solve(precision, X.T @ y / 0.5**2)
    assert found.converged
    np.testing.assert_allclose(found.start.mean, exact_mean, atol=1e-7)
    # its variances are the mean-field ones: 1 / diag(precision), up to the fixed draws' error
    np.testing.assert_allclose(np.diag(found.start.precision), np.diag(precision), rtol=0.5)


@pytest.mark.parametrize("likelihood,scale", [("normal", "halfnormal"), ("bernoulli", "halfcauchy")])
def test_a_centred_hierarchy_fits_from_the_default_start_and_updates_exactly(x64, likelihood, scale):
    problem = varying_regression(8, 160, likelihood, centred=True, scale=scale, slopes=likelihood == "normal",
                                 seed=1 if likelihood == "normal" else 2)
    post = pc.fit(problem.model, *problem.args)
    start = post.record["start"]
    assert post.residual < 1e-8
    assert start["kind"] == "elbo" and start["candidates"]["elbo"] < start["candidates"]["map"], start
    first, second = _halves(problem)
    updated = pc.fit(problem.model, *first).update(*second, correction="exact")
    assert updated.residual < 1e-8
    assert float(updated.kl(post)) < 1e-8 and float(post.kl(updated)) < 1e-8


def test_eight_schools_centred_and_non_centred_agree_with_their_updates(x64):
    for centred in (True, False):
        problem = eight_schools(centred)
        post = pc.fit(problem.model, *problem.args)
        assert post.residual < 1e-8
        first, second = _halves(problem)
        updated = pc.fit(problem.model, *first).update(*second, correction="exact")
        assert float(updated.kl(post)) < 1e-8, problem.name


def test_the_suite_refuses_unknown_options():
    with pytest.raises(InvalidOptionError, match="likelihood"):
        varying_regression(likelihood="gamma")
    with pytest.raises(InvalidOptionError, match="scale"):
        varying_regression(scale="lognormal")
    assert len(suite(fast=True)) == 8
