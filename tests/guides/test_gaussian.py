"""Guide adapters: every supported guide, latent order, round trips, unsupported guides."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import (AutoBNAFNormal, AutoDAIS, AutoDelta, AutoDiagonalNormal, AutoIAFNormal,
                                     AutoLaplaceApproximation, AutoLowRankMultivariateNormal,
                                     AutoMultivariateNormal, AutoNormal)

import numpyro_pc as pc
from numpyro_pc.errors import InvalidOptionError
from numpyro_pc.guides.gaussian import from_guide, to_guide_params
from numpyro_pc.model.likelihood import bind_model, constrain

from models import logistic_model, make_logistic


def unordered_model(X, y=None):
    """Sites declared in non-alphabetical order with different shapes and supports."""
    zeta = numpyro.sample("zeta", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    alpha = numpyro.sample("alpha", dist.HalfNormal(1.0))
    mid = numpyro.sample("mid", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X[:, :2] @ zeta + X[:, 2:] @ mid, alpha), obs=y)


def test_flat_order_follows_the_guide_not_sorted_keys(x64):
    rng = np.random.default_rng(0)
    X, y = jnp.asarray(rng.normal(size=(20, 5))), jnp.asarray(rng.normal(size=20))
    spec, data = bind_model(unordered_model, (X, y))
    assert spec.latent.names == ("zeta", "alpha", "mid")  # sorted would be alpha, mid, zeta
    guide = AutoMultivariateNormal(unordered_model)
    params = {"auto_loc": jnp.arange(6.0) / 10, "auto_scale_tril": 0.1 * jnp.eye(6)}
    with numpyro.handlers.seed(rng_seed=0):
        guide(X, y)
    family, q = from_guide(guide, params, spec.latent, (X, y))
    ours = constrain(spec, q.mean, data)
    theirs = guide.median(params)
    for name in spec.latent.names:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-12)
    # ravel_pytree's sorted order would put alpha first: make sure that is not what happened
    assert not np.allclose(ours["alpha"], np.exp(0.0))


VB_GUIDES = [AutoNormal, AutoDiagonalNormal, AutoMultivariateNormal, AutoLowRankMultivariateNormal]


@pytest.fixture(scope="module")
def logistic_data():
    return make_logistic(150, 4, seed=1)


@pytest.mark.parametrize("guide_cls", VB_GUIDES + [AutoLaplaceApproximation, AutoDelta],
                         ids=lambda c: c.__name__)
def test_every_supported_guide_refines_to_the_reference(x64, logistic_data, guide_cls):
    X, y = logistic_data
    guide = guide_cls(logistic_model)
    res = SVI(logistic_model, guide, optax.adam(0.02), Trace_ELBO()).run(
        jax.random.PRNGKey(0), 800, X, y, progress_bar=False)
    post = pc.dual_form(logistic_model, guide, res.params, X, y)
    assert post.residual < 1e-8
    family = {AutoNormal: "diagonal", AutoDiagonalNormal: "diagonal", AutoDelta: "isotropic",
              AutoLowRankMultivariateNormal: "lowrank-2"}.get(guide_cls, "full")  # rank round(√5) = 2
    assert post.family.name == family
    rule = "delta" if guide_cls in (AutoLaplaceApproximation, AutoDelta) else "gh"
    assert post.rule.kind == rule
    ref = pc.fit(logistic_model, X, y, family=family, expectation=rule, tol=1e-11)
    # both are the same fixed point, reached to residual 1e-8 from different starts
    assert float(post.kl(ref)) < 1e-10
    # the refined posterior goes back into the guide and Predictive works
    params = post.to_guide_params()
    samples = numpyro.infer.Predictive(logistic_model, guide=guide, params=params, num_samples=3)(
        jax.random.PRNGKey(1), X)
    assert samples["y"].shape == (3, X.shape[0])


@pytest.mark.parametrize("guide_cls", [AutoNormal, AutoDiagonalNormal, AutoMultivariateNormal, AutoDelta],
                         ids=lambda c: c.__name__)
def test_params_round_trip_exactly(x64, logistic_data, guide_cls):
    X, y = logistic_data
    guide = guide_cls(logistic_model)
    res = SVI(logistic_model, guide, optax.adam(0.02), Trace_ELBO()).run(
        jax.random.PRNGKey(0), 50, X, y, progress_bar=False)
    spec, data = bind_model(logistic_model, (X, y))
    family, q = from_guide(guide, res.params, spec.latent, (X, y))
    back = to_guide_params(guide, family, q, spec.latent, constrain_fn=lambda z: constrain(spec, z, data))
    for key, value in back.items():
        np.testing.assert_allclose(value, res.params[key], rtol=1e-9, atol=1e-12)


def test_low_rank_guide_of_rank_d_minus_1_maps_exactly(x64, logistic_data):
    X, y = logistic_data
    guide = AutoLowRankMultivariateNormal(logistic_model, rank=4)  # d = 5
    res = SVI(logistic_model, guide, optax.adam(0.02), Trace_ELBO()).run(
        jax.random.PRNGKey(0), 50, X, y, progress_bar=False)
    spec, _ = bind_model(logistic_model, (X, y))
    family, q = from_guide(guide, res.params, spec.latent, (X, y))
    w, s = res.params["auto_cov_factor"], res.params["auto_scale"]
    np.testing.assert_allclose(family.dense_covariance(q), w @ w.T + jnp.diag(s**2), rtol=1e-9)


@pytest.mark.parametrize("guide_cls", [AutoIAFNormal, AutoBNAFNormal, AutoDAIS], ids=lambda c: c.__name__)
def test_unsupported_guides_raise_type_error_naming_supported(logistic_data, guide_cls):
    X, y = logistic_data
    guide = guide_cls(logistic_model)
    with pytest.raises(TypeError, match="AutoMultivariateNormal") as info:
        pc.dual_form(logistic_model, guide, {}, X, y)
    assert isinstance(info.value, pc.UnsupportedGuideError)


def test_params_of_another_guide_are_rejected(logistic_data):
    X, y = logistic_data
    diag = AutoDiagonalNormal(logistic_model)
    res = SVI(logistic_model, diag, optax.adam(0.02), Trace_ELBO()).run(
        jax.random.PRNGKey(0), 10, X, y, progress_bar=False)
    with pytest.raises(pc.GuideParamsError, match="auto_scale_tril"):
        pc.dual_form(logistic_model, AutoMultivariateNormal(logistic_model), res.params, X, y)


def test_singular_covariance_is_not_positive_definite(logistic_data):
    X, y = logistic_data
    guide = AutoMultivariateNormal(logistic_model)
    params = {"auto_loc": jnp.zeros(5), "auto_scale_tril": jnp.zeros((5, 5))}
    with pytest.raises(pc.NotPositiveDefiniteError):
        pc.dual_form(logistic_model, guide, params, X, y)


def test_a_guide_is_added_by_registering_an_adapter(x64, monkeypatch):
    from numpyro_pc.guides import gaussian as guides
    from numpyro_pc.families.registry import Gaussian

    monkeypatch.setattr(guides, "_REGISTRY", dict(guides._REGISTRY))  # registration is undone after the test

    class LogScaleNormal(AutoDiagonalNormal):
        """A guide the package does not know: a subclass is not matched by its parent's adapter."""

    class LogScaleAdapter(guides.GuideAdapter):
        family = "diagonal"

        def read(self, guide, params, latent, dtype):
            loc = jnp.asarray(params[f"{guide.prefix}_loc"], dtype)
            return Gaussian(loc, jnp.exp(-2.0 * jnp.asarray(params[f"{guide.prefix}_log_scale"], dtype)))

        def write(self, guide, family, q, latent, constrain_fn):
            return {f"{guide.prefix}_loc": q.mean, f"{guide.prefix}_log_scale": -0.5 * jnp.log(q.precision)}

    X, y = make_logistic(30, 3)
    spec, _ = bind_model(logistic_model, (X, y))
    guide = LogScaleNormal(logistic_model)
    params = {"auto_loc": jnp.linspace(-1.0, 1.0, 4), "auto_log_scale": jnp.log(jnp.arange(1.0, 5.0))}
    with pytest.raises(pc.UnsupportedGuideError, match="register_guide"):
        from_guide(guide, params, spec.latent, (X, y))
    guides.register_guide(LogScaleNormal, LogScaleAdapter())
    family, q = from_guide(guide, params, spec.latent, (X, y))
    assert family.name == "diagonal" and guides.default_expectation(guide, spec) == "auto"
    np.testing.assert_allclose(q.precision, 1.0 / np.arange(1.0, 5.0) ** 2, rtol=1e-14)
    back = to_guide_params(guide, family, q, spec.latent)
    np.testing.assert_allclose(back["auto_log_scale"], params["auto_log_scale"], rtol=1e-14, atol=1e-15)
    with pytest.raises(InvalidOptionError):
        guides.register_guide(LogScaleNormal, object())
