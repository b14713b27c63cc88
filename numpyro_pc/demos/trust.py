"""The ``trust`` section of the demo (right or refused): an unscaled regression from the default start,
a mis-bound model and a label outside its support refused with typed errors."""

from __future__ import annotations

import time

import jax.numpy as jnp
from sklearn.datasets import load_diabetes

import numpyro_pc as pc
from numpyro_pc.demos.models import plate_from_argument, progression_classifier, raw_diabetes_regression

__all__ = ["demo_trust"]


def demo_trust() -> dict:
    """Right or refused: an unscaled regression from the default start, and a mis-bound model refused."""
    raw = load_diabetes(scaled=False)
    bmi, bp = (jnp.asarray(raw.data[:, raw.feature_names.index(c)]) for c in ("bmi", "bp"))
    y = jnp.asarray(raw.target)
    print(f"\nRight or refused: diabetes, unscaled (bmi, bp, disease progression up to {float(y.max()):.0f}), "
          "sigma ~ HalfNormal(100)")
    t0 = time.perf_counter()
    post = pc.fit(raw_diabetes_regression, bmi, bp, y)
    seconds = time.perf_counter() - t0
    start = post.record.start
    sd = jnp.sqrt(jnp.diag(post.covariance))
    print(f"  start: MAP by L-BFGS ({start.iterations} it.) + Laplace precision; rule "
          f"'{post.rule.kind}' over a {post.rule.subspace_dim}-dimensional subspace per example")
    print(f"  converged: residual {post.residual:.1e} in {len(post.history) - 1} iterations, {seconds:.1f} s; "
          f"slope of bmi {float(post.mean[1]):.2f} ± {float(sd[1]):.2f}")
    try:
        pc.fit(plate_from_argument, int(bmi.shape[0]), bmi, y)
        refused = None
    except pc.errors.ModelBindingError as err:
        refused = str(err)
        print(f"  plate('data', n) with n an argument: refused with ModelBindingError — {refused.split('. ')[0]}.")
    high = (y > 140).astype(y.dtype).at[100].set(2.0)  # one label outside {0, 1}, far past the first rows
    try:
        pc.fit(progression_classifier, (bmi - bmi.mean()) / bmi.std(), high)
        support_refused = None
    except pc.DataSupportError as err:
        support_refused = str(err)
        print(f"  a Bernoulli label 2 in row 100: refused with DataSupportError — {support_refused.split('; first')[0]}.")
    return dict(residual=post.residual, iterations=len(post.history) - 1, seconds=seconds, refused=refused,
                support_refused=support_refused)
