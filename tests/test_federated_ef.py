"""Federated posterior correction for exponential-family posteriors (issue 13), float64.

Oracles:

* conjugate pairs (Beta–Bernoulli, Gamma–Poisson, Dirichlet–Categorical, a Bernoulli latent):
  the sites do not depend on ``λ``, so one round gives the batch posterior ``pc.fit`` on all
  the data and the closed form (1e-10);
* non-conjugate likelihood (misclassified Bernoulli, Beta factor) and non-conjugate prior
  (LogNormal prior, Gamma factor): with every site corrected the federated fixed point is the
  batch BLR fixed point (1e-8) and the ELBO optimum found by scipy (1e-6); one round is not;
* mixed family (Gamma precision × full Gaussian weights): the batch fit and closed-form CAVI;
* ADMM (Beta–Bernoulli, Gamma–Poisson, misclassified Bernoulli): the batch posterior (KL < 1e-8),
  and in the conjugate models the error of eq. ``admm`` round by round in closed form;
* malformed messages and AMA: typed refusals, the server's state unchanged.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special, stats

import numpyro_pc as pc
from numpyro_pc import federated
from numpyro_pc.errors import ClientMessageError, InvalidOptionError, MissingCapabilityError, OutOfDomainError
from numpyro_pc.federated import ef

from test_expfam import (_best_beta, _best_gamma, _data, _y, beta_bernoulli, closed_form,
                         dirichlet_categorical, gamma_poisson, lognormal_poisson, misclassified)
from test_expfam_mixed import RATES, _cavi_regression, _regression_data, regression, switch

RELEASE_PROGRAMS_EACH_TEST = True  # large programs, rarely shared: keeps a worker's memory bounded (conftest)

SIZES = (10, 20, 30)  # unequal shards: the padded rows must not count


def _shards(kind, d, sizes=SIZES):
    return [(_y(kind, part),) for part in np.split(d, np.cumsum(sizes)[:-1])]


def _args(natural, post):
    return np.concatenate([np.ravel(v) for _, (_, a) in post.family.describe(natural).items() for v in a.values()])


@pytest.mark.parametrize("kind, model, site, family", [
    ("bern", beta_bernoulli, "p", "beta"), ("pois", gamma_poisson, "rate", "gamma"),
    ("cat", dirichlet_categorical, "pi", "dirichlet")])
def test_conjugate_one_round_is_the_batch_posterior(x64, kind, model, site, family):
    d = _data(2)[kind]
    batch = pc.fit(model, y=_y(kind, d), family={site: family})
    with pytest.warns(RuntimeWarning, match="rounds reached"):
        one = federated.run(model, _shards(kind, d), family={site: family}, rounds=1)
    np.testing.assert_allclose(one.posterior.natural, batch.natural, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(_args(one.posterior.natural, batch), closed_form(kind, d), rtol=1e-10)
    post = one.posterior
    assert post.num_examples == d.size and post.conjugate_prior and post.residual < 1e-10
    np.testing.assert_allclose(post.prior_natural, batch.prior_natural, rtol=1e-12, atol=1e-12)
    # the round after changes nothing: converged, and the clients' local posteriors equal the global one
    again = ef.run_ef(model, _shards(kind, d), {site: family}, rounds=5, rho=0.05)
    assert again.converged and again.rounds == 2 and again.history[-1]["residual"] < 1e-12


def test_bernoulli_latent_one_round(x64):
    y = np.random.default_rng(4).poisson(2.0, 12).astype(float)
    batch = pc.fit(switch, y=jnp.asarray(y), family={"z": "bernoulli"})
    res = ef.run_ef(switch, [(jnp.asarray(p),) for p in np.array_split(y, 3)], {"z": "bernoulli"}, rounds=3,
                    reference=batch)
    assert res.converged and res.history[0]["error_to_reference"] < 1e-10
    logit = special.logit(0.3) + np.sum(stats.poisson(RATES[1]).logpmf(y) - stats.poisson(RATES[0]).logpmf(y))
    np.testing.assert_allclose(res.posterior.mean["z"], special.expit(logit), rtol=1e-10)


def _errors(res):
    return res.column("error_to_reference")


def test_non_conjugate_likelihood_reaches_the_batch_fixed_point(x64):
    y = _data(4, n=40)["bern"]
    batch = pc.fit(misclassified, y=jnp.asarray(y), family={"p": "beta"})
    assert batch.record["max_site_nonlinearity"] > 1e-6  # the sites move with λ: corrections matter
    shards = [(jnp.asarray(p),) for p in np.split(y, [4, 12, 22])]  # four unequal clients
    res = ef.run_ef(misclassified, shards, {"p": "beta"}, rounds=40, reference=batch)
    err = _errors(res)
    print("misclassified, error per round:", " ".join(f"{e:.1e}" for e in err))
    assert res.converged and err[0] > 1e-3 and err[-1] < 1e-8
    np.testing.assert_allclose(res.posterior.natural, batch.natural, rtol=1e-8)
    np.testing.assert_allclose(_args(res.posterior.natural, batch), _best_beta(y), rtol=1e-6)
    assert res.posterior.residual < 1e-8
    # PVI (ρ = 1, damped sites) reaches the same fixed point
    pvi = federated.run(misclassified, shards, family={"p": "beta"}, algorithm="pvi", damping=0.7, rounds=80)
    assert pvi.converged
    np.testing.assert_allclose(pvi.posterior.natural, batch.natural, rtol=1e-8)
    # so does ADMM (its fixed point has λ_k = λ_jnt, hence λ_jnt = λ_0 + Σ η_k)
    admm = federated.run(misclassified, shards, family={"p": "beta"}, algorithm="admm", rounds=80, reference=batch)
    kl = admm.column("kl_to_reference")
    print("misclassified, ADMM KL per round:", " ".join(f"{e:.1e}" for e in kl))
    assert admm.converged and kl[0] > 1e-3 and kl[-1] < 1e-8
    np.testing.assert_allclose(admm.posterior.natural, batch.natural, rtol=1e-8)


def test_non_conjugate_prior_travels_with_the_first_client(x64):
    y = _data(3, n=25)["pois"]
    batch = pc.fit(lognormal_poisson, y=jnp.asarray(y), family={"rate": "gamma"})
    shards = [(jnp.asarray(p),) for p in np.array_split(y, 3)]
    clients = ef.bind_ef_clients(lognormal_poisson, shards, {"rate": "gamma"})
    assert not clients.conjugate and np.asarray(clients.prior_weight).tolist() == [1.0, 0.0, 0.0]
    res = ef.run_ef(lognormal_poisson, shards, {"rate": "gamma"}, rounds=30, reference=batch)
    err = _errors(res)
    print("lognormal prior, error per round:", " ".join(f"{e:.1e}" for e in err))
    assert res.converged and err[0] > 1e-5 and err[-1] < 1e-8
    np.testing.assert_allclose(res.posterior.natural, batch.natural, rtol=1e-8)
    np.testing.assert_allclose(_args(res.posterior.natural, batch), _best_gamma(y), rtol=1e-6)
    assert not res.posterior.conjugate_prior and res.posterior.residual < 1e-8


def test_mixed_gamma_and_full_gaussian_regression(x64):
    X, y = _regression_data()
    family = {"tau": "gamma", "w": "full"}
    batch = pc.fit(regression, jnp.asarray(X), y=jnp.asarray(y), family=family)
    shards = [(jnp.asarray(X[r]), jnp.asarray(y[r])) for r in np.split(np.arange(50), [12, 30])]
    res = ef.run_ef(regression, shards, family, rounds=40, reference=batch)
    err = _errors(res)
    print("regression, error per round:", " ".join(f"{e:.1e}" for e in err), "rho used", res.history[-1]["rho_max"])
    assert res.converged and err[0] > 1e-3 and err[-1] < 1e-8
    np.testing.assert_allclose(res.posterior.natural, batch.natural, rtol=1e-8, atol=1e-8)
    m, cov, a, b = _cavi_regression(X, y)
    q = res.posterior.distributions()
    np.testing.assert_allclose(q["w"].loc, m, rtol=1e-7)
    np.testing.assert_allclose(q["w"].covariance_matrix, cov, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose([q["tau"].concentration, q["tau"].rate], [a, b], rtol=1e-7)


@pytest.mark.parametrize("kind, model, site, family", [
    ("bern", beta_bernoulli, "p", "beta"), ("pois", gamma_poisson, "rate", "gamma")])
def test_admm_reaches_the_central_posterior(x64, kind, model, site, family):
    """ADMM's server step, eq. ``admm`` in natural parameters. In a conjugate model round one makes the sites
    exact (``η_k = η̂_k``); from then on every local posterior equals ``λ_jnt``, so with ``S = λ_⋆ − λ_0`` the error
    is ``(1 − ρK)/(1 + ρK) S`` after round one and shrinks by ``1 − α = ρK/(1 + ρK)`` per round: a FedPC step (which
    lands on ``λ_⋆`` in one round) or a wrong ``α`` fails these checks."""
    d = _data(2)[kind]
    central = pc.fit(model, y=_y(kind, d), family={site: family})
    num, rho = len(SIZES), 0.1
    res = federated.run(model, _shards(kind, d), family={site: family}, algorithm="admm", rho=rho, rounds=60,
                        reference=central)
    kl, err = res.column("kl_to_reference"), _errors(res)
    print(f"{kind}, ADMM ρ={rho}: {res.rounds} rounds; KL per round:", " ".join(f"{e:.1e}" for e in kl))
    assert res.converged and kl[0] > 1e-3  # the first round is not the answer
    # KL to 1e-8: float64 round-off in the KL of two equal posteriors is ~1e-13 (measured), far below
    assert kl[-1] < 1e-8 and float(res.posterior.family.kl(res.posterior.natural, central.natural)) < 1e-8
    # the stop came from the residual (λ_jnt reaching the sites' sum shrinks by 1 − α per round), not from a KL
    # waiting for its rounding to come out below 1e-16
    residual_met = np.flatnonzero(res.column("residual") <= 1e-10)
    assert res.rounds == residual_met[0] + 1
    np.testing.assert_allclose(_args(res.posterior.natural, central), closed_form(kind, d), rtol=1e-8)
    step = np.linalg.norm(central.natural - central.prior_natural) / np.linalg.norm(central.natural)
    np.testing.assert_allclose(err[0], abs(1 - rho * num) / (1 + rho * num) * step, rtol=1e-10)
    # rounds 2-6: errors ≥ 1e-5, so the ratios hold to round-off (1e-16 / 1e-5 relative)
    np.testing.assert_allclose(err[1:6] / err[:5], rho * num / (1 + rho * num), rtol=1e-8)
    # the default ρ = 1/K gives α = 1/2 and a first round that is exact; the stop needs one more round
    default = ef.run_ef(model, _shards(kind, d), {site: family}, algorithm="admm", rounds=5, reference=central)
    assert default.converged and default.rounds <= 3 and default.history[0]["error_to_reference"] < 1e-12


@pytest.mark.parametrize("kind, model, site, family", [
    ("bern", beta_bernoulli, "p", "beta"), ("pois", gamma_poisson, "rate", "gamma")])
def test_the_kl_stop_rule_knows_the_kl_rounding(x64, kind, model, site, family):
    """``KL`` of two nearly equal posteriors is a difference of log-normalisers of size ~40–70 here: its float64
    rounding (~1e-13) is far above the default stop ``1e-16``. Oracle: 200 pairs equal to 1e-15 relative (true KL
    ~1e-28) all within ``kl_rounding``, and a pair with a true KL of ~1e-9 well above it (the floor is not a
    loose tolerance)."""
    d = _data(2)[kind]
    post = pc.fit(model, y=_y(kind, d), family={site: family})
    fam, lam = post.family, post.natural
    rng = np.random.default_rng(0)
    near = [lam * (1 + 1e-15 * jnp.asarray(rng.normal(size=lam.shape))) for _ in range(200)]
    worst = max(abs(float(fam.kl(other, lam))) for other in near)
    floor = float(ef.kl_rounding(fam, lam, lam))
    assert 1e-15 < worst <= floor < 1e-11
    apart = lam * (1 + 1e-4 * jnp.asarray(rng.normal(size=lam.shape)))
    assert float(fam.kl(apart, lam)) > 100 * float(ef.kl_rounding(fam, apart, lam))


def test_admm_combination_outside_the_domain_is_refused(x64):
    y = jnp.asarray(_data(4, n=12)["bern"])
    clients = ef.bind_ef_clients(beta_bernoulli, [(y[:6],), (y[6:],)], {"p": "beta"})
    fam, state = clients.config.family, ef.init_ef(clients)
    local = jnp.stack([clients.prior + 10.0] * 2)  # two local posteriors well inside the domain
    inside = ef.admm_server_ef(fam, state, local, 0.5)  # α ∈ (0, 1]: a convex combination
    np.testing.assert_allclose(inside.joint, clients.prior + 5.0, rtol=1e-14)
    assert bool(fam.in_domain(inside.joint)) and state.joint is None
    with pytest.raises(OutOfDomainError, match="convex"):  # α = 3 extrapolates to λ_0 − 20
        ef.admm_server_ef(fam, state, local, 3.0)
    with pytest.raises(ClientMessageError, match="finite"):
        ef.admm_server_ef(fam, state, local.at[0, 0].set(jnp.nan), 0.5)


def test_ama_is_refused_with_the_reason(x64):
    y = jnp.asarray(_data(4, n=12)["bern"])
    with pytest.raises(MissingCapabilityError, match="precision fixed by the prior") as err:
        federated.run(beta_bernoulli, [(y[:6],), (y[6:],)], family={"p": "beta"}, algorithm="ama")
    assert "natural parameters are learned" in str(err.value) and "'admm'" in str(err.value)


def test_malformed_messages_are_refused_and_leave_the_state(x64):
    y = _data(4, n=40)["bern"]
    shards = [(jnp.asarray(p),) for p in np.array_split(y, 3)]
    clients = ef.bind_ef_clients(misclassified, shards, {"p": "beta"})
    fam = clients.config.family
    state, _ = ef.round_ef(clients, ef.init_ef(clients), rho=1.0 / 3)
    before = np.array(state.sites)
    lam = np.asarray(ef.global_natural(state))
    good = np.asarray(state.sites[1]) + 0.5
    cases = [(np.array([np.nan, 1.0]), "finite"), (np.ones(3), r"shape \(2,\)"),
             (np.asarray(state.sites[2]) - np.array([lam[0] + 5.0, 0.0]), "domain"),
             (np.array([1, 2]), "dtype float64")]
    for message, what in cases:
        with pytest.raises(ClientMessageError, match=what) as err:
            ef.aggregate_ef(fam, state, {1: good, 2: message})
        assert err.value.client == 2
        np.testing.assert_array_equal(np.asarray(state.sites), before)
    with pytest.raises(ClientMessageError, match="client index"):
        ef.aggregate_ef(fam, state, {7: good})
    # not strict: the bad client keeps its site, the good one is stored
    new, rejected = ef.aggregate_ef(fam, state, {1: good, 2: np.array([np.inf, 0.0])}, strict=False)
    assert list(rejected) == [2] and "finite" in rejected[2]
    np.testing.assert_array_equal(np.asarray(new.sites[2]), before[2])
    np.testing.assert_array_equal(np.asarray(new.sites[1]), good)
    np.testing.assert_array_equal(np.asarray(state.sites), before)
    # each message alone keeps λ inside, together they do not: refused, nothing stored
    shift = np.array([0.6 * (lam[0] + 1.0), 0.0])
    with pytest.raises(OutOfDomainError, match="together"):
        ef.aggregate_ef(fam, state, {k: np.asarray(state.sites[k]) - shift for k in (0, 1)})
    np.testing.assert_array_equal(np.asarray(state.sites), before)


def test_option_refusals(x64):
    y = jnp.asarray(_data(4, n=12)["bern"])
    shards = [(y[:6],), (y[6:],)]
    with pytest.raises(InvalidOptionError, match="fedpc"):
        ef.run_ef(beta_bernoulli, shards, {"p": "beta"}, algorithm="sgd")
    with pytest.raises(InvalidOptionError, match="admm_alpha"):
        ef.run_ef(beta_bernoulli, shards, {"p": "beta"}, admm_alpha=0.5)
    with pytest.raises(InvalidOptionError, match="PVI"):
        ef.run_ef(beta_bernoulli, shards, {"p": "beta"}, algorithm="pvi", rho=0.5)
    with pytest.raises(InvalidOptionError, match="Gaussian"):
        federated.run(beta_bernoulli, shards, family={"p": "beta"}, max_share=0.5)
