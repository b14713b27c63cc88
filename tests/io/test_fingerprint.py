"""Model fingerprints: deterministic, independent of the data values, sensitive to the model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist

from numpyro_pc.io.fingerprint import compare_fingerprints, model_fingerprint
from numpyro_pc.model.likelihood import bind_model

from models import linear_model, logistic_model, make_linear, make_logistic


def _fp(model, *args, shared=(), **kwargs):
    return model_fingerprint(*bind_model(model, args, kwargs, shared=shared))


def counts_model(X, n, y=None, prior_cov=None, weight=1.0):
    w = numpyro.sample("w", dist.MultivariateNormal(jnp.zeros(X.shape[1]), prior_cov))
    with numpyro.plate("data", X.shape[0]), numpyro.handlers.scale(scale=weight):
        numpyro.sample("y", dist.Binomial(total_count=n, logits=X @ w), obs=y)


def test_fingerprint_is_json_and_ignores_the_data_values():
    X, y = make_logistic(8, 3, seed=0)
    X2, y2 = make_logistic(5, 3, seed=1)
    a, b = _fp(logistic_model, X, y), _fp(logistic_model, X2, y2)
    assert json.loads(json.dumps(a)) == a and compare_fingerprints(a, b) == [] and a == b


def test_fixed_parameters_arguments_and_handlers_are_compared():
    X, y = make_linear(6, 3)
    base = _fp(linear_model, X, y, noise=0.5)
    assert compare_fingerprints(base, _fp(linear_model, X, y, noise=0.7)) == [
        "arguments.noise: 0.5 when saved, 0.7 now", "sites.y.params.scale.values[0]: 0.5 when saved, 0.7 now"]
    assert any("prior_scale" in d for d in compare_fingerprints(base, _fp(linear_model, X, y, noise=0.5,
                                                                          prior_scale=3.0)))
    n = jnp.full(6, 4.0)
    k = jnp.asarray([0.0, 1.0, 4.0, 2.0, 3.0, 1.0])  # valid Binomial counts: binding checks the log density
    big = jnp.eye(3) * 2.0
    counts = _fp(counts_model, X, n, k, prior_cov=big, shared=("prior_cov",))
    assert counts["sites"]["y"]["params"]["total_count"] == {"depends_on": "data"}
    assert compare_fingerprints(counts, _fp(counts_model, X, n, k, prior_cov=big, weight=2.0, shared=("prior_cov",)))
    assert compare_fingerprints(counts, _fp(counts_model, X, n, k, prior_cov=big * 2, shared=("prior_cov",)))


def test_observed_value_shapes_are_compared():
    """One example's ``y`` of shape ``(1, 1)`` broadcasts against logits ``(1,)`` and binds; its shape differs."""
    X, y = make_logistic(8, 3)
    base = _fp(logistic_model, X, y)
    assert base["sites"]["y"]["value_shape"] == [1] and "value_shape" not in base["sites"]["w"]
    assert compare_fingerprints(base, _fp(logistic_model, X[:1], y[:1, None])) == [
        "sites.y.value_shape: [1] when saved, [1, 1] now"]


def test_large_parameters_are_hashed():
    X, _ = make_linear(6, 20)
    k = jnp.asarray([0.0, 1.0, 4.0, 2.0, 3.0, 1.0])
    fp = _fp(counts_model, X, jnp.full(6, 4.0), k, prior_cov=jnp.eye(20), shared=("prior_cov",))
    tril = fp["sites"]["w"]["params"]["scale_tril"]
    assert set(tril) == {"kind", "shape", "sha256"} and tril["shape"] == [20, 20]


def test_a_different_version_is_one_difference():
    X, y = make_logistic(8, 3)
    assert len(compare_fingerprints({"version": 0}, _fp(logistic_model, X, y))) == 1
    assert len(compare_fingerprints("not a fingerprint", _fp(logistic_model, X, y))) == 1


def test_fingerprint_is_deterministic_across_processes():
    """NumPyro flattens distribution fields in set order (hash-seed dependent); the fingerprint must not."""
    code = ("import sys, json, jax; sys.path.insert(0, 'tests'); from models import logistic_model, make_logistic;"
            "from numpyro_pc.model.likelihood import bind_model; from numpyro_pc.io.fingerprint import model_fingerprint;"
            "X, y = make_logistic(10, 1, seed=3);"
            "print(json.dumps(model_fingerprint(*bind_model(logistic_model, (X, y))), sort_keys=True))")
    outputs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parents[2], env={**os.environ, "PYTHONHASHSEED": seed}).stdout
               for seed in ("1", "2")}
    assert len(outputs) == 1
    X, y = make_logistic(10, 1, seed=3)
    assert json.loads(outputs.pop()) == _fp(logistic_model, X, y)
