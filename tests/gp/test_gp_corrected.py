"""Oracles for the posterior-corrected streaming GP (float64, fixed seeds).

Collapsed (Gaussian) bound: with every past example in the memory, the old
pseudo-observations minus the memory's sites are a constant (``−F_old``), so the corrected
bound plus the old batch's bound equals Titsias' batch bound on all data *for any new θ
and Z_b*, and ``q(b)`` is the batch ``q(u)``. A sign error in any of the three site terms
(precision, linear, constant/trace) breaks the identity by O(1).

Uncollapsed bound: the old fit's dual form makes ``log q_old(a) − log p(a|θ_old) = −Σ_i ℓ̂_i(a)`` up
to a constant, so with every past example in the memory the corrected uncollapsed bound differs from
the batch uncollapsed bound on all data by a constant, for any ``q(b)``, θ and ``Z_b``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gpx = pytest.importorskip("gpjax")

from gpjax.parameters import PositiveReal  # noqa: E402

from numpyro_pc.gp import collapsed_fit, handover, prior_state  # noqa: E402
from numpyro_pc.gp.corrected import correction_term, gaussian_sites, memory_sites  # noqa: E402
from numpyro_pc.gp.state import Hyper, chol, kernel_matrix  # noqa: E402
from numpyro_pc.gp.uncollapsed import BernoulliLogit, marginals, uncollapsed_bound, whiten  # noqa: E402

EPS = 1e-6


def _hyper(Z, lengthscale, variance, noise, likelihood=None):
    return Hyper(kernel=gpx.kernels.RBF(lengthscale=jnp.asarray(lengthscale), variance=jnp.array(variance)),
                 mean_function=gpx.mean_functions.Zero(),
                 noise=None if likelihood is not None else PositiveReal(jnp.array(noise)), likelihood=likelihood,
                 Z=jnp.asarray(Z))


def _data(n, d, seed):
    rng = np.random.default_rng(seed)
    X = rng.uniform(-2, 2, (n, d))
    return X, np.sin(2 * X[:, 0]) + 0.5 * np.cos(X[:, -1]) + 0.1 * rng.normal(size=n)


def _old(X1, y1, Za, **hp):
    h1 = _hyper(Za, **hp)
    fit = collapsed_fit(h1, prior_state(h1, EPS), jnp.asarray(X1), jnp.asarray(y1), jnp.ones(len(y1)))
    return handover(h1, fit.mean, fit.cov, EPS), float(fit.bound)


@pytest.mark.parametrize("d", [1, 3])
def test_corrected_bound_with_full_memory_is_the_batch_bound(x64, d):
    X, y = _data(70, d, seed=d)
    rng = np.random.default_rng(10 + d)
    old, F_old = _old(X[:40], y[:40], X[rng.choice(40, 7, replace=False)], lengthscale=np.full(d, 0.9),
                      variance=1.2, noise=0.05)
    # new θ, new noise and new Z_b (8 points, none of them old): Bui's bound alone is not exact here
    h2 = _hyper(rng.uniform(-2, 2, (8, d)), lengthscale=np.full(d, 1.3), variance=0.7, noise=0.08)
    Xa, ya = jnp.asarray(X), jnp.asarray(y)                      # the new batch (30 rows) + the memory (40 rows)
    sites = gaussian_sites(old, jnp.asarray(X[:40]), jnp.asarray(y[:40]), jnp.ones(40))
    corr = collapsed_fit(h2, old, Xa, ya, jnp.ones(70), 0.0, sites)
    batch = collapsed_fit(h2, prior_state(h2, EPS), Xa, ya, jnp.ones(70))
    bui = collapsed_fit(h2, old, Xa[40:], ya[40:], jnp.ones(30))
    assert abs(F_old + float(corr.bound) - float(batch.bound)) < 1e-8
    np.testing.assert_allclose(corr.mean, batch.mean, atol=1e-8)
    np.testing.assert_allclose(corr.cov, batch.cov, atol=1e-8)
    assert abs(F_old + float(bui.bound) - float(batch.bound)) > 1e-2   # the identity is not trivial


def test_corrected_bound_with_half_memory_sits_between(x64):
    # memory of a subset: masked rows contribute nothing (padding-invariant), and with fixed θ and Z_b = Z_a
    # (where Bui's update is already exact) the corrected bound equals Bui's for any memory
    X, y = _data(60, 2, seed=7)
    Za = X[:6]
    old, F_old = _old(X[:40], y[:40], Za, lengthscale=np.full(2, 0.9), variance=1.2, noise=0.05)
    h = _hyper(Za, lengthscale=np.full(2, 0.9), variance=1.2, noise=0.05)
    mask = jnp.asarray((np.arange(40) % 2).astype(float))
    sites = gaussian_sites(old, jnp.asarray(X[:40]), jnp.asarray(y[:40]), mask)
    Xc, yc = jnp.asarray(np.concatenate([X[40:], X[:40]])), jnp.asarray(np.concatenate([y[40:], y[:40]]))
    corr = collapsed_fit(h, old, Xc, yc, jnp.concatenate([jnp.ones(20), mask]), 0.0, sites)
    bui = collapsed_fit(h, old, jnp.asarray(X[40:]), jnp.asarray(y[40:]), jnp.ones(20))
    assert abs(float(corr.bound) - float(bui.bound)) < 1e-8
    np.testing.assert_allclose(corr.mean, bui.mean, atol=1e-8)


def _bernoulli_state():
    rng = np.random.default_rng(3)
    X = rng.uniform(-2, 2, (30, 2))
    y = (X[:, 1] > 0.5 * X[:, 0] ** 2 - 1).astype(float)
    h = _hyper(X[:6], lengthscale=np.ones(2), variance=1.0, noise=None, likelihood=BernoulliLogit())
    Kzz = kernel_matrix(h.kernel, h.Z, h.Z) + EPS * jnp.eye(6)
    mean = jnp.asarray(rng.normal(size=6))
    cov = Kzz @ jnp.linalg.inv(Kzz + 3.0 * jnp.eye(6)) @ Kzz + 0.01 * jnp.eye(6)
    return handover(h, mean, cov, EPS), h, jnp.asarray(X), jnp.asarray(y)


def test_function_space_correction_vanishes_to_first_order_at_the_old_posterior(x64):
    # Sites are E_q[ℓ'] and E_q[ℓ''] at the old marginals (Bonnet/Price): at q = q_old the correction
    # E_q[ℓ_i − ℓ̂_i] has zero gradient in (μ_i, v_i) for every memory row. A flipped site sign doubles it.
    old, h, X, y = _bernoulli_state()
    sites = memory_sites(old, X, y)
    Lb = chol(old.Kzz)
    q = whiten(Lb, old.mean, old.cov)

    def corr(mean, L):
        return correction_term(h, old, Lb, q._replace(mean=mean, chol=L), X, y, jnp.ones(30), sites)

    gm, gL = jax.grad(corr, (0, 1))(q.mean, q.chol)
    assert float(jnp.max(jnp.abs(gm))) < 1e-6 and float(jnp.max(jnp.abs(gL))) < 1e-6
    gm_pert, _ = jax.grad(corr, (0, 1))(q.mean + 0.3, q.chol)
    assert float(jnp.max(jnp.abs(gm_pert))) > 1e-2                   # not identically zero


def test_corrected_uncollapsed_bound_with_full_memory_is_the_batch_bound_plus_a_constant(x64):
    # Gaussian likelihood through the uncollapsed bound: the old q(a) is Titsias' closed-form optimum, so its
    # sites are exact and the identity holds to rounding (1e-8 on bounds of size ~100). Each trial draws a
    # new θ (lengthscale, kernel variance up to 50×, noise), new Z_b and a random q(b).
    X, y = _data(60, 2, seed=5)
    rng = np.random.default_rng(11)
    old, _ = _old(X[:35], y[:35], X[rng.choice(35, 6, replace=False)], lengthscale=np.full(2, 0.8),
                  variance=1.0, noise=0.05)
    Xo, yo, Xn, yn = (jnp.asarray(a) for a in (X[:35], y[:35], X[35:], y[35:]))
    sites = memory_sites(old, Xo, yo)
    gaps, f_space_gaps = [], []
    for variance in (0.5, 3.0, 50.0):
        h = _hyper(rng.uniform(-2, 2, (7, 2)), lengthscale=rng.uniform(0.5, 1.5, 2), variance=variance,
                   noise=rng.uniform(0.03, 0.2))
        Lb = chol(kernel_matrix(h.kernel, h.Z, h.Z) + EPS * jnp.eye(7))
        A = jnp.asarray(rng.normal(size=(7, 7)))
        q = whiten(Lb, jnp.zeros(7), jnp.eye(7))._replace(mean=jnp.asarray(rng.normal(size=7)),
                                                           chol=jnp.tril(0.3 * A) + jnp.eye(7))
        corr = uncollapsed_bound(h, old, Xn, yn, jnp.ones(25), q) + correction_term(h, old, Lb, q, Xo, yo,
                                                                                      jnp.ones(35), sites)
        batch = uncollapsed_bound(h, prior_state(h, EPS), X, y, jnp.ones(60), q)
        gaps.append(float(corr - batch))
        # control: the same sites written in f_i under the new θ (the pre-fix form) keep ½ ĥ_i (k_ii − q_ii)
        mu, var = marginals(h, Lb, q, Xo)
        f_site = jnp.sum(sites.g * mu + 0.5 * sites.h * ((mu - sites.m) ** 2 + var))
        a_site = correction_term(h, old, Lb, q, Xo, yo, jnp.ones(35), sites) - correction_term(
            h, old, Lb, q, Xo, yo, jnp.ones(35), sites._replace(g=0 * sites.g, h=0 * sites.h))
        f_space_gaps.append(gaps[-1] - float(a_site) + float(f_site))
    assert max(gaps) - min(gaps) < 1e-8
    assert max(f_space_gaps) - min(f_space_gaps) > 1.0                  # the identity is not trivial


def test_corrected_bound_with_full_memory_is_the_batch_bound_when_a_constant_mean_moves(x64):
    # the scale-free defaults learn a Constant mean: the memory's sites hold the old residuals y − c_old
    # (as the old term does), the memory rows enter with the new c; with every past row in the memory the
    # identity holds for any new θ and c. Control: sites built with the new c break it by O(1).
    X, y = _data(70, 2, seed=4)
    y = y + 3.0
    rng = np.random.default_rng(14)

    def hyper(Z, c, **hp):
        h = _hyper(Z, **hp)
        return Hyper(kernel=h.kernel, mean_function=gpx.mean_functions.Constant(jnp.array(c)), noise=h.noise,
                     likelihood=None, Z=h.Z)

    h1 = hyper(X[rng.choice(40, 7, replace=False)], 2.6, lengthscale=np.full(2, 0.9), variance=1.2, noise=0.05)
    fit = collapsed_fit(h1, prior_state(h1, EPS), jnp.asarray(X[:40]), jnp.asarray(y[:40]), jnp.ones(40))
    old, F_old = handover(h1, fit.mean, fit.cov, EPS), float(fit.bound)
    Xa, ya = jnp.asarray(X), jnp.asarray(y)
    sites = gaussian_sites(old, jnp.asarray(X[:40]), jnp.asarray(y[:40]), jnp.ones(40))
    for c in (3.1, 2.0):
        h2 = hyper(rng.uniform(-2, 2, (8, 2)), c, lengthscale=np.full(2, 1.3), variance=0.7, noise=0.08)
        corr = collapsed_fit(h2, old, Xa, ya, jnp.ones(70), 0.0, sites)
        batch = collapsed_fit(h2, prior_state(h2, EPS), Xa, ya, jnp.ones(70))
        assert abs(F_old + float(corr.bound) - float(batch.bound)) < 1e-8
        np.testing.assert_allclose(corr.mean, batch.mean, atol=1e-8)
        moved = old._replace(hyper=Hyper(kernel=h1.kernel, mean_function=h2.mean_function, noise=h1.noise,
                                         likelihood=None, Z=h1.Z))
        wrong = gaussian_sites(moved, jnp.asarray(X[:40]), jnp.asarray(y[:40]), jnp.ones(40))
        bad = collapsed_fit(h2, old, Xa, ya, jnp.ones(70), 0.0, wrong)
        assert abs(F_old + float(bad.bound) - float(batch.bound)) > 1.0
