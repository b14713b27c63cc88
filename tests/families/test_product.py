"""A family the package does not ship: an inverse-Gamma factor, one class plus ``register_factor``.

The oracle is conjugacy: ``σ² ~ InverseGamma(a, b)``, ``y_i ~ N(0, σ²)`` has the posterior
``InverseGamma(a + n/2, b + Σ y_i²/2)``, and the leave-one-out predictive of ``y_i`` is a
Student-t with ``2 a₋ᵢ`` degrees of freedom and scale ``sqrt(b₋ᵢ / a₋ᵢ)``. Every check is in
float64; 1e-10 relative is rounding after one conjugate step (the Gauss–Laguerre regression of a
loss linear in ``T`` is exact), 1e-8 for the LOO densities (32 Gauss–Laguerre nodes for a smooth,
non-polynomial predictive).
"""

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax.scipy.special import gammaln
from numpyro.distributions import constraints
from scipy import stats

import numpyro_pc as pc
from numpyro_pc.families.expfam import Factor
from numpyro_pc.families.point_sets import gamma_rule
from numpyro_pc.errors import InvalidOptionError, SavedModelMismatchError

A0, B0 = 3.0, 2.0


@dataclass(frozen=True)
class InverseGammaFactor(Factor):
    """``T(x) = (log x, 1/x)``, ``λ = (−a − 1, −b)``, ``A(λ) = log Γ(a) − a log b``; the Gauss rule
    is Gauss–Laguerre's for ``1/x ~ Gamma(a, b)``, mapped back."""

    family_name = "invgamma"
    support = constraints.positive
    dist_args = ("concentration", "rate")
    dist_class = dist.InverseGamma

    def _ab(self, lam):
        pair = jnp.reshape(lam, self.shape + (2,))
        return -pair[..., 0] - 1.0, -pair[..., 1]

    def stats(self, x):
        t = jnp.stack([jnp.log(x), 1.0 / x], -1)
        return jnp.reshape(t, x.shape[:x.ndim - len(self.shape)] + (-1,))

    def log_normalizer(self, lam):
        a, b = self._ab(lam)
        return jnp.sum(gammaln(a) - a * jnp.log(b))

    def in_domain(self, lam):
        a, b = self._ab(lam)
        return jnp.all(jnp.isfinite(lam)) & jnp.all(a > 0) & jnp.all(b > 0)

    def to_args(self, lam):
        return self._ab(lam)

    def from_args(self, a, b):
        a, b = jnp.broadcast_to(a, self.shape), jnp.broadcast_to(b, self.shape)
        return jnp.reshape(jnp.stack([-a - 1.0, -b], -1), (-1,))

    def sample(self, key, lam, num):
        a, b = self._ab(lam)
        return b / jax.random.gamma(key, a, (num,) + self.shape, dtype=lam.dtype)

    @property
    def has_rule(self):
        return math.prod(self.shape) == 1

    def rule(self, lam, num_nodes):
        a, b = self._ab(lam)
        y, w = gamma_rule(jnp.reshape(a, ()), jnp.reshape(b, ()), num_nodes)
        return jnp.reshape(1.0 / y, (num_nodes,) + self.shape), w


pc.register_factor(InverseGammaFactor)


def variance_model(y=None):
    sigma2 = numpyro.sample("sigma2", dist.InverseGamma(A0, B0))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Normal(0.0, jnp.sqrt(sigma2)), obs=y)


def _posterior(y):
    return A0 + 0.5 * y.size, B0 + 0.5 * float(np.sum(y**2))


def _args(post):
    a, b = post.family.factors[0].to_args(post.natural)
    return [float(a), float(b)]


@pytest.fixture
def data():
    return np.random.default_rng(21).normal(0.0, 1.7, 30)


