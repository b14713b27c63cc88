"""Per-example losses and the prior term against NumPyro's own log densities."""

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro import handlers
from numpyro.infer.util import log_density, potential_energy

import numpyro_pc as pc
from numpyro_pc.model.likelihood import IMPLICIT_PLATE, bind_model, losses, prior_loss

from models import logistic_model, make_linear, scale_model


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


def no_plate_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    numpyro.sample("y", dist.Normal(X @ w, 1.0).to_event(1), obs=y)


def test_missing_plate_is_rejected():
    X, y = make_linear(8, 2)
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


# --------------------------------------------------------------------------- models without a plate
# UC Berkeley admissions 1973 by department (A-F) and sex (male, female): 12 rows.
UCB_ADMIT = np.array([512, 89, 353, 17, 120, 202, 138, 131, 53, 94, 22, 24], float)
UCB_APPLICATIONS = np.array([825, 108, 560, 25, 325, 593, 417, 375, 191, 393, 373, 341], float)
UCB_DEPT = np.repeat(np.arange(6), 2)
UCB_MALE = np.tile([1.0, 0.0], 6)


def ucb_no_plate(dept, male, applications, admit=None):
    alpha = numpyro.sample("alpha", dist.Normal(0.0, 1.5).expand([6]))
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0))
    numpyro.sample("admit", dist.Binomial(applications, logits=alpha[dept] + beta * male), obs=admit)


def ucb_plate(dept, male, applications, admit=None):
    alpha = numpyro.sample("alpha", dist.Normal(0.0, 1.5).expand([6]))
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", dept.shape[0]):
        numpyro.sample("admit", dist.Binomial(applications, logits=alpha[dept] + beta * male), obs=admit)


def _ucb(rows):
    return tuple(jnp.asarray(a[rows]) for a in (UCB_DEPT, UCB_MALE, UCB_APPLICATIONS, UCB_ADMIT))


def _same_posterior(a, b, tol=1e-10):
    np.testing.assert_allclose(a.mean, b.mean, rtol=0, atol=tol)
    np.testing.assert_allclose(a.precision, b.precision, rtol=tol, atol=tol)
    np.testing.assert_array_equal(a.ids, b.ids)


def test_observed_rows_without_a_plate_are_an_implicit_plate(x64):
    spec, data = bind_model(ucb_no_plate, _ucb(slice(None)))
    assert spec.plate == IMPLICIT_PLATE and spec.num_examples == 12 and spec.observed == ("admit",)
    assert spec.kinds == ("example",) * 4 and spec.affine
    z = jnp.linspace(-1.0, 1.0, spec.latent.dim)
    plated, plated_data = bind_model(ucb_plate, _ucb(slice(None)))
    np.testing.assert_allclose(losses(spec, z, data), losses(plated, z, plated_data), rtol=1e-14)
    np.testing.assert_allclose(prior_loss(spec, z, data), prior_loss(plated, z, plated_data), rtol=1e-14)


def height_model(height):
    """A scalar-parameter observation: the rows come from the observed value's shape alone."""
    mu = numpyro.sample("mu", dist.Normal(170.0, 20.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(10.0))
    numpyro.sample("height", dist.Normal(mu, sigma), obs=height)


def test_rows_of_an_observed_value_broadcast_against_scalar_parameters(x64):
    height = jnp.asarray(np.random.default_rng(1).normal(165.0, 8.0, size=9))
    spec, data = bind_model(height_model, (height,))
    assert spec.num_examples == 9
    z = jnp.asarray([0.1, 0.3])
    mu, sigma = z[0], jnp.exp(z[1])
    np.testing.assert_allclose(losses(spec, z, data), -dist.Normal(mu, sigma).log_prob(height), rtol=1e-12)


def test_fit_update_delete_and_load_without_a_plate_equal_the_plate_model(x64, tmp_path):
    first, rest = _ucb(slice(0, 8)), _ucb(slice(8, 12))
    no_plate, plate = pc.fit(ucb_no_plate, *_ucb(slice(None))), pc.fit(ucb_plate, *_ucb(slice(None)))
    _same_posterior(no_plate, plate)
    streamed, plate_streamed = pc.fit(ucb_no_plate, *first).update(*rest), pc.fit(ucb_plate, *first).update(*rest)
    _same_posterior(streamed, plate_streamed)
    deleted, plate_deleted = streamed.delete([2, 9]), plate_streamed.delete([2, 9])
    _same_posterior(deleted, plate_deleted)
    back = pc.load(deleted.save(tmp_path / "ucb"), ucb_no_plate)
    _same_posterior(back, deleted, tol=0.0)
    _same_posterior(back.update(*_ucb(slice(2, 3))), plate_deleted.update(*_ucb(slice(2, 3))))


def two_lengths_model(X, y=None, y2=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)
    numpyro.sample("y2", dist.Normal(w.sum(), 1.0), obs=y2)


def columns_model(X, Y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    numpyro.sample("Y", dist.Normal(w[:, None] * X.T, 1.0), obs=Y.T)  # rows along the last axis


def unshared_scales_model(X, y=None, scales=None):
    w = numpyro.sample("w", dist.Normal(0.0, scales).to_event(1))
    numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)


Y_GLOBAL = jnp.arange(5.0)


def global_data_model(scale):
    mu = numpyro.sample("mu", dist.Normal(0.0, scale))
    numpyro.sample("y", dist.Normal(mu, 1.0), obs=Y_GLOBAL)


def test_ambiguous_models_without_a_plate_are_refused():
    X, y = make_linear(8, 2)
    rule = "inside a plate.*leading batch dimension of the observed sites"
    with pytest.raises(pc.UnsupportedModelError, match=rule):
        bind_model(no_plate_model, (X, y))
    with pytest.raises(pc.UnsupportedModelError, match=r"\['y'\] have no batch dimension.*y: \(\)"):
        bind_model(no_plate_model, (X, y))  # the rows folded into one event by to_event(1)
    with pytest.raises(pc.UnsupportedModelError, match=r"dimensions disagree .*y: \(8,\), y2: \(3,\)"):
        bind_model(two_lengths_model, (X, y, y[:3]))
    with pytest.raises(pc.UnsupportedModelError, match=r"dimension is 2 .*Y: \(2, 8\).* length 8 \(X: 8, Y: 8\)"):
        bind_model(columns_model, (X, jnp.stack([y, y], 1)))
    scales = jnp.asarray([1.0, 3.0])
    with pytest.raises(pc.UnsupportedModelError, match=r"different leading lengths \(X: 8, y: 8, scales: 2\)"):
        bind_model(unshared_scales_model, (X, y), dict(scales=scales))
    spec, _ = bind_model(unshared_scales_model, (X, y), dict(scales=scales), shared=("scales",))
    assert spec.num_examples == 8 and spec.kinds == ("example", "example", "shared")
    with pytest.raises(pc.UnsupportedModelError, match=r"no array argument .* 5 rows"):
        bind_model(global_data_model, (1.0,))
    with pytest.raises(pc.UnsupportedModelError, match=r"data_plate='data' is not a plate"):
        bind_model(ucb_no_plate, _ucb(slice(None)), data_plate="data")
