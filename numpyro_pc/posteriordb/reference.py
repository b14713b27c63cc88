"""Real models from the posterior database (stan-dev/posteriordb) translated to NumPyro.

The data live outside the package, in ``posteriordb/`` under the data directory found as
in :mod:`numpyro_pc.datasets.loaders` (the ``path`` argument, then ``NUMPYRO_PC_DATA``, then
``../shared/data``). A posterior is named ``<data>-<model>``; :func:`load_posterior`
reads its data, reference summary and reference draws, and :func:`translate` returns the
NumPyro model with its arguments and the mapping from its latent sites to the Stan
reference parameter names.

Translations follow the Stan code exactly: where Stan gives no prior the NumPyro model
uses :class:`~numpyro.distributions.ImproperUniform` with the same support (``<lower=0>``
is a positive support), and proper priors on constrained parameters use the constrained
support of Stan (e.g. ``sigma ~ cauchy(0, 2.5)`` with ``<lower=0>`` is a half-Cauchy).
Only models with one likelihood term per example of a data plate are in :data:`SUPPORTED`.
:data:`UNSUPPORTED` lists the others with the typed error that :func:`numpyro_pc.fit`
raises on a faithful translation (built by :func:`translate` too), or, for ODE models
whose faithful translation cannot even be written without an ODE solver, the
:class:`~numpyro_pc.errors.UnsupportedModelError` that :func:`translate` raises itself.
The hierarchical posteriors of the database without reference draws (radon, rats, seeds,
dogs, pilots, centred eight schools) and UC Berkeley admissions are translated in
:mod:`numpyro_pc.posteriordb.hierarchical` (:data:`HIERARCHICAL`); :func:`translate` finds them too.

Example::

    from numpyro_pc import posteriordb
    import numpyro_pc as pc

    tr = posteriordb.translate("kidiq-kidscore_momhs")
    post = pc.fit(tr.model, *tr.args, **tr.kwargs)
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints

from numpyro_pc.deprecation import warn_renamed
from numpyro_pc.datasets.loaders import DatasetError
from numpyro_pc.errors import ModelBindingError, UnsupportedModelError

from .base import (
    ReferencePosterior,
    Translation,
    flat_prior,
    load_data,
    posteriordb_dir,
    require_posteriordb_dir,
    stack_draws,
    stan_names,
)
from .hierarchical import HIERARCHICAL, translate_hierarchical
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import NoReturn
    from typing import Any

__all__ = ["ReferencePosterior", "Translation", "posteriordb_dir", "load_posterior", "translate", "reference_unconstrained",
           "compare", "SUPPORTED", "UNSUPPORTED", "NOT_TRANSLATED",
           "HIERARCHICAL", "MAX_SKEW", "MAX_EXCESS_KURTOSIS"]

#: a reference marginal counts as close to Gaussian (in the unconstrained space) when the
#: sample skewness and excess kurtosis of its 1,000 unconstrained draws are below these
MAX_SKEW = 0.5
MAX_EXCESS_KURTOSIS = 1.0

NES_YEARS = (1972, 1976, 1980, 1984, 1988, 1992, 1996, 2000)


def __getattr__(name: str) -> type:
    if name == "Posterior":  # renamed: pc.Posterior is the fitted posterior of every family
        warn_renamed("numpyro_pc.posteriordb.Posterior is now ReferencePosterior (numpyro_pc.Posterior is the "
                     "fitted dual-form posterior); the old name will be removed in the next release")
        return ReferencePosterior
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_posterior(name, path=None) -> ReferencePosterior:
    """Read ``posteriordb/{data,reference}`` files of the posterior ``<data>-<model>``.

    :param str name: e.g. ``"earnings-logearn_height"``.
    :param path: data directory (default: see :mod:`numpyro_pc.datasets.loaders`).
    :rtype: ReferencePosterior
    :raises DatasetError: when the folder or a file is missing.
    """
    folder = require_posteriordb_dir(path)
    ref_file = folder / "reference" / f"{name}.json"
    if not ref_file.exists():
        raise DatasetError(f"no reference posterior {ref_file}")
    ref = json.loads(ref_file.read_text())
    data = load_data(ref["data"], path)
    with np.load(folder / "reference" / f"{name}.npz") as z:
        draws = {k: np.asarray(z[k]) for k in z.files}
    return ReferencePosterior(name, data, ref["summary"], draws)


# ----------------------------------------------------------------- regressions (y ~ normal(X beta, sigma))


def _regression(sigma_prior=None) -> Callable[..., None]:
    def model(X, y=None) -> None:
        beta = numpyro.sample("beta", flat_prior(constraints.real_vector, (X.shape[1],)))
        sigma = numpyro.sample("sigma", flat_prior(constraints.positive) if sigma_prior is None else sigma_prior)
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ beta, sigma), obs=y)
    return model


def _design(d, model) -> tuple[Any, np.ndarray]:
    """(response, columns) of each regression, as in the Stan ``transformed data`` blocks."""
    one = lambda v: np.ones_like(v, dtype=float)  # noqa: E731
    f = lambda k: np.asarray(d[k], dtype=float)  # noqa: E731
    if model in ("earn_height", "log10earn_height", "logearn_height", "logearn_height_male", "logearn_interaction",
                 "logearn_interaction_z", "logearn_logheight_male"):
        earn, h, male = f("earn"), f("height"), f("male")
        y = {"earn_height": earn, "log10earn_height": np.log10(earn)}.get(model, np.log(earn))
        z = (h - h.mean()) / h.std(ddof=1)
        cols = {"earn_height": [h], "log10earn_height": [h], "logearn_height": [h],
                "logearn_height_male": [h, male], "logearn_interaction": [h, male, h * male],
                "logearn_interaction_z": [z, male, z * male], "logearn_logheight_male": [np.log(h), male]}[model]
    elif model.startswith("kidscore"):
        y, hs, iq = f("kid_score"), f("mom_hs"), f("mom_iq")
        if model == "kidscore_mom_work":
            w = np.asarray(d["mom_work"])
            cols = [(w == 2) * 1.0, (w == 3) * 1.0, (w == 4) * 1.0]
        elif model in ("kidscore_interaction_c", "kidscore_interaction_c2", "kidscore_interaction_z"):
            c_hs, c_iq = {"kidscore_interaction_c": (hs - hs.mean(), iq - iq.mean()),
                          "kidscore_interaction_c2": (hs - 0.5, iq - 100.0),
                          "kidscore_interaction_z": ((hs - hs.mean()) / (2 * hs.std(ddof=1)),
                                                     (iq - iq.mean()) / (2 * iq.std(ddof=1)))}[model]
            cols = [c_hs, c_iq, c_hs * c_iq]
        else:
            cols = {"kidscore_momhs": [hs], "kidscore_momhsiq": [hs, iq],
                    "kidscore_interaction": [hs, iq, hs * iq]}[model]
    elif model == "mesquite":
        y = f("weight")
        cols = [f(k) for k in ("diam1", "diam2", "canopy_height", "total_height", "density", "group")]
    elif model.startswith("logmesquite"):
        d1, d2, ch = f("diam1"), f("diam2"), f("canopy_height")
        y = np.log(f("weight"))
        vol, area, shape = np.log(d1 * d2 * ch), np.log(d1 * d2), np.log(d1 / d2)
        cols = {"logmesquite_logvolume": [vol], "logmesquite_logva": [vol, area, f("group")],
                "logmesquite_logvash": [vol, area, shape, np.log(f("total_height")), f("group")],
                "logmesquite_logvas": [vol, area, shape, np.log(f("total_height")), np.log(f("density")),
                                       f("group")]}[model]
    elif model == "nes":
        y, age = f("partyid7"), np.asarray(d["age_discrete"])
        cols = [f("real_ideo"), f("race_adj"), (age == 2) * 1.0, (age == 3) * 1.0, (age == 4) * 1.0, f("educ1"),
                f("gender"), f("income")]
    else:  # pragma: no cover
        raise KeyError(model)
    return y, np.column_stack([one(y)] + cols)


_CAUCHY_SIGMA = ("kidscore_momhs", "kidscore_momhsiq", "kidscore_interaction")


# one model function per prior, shared by all regressions, so that fits of equal shapes reuse compilations
_REGRESSION_FLAT = _regression()
_REGRESSION_CAUCHY = _regression(dist.HalfCauchy(2.5))


def _translate_regression(post, model_name) -> Translation:
    y, X = _design(post.data, model_name)
    params = {"beta": stan_names("beta", (X.shape[1],)), "sigma": ["sigma"]}
    shapes = {"beta": (X.shape[1],), "sigma": ()}
    model = _REGRESSION_CAUCHY if model_name in _CAUCHY_SIGMA else _REGRESSION_FLAT
    return Translation(model, (jnp.asarray(X), jnp.asarray(y)), {}, params,
                       lambda draws: stack_draws(draws, params, shapes))


def _translate_diamonds(post) -> Translation:
    X = np.asarray(post.data["X"], dtype=float)
    Xc = X[:, 1:] - X[:, 1:].mean(0)
    kc = Xc.shape[1]

    def model(Xc, y=None) -> None:
        b = numpyro.sample("b", dist.Normal(0.0, 1.0).expand([kc]).to_event(1))
        intercept = numpyro.sample("Intercept", dist.StudentT(3.0, 8.0, 10.0))
        sigma = numpyro.sample("sigma", flat_prior(constraints.positive))  # half student_t(3, 0, 10) up to a constant
        numpyro.factor("sigma_prior", dist.StudentT(3.0, 0.0, 10.0).log_prob(sigma))
        with numpyro.plate("data", Xc.shape[0]):
            numpyro.sample("y", dist.Normal(intercept + Xc @ b, sigma), obs=y)

    params = {"b": stan_names("b", (kc,)), "Intercept": ["Intercept"], "sigma": ["sigma"]}
    shapes = {"b": (kc,), "Intercept": (), "sigma": ()}
    return Translation(model, (jnp.asarray(Xc), jnp.asarray(post.data["Y"], dtype=float)), {}, params,
                       lambda draws: stack_draws(draws, params, shapes))


def _translate_eight_schools(post) -> Translation:
    J = int(post.data["J"])

    def model(school, scale, y=None) -> None:
        theta_trans = numpyro.sample("theta_trans", dist.Normal(0.0, 1.0).expand([J]).to_event(1))
        mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
        tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
        theta = theta_trans * tau + mu
        with numpyro.plate("data", school.shape[0]):
            numpyro.sample("y", dist.Normal(theta[school], scale), obs=y)

    params = {"theta_trans": stan_names("theta", (J,)), "mu": ["mu"], "tau": ["tau"]}

    def reference(draws) -> dict[str, Any]:
        theta = np.stack([draws[n] for n in params["theta_trans"]], -1)
        return {"theta_trans": (theta - draws["mu"][:, None]) / draws["tau"][:, None], "mu": draws["mu"],
                "tau": draws["tau"]}

    args = (jnp.arange(J), jnp.asarray(post.data["sigma"], dtype=float), jnp.asarray(post.data["y"], dtype=float))
    return Translation(model, args, {}, params, reference)


def _translate_ark(post) -> Translation:
    K, y = int(post.data["K"]), np.asarray(post.data["y"], dtype=float)
    T = y.shape[0]
    lags = np.stack([y[K - k:T - k] for k in range(1, K + 1)], -1)  # lags[:, k-1] = y[t-k]

    def model(lags, y=None) -> None:
        alpha = numpyro.sample("alpha", dist.Normal(0.0, 10.0))
        beta = numpyro.sample("beta", dist.Normal(0.0, 10.0).expand([K]).to_event(1))
        sigma = numpyro.sample("sigma", dist.HalfCauchy(2.5))
        with numpyro.plate("data", lags.shape[0]):
            numpyro.sample("y", dist.Normal(alpha + lags @ beta, sigma), obs=y)

    params = {"alpha": ["alpha"], "beta": stan_names("beta", (K,)), "sigma": ["sigma"]}
    shapes = {"alpha": (), "beta": (K,), "sigma": ()}
    return Translation(model, (jnp.asarray(lags), jnp.asarray(y[K:])), {}, params,
                       lambda draws: stack_draws(draws, params, shapes))


def _gp_chol(x, alpha, rho) -> jax.Array:
    d2 = (x[:, None] - x[None, :]) ** 2
    cov = alpha ** 2 * jnp.exp(-0.5 * d2 / rho ** 2) + 1e-10 * jnp.eye(x.shape[0])
    return jnp.linalg.cholesky(cov)


def _translate_gp_pois(post) -> Translation:
    x = jnp.asarray(post.data["x"], dtype=float)
    N = x.shape[0]

    def model(index, k=None) -> None:
        rho = numpyro.sample("rho", dist.Gamma(25.0, 4.0))
        alpha = numpyro.sample("alpha", dist.HalfNormal(2.0))
        f_tilde = numpyro.sample("f_tilde", dist.Normal(0.0, 1.0).expand([N]).to_event(1))
        f = _gp_chol(x, alpha, rho) @ f_tilde
        with numpyro.plate("data", index.shape[0]):
            numpyro.sample("k", dist.Poisson(jnp.exp(f[index])), obs=k)

    params = {"rho": ["rho"], "alpha": ["alpha"], "f_tilde": stan_names("f", (N,))}

    def reference(draws) -> dict[str, Any]:
        f = np.stack([draws[n] for n in params["f_tilde"]], -1)
        L = np.asarray(jax.vmap(lambda a, r: _gp_chol(x, a, r))(draws["alpha"], draws["rho"]))
        return {"rho": draws["rho"], "alpha": draws["alpha"],
                "f_tilde": np.linalg.solve(L, f[..., None])[..., 0]}

    return Translation(model, (jnp.arange(N), jnp.asarray(post.data["k"])), {}, params, reference)


def _translate_gp_regr(post) -> Translation:
    x, y = jnp.asarray(post.data["x"], dtype=float), jnp.asarray(post.data["y"], dtype=float)

    def model(x, y=None) -> None:  # y ~ multi_normal: one likelihood term for the whole data set
        rho = numpyro.sample("rho", dist.Gamma(25.0, 4.0))
        alpha = numpyro.sample("alpha", dist.HalfNormal(2.0))
        sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
        cov = (alpha ** 2 * jnp.exp(-0.5 * (x[:, None] - x[None, :]) ** 2 / rho ** 2)
               + sigma * jnp.eye(x.shape[0]))
        numpyro.sample("y", dist.MultivariateNormal(jnp.zeros(x.shape[0]), cov), obs=y)

    params = {"rho": ["rho"], "alpha": ["alpha"], "sigma": ["sigma"]}
    return Translation(model, (x, y), {}, params, lambda d: stack_draws(d, params, {k: () for k in params}))


def _translate_gauss_mix(post) -> Translation:
    def model(y) -> None:
        mu = numpyro.sample("mu", flat_prior(constraints.ordered_vector, (2,)))
        numpyro.factor("mu_prior", dist.Normal(0.0, 2.0).log_prob(mu).sum())
        sigma = numpyro.sample("sigma", dist.HalfNormal(2.0).expand([2]).to_event(1))
        theta = numpyro.sample("theta", dist.Beta(5.0, 5.0))
        mix = dist.MixtureSameFamily(dist.Categorical(probs=jnp.stack([theta, 1.0 - theta])), dist.Normal(mu, sigma))
        with numpyro.plate("data", y.shape[0]):
            numpyro.sample("y", mix, obs=y)

    params = {"mu": ["mu[1]", "mu[2]"], "sigma": ["sigma[1]", "sigma[2]"], "theta": ["theta"]}
    shapes = {"mu": (2,), "sigma": (2,), "theta": ()}
    return Translation(model, (jnp.asarray(post.data["y"], dtype=float),), {}, params,
                       lambda d: stack_draws(d, params, shapes))


# ----------------------------------------------------------------- time series and HMMs (not per-example)


def _translate_garch(post) -> Translation:
    y, sigma1 = jnp.asarray(post.data["y"], dtype=float), float(post.data["sigma1"])

    def model(y) -> None:  # sigma[t] depends on every earlier y: the terms are not per-example
        mu = numpyro.sample("mu", flat_prior(constraints.real))
        alpha0 = numpyro.sample("alpha0", flat_prior(constraints.positive))
        alpha1 = numpyro.sample("alpha1", flat_prior(constraints.unit_interval))
        beta1 = numpyro.sample("beta1", flat_prior(constraints.interval(0.0, 1.0 - alpha1)))

        def step(s, y_prev) -> tuple[Any, Any]:
            s = jnp.sqrt(alpha0 + alpha1 * (y_prev - mu) ** 2 + beta1 * s ** 2)
            return s, s
        _, rest = jax.lax.scan(step, jnp.asarray(sigma1), y[:-1])
        with numpyro.plate("data", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu, jnp.concatenate([jnp.array([sigma1]), rest])), obs=y)

    params = {k: [k] for k in ("mu", "alpha0", "alpha1", "beta1")}
    return Translation(model, (y,), {}, params, lambda d: stack_draws(d, params, {k: () for k in params}))


def _translate_arma(post) -> Translation:
    y = jnp.asarray(post.data["y"], dtype=float)

    def model(y) -> None:  # err[t] depends on err[t-1]: recursion over the whole series
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        phi = numpyro.sample("phi", dist.Normal(0.0, 2.0))
        theta = numpyro.sample("theta", dist.Normal(0.0, 2.0))
        sigma = numpyro.sample("sigma", dist.HalfCauchy(2.5))
        err1 = y[0] - (mu + phi * mu)

        def step(err, ys) -> tuple[Any, Any]:
            e = ys[1] - (mu + phi * ys[0] + theta * err)
            return e, e
        _, rest = jax.lax.scan(step, err1, jnp.stack([y[:-1], y[1:]], -1))
        err = jnp.concatenate([err1[None], rest])
        with numpyro.plate("data", y.shape[0]):
            numpyro.sample("err", dist.Normal(0.0, sigma), obs=err)

    params = {k: [k] for k in ("mu", "phi", "theta", "sigma")}
    return Translation(model, (y,), {}, params, lambda d: stack_draws(d, params, {k: () for k in params}))


def _translate_hmm_example(post) -> Translation:
    y, K = jnp.asarray(post.data["y"], dtype=float), int(post.data["K"])

    def model(y) -> None:  # forward algorithm: one log_sum_exp over the whole sequence
        theta1 = numpyro.sample("theta1", flat_prior(constraints.simplex, (K,)))
        theta2 = numpyro.sample("theta2", flat_prior(constraints.simplex, (K,)))
        mu = numpyro.sample("mu", flat_prior(constraints.positive_ordered_vector, (K,)))
        numpyro.factor("mu_prior", dist.Normal(jnp.array([3.0, 10.0]), 1.0).log_prob(mu).sum())
        log_theta = jnp.log(jnp.stack([theta1, theta2]))
        emit = dist.Normal(mu, 1.0).log_prob(y[:, None])

        def step(gamma, e) -> tuple[Any, None]:
            g = jax.nn.logsumexp(gamma[:, None] + log_theta, 0) + e
            return g, None
        gamma, _ = jax.lax.scan(step, emit[0], emit[1:])
        numpyro.factor("loglik", jax.nn.logsumexp(gamma))

    params = {"theta1": ["theta1[1]", "theta1[2]"], "theta2": ["theta2[1]", "theta2[2]"], "mu": ["mu[1]", "mu[2]"]}
    return Translation(model, (y,), {}, params, lambda d: stack_draws(d, params, {k: (K,) for k in params}))


def _ode(name) -> Callable[[Any], NoReturn]:
    def fail(post) -> NoReturn:
        raise UnsupportedModelError(
            f"{name} is an ODE model (Stan integrate_ode_*): its likelihood needs the solution of an ODE over "
            "all observation times, so a faithful translation has no per-example likelihood terms and "
            "numpyro_pc has no ODE solver binding; the dual form does not apply.")
    return fail


# ----------------------------------------------------------------- registry

SUPPORTED: dict[str, Any] = {}  # a regression spec name, or a translator taking the posterior
for _m in ("earn_height", "log10earn_height", "logearn_height", "logearn_height_male", "logearn_interaction",
           "logearn_interaction_z", "logearn_logheight_male"):
    SUPPORTED[f"earnings-{_m}"] = _m
for _m in ("kidscore_momhs", "kidscore_momhsiq", "kidscore_interaction"):
    SUPPORTED[f"kidiq-{_m}"] = _m
for _m in ("kidscore_interaction_c", "kidscore_interaction_c2", "kidscore_interaction_z", "kidscore_mom_work"):
    SUPPORTED[f"kidiq_with_mom_work-{_m}"] = _m
for _m in ("mesquite", "logmesquite_logva", "logmesquite_logvas", "logmesquite_logvash", "logmesquite_logvolume"):
    SUPPORTED[f"mesquite-{_m}"] = _m
SUPPORTED.update({f"nes{_y}-nes": "nes" for _y in NES_YEARS})
SUPPORTED.update({"diamonds-diamonds": _translate_diamonds,
                  "eight_schools-eight_schools_noncentered": _translate_eight_schools,
                  "arK-arK": _translate_ark, "gp_pois_regr-gp_pois_regr": _translate_gp_pois,
                  "low_dim_gauss_mix-low_dim_gauss_mix": _translate_gauss_mix})

#: posterior -> (translator, error raised by ``pc.fit`` on the translation (or by :func:`translate`), why).
#: ``UnsupportedModelError``: no observed site in a plate; ``ModelBindingError``: the per-example terms
#: do not add up to the model's log likelihood.
UNSUPPORTED = {
    "gp_pois_regr-gp_regr": (_translate_gp_regr, UnsupportedModelError,
                             "marginal GP likelihood y ~ multi_normal: one term for all observations"),
    "garch-garch11": (_translate_garch, ModelBindingError,
                      "sigma[t] is a recursion over all earlier observations"),
    "arma-arma11": (_translate_arma, ModelBindingError, "err[t] is a recursion over all earlier observations"),
    "hmm_example-hmm_example": (_translate_hmm_example, UnsupportedModelError,
                                "forward algorithm: one log_sum_exp over the whole sequence"),
    "hudson_lynx_hare-lotka_volterra": (_ode("lotka_volterra"), UnsupportedModelError, "ODE model"),
    "one_comp_mm_elim_abs-one_comp_mm_elim_abs": (_ode("one_comp_mm_elim_abs"), UnsupportedModelError, "ODE model"),
}
#: posteriors not translated (same structure as hmm_example, or no reference posterior in the folder)
NOT_TRANSLATED = {
    "bball_drive_event_0-hmm_drive_0": "hidden Markov model, forward algorithm over the whole sequence "
                                       "(as hmm_example-hmm_example)",
    "bball_drive_event_1-hmm_drive_1": "hidden Markov model (as hmm_example-hmm_example)",
    "mcycle_gp-accel_gp": "no reference posterior in the data folder (the model itself has per-example terms)",
}


def translate(name, path=None, posterior=None) -> Translation:
    """The NumPyro translation of the posterior ``name``.

    :param str name: ``<data>-<model>``, a key of :data:`SUPPORTED`, :data:`UNSUPPORTED` or
        :data:`~numpyro_pc.posteriordb.hierarchical.HIERARCHICAL` (no reference draws: only the data are read).
    :param path: data directory.
    :param ReferencePosterior posterior: already loaded posterior (else read with :func:`load_posterior`).
    :rtype: Translation
    :raises UnsupportedModelError: for ODE models, and for names in no registry.
    """
    if name in HIERARCHICAL:
        return translate_hierarchical(name, path, None if posterior is None else posterior.data)
    if name in NOT_TRANSLATED:
        raise UnsupportedModelError(f"{name}: {NOT_TRANSLATED[name]}")
    entry = SUPPORTED[name] if name in SUPPORTED else UNSUPPORTED.get(name, (None,))[0]
    if entry is None:
        raise UnsupportedModelError(f"no NumPyro translation of posterior {name!r}")
    if name in UNSUPPORTED and UNSUPPORTED[name][2] == "ODE model":
        entry(None)  # raises
    post = posterior if posterior is not None else load_posterior(name, path)
    return _translate_regression(post, entry) if isinstance(entry, str) else entry(post)


def reference_unconstrained(translation, posterior, latent) -> np.ndarray:
    """Reference draws mapped to the model's flat unconstrained space, ``(num_draws, d)``.

    :param Translation translation: from :func:`translate`.
    :param ReferencePosterior posterior: from :func:`load_posterior`.
    :param latent: the :class:`~numpyro_pc.model.latent.LatentSpace` of the fitted posterior.
    """
    constrained = translation.reference(posterior.draws)
    parts = [np.asarray(t.inv(jnp.asarray(constrained[n]))).reshape(len(constrained[n]), -1)
             for n, t in zip(latent.names, latent.transforms)]
    return np.concatenate(parts, -1)



def compare(mean, covariance, translation, posterior, latent) -> dict[Any, Any]:
    """Per unconstrained coordinate: error of a Gaussian ``N(mean, covariance)`` against the reference.

    :return: dict of arrays over the ``d`` coordinates: ``labels``, ``z`` (``(mean − ref mean) / ref sd``),
        ``sd_ratio`` (``sd / ref sd``), ``skew`` and ``kurtosis`` (excess) of the unconstrained reference
        draws, and ``gaussian`` (``|skew| < MAX_SKEW`` and ``|kurtosis| < MAX_EXCESS_KURTOSIS``).
    """
    ref = reference_unconstrained(translation, posterior, latent)
    center = ref - ref.mean(0)
    sd = ref.std(0)
    skew = (center ** 3).mean(0) / sd ** 3
    kurt = (center ** 4).mean(0) / sd ** 4 - 3.0
    mean, cov = np.asarray(mean), np.asarray(covariance)
    return dict(labels=np.asarray(latent.labels()), z=(mean - ref.mean(0)) / sd, sd_ratio=np.sqrt(np.diag(cov)) / sd,
                skew=skew, kurtosis=kurt, gaussian=(np.abs(skew) < MAX_SKEW) & (np.abs(kurt) < MAX_EXCESS_KURTOSIS))