def test_registered_family_fits_updates_deletes_in_closed_form(x64, data):
    y = jnp.asarray(data)
    post = pc.fit(variance_model, y=y, family={"sigma2": "invgamma"})
    assert post.config.rule == "quadrature" and post.conjugate_prior
    np.testing.assert_allclose(_args(post), _posterior(data), rtol=1e-10)
    assert isinstance(post.distributions()["sigma2"], dist.InverseGamma)

    head = pc.fit(variance_model, y=y[:18], family={"sigma2": "invgamma"})
    np.testing.assert_allclose(_args(head.update(y=y[18:], correction="exact")), _posterior(data), rtol=1e-10)
    gone = post.delete(np.arange(18, 30), method="corrected")
    np.testing.assert_allclose(_args(gone), _posterior(data[:18]), rtol=1e-10)
    np.testing.assert_allclose(_args(post.delete(np.arange(18, 30), method="remove_site")), _posterior(data[:18]),
                               rtol=1e-10)  # conjugate sites do not go stale


def test_registered_family_reads_a_guide_and_scores_leave_one_out(x64, data):
    y = jnp.asarray(data)

    def guide(y=None):
        a = numpyro.param("a", 1.0, constraint=constraints.positive)
        b = numpyro.param("b", 1.0, constraint=constraints.positive)
        numpyro.sample("sigma2", dist.InverseGamma(a, b))

    post = pc.dual_form(variance_model, guide, {"a": 4.0, "b": 5.0}, y=y)
    np.testing.assert_allclose(_args(post), _posterior(data), rtol=1e-10)
    np.testing.assert_allclose([post.to_guide_params()[k] for k in ("a", "b")], _posterior(data), rtol=1e-10)

    loo = pc.loo(post)
    want = []
    for i in range(data.size):
        a, b = _posterior(np.delete(data, i))
        want.append(stats.t.logpdf(data[i], df=2 * a, scale=math.sqrt(b / a)))
    np.testing.assert_allclose(loo.pointwise, want, rtol=1e-8)


def test_registered_family_saves_and_loads(x64, data, tmp_path, monkeypatch):
    y = jnp.asarray(data)
    post = pc.fit(variance_model, y=y, family={"sigma2": "invgamma"})
    path = tmp_path / "variance.npc"
    pc.save(post, path)
    back = pc.load(path, variance_model)
    np.testing.assert_array_equal(np.asarray(back.natural), np.asarray(post.natural))
    np.testing.assert_allclose(_args(back.update(y=y[:5] + 1.0)), _posterior(np.concatenate([data, data[:5] + 1.0])),
                               rtol=1e-10)

    from numpyro_pc.families import product as ef_product

    monkeypatch.delitem(ef_product.EF_FAMILIES, "invgamma")  # a session that has not registered the factor
    monkeypatch.delitem(ef_product._REGISTERED, dist.InverseGamma)
    with pytest.raises(SavedModelMismatchError, match="register_factor"):
        pc.load(path, variance_model)


def test_register_factor_refuses_what_it_cannot_use():
    with pytest.raises(InvalidOptionError, match="subclass of numpyro_pc.families.expfam.Factor"):
        pc.register_factor(dist.InverseGamma)

    @dataclass(frozen=True)
    class Unnamed(InverseGammaFactor):
        family_name = "Not A Name"

    with pytest.raises(InvalidOptionError, match="lower-case identifier family_name"):
        pc.register_factor(Unnamed)

    @dataclass(frozen=True)
    class Impostor(InverseGammaFactor):
        family_name = "gamma"

    with pytest.raises(InvalidOptionError, match="taken by GammaFactor"):
        pc.register_factor(Impostor)

    @dataclass(frozen=True)
    class BetaReader(InverseGammaFactor):
        family_name = "betareader"
        dist_class = dist.Beta

    with pytest.raises(InvalidOptionError, match="read by a built-in factor"):
        pc.register_factor(BetaReader)

    @dataclass(frozen=True)
    class SecondReader(InverseGammaFactor):
        family_name = "secondreader"

    with pytest.raises(InvalidOptionError, match="read by InverseGammaFactor"):
        pc.register_factor(SecondReader)
    assert pc.register_factor(InverseGammaFactor) is InverseGammaFactor  # registering again is harmless
