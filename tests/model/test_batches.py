"""Binding a new batch to a fitted posterior (numpyro_pc.model.batches): what a batch may and may not change."""

import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import numpyro_pc as pc
from numpyro_pc import errors

from models import make_logistic


def offset_model(X, y=None, offset=None, scale=1.0):
    w = numpyro.sample("w", dist.Normal(0.0, scale).expand([X.shape[1]]).to_event(1))
    shift = 0.0 if offset is None else offset
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + shift), obs=y)


@pytest.mark.parametrize("fitted, passed, named", [
    (dict(offset=np.zeros(60)), {}, "missing 'offset' (a per-example array)"),
    (dict(scale=2.0), {}, "missing 'scale' (a fixed value)"),
    ({}, dict(scale=2.0), "added 'scale' (a fixed value)"),
])
def test_a_batch_that_omits_or_adds_an_argument_is_refused_naming_it(x64, fitted, passed, named):
    """Issue 32: omitting a defaulted keyword would silently take the model's default (another model)."""
    X, y = make_logistic(60, 2, seed=0)
    post = pc.fit(offset_model, X, y, **fitted)
    extra = {k: v[:5] if isinstance(v, np.ndarray) else v for k, v in passed.items()}
    with pytest.raises(errors.DataShapeError, match=named.replace("(", r"\(").replace(")", r"\)")):
        post.update(X[:5], y[:5], **extra)


def test_a_batch_with_the_fitted_arguments_is_accepted(x64):
    X, y = make_logistic(60, 2, seed=0)
    post = pc.fit(offset_model, X[:40], y[:40], offset=np.zeros(40), scale=2.0)
    batch = post.update(X[40:], y[40:], offset=np.zeros(20), scale=2.0, correction="exact")
    full = pc.fit(offset_model, X, y, offset=np.zeros(60), scale=2.0)
    assert pc.kl(batch, full) < 1e-8  # exact update = batch fit (both at tol 1e-8)
