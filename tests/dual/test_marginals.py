"""Per-site marginals of a Gaussian posterior (numpyro_pc.dual.marginals, ``post.distributions()``).

Oracles, float64: each marginal's base Gaussian has the covariance block of the dense ``Σ`` (full family)
or its diagonal (diagonal family), to 1e-10 (two solves' rounding); its event shape is the site's
constrained shape, also for a simplex (stick-breaking: one coordinate fewer unconstrained), a positive
scalar and a matrix-shaped site; its log-density at a point is the Gaussian's at the unconstrained
coordinates minus the bijection's log-Jacobian (NumPyro's transforms, evaluated independently here).
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.distributions.transforms import biject_to

import numpyro_pc as pc
from numpyro_pc.errors import MissingCapabilityError
from numpyro_pc.model.likelihood import constrain


def shapes_model(x, y=None):
    probs = numpyro.sample("probs", dist.Dirichlet(jnp.ones(3)))  # simplex: 2 unconstrained coordinates
    scale = numpyro.sample("scale", dist.HalfNormal(1.0))  # a positive scalar
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2, 2]).to_event(2))  # matrix-shaped
    with numpyro.plate("data", x.shape[0]):
        loc = x @ w[0] + w[1, 0] * probs[0] - probs[2]
        numpyro.sample("y", dist.Normal(loc, scale), obs=y)


def _data(n=30):
    x = jax.random.normal(jax.random.PRNGKey(0), (n, 2))
    y = x @ jnp.array([0.5, -1.0]) + 0.3 * jax.random.normal(jax.random.PRNGKey(1), (n,))
    return x, y


@pytest.fixture(scope="module", params=["full", "diagonal"])
def fitted(request):
    with jax.enable_x64():
        return pc.fit(shapes_model, *_data(), family=request.param), request.param


@pytest.mark.slow  # two fits of a three-site model, 18-24 s (tests/tiers.py)
def test_marginal_shapes_blocks_and_densities(fitted):
    post, family = fitted
    with jax.enable_x64():
        marginals = post.distributions()
        draws = post.sample(jax.random.PRNGKey(2), 3)
        cov = np.asarray(post.covariance)
        latent = post.spec.latent
        for name, start, size in zip(latent.names, latent.offsets, latent.sizes):
            marginal = marginals[name]
            assert marginal.event_shape == draws[name].shape[1:], name
            base = marginal.base_dist if isinstance(marginal, dist.TransformedDistribution) else marginal
            block = cov[start:start + size, start:start + size]
            if family == "diagonal":
                np.testing.assert_allclose(np.asarray(base.base_dist.scale) ** 2, np.diag(block), rtol=1e-10)
                gaussian = dist.Normal(post.mean[start:start + size], jnp.sqrt(jnp.diag(block))).to_event(1)
            else:
                np.testing.assert_allclose(np.asarray(base.covariance_matrix), block, rtol=1e-10, atol=1e-12)
                gaussian = dist.MultivariateNormal(post.mean[start:start + size], covariance_matrix=block)
            support = biject_to(dist.Dirichlet(jnp.ones(3)).support if name == "probs" else
                                dist.HalfNormal(1.0).support if name == "scale" else dist.Normal(0.0, 1.0).support)
            for x in draws[name]:
                u = support.inv(x)
                expected = gaussian.log_prob(jnp.reshape(u, (size,))) - jnp.sum(support.log_abs_det_jacobian(u, x))
                assert float(marginal.log_prob(x)) == pytest.approx(float(expected), rel=1e-9, abs=1e-9), name


def latent_bound_model(y=None):
    tau = numpyro.sample("tau", dist.HalfNormal(2.0))
    x = numpyro.sample("x", dist.Uniform(0.0, tau))  # its support depends on tau
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Normal(x, 1.0), obs=y)


@pytest.mark.slow  # 8 s (measured alone, 2 cores)
def test_a_support_that_depends_on_other_latents_is_refused():
    with jax.enable_x64():
        post = pc.fit(latent_bound_model, y=jnp.array([0.4, 0.9, 1.3, 0.2]), family="diagonal")
        with pytest.raises(MissingCapabilityError, match="support of 'x'.*depends on other latents"):
            post.distributions()


def test_a_point_estimate_s_marginals_are_its_point():
    x, y = _data()
    with jax.enable_x64():
        post = pc.fit(shapes_model, x, y, family="isotropic", expectation="delta")
        assert post.is_point_estimate
        marginals = post.distributions()
        point = constrain(post.spec, post.mean, post.data)
    for name, marginal in marginals.items():
        assert isinstance(marginal, dist.Delta)
        np.testing.assert_allclose(np.asarray(marginal.v), np.asarray(point[name]), rtol=1e-12, atol=1e-12)
