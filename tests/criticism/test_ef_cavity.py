"""Criticism and diagnostics of exponential-family product posteriors (issue 26, item 2):
``pc.loo``, ``pc.information_gain`` and ``pc.correction_magnitude`` on Beta, Gamma and
Dirichlet posteriors.

Oracles: the closed-form leave-one-out predictives of the conjugate pairs (beta-binomial,
negative binomial, Dirichlet-categorical; the cavity ``λ + g_i`` is exact there and the
Gauss rules integrate these likelihoods to rounding), exact refits without the example for a
non-conjugate prior, the Beta KL written with SciPy's special functions, and a Monte Carlo
standard deviation of the site log-ratio for the correction magnitude.
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from scipy import special

import numpyro_pc as pc
from numpyro_pc import errors
from numpyro_pc.criticism.ef_cavity import ef_predictive
from numpyro_pc.sites.expfam import compute_sites as compute_ef_sites

from models import A0, B0, _bern, _cat, _pois, beta_bernoulli, dirichlet_categorical, flat_beta_bernoulli, lognormal_poisson
from models import misclassified

RATE0 = 0.5
ALPHA = np.array([1.0, 2.0, 3.0])  # dirichlet_categorical's prior


def gamma_poisson(y=None):
    rate = numpyro.sample("rate", dist.Gamma(A0, RATE0))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Poisson(rate), obs=y)


def _negative_binomial(c, a, r):
    """``log ∫ Poisson(c | x) Gamma(x | a, r) dx``."""
    return (special.gammaln(a + c) - special.gammaln(a) - special.gammaln(c + 1) + a * np.log(r / (r + 1))
            - c * np.log(r + 1))


def _beta_kl(a1, b1, a2, b2):
    """``KL(Beta(a1, b1) ‖ Beta(a2, b2))``."""
    return (special.betaln(a2, b2) - special.betaln(a1, b1) + (a1 - a2) * special.digamma(a1)
            + (b1 - b2) * special.digamma(b1) + (a2 - a1 + b2 - b1) * special.digamma(a1 + b1))


def _exact_loo(kind, d):
    """Closed-form ``log p(y_i | y_{-i})`` of the conjugate pairs."""
    if kind == "beta":
        a, b = A0 + d.sum(), B0 + (1 - d).sum()
        return np.where(d == 1, np.log((a - 1) / (a + b - 1)), np.log((b - 1) / (a + b - 1)))
    if kind == "gamma":
        return _negative_binomial(d, A0 + d.sum() - d, RATE0 + d.size - 1)
    counts = ALPHA + np.bincount(d, minlength=3)
    return np.log((counts[d] - 1) / (counts.sum() - 1))


# the Gauss rules of Beta and Gamma integrate these likelihoods to rounding (1e-10); a Dirichlet has no
# rule, so its predictives are means over the rule's 2048 fixed draws (0.8 % each): its leave-one-out
# *change* log p(y_i | y_-i) − log p(y_i | y), 0.03–0.04 here, is checked instead, where the draws' error
# largely cancels (2e-4 measured; 2e-3 allowed, well below the change itself)
CONJUGATE = [("beta", beta_bernoulli, {"p": "beta"}, _bern(), 1e-10),
             ("gamma", gamma_poisson, {"rate": "gamma"}, _pois(), 1e-10),
             ("dirichlet", dirichlet_categorical, {"pi": "dirichlet"}, _cat(), 2e-3)]


# ---------------------------------------------------------------- leave-one-out


@pytest.mark.parametrize("kind, model, family, data, atol", CONJUGATE, ids=[c[0] for c in CONJUGATE])
def test_loo_of_conjugate_pairs_is_the_closed_form(x64, kind, model, family, data, atol):
    y = jnp.asarray(data, jnp.int32 if kind == "dirichlet" else jnp.float64)
    post = pc.fit(model, y=y, family=family)
    result = pc.loo(post)
    # exact cavities: the sites of a conjugate pair are constants
    if kind == "dirichlet":
        in_sample = ef_predictive(post, np.broadcast_to(np.asarray(post.natural), (data.size, 3)), np.arange(data.size))
        counts = ALPHA + np.bincount(data, minlength=3)
        change = _exact_loo(kind, data) - np.log(counts[data] / counts.sum())
        np.testing.assert_allclose(result.pointwise - in_sample, change, rtol=0, atol=atol)
    else:
        np.testing.assert_allclose(result.pointwise, _exact_loo(kind, np.asarray(data)), rtol=0, atol=atol)
    np.testing.assert_array_equal(result.ids, np.arange(len(data)))
    assert np.all((result.khat > 0) & (result.khat < 0.7))  # one of N examples: a small but real KL
    assert float(result["p_loo"]) > 0 and not result.refitted.any()


def test_corrected_loo_of_a_non_conjugate_prior_is_the_refit(x64):
    c = _pois()
    post = pc.fit(lognormal_poisson, y=jnp.asarray(c), family={"rate": "gamma"}, tol=1e-12)
    chosen = np.array([0, 7, 19])
    result = pc.loo(post, method="corrected", where=chosen)
    assert result.refitted.tolist() == np.isin(np.arange(c.size), chosen).tolist()
    for i in chosen:  # the oracle: a fit without example i, scored by the negative binomial in closed form
        rest = pc.fit(lognormal_poisson, y=jnp.asarray(np.delete(c, i)), family={"rate": "gamma"}, tol=1e-12)
        (_, args), = rest.family.describe(rest.natural).values()
        a, r = (float(v) for v in args.values())
        # both fixed points to a 1e-12 relative residual: the predictive agrees far below 1e-8
        np.testing.assert_allclose(result.pointwise[i], _negative_binomial(c[i], a, r), rtol=0, atol=1e-8)
    cheap = pc.loo(post)
    # site removal keeps the other examples' stale sites; with k̂ ~ 0.5 the error measured is 5e-5
    np.testing.assert_allclose(cheap.pointwise, result.pointwise, rtol=0, atol=1e-3)
    assert np.max(np.abs(cheap.pointwise[chosen] - result.pointwise[chosen])) > 1e-8  # the refit did change them


def test_loo_refuses_the_taylor_cavity_with_the_reason(x64):
    post = pc.fit(beta_bernoulli, y=jnp.asarray(_bern()), family={"p": "beta"})
    with pytest.raises(errors.UnsupportedGuideError, match="linear in its sufficient statistics"):
        pc.loo(post, method="taylor")
    with pytest.raises(errors.UnsupportedGuideError, match="found dict"):
        pc.loo({"p": 0.3})


def test_az_compare_ranks_exponential_family_loo_results(x64):
    import arviz as az

    y = jnp.asarray(_bern())
    good = pc.loo(pc.fit(beta_bernoulli, y=y, family={"p": "beta"}))
    worse = pc.loo(pc.fit(misclassified, y=y, family={"p": "beta"}))
    table = az.compare({"beta": good, "misclassified": worse})
    assert set(table.index) == {"beta", "misclassified"}
    assert np.isclose(table.loc["beta", "elpd_loo"], float(good["elpd_loo"]))


# ---------------------------------------------------------------- information gain


def test_information_gain_of_a_conjugate_update_and_deletion(x64):
    y = _bern()
    old = pc.fit(beta_bernoulli, y=jnp.asarray(y[:40]), family={"p": "beta"})
    new = old.update(y=jnp.asarray(y[40:]))
    gain = pc.information_gain(old, new)
    s1, s2 = y[:40].sum(), y.sum()
    want = _beta_kl(A0 + s2, B0 + y.size - s2, A0 + s1, B0 + 40 - s1)
    np.testing.assert_allclose(gain["kl"], want, rtol=1e-10)
    # conjugate sites are constants: nothing to correct, and the parts add up to the KL to rounding
    assert abs(gain["correction"]) < 1e-10 and gain["removed"] == 0.0
    a, b = A0 + s2, B0 + y.size - s2  # new data: −Σ E[ℓ̂_i] with ℓ̂_i = −y log p − (1 − y) log(1 − p)
    e_log_p, e_log_q = special.digamma(a) - special.digamma(a + b), special.digamma(b) - special.digamma(a + b)
    np.testing.assert_allclose(gain["new_data"], np.sum(y[40:] * e_log_p + (1 - y[40:]) * e_log_q), rtol=1e-10)
    assert abs(gain["identity_error"]) < 1e-10 and gain["new_data"] < 0
    gone = new.delete([1, 2, 3])
    loss = pc.information_gain(new, gone)
    assert loss["new_data"] == 0.0 and abs(loss["correction"]) < 1e-10 and loss["removed"] > 0
    assert abs(loss["identity_error"]) < 1e-10


def test_information_gain_of_a_non_conjugate_update_has_a_correction(x64):
    y = _bern()
    old = pc.fit(misclassified, y=jnp.asarray(y[:40]), family={"p": "beta"}, tol=1e-12)
    new = old.update(y=jnp.asarray(y[40:]), tol=1e-12)
    gain = pc.information_gain(old, new)
    # the identity holds up to the two fixed points' residuals (1e-12 relative to λ ~ 60)
    assert abs(gain["identity_error"]) < 1e-9 * gain["kl"] + 1e-10
    assert gain["correction"] > 1e-2  # the old sites moved: this model's sites depend on q
    vcl = old.update(y=jnp.asarray(y[40:]), correction="none", tol=1e-12)
    assert abs(pc.information_gain(old, vcl)["correction"]) < 1e-10  # VCL keeps the old sites


def test_information_gain_refuses_posteriors_of_two_kinds(x64):
    y = jnp.asarray(_bern())
    ef = pc.fit(beta_bernoulli, y=y, family={"p": "beta"})
    with pytest.raises(errors.IncompatiblePosteriorsError, match="another dual-form posterior.*got int"):
        pc.information_gain(ef, 3)
    with pytest.raises(errors.UnsupportedGuideError, match="found int"):
        pc.information_gain(3, ef)
    other = pc.fit(gamma_poisson, y=jnp.asarray(_pois()), family={"rate": "gamma"})
    with pytest.raises(errors.IncompatiblePosteriorsError, match="different latent sites"):
        pc.information_gain(ef, other)
    flat = pc.fit(flat_beta_bernoulli, y=y, family={"p": "beta"})  # the same site and family, another model
    with pytest.raises(errors.IncompatiblePosteriorsError, match="one model"):
        pc.information_gain(ef, flat)
    gaussian = pc.fit(beta_bernoulli, y=y)  # the same latent site, in the full Gaussian family
    with pytest.raises(errors.IncompatiblePosteriorsError, match="different families"):
        pc.information_gain(ef, gaussian)
    with pytest.raises(errors.IncompatiblePosteriorsError, match="different families"):
        pc.information_gain(gaussian, ef)


# ---------------------------------------------------------------- correction magnitude


def test_correction_magnitude_is_zero_for_conjugate_sites(x64):
    y = _bern()
    post = pc.fit(beta_bernoulli, y=jnp.asarray(y[:40]), family={"p": "beta"})
    out = pc.correction_magnitude(post, y=jnp.asarray(y[40:]))
    assert out["magnitude"].shape == (40,) and np.all(out["magnitude"] < 1e-10)
    np.testing.assert_array_equal(out["ids"], np.arange(40))


def test_correction_magnitude_is_the_spread_of_the_site_log_ratio(x64):
    y = _bern()
    post = pc.fit(misclassified, y=jnp.asarray(y[:40]), family={"p": "beta"}, tol=1e-12)
    out = pc.correction_magnitude(post, y=jnp.asarray(y[40:]))
    vcl = post.update(y=jnp.asarray(y[40:]), correction="none", tol=1e-12)
    fresh = pc.fit(misclassified, y=jnp.asarray(y[:40]), family={"p": "beta"}, tol=1e-12)  # only for its config
    sites = compute_ef_sites(fresh.config, vcl.natural, post.data).grads
    draws = vcl.family.sample(vcl.natural, jax.random.PRNGKey(0), 400_000)
    log_ratio = vcl.family.stats(draws) @ (sites - post.state.grads).T  # ⟨δg_i, T(x)⟩ per draw
    # 4e5 draws: the standard deviation's relative standard error is about 0.1 %
    np.testing.assert_allclose(out["magnitude"], np.std(np.asarray(log_ratio), 0), rtol=1e-2)
    np.testing.assert_allclose(out["by_site"]["p"], out["magnitude"], rtol=1e-12)  # one latent site
    assert out["total"] > 0 and np.isclose(out["total"], out["magnitude"].sum())


# ---------------------------------------------------------------- influence


def test_influence_of_a_beta_posterior_is_the_closed_form(x64):
    y = _bern()
    post = pc.fit(beta_bernoulli, y=jnp.asarray(y), family={"p": "beta"})
    odds = lambda mean: mean["p"] / (1 - mean["p"])  # noqa: E731
    out = pc.influence(post, fn=odds)
    assert tuple(out.delta) == ("remove_site", "influence") and out.labels == ("p",)
    a, b = A0 + y.sum(), B0 + (1 - y).sum()
    loo_mean = np.where(y == 1, (a - 1) / (a + b - 1), a / (a + b - 1))  # the exact leave-one-out posterior's
    np.testing.assert_allclose(out.delta["remove_site"][:, 0], loo_mean - a / (a + b), rtol=0, atol=1e-12)
    # first order: removing y_i = 1 lowers a by one, ∂/∂a a/(a+b) = b/(a+b)²; y_i = 0 lowers b
    first = np.where(y == 1, -b, a) / (a + b) ** 2
    np.testing.assert_allclose(out.delta["influence"][:, 0], first, rtol=1e-10)
    np.testing.assert_allclose(out.function["remove_site"], loo_mean / (1 - loo_mean) - a / b, rtol=0, atol=1e-12)
    with pytest.raises(errors.UnsupportedGuideError, match="removing a site is exact"):
        pc.influence(post, estimators=("tracin",))


def test_influence_of_a_dirichlet_posterior_moves_each_probability(x64):
    d = _cat()
    post = pc.fit(dirichlet_categorical, y=jnp.asarray(d, jnp.int32), family={"pi": "dirichlet"})
    out = pc.influence(post, estimators=("remove_site",))
    counts = ALPHA + np.bincount(d, minlength=3)
    loo = (counts[None, :] - np.eye(3)[d]) / (counts.sum() - 1)
    np.testing.assert_allclose(out.delta["remove_site"], loo - counts / counts.sum(), rtol=0, atol=1e-12)
    assert out.labels == ("pi[0]", "pi[1]", "pi[2]") and out.function is None
    np.testing.assert_allclose(out.delta["remove_site"].sum(1), 0.0, atol=1e-12)  # stays on the simplex


# ---------------------------------------------------------------- LOO-PIT


def normal_mean(y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def test_loo_pit_of_a_normal_mean_is_the_closed_form(x64):
    from scipy import stats

    y = np.random.default_rng(5).normal(1.0, 1.0, 6)  # few examples: each one moves the posterior
    post = pc.fit(normal_mean, y=jnp.asarray(y), family={"mu": "normal"})
    pit = pc.criticism.loo_pit(post, jax.random.PRNGKey(0), num_samples=20000)
    precision = 1 / 4 + y.size - 1  # the exact leave-one-out posterior of each example
    mean = (y.sum() - y) / precision
    want = stats.norm.cdf(y, mean, np.sqrt(1 + 1 / precision))
    # exact importance weights (the site ⟨g_i, T⟩), 20000 predictive draws: error 0.004 measured; the
    # in-sample PIT (no weights) is off by up to 0.038 here, so the tolerance tells them apart
    np.testing.assert_allclose(pit, want, rtol=0, atol=0.015)


# ---------------------------------------------------------------- correction factor


def test_correction_factor_of_a_beta_posterior_is_the_site_gap(x64):
    y = _bern()
    post = pc.fit(misclassified, y=jnp.asarray(y), family={"p": "beta"}, tol=1e-12)
    log_density = pc.handlers.correction_factor(post, memory=[0, 1, 2], correct_prior=False)
    g = np.asarray(post.state.grads[:3])
    for p in (0.2, 0.35, 0.6):  # −Σ_i (ℓ_i(p) − ⟨g_i, T(p)⟩), T(p) = (log p, log(1 − p))
        s = 0.1 + 0.8 * p
        loss = -(y[:3] * np.log(s) + (1 - y[:3]) * np.log1p(-s))
        want = -np.sum(loss - g @ np.array([np.log(p), np.log1p(-p)]))
        np.testing.assert_allclose(float(log_density({"p": jnp.asarray(p)})), want, rtol=1e-12)
    conjugate = pc.fit(beta_bernoulli, y=jnp.asarray(y), family={"p": "beta"})
    gap = pc.handlers.correction_factor(conjugate)  # exact sites: the gap is one constant
    values = [float(gap({"p": jnp.asarray(p)})) for p in (0.1, 0.5, 0.9)]
    np.testing.assert_allclose(values, values[0], rtol=0, atol=1e-10)
    with pytest.raises(pc.UnknownExampleError):
        pc.handlers.correction_factor(conjugate, memory=[999])


# ---------------------------------------------------------------- leave-future-out


@pytest.mark.parametrize("horizon", [1, 2])
def test_lfo_of_a_beta_posterior_is_the_sequential_predictive(x64, horizon):
    y = _bern(30, seed=7)
    result = pc.lfo(beta_bernoulli, y=jnp.asarray(y), initial=10, step=3, horizon=horizon,
                    fit_options={"family": {"p": "beta"}})
    want = []
    for i in result.ids:  # log p(y_{i+1:i+M} | y_{1:i}): the chain of beta-binomial one-step predictives
        a, b, total = A0 + y[:i].sum(), B0 + i - y[:i].sum(), 0.0
        for yj in y[i:i + horizon]:
            total += np.log((a if yj == 1 else b) / (a + b))
            a, b = a + yj, b + 1 - yj
        want.append(total)
    np.testing.assert_array_equal(result.ids, np.arange(10, 31 - horizon, 3))
    # exact streaming updates of a conjugate pair, and Gauss–Jacobi rules exact for these polynomials
    np.testing.assert_allclose(result.pointwise, want, rtol=0, atol=1e-10)


def recalibrated(y=None):  # a discrete global latent: which of two known rates
    z = numpyro.sample("z", dist.Bernoulli(0.5))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.where(z == 1, 4.0, 3.0)), obs=y)


def test_lfo_of_a_discrete_latent_is_the_exact_mixture_predictive(x64):
    from scipy import stats

    c = _pois(24, seed=8)
    result = pc.lfo(recalibrated, y=jnp.asarray(c), initial=12, step=4, fit_options={"family": {"z": "bernoulli"}})
    log_ratio = stats.poisson(4.0).logpmf(c) - stats.poisson(3.0).logpmf(c)
    want = []
    for i in result.ids:  # the exact posterior of z (enumeration), then the two-component predictive
        w = special.expit(log_ratio[:i].sum())
        want.append(np.log(w * stats.poisson(4.0).pmf(c[i]) + (1 - w) * stats.poisson(3.0).pmf(c[i])))
    np.testing.assert_allclose(result.pointwise, want, rtol=0, atol=1e-10)
