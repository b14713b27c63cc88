"""Logistic regression on LIBSVM a7a (123 binary features, labels 0/1), prior N(0, I): the model and the data
the app's clients take their partitions of (run config ``model`` and ``data``)."""

import numpy as np
import numpyro
import numpyro.distributions as dist

from numpyro_pc.datasets.loaders import load_a7a


def model(X, y=None):
    """Bernoulli likelihood with logits ``X @ w``, ``w ~ N(0, I)`` (123 coefficients)."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def a7a():
    """The 16,100 training examples of a7a as ``(X, y)`` (read from ``NUMPYRO_PC_DATA`` or the package's data
    folder, see :func:`numpyro_pc.datasets.loaders.load_a7a`)."""
    X, y = load_a7a("train")
    return np.asarray(X, dtype=np.float64), np.asarray(y, dtype=np.float64)
