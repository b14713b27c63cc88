"""The shared model zoo of the tests: NumPyro models, their data makers and the closed-form oracles
that several test files use (imported as ``from models import ...``; tests/ is on pytest's pythonpath)."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import scipy.optimize
from numpyro.distributions import constraints
from scipy import special, stats

from jax_cache import use_test_compilation_cache  # before numpyro_pc: it sets the harness's cache switch

import numpyro_pc as pc
from numpyro_pc.families.registry import Gaussian

use_test_compilation_cache()  # a process a test starts shares the suite's compiled programs (as with conftest before)


# ---------------------------------------------------------------- Gaussian-posterior models and their data (formerly in conftest.py)
def logistic_model(X, y=None):
    """Bayesian logistic regression with an intercept: b ~ N(0,1), w ~ N(0, I)."""
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def linear_model(X, y=None, noise=0.5, prior_scale=2.0):
    """Conjugate Bayesian linear regression with known noise."""
    w = numpyro.sample("w", dist.Normal(0.0, prior_scale).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, noise), obs=y)


def scale_model(X, y=None):
    """Linear regression with a HalfNormal noise scale (a constrained latent)."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, sigma), obs=y)


def make_logistic(n, d, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)) / np.sqrt(d) * 2.0
    w = rng.normal(size=d)
    y = (rng.uniform(size=n) < 1.0 / (1.0 + np.exp(-(X @ w + 0.3)))).astype(float)
    return jnp.asarray(X), jnp.asarray(y)


def make_linear(n, d, seed=0, noise=0.5):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    w = rng.normal(size=d)
    y = X @ w + noise * rng.normal(size=n)
    return jnp.asarray(X), jnp.asarray(y)


def vb_optimality_gap(model, args, post, nodes=30, kwargs=None):
    """Relative violation of the Gaussian VB optimality conditions ``E_q[∇ℓ] = 0`` and
    ``S = E_q[∇²ℓ]`` (ℓ the whole negative log joint) by brute-force tensor Gauss–Hermite
    quadrature over all of ``z`` — an oracle independent of the package's expectation rules,
    for models with ``d ≤ 3``. Returns ``(mean_gap, precision_gap)``.
    """
    from numpyro_pc.model.likelihood import bind_model
    from numpyro_pc.solvers.start import negative_log_joint

    spec, data = bind_model(model, args, kwargs or {})
    d = spec.latent.dim
    weights = jnp.ones(spec.num_examples, jnp.float64)
    f = lambda z: negative_log_joint(spec, z, data, weights)  # noqa: E731
    xi, w = np.polynomial.hermite_e.hermegauss(nodes)
    grid = np.stack([g.ravel() for g in np.meshgrid(*([xi] * d), indexing="ij")], 1)
    weight = np.prod(np.stack([g.ravel() for g in np.meshgrid(*([w] * d), indexing="ij")], 1), 1)
    weight = jnp.asarray(weight / (2 * np.pi) ** (d / 2))
    points = post.mean[None, :] + jnp.asarray(grid) @ jnp.linalg.cholesky(post.covariance).T
    grads = jax.lax.map(jax.grad(f), points, batch_size=4096)
    hessians = jax.lax.map(jax.hessian(f), points, batch_size=4096)
    g = weight @ grads
    h = jnp.einsum("k,kab->ab", weight, hessians)
    scale = float(weight @ jnp.linalg.norm(grads, axis=1))
    return float(jnp.linalg.norm(g)) / scale, float(jnp.linalg.norm(post.precision - h) / jnp.linalg.norm(h))


# ---------------------------------------------------------------- exponential-family models, data and closed forms (tests/dual/test_expfam_adapt.py, test_expfam_fit.py)
A0, B0 = 2.0, 3.0


def beta_bernoulli(y=None):
    p = numpyro.sample("p", dist.Beta(A0, B0))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Bernoulli(probs=p), obs=y)


def flat_beta_bernoulli(y=None):  # same sites, another prior
    p = numpyro.sample("p", dist.Beta(1.0, 1.0))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Bernoulli(probs=p), obs=y)


def beta_guide(y=None):
    a = numpyro.param("a", 1.0, constraint=constraints.positive)
    b = numpyro.param("b", 1.0, constraint=constraints.positive)
    numpyro.sample("p", dist.Beta(a, b))


def dirichlet_categorical(y=None):
    pi = numpyro.sample("pi", dist.Dirichlet(jnp.array([1.0, 2.0, 3.0])))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Categorical(probs=pi), obs=y)


def lognormal_poisson(y=None):  # a prior that is not conjugate-form
    rate = numpyro.sample("rate", dist.LogNormal(0.5, 0.8))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Poisson(rate), obs=y)


def two_sites(y=None, c=None):
    p = numpyro.sample("p", dist.Beta(A0, B0))
    rate = numpyro.sample("rate", dist.Gamma(A0, 0.5))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Bernoulli(probs=p), obs=y)
        numpyro.sample("c", dist.Poisson(rate), obs=c)


