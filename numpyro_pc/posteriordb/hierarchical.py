r"""Hierarchical posteriordb models (no reference draws) translated to NumPyro, and UC Berkeley admissions.

The posterior database holds these models and their data but no reference posteriors, so
only the data file is read (:func:`~numpyro_pc.posteriordb.base.load_data`). Every
translation follows its Stan code as :mod:`numpyro_pc.posteriordb.reference` does: Stan's implicit
flat priors are :class:`~numpyro.distributions.ImproperUniform` on the parameter's support,
proper priors on constrained parameters use the constrained support (``sigma ~ normal(0, 1)``
with ``<lower=0>`` is a half-normal), latent sites keep the Stan parameter names, and the
observed site keeps the Stan data name. Each observation is one example of a
``numpyro.plate("data", N)``; group effects are sampled in a plate of their own (named after
the group) and picked per observation by a 0-based index argument, so the positional
arguments are all per-observation arrays and any subset of rows is a valid batch.

The posteriors (:data:`HIERARCHICAL`):

- ``radon_mn-radon_hierarchical_intercept_centered``: ``log_radon ~ N(alpha[county] + beta[1] log_uppm
  + beta[2] floor_measure, sigma_y)``, ``alpha ~ N(mu_alpha, sigma_alpha)`` (919 homes, 85 counties);
  ``..._noncentered``: the same with ``alpha = mu_alpha + sigma_alpha alpha_raw``, ``alpha_raw ~ N(0, 1)``.
- ``radon_mn-radon_variable_intercept_slope_centered``: ``log_radon ~ N(alpha[county] + beta[county]
  floor_measure, sigma_y)`` with centred ``alpha`` and ``beta``; ``..._noncentered``: both non-centred.
- ``rats_data-rats_model``: ``y ~ N(alpha[rat] + beta[rat] (x − xbar), sigma_y)``, flat priors on the
  three scales (150 weights of 30 rats).
- ``seeds_data-seeds_model``: ``n ~ binomial_logit(N, alpha0 + alpha1 x1 + alpha2 x2 + alpha12 x1 x2 + b)``,
  one random effect per plate ``b ~ N(0, 1/sqrt(tau))``, ``tau ~ gamma(0.001, 0.001)``;
  ``seeds_data-seeds_centered_model``: ``b = c − mean(c)``, ``c ~ N(0, sigma)``, ``sigma ~ half-Cauchy(0, 1)``.
- ``dogs-dogs_hierarchical``: ``y[j, t] ~ bernoulli(a^prev_shock[j, t] b^prev_avoid[j, t])`` with the
  counts of earlier shocks and avoidances as per-trial covariates (Stan's ``transformed data``); each of
  the 30 × 25 trials is an example.
- ``pilots-pilots``: ``y ~ N(a[group] + b[scenario], sigma_y)``, ``a ~ N(10 mu_a, sigma_a)``,
  ``b ~ N(10 mu_b, sigma_b)``, flat priors on the scales over ``(0, 100)``.
- ``eight_schools-eight_schools_centered``: ``y ~ N(theta[school], sigma)``, ``theta ~ N(mu, tau)``.
- ``ucbadmit-ucbadmit``: UC Berkeley admissions, a varying-intercept binomial logistic regression
  (:func:`ucbadmit`; data embedded, no data folder needed).

Example::

    from numpyro_pc import posteriordb
    import numpyro_pc as pc

    tr = posteriordb.translate("rats_data-rats_model")
    post = pc.fit(tr.model, *tr.args, **tr.kwargs)
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints

from numpyro_pc.errors import UnsupportedModelError

from .base import Translation, flat_prior, load_data, stack_draws, stan_names
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["HIERARCHICAL", "translate_hierarchical", "ucbadmit", "UCBADMIT"]

#: UC Berkeley graduate admissions, fall 1973 (Bickel, Hammel & O'Connell 1975, as tabulated in
#: McElreath's *Statistical Rethinking*, data ``UCBadmit``): one row per department (A–F) and
#: applicant gender; columns ``dept`` (0–5), ``male`` (1/0), ``admit``, ``applications``.
UCBADMIT = np.array([
    [0, 1, 512, 825], [0, 0, 89, 108], [1, 1, 353, 560], [1, 0, 17, 25],
    [2, 1, 120, 325], [2, 0, 202, 593], [3, 1, 138, 417], [3, 0, 131, 375],
    [4, 1, 53, 191], [4, 0, 94, 393], [5, 1, 22, 373], [5, 0, 24, 341],
])


def _translation(model, args, shapes) -> Translation:
    params = {site: stan_names(site, shape) for site, shape in shapes.items()}
    return Translation(model, tuple(jnp.asarray(a) for a in args), {}, params,
                       lambda draws: stack_draws(draws, params, shapes))


def _half_normal_scales(*names) -> list[Any]:
    return [numpyro.sample(n, dist.HalfNormal(1.0)) for n in names]


# ----------------------------------------------------------------- radon (Minnesota, 919 homes, 85 counties)


def _radon_intercept(data, centred) -> Translation:
    J = int(data["J"])

    def model(county, log_uppm, floor_measure, log_radon=None) -> None:
        sigma_alpha, sigma_y = _half_normal_scales("sigma_alpha", "sigma_y")
        mu_alpha = numpyro.sample("mu_alpha", dist.Normal(0.0, 10.0))
        beta = numpyro.sample("beta", dist.Normal(0.0, 10.0).expand([2]).to_event(1))
        with numpyro.plate("county", J):
            if centred:
                alpha = numpyro.sample("alpha", dist.Normal(mu_alpha, sigma_alpha))
            else:
                alpha = mu_alpha + sigma_alpha * numpyro.sample("alpha_raw", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", county.shape[0]):
            mu = alpha[county] + log_uppm * beta[0] + floor_measure * beta[1]
            numpyro.sample("log_radon", dist.Normal(mu, sigma_y), obs=log_radon)

    shapes = {"sigma_alpha": (), "sigma_y": (), "mu_alpha": (), "beta": (2,), "alpha" if centred else "alpha_raw": (J,)}
    args = (data["county_idx"] - 1, data["log_uppm"].astype(float), data["floor_measure"].astype(float),
            data["log_radon"].astype(float))
    return _translation(model, args, shapes)


def _radon_slope(data, centred) -> Translation:
    J = int(data["J"])

    def model(county, floor_measure, log_radon=None) -> None:
        sigma_y, sigma_beta, sigma_alpha = _half_normal_scales("sigma_y", "sigma_beta", "sigma_alpha")
        mu_alpha = numpyro.sample("mu_alpha", dist.Normal(0.0, 10.0))
        mu_beta = numpyro.sample("mu_beta", dist.Normal(0.0, 10.0))
        with numpyro.plate("county", J):
            if centred:
                alpha = numpyro.sample("alpha", dist.Normal(mu_alpha, sigma_alpha))
                beta = numpyro.sample("beta", dist.Normal(mu_beta, sigma_beta))
            else:
                alpha = mu_alpha + sigma_alpha * numpyro.sample("alpha_raw", dist.Normal(0.0, 1.0))
                beta = mu_beta + sigma_beta * numpyro.sample("beta_raw", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", county.shape[0]):
            mu = alpha[county] + floor_measure * beta[county]
            numpyro.sample("log_radon", dist.Normal(mu, sigma_y), obs=log_radon)

    effects = ("alpha", "beta") if centred else ("alpha_raw", "beta_raw")
    shapes = {"sigma_y": (), "sigma_beta": (), "sigma_alpha": (), "mu_alpha": (), "mu_beta": (),
              **{e: (J,) for e in effects}}
    args = (data["county_idx"] - 1, data["floor_measure"].astype(float), data["log_radon"].astype(float))
    return _translation(model, args, shapes)


# ----------------------------------------------------------------- rats, seeds, dogs, pilots, eight schools


def _rats(data) -> Translation:
    J, xbar = int(data["N"]), float(data["xbar"])

    def model(rat, x, y=None) -> None:
        mu_alpha = numpyro.sample("mu_alpha", dist.Normal(0.0, 100.0))
        mu_beta = numpyro.sample("mu_beta", dist.Normal(0.0, 100.0))
        sigma_y, sigma_alpha, sigma_beta = (numpyro.sample(n, flat_prior(constraints.positive))
                                            for n in ("sigma_y", "sigma_alpha", "sigma_beta"))
        with numpyro.plate("rat", J):
            alpha = numpyro.sample("alpha", dist.Normal(mu_alpha, sigma_alpha))
            beta = numpyro.sample("beta", dist.Normal(mu_beta, sigma_beta))
        with numpyro.plate("data", rat.shape[0]):
            numpyro.sample("y", dist.Normal(alpha[rat] + beta[rat] * (x - xbar), sigma_y), obs=y)

    shapes = {"mu_alpha": (), "mu_beta": (), "sigma_y": (), "sigma_alpha": (), "sigma_beta": (), "alpha": (J,),
              "beta": (J,)}
    return _translation(model, (data["rat"] - 1, data["x"].astype(float), data["y"].astype(float)), shapes)


def _seeds(data, centred) -> Translation:
    I = int(data["I"])  # noqa: E741 (Stan's name)

    def model(plate_id, x1, x2, N, n=None) -> None:
        alphas = [numpyro.sample(a, dist.Normal(0.0, 1.0 if centred else 1.0e3))
                  for a in ("alpha0", "alpha1", "alpha12", "alpha2")]
        alpha0, alpha1, alpha12, alpha2 = alphas
        if centred:
            sigma = numpyro.sample("sigma", dist.HalfCauchy(1.0))
        else:
            sigma = 1.0 / jnp.sqrt(numpyro.sample("tau", dist.Gamma(1.0e-3, 1.0e-3)))
        with numpyro.plate("plate", I):
            if centred:
                c = numpyro.sample("c", dist.Normal(0.0, sigma))
                b = c - c.mean()
            else:
                b = numpyro.sample("b", dist.Normal(0.0, sigma))
        with numpyro.plate("data", plate_id.shape[0]):
            eta = alpha0 + alpha1 * x1 + alpha2 * x2 + alpha12 * x1 * x2 + b[plate_id]
            numpyro.sample("n", dist.Binomial(N, logits=eta), obs=n)

    shapes = {"alpha0": (), "alpha1": (), "alpha12": (), "alpha2": (),
              **({"sigma": (), "c": (I,)} if centred else {"tau": (), "b": (I,)})}
    args = (np.arange(I), data["x1"].astype(float), data["x2"].astype(float), data["N"], data["n"])
    return _translation(model, args, shapes)


def _dogs(data) -> Translation:
    y = np.asarray(data["y"])
    zeros = np.zeros((y.shape[0], 1))
    prev_shock = np.concatenate([zeros, np.cumsum(y, 1)[:, :-1]], 1)
    prev_avoid = np.concatenate([zeros, np.cumsum(1 - y, 1)[:, :-1]], 1)

    def model(prev_shock, prev_avoid, y=None) -> None:
        a = numpyro.sample("a", flat_prior(constraints.unit_interval))
        b = numpyro.sample("b", flat_prior(constraints.unit_interval))
        with numpyro.plate("data", prev_shock.shape[0]):
            # p = a^prev_shock b^prev_avoid, formed in logs; at t = 1 both counts are 0 and p = 1
            p = jnp.exp(prev_shock * jnp.log(a) + prev_avoid * jnp.log(b))
            numpyro.sample("y", dist.Bernoulli(probs=p), obs=y)

    args = (prev_shock.ravel(), prev_avoid.ravel(), y.ravel())
    return _translation(model, args, {"a": (), "b": ()})


def _pilots(data) -> Translation:
    n_groups, n_scenarios = int(data["n_groups"]), int(data["n_scenarios"])

    def model(group_id, scenario_id, y=None) -> None:
        mu_a = numpyro.sample("mu_a", dist.Normal(0.0, 1.0))
        mu_b = numpyro.sample("mu_b", dist.Normal(0.0, 1.0))
        sigma_a, sigma_b, sigma_y = (numpyro.sample(n, flat_prior(constraints.interval(0.0, 100.0)))
                                     for n in ("sigma_a", "sigma_b", "sigma_y"))
        with numpyro.plate("group", n_groups):
            a = numpyro.sample("a", dist.Normal(10.0 * mu_a, sigma_a))
        with numpyro.plate("scenario", n_scenarios):
            b = numpyro.sample("b", dist.Normal(10.0 * mu_b, sigma_b))
        with numpyro.plate("data", group_id.shape[0]):
            numpyro.sample("y", dist.Normal(a[group_id] + b[scenario_id], sigma_y), obs=y)

    shapes = {"mu_a": (), "mu_b": (), "sigma_a": (), "sigma_b": (), "sigma_y": (), "a": (n_groups,),
              "b": (n_scenarios,)}
    args = (data["group_id"] - 1, data["scenario_id"] - 1, data["y"].astype(float))
    return _translation(model, args, shapes)


def _eight_schools_centered(data) -> Translation:
    J = int(data["J"])

    def model(school, sigma, y=None) -> None:
        tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
        mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
        with numpyro.plate("school", J):
            theta = numpyro.sample("theta", dist.Normal(mu, tau))
        with numpyro.plate("data", school.shape[0]):
            numpyro.sample("y", dist.Normal(theta[school], sigma), obs=y)

    args = (np.arange(J), data["sigma"].astype(float), data["y"].astype(float))
    return _translation(model, args, {"tau": (), "mu": (), "theta": (J,)})


# ----------------------------------------------------------------- UC Berkeley admissions (embedded data)


def ucbadmit(data=None) -> Translation:
    r"""UC Berkeley admissions: a varying-intercept binomial logistic regression by department.

    The multilevel admissions model of *Statistical Rethinking* (2nd ed., ch. 13 priors) with a
    gender coefficient, written as NumPyro's ``ucbadmit`` example writes its data (one row per
    department and gender)::

        admit_i ~ Binomial(applications_i, logit⁻¹(alpha_dept[dept_i] + beta_male · male_i))
        alpha_dept[j] ~ N(a_bar, sigma_dept)   (centred, j = A…F)
        a_bar ~ N(0, 1.5),  sigma_dept ~ Exponential(1),  beta_male ~ N(0, 1)

    :param data: ignored (the data are :data:`UCBADMIT`); present for the registry's signature.
    :rtype: ~numpyro_pc.posteriordb.base.Translation
    """
    num_dept = 6

    def model(dept, male, applications, admit=None) -> None:
        a_bar = numpyro.sample("a_bar", dist.Normal(0.0, 1.5))
        sigma_dept = numpyro.sample("sigma_dept", dist.Exponential(1.0))
        beta_male = numpyro.sample("beta_male", dist.Normal(0.0, 1.0))
        with numpyro.plate("dept", num_dept):
            alpha_dept = numpyro.sample("alpha_dept", dist.Normal(a_bar, sigma_dept))
        with numpyro.plate("data", dept.shape[0]):
            logits = alpha_dept[dept] + beta_male * male
            numpyro.sample("admit", dist.Binomial(applications, logits=logits), obs=admit)

    dept, male, admit, applications = UCBADMIT.T
    shapes = {"a_bar": (), "sigma_dept": (), "beta_male": (), "alpha_dept": (num_dept,)}
    return _translation(model, (dept, male.astype(float), applications, admit), shapes)


# ----------------------------------------------------------------- registry

#: posterior ``<data>-<model>`` -> (data file name or ``None`` for embedded data, translator of the data dict)
HIERARCHICAL = {
    "radon_mn-radon_hierarchical_intercept_centered": ("radon_mn", lambda d: _radon_intercept(d, True)),
    "radon_mn-radon_hierarchical_intercept_noncentered": ("radon_mn", lambda d: _radon_intercept(d, False)),
    "radon_mn-radon_variable_intercept_slope_centered": ("radon_mn", lambda d: _radon_slope(d, True)),
    "radon_mn-radon_variable_intercept_slope_noncentered": ("radon_mn", lambda d: _radon_slope(d, False)),
    "rats_data-rats_model": ("rats_data", _rats),
    "seeds_data-seeds_model": ("seeds_data", lambda d: _seeds(d, False)),
    "seeds_data-seeds_centered_model": ("seeds_data", lambda d: _seeds(d, True)),
    "dogs-dogs_hierarchical": ("dogs", _dogs),
    "pilots-pilots": ("pilots", _pilots),
    "eight_schools-eight_schools_centered": ("eight_schools", _eight_schools_centered),
    "ucbadmit-ucbadmit": (None, ucbadmit),
}


def translate_hierarchical(name, path=None, data=None) -> Translation:
    """The NumPyro translation of the hierarchical posterior ``name`` (a key of :data:`HIERARCHICAL`).

    :param str name: ``<data>-<model>``.
    :param path: data directory (see :mod:`numpyro_pc.datasets.loaders`).
    :param dict data: the Stan data (else read with :func:`~numpyro_pc.posteriordb.base.load_data`).
    :rtype: ~numpyro_pc.posteriordb.base.Translation
    :raises UnsupportedModelError: for a name not in :data:`HIERARCHICAL`.
    :raises DatasetError: when the data file is needed and missing.
    """
    if name not in HIERARCHICAL:
        raise UnsupportedModelError(f"no hierarchical NumPyro translation of posterior {name!r}")
    data_name, translator = HIERARCHICAL[name]
    if data is None and data_name is not None:
        data = load_data(data_name, path)
    return translator(data)
