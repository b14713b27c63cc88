"""The demo's models: a logistic regression for the breast-cancer data, and the diabetes models of the
``trust`` section (an unscaled regression, a plate tied to an argument, a classifier)."""

from __future__ import annotations

import numpyro
import numpyro.distributions as dist

__all__ = ["logistic_model", "raw_diabetes_regression", "plate_from_argument", "progression_classifier"]


def logistic_model(X, y=None, prior_scale=1.0) -> None:
    b = numpyro.sample("b", dist.Normal(0.0, prior_scale))
    w = numpyro.sample("w", dist.Normal(0.0, prior_scale).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def raw_diabetes_regression(bmi, bp, y=None, noise_scale=100.0) -> None:
    a = numpyro.sample("a", dist.Normal(0.0, 100.0))
    b = numpyro.sample("b", dist.Normal(0.0, 10.0).expand([2]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(noise_scale))
    with numpyro.plate("data", bmi.shape[0]):
        numpyro.sample("y", dist.Normal(a + b[0] * bmi + b[1] * bp, sigma), obs=y)


def plate_from_argument(n, bmi, y=None) -> None:
    a = numpyro.sample("a", dist.Normal(0.0, 100.0))
    with numpyro.plate("data", n):
        numpyro.sample("y", dist.Normal(a + bmi, 50.0), obs=y)


def progression_classifier(x, y=None) -> None:
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=w[0] + w[1] * x), obs=y)