def _bern(n=60, seed=0):
    return np.random.default_rng(seed).binomial(1, 0.3, n).astype(float)


def _cat(n=60, seed=0):
    return np.random.default_rng(seed).integers(0, 3, n)


def _pois(n=25, seed=3):
    return np.random.default_rng(seed).poisson(4.0, n).astype(float)


def gamma_poisson(y=None):
    rate = numpyro.sample("rate", dist.Gamma(A0, 0.5))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Poisson(rate), obs=y)


def _data(seed=0, n=60):
    rng = np.random.default_rng(seed)
    return dict(bern=rng.binomial(1, 0.3, n).astype(float), pois=rng.poisson(4.0, n).astype(float),
                norm=1.5 + rng.normal(0, 0.7, n), cat=rng.integers(0, 3, n))


def closed_form(kind, d):
    """Distribution arguments of the exact posterior given the data ``d`` of that kind."""
    if kind == "bern":
        return np.array([A0 + d.sum(), B0 + (1 - d).sum()])
    if kind == "pois":
        return np.array([A0 + d.sum(), 0.5 + d.size])
    if kind == "norm":
        return np.array([A0 + d.size / 2, B0 + ((d - 1.5) ** 2).sum() / 2])
    return np.array([1.0, 2.0, 3.0]) + np.bincount(d, minlength=3)


def _y(kind, d):
    return jnp.asarray(d) if kind != "cat" else jnp.asarray(d, jnp.int32)


def misclassified(y=None):
    p = numpyro.sample("p", dist.Beta(A0, B0))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Bernoulli(probs=0.1 + 0.8 * p), obs=y)


def _best_gamma(y):
    """ELBO of Gamma(a, r) in closed form (E[log x] = ψ(a) - log r, E[(log x)^2] = ψ'(a) + E[log x]^2)."""
    m, s = 0.5, 0.8

    def neg_elbo(log_args):
        a, r = np.exp(log_args)
        elog, ex = special.digamma(a) - np.log(r), a / r
        elog2 = special.polygamma(1, a) + elog**2
        prior = -elog - np.log(s * np.sqrt(2 * np.pi)) - (elog2 - 2 * m * elog + m * m) / (2 * s * s)
        return -(prior + y.sum() * elog - y.size * ex + stats.gamma(a, scale=1 / r).entropy())

    return _nelder_mead(neg_elbo, [y.sum() + 1, y.size + 1])


_LEGENDRE = special.roots_legendre(2000)


def _best_beta(y):
    """ELBO of Beta(a, b) with the likelihood's expectation by 2000-node Gauss–Legendre on (0, 1)."""
    t, wt = _LEGENDRE
    x, wx = 0.5 * (t + 1), 0.5 * wt
    s = 0.1 + 0.8 * x
    loglik = y.sum() * np.log(s) + (y.size - y.sum()) * np.log1p(-s)

    def neg_elbo(log_args):
        a, b = np.exp(log_args)
        q = stats.beta(a, b)
        e_lik = wx @ (q.pdf(x) * loglik)
        e_prior = (A0 - 1) * (special.digamma(a) - special.digamma(a + b)) + (B0 - 1) * (
            special.digamma(b) - special.digamma(a + b)) - special.betaln(A0, B0)
        return -(e_lik + e_prior + q.entropy())

    return _nelder_mead(neg_elbo, [5.0, 5.0])


def _nelder_mead(fn, start):
    res = scipy.optimize.minimize(fn, np.log(start), method="Nelder-Mead",
                                  options=dict(xatol=1e-10, fatol=1e-13, maxiter=8000))
    assert res.success, res.message
    return np.exp(res.x)


# ---------------------------------------------------------------- Normal–Gamma regression and a discrete switch (tests/families/test_expfam_gaussian.py)
# the Normal–Gamma regression of tests/families/test_expfam_gaussian.py, whose prior there is
# Gamma(A0, B0) with A0, B0 = 3.0, 2.0 there (not the Beta/Gamma priors A0, B0 above)
NG_A0, NG_B0 = 3.0, 2.0


def regression(X, y=None):
    tau = numpyro.sample("tau", dist.Gamma(NG_A0, NG_B0))
    w = numpyro.sample("w", dist.Normal(0.0, 2.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, 1.0 / jnp.sqrt(tau)), obs=y)


def _cavi_regression(X, y, iters=2000):
    n, d = X.shape
    e_tau = NG_A0 / NG_B0
    for _ in range(iters):
        prec = e_tau * X.T @ X + np.eye(d) / 4.0
        cov = np.linalg.inv(prec)
        m = cov @ (e_tau * X.T @ y)
        a = NG_A0 + n / 2
        b = NG_B0 + 0.5 * (np.sum((y - X @ m) ** 2) + np.trace(X.T @ X @ cov))
        e_tau = a / b
    return m, cov, a, b


