r"""Hierarchical models as Bayesian modellers write them, with data to run them on.

The suite behind the hierarchical benchmark, tests and tutorial: varying-intercept and
varying-slope regressions with Gaussian, logistic and Poisson likelihoods, centred and
non-centred, with HalfNormal, HalfCauchy or Exponential group scales; and eight schools in
both parametrisations. Every model takes its data as positional arguments and declares its
observations in a plate named ``"data"``; group effects live in a plate of their own, so they
are global latents of the dual form (one coordinate per group) and each observation's site
depends on its own group's coordinates only.

Centred:  ``a_j ~ N(μ_a, τ_a)``, ``y_n ~ p(· | a_{g_n} + b_{g_n} x_n)``.
Non-centred: ``a_j = μ_a + τ_a ã_j``, ``ã_j ~ N(0, 1)``.

The joint density of a centred hierarchy has no maximum: it grows without bound as a group
scale ``τ → 0`` with the group effects collapsed onto their mean. A MAP search drifts there;
:func:`numpyro_pc.fit` detects the failed search and starts from the mean-field ELBO instead
(:func:`numpyro_pc.solvers.start.mean_field_elbo`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist

from numpyro_pc.errors import InvalidOptionError

from .hierarchical import UCBADMIT

__all__ = ["HierarchicalProblem", "varying_regression", "eight_schools", "correlated_admissions", "suite",
           "baseball", "eight_schools_as_written", "local_latent_examples",
           "EIGHT_SCHOOLS_Y", "EIGHT_SCHOOLS_SIGMA"]

EIGHT_SCHOOLS_Y = np.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
EIGHT_SCHOOLS_SIGMA = np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])
BASEBALL_AT_BATS = np.full(18, 45.0)  # Efron & Morris (1975): 18 players' first 45 at-bats of 1970
BASEBALL_HITS = np.array([18, 17, 16, 15, 14, 14, 13, 12, 11, 11, 10, 10, 10, 10, 10, 9, 8, 7], dtype=float)

_SCALES = {
    "halfnormal": lambda: dist.HalfNormal(1.0),
    "halfcauchy": lambda: dist.HalfCauchy(1.0),
    "exponential": lambda: dist.Exponential(1.0),
}
_LIKELIHOODS = ("normal", "bernoulli", "poisson")


class HierarchicalProblem(NamedTuple):
    """A model with its data: ``name`` (likelihood, parametrisation, scale prior, groups), ``model``
    (call it as ``model(*args)``), ``args`` (the positional data arguments, the observed response
    last) and ``num_groups``."""

    name: str
    model: Callable
    args: tuple
    num_groups: int


def _check(value, allowed, what) -> None:
    if value not in allowed:
        raise InvalidOptionError(f"{what} must be one of {sorted(allowed)}; got {value!r}")


def varying_regression(num_groups: int = 20, num_obs: int = 400, likelihood: str = "normal", centred: bool = True,
                       scale: str = "halfnormal", slopes: bool = False, seed: int = 0) -> HierarchicalProblem:
    """A varying-intercept (and optionally varying-slope) regression with simulated data.

    Group sizes are unequal (a Dirichlet draw), so some groups are small and pooled hard.

    :param int num_groups: groups ``J``.
    :param int num_obs: observations ``N``.
    :param str likelihood: ``"normal"`` (with a learned noise scale), ``"bernoulli"`` (logit link)
        or ``"poisson"`` (log link).
    :param bool centred: ``a_j ~ N(μ, τ)`` (centred) or ``a_j = μ + τ ã_j`` (non-centred).
    :param str scale: the prior of the group scales: ``"halfnormal"``, ``"halfcauchy"`` or ``"exponential"``.
    :param bool slopes: add a varying slope on one covariate.
    :param int seed: seed of the simulated data.
    :return: :class:`HierarchicalProblem` with ``args = (group, x, y)``.
    """
    _check(likelihood, _LIKELIHOODS, "likelihood")
    _check(scale, _SCALES, "scale")
    rng = np.random.default_rng(seed)
    shares = rng.dirichlet(np.full(num_groups, 2.0))
    group = rng.choice(num_groups, size=num_obs, p=shares)
    group[:num_groups] = np.arange(num_groups)  # every group observed at least once
    x = rng.normal(size=num_obs)
    intercepts = 0.3 + 0.6 * rng.normal(size=num_groups)
    slope_values = (-0.4 + 0.3 * rng.normal(size=num_groups)) if slopes else np.full(num_groups, -0.4)
    eta = intercepts[group] + slope_values[group] * x
    if likelihood == "normal":
        y = eta + 0.8 * rng.normal(size=num_obs)
    elif likelihood == "bernoulli":
        y = (rng.uniform(size=num_obs) < 1.0 / (1.0 + np.exp(-eta))).astype(np.float64)
    else:
        y = rng.poisson(np.exp(eta)).astype(np.float64)
    scale_prior = _SCALES[scale]

    def effects(name: str, mean_prior_sd: float) -> jnp.ndarray:
        mu = numpyro.sample(f"mu_{name}", dist.Normal(0.0, mean_prior_sd))
        tau = numpyro.sample(f"tau_{name}", scale_prior())
        with numpyro.plate(f"groups_{name}", num_groups):
            if centred:
                return numpyro.sample(name, dist.Normal(mu, tau))
            raw = numpyro.sample(f"{name}_raw", dist.Normal(0.0, 1.0))
            return mu + tau * raw

    def model(group, x, y=None) -> None:
        a = effects("a", 2.0)
        if slopes:
            b = effects("b", 2.0)[group]
        else:
            b = numpyro.sample("b", dist.Normal(0.0, 2.0))
        eta = a[group] + b * x
        if likelihood == "normal":
            sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
        with numpyro.plate("data", group.shape[0]):
            if likelihood == "normal":
                numpyro.sample("y", dist.Normal(eta, sigma), obs=y)
            elif likelihood == "bernoulli":
                numpyro.sample("y", dist.Bernoulli(logits=eta), obs=y)
            else:
                numpyro.sample("y", dist.Poisson(rate=jnp.exp(eta)), obs=y)

    name = (f"{likelihood} {'slopes' if slopes else 'intercepts'} {'centred' if centred else 'non-centred'} "
            f"{scale} J={num_groups}")
    return HierarchicalProblem(name, model, (group, x, y), num_groups)


def eight_schools(centred: bool = True) -> HierarchicalProblem:
    """Rubin's eight schools: ``y_j ~ N(θ_j, σ_j)``, ``θ_j ~ N(μ, τ)``, ``μ ~ N(0, 5)``, ``τ ~ HalfCauchy(5)``.

    The school effects are global latents in a plate of their own (``"schools"``); each
    school's observation is one example of the ``"data"`` plate and picks its effect by the
    index argument ``school``.
    """
    def model(school, sigma, y=None) -> None:
        mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
        tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
        with numpyro.plate("schools", 8):
            if centred:
                theta = numpyro.sample("theta", dist.Normal(mu, tau))
            else:
                theta = mu + tau * numpyro.sample("theta_raw", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", sigma.shape[0]):
            numpyro.sample("y", dist.Normal(theta[school], sigma), obs=y)

    name = f"eight schools {'centred' if centred else 'non-centred'}"
    return HierarchicalProblem(name, model, (np.arange(8), EIGHT_SCHOOLS_SIGMA.copy(), EIGHT_SCHOOLS_Y.copy()), 8)


def correlated_admissions() -> HierarchicalProblem:
    r"""UC Berkeley admissions with a correlated intercept and gender slope per department.

    The model of NumPyro's ``ucbadmit`` example, non-centred with an LKJ-Cholesky correlation
    (d = 17)::

        admit_i ~ Binomial(applications_i, logit⁻¹(μ_0 + v_{d_i,0} + (μ_1 + v_{d_i,1}) · male_i))
        v_j = diag(σ) L ε_j,  ε_j ~ N(0, I_2),  L ~ LKJCholesky(2, 2),  σ_k ~ HalfNormal(1),
        μ ~ N(0, (4, 1))

    SVI with ``AutoNormal`` (Adam 0.01, 5,000 steps) collapses ``σ_0`` to 0.002 here, a local
    optimum that :func:`numpyro_pc.dual_form` warns about (:mod:`numpyro_pc.solvers.boundary`).
    """
    def model(dept, male, applications, admit=None) -> None:
        mu = numpyro.sample("v_mu", dist.Normal(0.0, jnp.array([4.0, 1.0])))
        sigma = numpyro.sample("sigma", dist.HalfNormal(jnp.ones(2)))
        chol = numpyro.sample("L_Rho", dist.LKJCholesky(2, concentration=2.0))
        raw = numpyro.sample("z", dist.Normal(jnp.zeros((6, 2)), 1.0))
        effects = raw @ (sigma[:, None] * chol).T
        logits = mu[0] + effects[dept, 0] + (mu[1] + effects[dept, 1]) * male
        with numpyro.plate("data", dept.shape[0]):
            numpyro.sample("admit", dist.Binomial(applications, logits=logits), obs=admit)

    dept, male, admit, applications = UCBADMIT.T
    return HierarchicalProblem("UC admissions, correlated intercept and slope", model,
                               (dept.astype(int), male.astype(float), applications.astype(float),
                                admit.astype(float)), 6)


def suite(fast: bool = False) -> list[HierarchicalProblem]:
    """The hierarchical suite: every likelihood, both parametrisations, every scale prior, 10–200 groups.

    :param bool fast: a smaller version (fewer groups and observations) for tests and fast notebooks.
    """
    n, j = (200, 10) if fast else (600, 40)
    problems = [eight_schools(True), eight_schools(False)]
    for centred in (True, False):
        problems += [
            varying_regression(j, n, "normal", centred, "halfnormal", slopes=True, seed=1),
            varying_regression(j, n, "bernoulli", centred, "halfcauchy", seed=2),
            varying_regression(j, n, "poisson", centred, "exponential", seed=3),
        ]
    if not fast:
        problems.append(varying_regression(200, 2000, "normal", True, "halfnormal", seed=4))
    return problems


def baseball() -> HierarchicalProblem:
    """NumPyro's baseball example (``partially_pooled``) as written, on Efron & Morris's 18 players:
    ``φ_i ~ Beta(m κ, (1 − m) κ)`` inside the players plate (a local latent per player),
    ``hits_i ~ Binomial(45, φ_i)``, ``m ~ Uniform(0, 1)``, ``κ ~ Pareto(1, 1.5)``."""
    def partially_pooled(at_bats, hits=None) -> None:
        m = numpyro.sample("m", dist.Uniform(0, 1))
        kappa = numpyro.sample("kappa", dist.Pareto(1, 1.5))
        with numpyro.plate("num_players", at_bats.shape[0]):
            phi = numpyro.sample("phi", dist.Beta(m * kappa, (1 - m) * kappa))
            numpyro.sample("obs", dist.Binomial(at_bats, probs=phi), obs=hits)

    return HierarchicalProblem("baseball as written (local abilities)", partially_pooled,
                               (BASEBALL_AT_BATS.copy(), BASEBALL_HITS.copy()), 18)


def eight_schools_as_written() -> HierarchicalProblem:
    """Eight schools, centred, as NumPyro's documentation writes it: ``θ_j`` inside the schools plate,
    which is also the data plate (a local latent per school; the plate's size from the data)."""
    def eight_schools(sigma, y=None) -> None:
        mu = numpyro.sample("mu", dist.Normal(0, 5))
        tau = numpyro.sample("tau", dist.HalfCauchy(5))
        with numpyro.plate("J", len(sigma)):
            theta = numpyro.sample("theta", dist.Normal(mu, tau))
            numpyro.sample("obs", dist.Normal(theta, sigma), obs=y)

    return HierarchicalProblem("eight schools as written (local effects)", eight_schools,
                               (EIGHT_SCHOOLS_SIGMA.copy(), EIGHT_SCHOOLS_Y.copy()), 8)


def local_latent_examples() -> list[HierarchicalProblem]:
    """NumPyro's examples whose units' latents lie inside the data plate (docs/hierarchical.md,
    "Local latent variables"): :func:`baseball` and :func:`eight_schools_as_written`."""
    return [baseball(), eight_schools_as_written()]
