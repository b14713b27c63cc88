"""Changing the prior of a fitted posterior (``post.change_prior``) against closed forms and batch refits.

Oracles: with a linear-Gaussian likelihood and the full family the data's sites do not depend on ``q``,
so dividing out the old prior site and solving with the new prior alone is the conjugate posterior
under the new prior (closed form, 1e-10); for any family the exact change's fixed point is the batch
fit under the new prior (KL 1e-10 in float64, solver tolerance 1e-12 on both sides); for a GLM the
K-prior's prediction matching of every retained example equals the exact change (the identity of
:mod:`numpyro_pc.ops.kprior`).
"""

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import numpyro_pc as pc
from numpyro_pc.errors import DataShapeError, InvalidOptionError, ModelMismatchError

from models import (_bern, _pois, beta_bernoulli, flat_beta_bernoulli, gamma_poisson, linear_model, lognormal_poisson,
                    make_linear, make_logistic)

TOL = 1e-12


def logistic(X, y=None, prior_scale=1.0):
    """Logistic regression with an intercept and a Normal(0, prior_scale) prior on every coefficient."""
    b = numpyro.sample("b", dist.Normal(0.0, prior_scale))
    w = numpyro.sample("w", dist.Normal(0.0, prior_scale).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def logistic_student(X, y=None):
    """The same likelihood under a weakly-informative Student-t prior (another model object)."""
    b = numpyro.sample("b", dist.StudentT(3.0, 0.0, 2.5))
    w = numpyro.sample("w", dist.StudentT(3.0, 0.0, 2.5).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def probit(X, y=None, prior_scale=1.0):
    """Another likelihood: refused as a prior change."""
    b = numpyro.sample("b", dist.Normal(0.0, prior_scale))
    w = numpyro.sample("w", dist.Normal(0.0, prior_scale).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(probs=dist.Normal().cdf(X @ w + b)), obs=y)


def test_a_linear_gaussian_prior_change_is_the_conjugate_posterior_without_touching_the_data(x64):
    X, y = make_linear(60, 3, seed=4)
    post = pc.fit(linear_model, X, y, family="full", tol=TOL)
    changed = post.change_prior(prior_scale=0.3, correction="prior", tol=TOL)
    precision = X.T @ X / 0.5**2 + jnp.eye(3) / 0.3**2
    mean = jnp.linalg.solve(precision, X.T @ y / 0.5**2)
    np.testing.assert_allclose(changed.state.mean, mean, rtol=0, atol=1e-10)
    np.testing.assert_allclose(changed.state.precision, precision, rtol=1e-12, atol=1e-10)
    assert float(jnp.max(jnp.abs(post.state.mean - mean))) > 1e-2  # the old prior gave another posterior
    assert changed.record.corrected == 0 and changed.record.operation == "change_prior"
    assert changed.site_identity_residual < 1e-10


@pytest.mark.parametrize("family", [pytest.param("full", marks=pytest.mark.slow), "diagonal"])  # full: 4 s
def test_the_exact_change_is_the_batch_fit_under_the_new_prior(x64, family):
    X, y = make_logistic(150, 4, seed=2)
    post = pc.fit(logistic, X, y, family=family, tol=TOL)
    changed = post.change_prior(prior_scale=0.3, tol=TOL)
    batch = pc.fit(logistic, X, y, prior_scale=0.3, family=family, tol=TOL)
    assert float(changed.kl(batch)) < 1e-10
    assert float(post.kl(batch)) > 1e-2  # the change is not trivial
    assert changed.site_identity_residual < 1e-8
    assert changed.record.corrected == 150 and changed.record.new == 0


def test_another_model_object_with_a_weakly_informative_prior(x64):
    X, y = make_logistic(150, 4, seed=8)
    post = pc.fit(logistic, X, y, family="full", tol=TOL)
    changed = post.change_prior(logistic_student, tol=TOL)
    assert float(changed.kl(pc.fit(logistic_student, X, y, family="full", tol=TOL))) < 1e-10
    assert changed.spec.model is logistic_student


def test_the_kprior_matches_every_retained_example_of_a_glm_exactly(x64):
    X, y = make_logistic(150, 4, seed=5)
    post = pc.fit(logistic, X, y, family="isotropic", tol=TOL)
    matched = post.change_prior(prior_scale=3.0, correction="kprior", tol=TOL)
    exact = post.change_prior(prior_scale=3.0, tol=TOL)
    assert float(matched.kl(exact)) < 1e-10
    assert matched.record.linearisation_error < 1e-12 and matched.record.memory == 150


@pytest.mark.slow  # 6 s (measured alone, one core)
def test_a_larger_memory_moves_the_change_monotonically_to_the_batch_fit(x64):
    X, y = make_logistic(120, 4, seed=7)
    post = pc.fit(logistic, X, y, family="diagonal", tol=TOL)
    batch = pc.fit(logistic, X, y, prior_scale=0.2, family="diagonal", tol=TOL)
    ids = np.asarray(post.data_ids)
    kls = [float(post.change_prior(prior_scale=0.2, correction="prior", tol=TOL).kl(batch))]
    kls += [float(post.change_prior(prior_scale=0.2, correction="memory", memory=ids[:k], tol=TOL).kl(batch))
            for k in (20, 60, 120)]
    assert all(a > b for a, b in zip(kls, kls[1:])), kls
    assert kls[0] > 1e-3 and kls[-1] < 1e-10


def test_the_changed_posterior_saves_loads_and_updates_with_its_new_prior(x64, tmp_path):
    X, y = make_logistic(160, 3, seed=9)
    post = pc.fit(logistic, X[:100], y[:100], family="full", tol=TOL).change_prior(prior_scale=0.4, tol=TOL)
    path = post.save(tmp_path / "changed.npz")
    loaded = pc.load(path, logistic)
    assert float(loaded.kl(post)) < 1e-14
    with pytest.raises(DataShapeError, match="prior_scale"):  # later batches are passed as the posterior now is
        loaded.update(X[100:], y[100:])
    grown = loaded.update(X[100:], y[100:], prior_scale=0.4, tol=TOL)
    assert float(grown.kl(pc.fit(logistic, X, y, prior_scale=0.4, family="full", tol=TOL))) < 1e-10


def test_what_a_prior_change_refuses(x64):
    X, y = make_logistic(40, 3, seed=1)
    post = pc.fit(logistic, X, y, family="full")
    with pytest.raises(ModelMismatchError, match="likelihood"):
        post.change_prior(probit)
    with pytest.raises(ModelMismatchError, match="latent"):
        post.change_prior(lambda X, y=None: logistic(X[:, :2], y))
    with pytest.raises(InvalidOptionError, match="no argument 'prior_sd'"):
        post.change_prior(prior_sd=2.0)
    with pytest.raises(InvalidOptionError, match="per-example data"):
        post.change_prior(X=X + 1.0)
    with pytest.raises(InvalidOptionError, match="always corrected"):
        post.change_prior(prior_scale=2.0, correction="none")
    with pytest.raises(InvalidOptionError, match="keep_memory"):
        post.change_prior(prior_scale=2.0, correction="kprior", memory=10)
    Xl, yl = make_linear(30, 3, seed=0)
    with pytest.raises(ModelMismatchError, match="likelihood"):  # the noise is part of the likelihood
        pc.fit(linear_model, Xl, yl, family="full").change_prior(noise=0.1)
    ef = pc.fit(beta_bernoulli, jnp.asarray([1.0, 0.0, 1.0, 1.0]), family={"p": "beta"})
    with pytest.raises(InvalidOptionError, match="kprior"):
        ef.change_prior(flat_beta_bernoulli, correction="kprior")


def test_with_no_data_retained_only_the_prior_site_is_replaced(x64):
    X, y = make_linear(50, 3, seed=6)
    post = pc.fit(linear_model, X, y, family="full", tol=TOL)
    changed = post.keep_memory(0).change_prior(prior_scale=0.3, correction="kprior", tol=TOL)
    # the linear-Gaussian sites are exact: with no example to match the change is still the conjugate posterior
    precision = X.T @ X / 0.5**2 + jnp.eye(3) / 0.3**2
    np.testing.assert_allclose(changed.state.mean, jnp.linalg.solve(precision, X.T @ y / 0.5**2), rtol=0, atol=1e-10)
    assert changed.num_retained == 0 and changed.num_examples == 50



def test_a_beta_posterior_under_a_flat_prior_is_the_closed_form(x64):
    y = jnp.asarray(_bern(60, seed=2))
    post = pc.fit(beta_bernoulli, y, family={"p": "beta"}, tol=TOL)
    changed = post.change_prior(flat_beta_bernoulli, correction="prior", tol=TOL)
    k = float(jnp.sum(y))
    a, b = changed.distributions()["p"].concentration1, changed.distributions()["p"].concentration0
    np.testing.assert_allclose([float(a), float(b)], [1.0 + k, 1.0 + 60 - k], rtol=1e-12)
    assert changed.conjugate_prior and changed.record.operation == "change_prior"
    assert float(changed.kl(pc.fit(flat_beta_bernoulli, y, family={"p": "beta"}, tol=TOL))) < 1e-12


def test_a_gamma_posterior_moved_to_a_prior_that_is_not_conjugate_form_is_the_batch_fit(x64):
    y = jnp.asarray(_pois(40, seed=5))
    post = pc.fit(gamma_poisson, y, family={"rate": "gamma"}, tol=TOL)
    changed = post.change_prior(lognormal_poisson, tol=TOL)
    batch = pc.fit(lognormal_poisson, y, family={"rate": "gamma"}, tol=TOL)
    assert float(changed.kl(batch)) < 1e-10 and float(post.kl(batch)) > 1e-4
    assert not changed.conjugate_prior
    replayed = post.change_prior(lognormal_poisson, correction="memory", memory=np.asarray(post.data_ids), tol=TOL)
    assert float(replayed.kl(batch)) < 1e-10
    # and back: the conjugate-form prior is recognised again
    back = changed.change_prior(gamma_poisson, tol=TOL)
    assert back.conjugate_prior and float(back.kl(post)) < 1e-10
