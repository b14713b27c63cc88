"""Family algebra against closed forms computed independently with NumPy/SciPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from numpyro_pc.families import registry
from numpyro_pc.families.discrete import BernoulliFactor
from numpyro_pc.families.expfam_gaussian import FullGaussianFactor
from numpyro_pc.families.product import ProductFamily
from numpyro_pc.families.registry import (DiagonalGaussian, Family, FullGaussian, Gaussian, GaussianFamily,
                                          IsotropicGaussian, add_site, get_family, remove_site, scale_site)

D = 4


def random_q(family, seed):
    rng = np.random.default_rng(seed)
    mean = jnp.asarray(rng.normal(size=D))
    if isinstance(family, FullGaussian):
        a = rng.normal(size=(D, D))
        return Gaussian(mean, jnp.asarray(a @ a.T + D * np.eye(D)))
    if isinstance(family, DiagonalGaussian):
        return Gaussian(mean, jnp.asarray(rng.uniform(0.5, 3.0, size=D)))
    return Gaussian(mean, jnp.asarray(rng.uniform(0.5, 3.0)))


FAMILIES = [FullGaussian(), DiagonalGaussian(), IsotropicGaussian()]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_parameter_maps_round_trip(x64, family):
    q = random_q(family, 0)
    back = family.from_natural(family.natural(q))
    np.testing.assert_allclose(back.mean, q.mean, rtol=1e-12)
    np.testing.assert_allclose(back.precision, q.precision, rtol=1e-12)
    mu = family.expectation(q)
    back = family.from_expectation(mu) if not isinstance(family, IsotropicGaussian) else \
        family.from_expectation(mu, q.precision)
    np.testing.assert_allclose(back.mean, q.mean, rtol=1e-12)
    np.testing.assert_allclose(back.precision, q.precision, rtol=1e-9)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_log_prob_entropy_match_scipy(x64, family):
    q = random_q(family, 1)
    cov = np.asarray(family.dense_covariance(q))
    ref = stats.multivariate_normal(np.asarray(q.mean), cov)
    z = np.random.default_rng(2).normal(size=(5, D))
    np.testing.assert_allclose(family.log_prob(q, jnp.asarray(z)), ref.logpdf(z), rtol=1e-12)
    np.testing.assert_allclose(family.entropy(q), ref.entropy(), rtol=1e-12)
    np.testing.assert_allclose(np.linalg.inv(cov), family.dense_precision(q), rtol=1e-10, atol=1e-12)


def kl_reference(m0, c0, m1, c1):
    """KL(N(m0,c0) ‖ N(m1,c1)) from the textbook formula in NumPy."""
    inv1 = np.linalg.inv(c1)
    diff = m1 - m0
    return 0.5 * (np.trace(inv1 @ c0) + diff @ inv1 @ diff - len(m0)
                  + np.linalg.slogdet(c1)[1] - np.linalg.slogdet(c0)[1])


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_kl_matches_formula(x64, family):
    q, p = random_q(family, 3), random_q(family, 4)
    expected = kl_reference(np.asarray(q.mean), np.asarray(family.dense_covariance(q)),
                            np.asarray(p.mean), np.asarray(family.dense_covariance(p)))
    np.testing.assert_allclose(family.kl(q, p), expected, rtol=1e-11)
    assert abs(float(family.kl(q, q))) < 1e-12


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_sampling_moments(x64, family):
    q = random_q(family, 5)
    z = family.sample(q, jax.random.PRNGKey(0), 200_000)
    cov = np.asarray(family.dense_covariance(q))
    # standard error of a mean is sqrt(var/n) ~ 2e-3 here; 6 standard errors
    np.testing.assert_allclose(z.mean(0), q.mean, atol=6 * np.sqrt(cov.diagonal().max() / 200_000))
    np.testing.assert_allclose(np.cov(np.asarray(z).T), cov, atol=0.02 * np.abs(cov).max())


def _product():
    product = ProductFamily((BernoulliFactor("z", ()), FullGaussianFactor("w", (2,))))
    lam = jnp.concatenate([product.factors[0].from_args(0.3),
                           product.factors[1].from_args(jnp.array([0.5, -1.0]), jnp.array([[1.0, 0.0], [0.3, 0.5]]))])
    return product, lam


def test_every_family_is_a_family_with_one_core():
    # the core, named once (numpyro_pc.protocols.family.Family): what every family implements, whatever its kind
    assert Family.__abstractmethods__ == {"natural", "expectation", "log_prob", "entropy", "kl", "sample"}
    product, lam = _product()
    assert all(isinstance(family, Family) for family in (*FAMILIES, product))
    assert not isinstance(product, GaussianFamily) and product.natural(lam) is lam
    with pytest.warns(FutureWarning, match="ExponentialFamily is now GaussianFamily"):
        assert registry.ExponentialFamily is GaussianFamily


@pytest.mark.slow  # 25-65 s on 2 loaded cores: eager draws and densities of four families
def test_one_argument_order_for_every_family(x64):
    # sample(q, key, n), log_prob(q, point), entropy(q), kl(q, p) for every kind, checked through an identity that a
    # swapped order breaks: the Monte Carlo entropy -E_q[log q] of the family's own draws equals its closed-form
    # entropy (5 standard errors of the mean of log q over 40 000 draws)
    members = [(family, random_q(family, 11)) for family in FAMILIES] + [_product()]
    for family, q in members:
        log_q = np.asarray(family.log_prob(q, family.sample(q, jax.random.PRNGKey(0), 40_000)))
        assert abs(-log_q.mean() - float(family.entropy(q))) < 5 * log_q.std() / np.sqrt(log_q.size)
        assert abs(float(family.kl(q, q))) < 1e-10


def test_site_algebra_is_product_of_gaussian_factors(x64):
    """exp(-site) multiplies q: log q_new - log q - (-site) must be constant in z."""
    family = FullGaussian()
    q = random_q(family, 6)
    rng = np.random.default_rng(7)
    g = jnp.asarray(rng.normal(size=D))
    a = rng.normal(size=(D, D))
    h = jnp.asarray(a @ a.T)
    ref = jnp.asarray(rng.normal(size=D))
    site = family.site_natural(g, h, ref)
    q_new = family.from_natural(add_site(family.natural(q), site))

    def site_value(z):
        return z @ g + 0.5 * (z - ref) @ h @ (z - ref)

    z = jnp.asarray(rng.normal(size=(6, D)))
    diff = family.log_prob(q_new, z) - family.log_prob(q, z) + jax.vmap(site_value)(z)
    np.testing.assert_allclose(diff, diff[0], atol=1e-10)
    back = family.from_natural(remove_site(family.natural(q_new), site))
    np.testing.assert_allclose(back.mean, q.mean, rtol=1e-10)
    twice = add_site(family.natural(q), scale_site(site, 2.0))
    np.testing.assert_allclose(twice.precision, q.precision + 2 * h, rtol=1e-12)


def test_get_family_names():
    assert get_family("diag").name == "diagonal"
    assert get_family("iso").name == "isotropic"
    with pytest.raises(ValueError, match="unknown family"):
        get_family("student-t")


def test_a_family_is_added_by_registering_it(x64, monkeypatch, tmp_path):
    # A registered family is usable by name through fit, update, delete and save/load. The
    # family here re-uses the diagonal algebra under another name, so its oracle is the
    # diagonal family's own fit: every number must agree exactly (same arithmetic, 1e-12).
    from dataclasses import dataclass

    import numpyro_pc as pc
    from numpyro_pc.families import registry as families
    from numpyro_pc.errors import InvalidOptionError

    from models import logistic_model, make_logistic

    @dataclass(frozen=True, repr=False)
    class MeanField(DiagonalGaussian):
        name: str = "meanfield"

    monkeypatch.setattr(families, "_FAMILIES", dict(families._FAMILIES))
    monkeypatch.setattr(families, "_ALIASES", dict(families._ALIASES))
    families.register_family(MeanField(), aliases=("mf",))
    assert get_family("mf") == MeanField() and "meanfield" in families.registered_families()
    with pytest.raises(InvalidOptionError, match="taken"):
        families.register_family(MeanField(name="full"))
    with pytest.raises(InvalidOptionError, match="GaussianFamily instance .*register_factor"):
        families.register_family("meanfield")

    X, y = make_logistic(60, 3)
    ours = pc.fit(logistic_model, X[:40], y[:40], family="mf")
    reference = pc.fit(logistic_model, X[:40], y[:40], family="diagonal")
    assert ours.family.name == "meanfield"
    np.testing.assert_allclose(ours.mean, reference.mean, rtol=1e-12)
    np.testing.assert_allclose(ours.state.precision, reference.state.precision, rtol=1e-12)
    updated = ours.update(X[40:], y[40:]).delete([0, 1])
    expected = reference.update(X[40:], y[40:]).delete([0, 1])
    np.testing.assert_allclose(updated.mean, expected.mean, rtol=1e-12)
    path = tmp_path / "meanfield.npc"
    updated.save(path)
    loaded = pc.load(path, logistic_model)
    assert loaded.family.name == "meanfield"
    np.testing.assert_array_equal(loaded.mean, updated.mean)
