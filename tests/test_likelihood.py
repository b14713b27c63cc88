"""Per-example losses and the prior term against NumPyro's own log densities."""

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro import handlers
from numpyro.infer.util import log_density, potential_energy

import numpyro_pc as pc
from numpyro_pc.likelihood import bind_model, losses, prior_loss

from conftest import logistic_model, make_linear, scale_model


def test_prior_term_with_jacobian_matches_potential_energy(x64):
    X, y = make_linear(30, 3)
    spec, data = bind_model(scale_model, (X, y))
    assert spec.latent.names == ("w", "sigma")
    rng = np.random.default_rng(0)
    for _ in range(3):
        z = jnp.asarray(rng.normal(size=spec.latent.dim))
        pe = potential_energy(scale_model, (X, y), {}, spec.latent.unravel(z))
        ell = losses(spec, z, data)
        np.testing.assert_allclose(prior_loss(spec, z, data), pe - ell.sum(), rtol=1e-12)
        # the per-example terms are the Normal log densities at the constrained sigma
        w, sigma = z[:3], jnp.exp(z[3])
        np.testing.assert_allclose(ell, -dist.Normal(X @ w, sigma).log_prob(y), rtol=1e-12)


def two_site_model(X, y1=None, y2=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y1", dist.Normal(X @ w, 1.0), obs=y1)
        numpyro.sample("y2", dist.Bernoulli(logits=X @ w), obs=y2)


def test_several_observed_sites_add_per_example(x64):
    X, y = make_linear(12, 2)
    y2 = (y > 0).astype(float)
    spec, data = bind_model(two_site_model, (X, y, y2))
    z = jnp.asarray([0.3, -0.7])
    expected = -(dist.Normal(X @ z, 1.0).log_prob(y) + dist.Bernoulli(logits=X @ z).log_prob(y2))
    np.testing.assert_allclose(losses(spec, z, data), expected, rtol=1e-12)
    assert spec.num_params == 2 and spec.affine


def masked_model(X, y=None, keep=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]), handlers.mask(mask=keep):
        numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)


def test_masks_are_respected(x64):
    X, y = make_linear(10, 2)
    keep = jnp.arange(10) % 3 != 0
    spec, data = bind_model(masked_model, (X, y), dict(keep=keep))
    z = jnp.asarray([0.5, 0.1])
    ell = losses(spec, z, data)
    assert np.all(np.asarray(ell)[~np.asarray(keep)] == 0.0)
    total = -log_density(masked_model, (X, y), dict(keep=keep), {"w": z})[0] - prior_loss(spec, z, data)
    np.testing.assert_allclose(ell.sum(), total, rtol=1e-12)


def local_latent_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        u = numpyro.sample("u", dist.Normal(0.0, 1.0))
        numpyro.sample("y", dist.Normal(X @ w + u, 1.0), obs=y)


def no_plate_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    numpyro.sample("y", dist.Normal(X @ w, 1.0).to_event(1), obs=y)


def test_local_latent_and_missing_plate_are_rejected():
    X, y = make_linear(8, 2)
    with pytest.raises(pc.UnsupportedModelError, match="local latent"):
        bind_model(local_latent_model, (X, y))
    with pytest.raises(pc.UnsupportedModelError, match="plate"):
        bind_model(no_plate_model, (X, y))


def test_leading_size_mismatch_and_nan_data():
    X, y = make_linear(8, 2)
    with pytest.raises(pc.DataShapeError, match="leading"):
        bind_model(logistic_model, (X, (y > 0)[:6].astype(float)))
    bad = X.at[2, 1].set(jnp.nan)
    with pytest.raises(pc.NonFiniteDataError, match="'X'"):
        bind_model(logistic_model, (bad, (y > 0).astype(float)))


def prior_scale_model(X, y=None, scales=None):
    w = numpyro.sample("w", dist.Normal(0.0, scales).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)


def test_shared_arguments(x64):
    X, y = make_linear(6, 2)
    scales = jnp.asarray([1.0, 3.0])
    with pytest.raises(pc.DataShapeError, match="shared"):
        bind_model(prior_scale_model, (X, y), dict(scales=scales))
    spec, data = bind_model(prior_scale_model, (X, y), dict(scales=scales), shared=("scales",))
    z = jnp.asarray([0.2, 0.4])
    np.testing.assert_allclose(prior_loss(spec, z, data), -dist.Normal(0.0, scales).log_prob(z).sum(), rtol=1e-12)


def test_example_ids_and_param_analysis():
    X, y = make_linear(5, 2)
    spec, _ = bind_model(scale_model, (X, y))
    # loc and scale both depend on z; scale = exp(z_sigma) is not affine
    assert spec.num_params == 2 and not spec.affine
    spec, _ = bind_model(logistic_model, (X, (y > 0).astype(float)))
    assert spec.num_params == 1 and spec.affine