def _regression_data(seed=2, n=50):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 3)) * np.array([1.0, 3.0, 0.3])  # unscaled columns
    y = X @ np.array([0.5, -0.2, 2.0]) + rng.normal(0, 0.8, n)
    return X, y


RATES = (1.5, 4.0)


def switch(y=None):
    z = numpyro.sample("z", dist.Bernoulli(0.3))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.where(z == 1, RATES[1], RATES[0])), obs=y)


# ---------------------------------------------------------------- the conjugate linear regression in closed form (tests/test_posterior.py)
NOISE, PRIOR = 0.5, 2.0


def closed_form_linear(X, y):
    precision = np.eye(X.shape[1]) / PRIOR**2 + X.T @ X / NOISE**2
    mean = np.linalg.solve(precision, X.T @ y / NOISE**2)
    return Gaussian(jnp.asarray(mean), jnp.asarray(precision))


# ---------------------------------------------------------------- a non-centred hierarchy and its grouped data (tests/curvature/test_memory.py)
def noncentred(g, x, y=None, num_groups=6):
    """Hierarchical linear regression, non-centred: loc = μ_a + s_a ã[g] + (μ_b + s_b b̃[g]) x is not affine in z."""
    mu_a = numpyro.sample("mu_a", dist.Normal(0.0, 5.0))
    s_a = numpyro.sample("s_a", dist.HalfNormal(2.0))
    mu_b = numpyro.sample("mu_b", dist.Normal(0.0, 5.0))
    s_b = numpyro.sample("s_b", dist.HalfNormal(2.0))
    a_raw = numpyro.sample("a_raw", dist.Normal(0.0, 1.0).expand([num_groups]).to_event(1))
    b_raw = numpyro.sample("b_raw", dist.Normal(0.0, 1.0).expand([num_groups]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(mu_a + s_a * a_raw[g] + (mu_b + s_b * b_raw[g]) * x, sigma), obs=y)


def grouped_data(n, groups, seed=0):
    rng = np.random.default_rng(seed)
    g = np.concatenate([np.arange(groups), rng.integers(0, groups, n - groups)])
    x = rng.normal(size=n)
    a, b = 1.0 + 0.7 * rng.normal(size=groups), -0.5 + 0.4 * rng.normal(size=groups)
    return jnp.asarray(g), jnp.asarray(x), jnp.asarray(a[g] + b[g] * x + 0.8 * rng.normal(size=n))


# ---------------------------------------------------------------- one fit per family and store (tests/protocols/test_sites.py)
N = 20
TOL = 1e-12
# name: (kind, family, storage); the Gaussian rows cover every curvature store
CASES = {
    "full-factor": ("gaussian", "full", "factor"),
    "full-dense": ("gaussian", "full", "dense"),
    "diagonal": ("gaussian", "diagonal", "auto"),
    "isotropic": ("gaussian", "isotropic", "auto"),
    "lowrank-sparse": ("gaussian", "lowrank-1", "sparse"),
    "beta": ("ef", {"p": "beta"}, None),
    "gamma": ("ef", {"rate": "gamma"}, None),  # a prior that is not conjugate-form
}


def _fit(name):
    kind, family, storage = CASES[name]
    if kind == "gaussian":
        X, y = make_logistic(N, 3, seed=4)
        return pc.fit(logistic_model, X, y, family=family, storage=storage, tol=TOL)
    if name == "beta":
        return pc.fit(beta_bernoulli, y=jnp.asarray(_bern(N, seed=1)), family=family, tol=TOL)
    return pc.fit(lognormal_poisson, y=jnp.asarray(_pois(N, seed=2)), family=family, tol=TOL)


# ---------------------------------------------------------------- local latents (one latent per unit of the data plate)
UNIT_TAU = 2.0  # known scale of the conjugate normal hierarchy's unit effects


def normal_hierarchy(sigma, y=None):
    """Conjugate normal hierarchy: mu ~ N(0, 10), a_i ~ N(mu, UNIT_TAU), y_i ~ N(a_i, sigma_i)."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("units", sigma.shape[0]):
        a = numpyro.sample("a", dist.Normal(mu, UNIT_TAU))
        numpyro.sample("y", dist.Normal(a, sigma), obs=y)


def normal_hierarchy_data(n=12, seed=0):
    rng = np.random.default_rng(seed)
    sigma = rng.uniform(0.5, 3.0, n)
    return jnp.asarray(sigma), jnp.asarray(1.5 + UNIT_TAU * rng.normal(size=n) + sigma * rng.normal(size=n))


def normal_hierarchy_posterior(sigma, y):
    """Exact posterior of mu, ``(mean, precision)``: each unit's marginal is N(mu, sigma_i² + tau²)."""
    w = 1.0 / (np.asarray(sigma) ** 2 + UNIT_TAU ** 2)
    precision = 1.0 / 100.0 + w.sum()
    return float(np.sum(w * np.asarray(y)) / precision), float(precision)
