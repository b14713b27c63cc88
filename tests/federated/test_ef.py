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
* malformed messages and AMA: typed refusals, the server's state unchanged;
* privacy (issue 26): without noise and clipping the private run is the exact run (conjugate) and the
  ``ρ → ∞`` run (non-conjugate) to float64 rounding; one example moves the clipped site by at most
  ``clip_natural``; the noise has the calibrated standard deviation (20 000 draws, 2 %); ``epsilon`` is the
  Gaussian path's accounting; a noised sum outside the domain is pulled back halfway to the boundary
  (closed form for a Beta);
* bounded aggregation: a huge bound is the unbounded run bit for bit; a client with scaled, one-label data moves
  the posterior by at most ``KL ≤ c²/2`` and its share by at most ``γ`` in the Fisher metric, and is named.
"""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from scipy import special, stats

import numpyro_pc as pc
from numpyro_pc import federated
from numpyro_pc.errors import ClientMessageError, InvalidOptionError, MissingCapabilityError, OutOfDomainError
from numpyro_pc.federated import ef
from numpyro_pc.federated.options import LocalSolve, Robustness, StopRule
from numpyro_pc.federated.privacy import GaussianMechanism

from models import (_best_beta, _best_gamma, _data, _y, beta_bernoulli, closed_form,
                         dirichlet_categorical, gamma_poisson, lognormal_poisson, misclassified)
from models import RATES, _cavi_regression, _regression_data, regression, switch

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
    with pytest.raises(InvalidOptionError, match="Gaussian posteriors"):
        federated.run(beta_bernoulli, shards, family={"p": "beta"}, local=LocalSolve(expectation="gh"))


# ---------------------------------------------------------------- privacy and bounded aggregation (issue 26)


def _quiet(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # private runs end on their round budget
        return fn(*args, **kw)


def test_private_run_without_noise_is_the_exact_run(x64):
    """ε = 1e30 leaves noise of sd ~1e-15·C: below float64 rounding of the natural parameters (~10-100)."""
    d = _data(2)["bern"]
    shards = _shards("bern", d)
    exact = _quiet(federated.run, beta_bernoulli, shards, family={"p": "beta"}, rounds=2)
    # a Bernoulli example's term (y, 1 - y) has norm 1: clip_natural = 1 clips nothing
    mech = GaussianMechanism(1e30, 1e-5, releases=2, clip_natural=1.0)
    private = _quiet(federated.run, beta_bernoulli, shards, family={"p": "beta"}, rounds=2, privacy=mech)
    np.testing.assert_allclose(private.posterior.natural, exact.posterior.natural, rtol=1e-13)
    assert [h["domain_step"] for h in private.history] == [1.0, 1.0]
    # init="prior": the initial sites are the first release (3 in all)
    mech = GaussianMechanism(1e30, 1e-5, releases=3, clip_natural=1.0)
    first = _quiet(federated.run, beta_bernoulli, shards, family={"p": "beta"}, rounds=2, init="prior", privacy=mech)
    np.testing.assert_allclose(first.posterior.natural, exact.posterior.natural, rtol=1e-13)
    # a conjugate model's sites are exact from the first release: round 1 changes nothing and the run stops
    assert first.column("epsilon").tolist() == [mech.epsilon_after(2)]
    # non-conjugate: the private client sends its site at the global λ (the ρ → ∞ step), so the oracle is the
    # exact run with ρ = 1e30 and no safeguard, round by round
    y = _data(4, n=40)["bern"]
    shards = [(jnp.asarray(p),) for p in np.split(y, [4, 12, 22])]
    steps = _quiet(ef.run_ef, misclassified, shards, {"p": "beta"}, rounds=4, rho=1e30, safeguard=False,
                   stop=StopRule(tol=0.0, residual_tol=0.0))
    mech = GaussianMechanism(1e30, 1e-5, releases=4, clip_natural=1e3)  # noise sd ~1e-12
    private = _quiet(federated.run, misclassified, shards, family={"p": "beta"}, rounds=4, privacy=mech,
                     stop=StopRule(tol=0.0, residual_tol=0.0))
    assert private.rounds == steps.rounds == 4
    np.testing.assert_allclose(private.posterior.natural, steps.posterior.natural, rtol=1e-10)
    np.testing.assert_allclose(np.asarray(private.sites), np.asarray(steps.sites), rtol=1e-10, atol=1e-10)


def test_private_release_is_clipped_and_has_the_calibrated_noise(x64):
    y = _data(4, n=40)["bern"]
    clients = ef.bind_ef_clients(misclassified, [(jnp.asarray(y),)], {"p": "beta"})
    cfg, stack = clients.config, clients.stack
    ex, mask = tuple(x[0] for x in stack.per_example), stack.mask[0]
    lam = clients.prior + jnp.array([3.0, 5.0])
    args = (stack.shared, clients.prior_weight[0], clients.prior)
    terms = np.linalg.norm(np.asarray(ef.compute_sites(cfg, lam, ef.ModelData(ex, stack.shared)).grads), axis=1)
    clip = 0.5 * float(np.median(terms))  # about half the examples are clipped
    mech = GaussianMechanism(2.0, 1e-5, releases=4, clip_natural=clip)
    full = ef.clipped_site_ef(cfg, lam, ex, mask, *args, mech)
    # with a clip above every term the clipped site is the exact one
    loose = GaussianMechanism(2.0, 1e-5, releases=4, clip_natural=2 * float(terms.max()))
    exact = ef.local_update_ef(cfg, lam, jnp.zeros(2), 1e30, ex, mask, *args, 1e-12, 5).site
    np.testing.assert_allclose(ef.clipped_site_ef(cfg, lam, ex, mask, *args, loose), exact, rtol=1e-12)
    for j in (0, 17, 39):  # the neighbouring shard: one example removed
        near = ef.clipped_site_ef(cfg, lam, ex, mask.at[j].set(0.0), *args, mech)
        assert np.linalg.norm(np.asarray(full - near)) <= clip * (1 + 1e-12)
    keys = jax.random.split(jax.random.PRNGKey(0), 10000)
    released = jax.vmap(lambda k: ef.release_ef(cfg, lam, ex, mask, *args, mech, k))(keys)
    noise = np.asarray(released - full)  # 20 000 coordinates
    sd = mech.noise * clip / math.sqrt(2.0)
    # the sample sd to 2 % (its standard error is 0.5 %) and the mean to 4 standard errors
    assert abs(noise.std() / sd - 1) < 0.02 and abs(noise.mean()) < 4 * sd / math.sqrt(noise.size)


def test_private_epsilon_is_the_gaussian_accounting_and_the_posterior_stays_proper(x64):
    from models import linear_model, make_linear

    mech = GaussianMechanism(0.3, 1e-5, releases=4)  # much noise: the sum of the sites leaves the domain
    d = _data(2)["bern"]
    res = _quiet(federated.run, beta_bernoulli, _shards("bern", d), family={"p": "beta"}, rounds=4, privacy=mech,
                 seed=1)
    X, y = make_linear(30, 2, seed=0)
    gauss = _quiet(federated.run, linear_model, [(X[:15], y[:15]), (X[15:], y[15:])], rounds=3, privacy=mech,
                   keep_data=False)  # init="prior": 3 rounds + the initial sites = 4 releases
    np.testing.assert_array_equal(res.column("epsilon"), [mech.epsilon_after(t) for t in (1, 2, 3, 4)])
    np.testing.assert_array_equal(res.column("epsilon")[1:], gauss.column("epsilon"))
    assert res.history[-1]["epsilon"] == pytest.approx(0.3, rel=1e-12)
    steps = res.column("domain_step")
    print("private Beta-Bernoulli, domain steps:", steps)
    assert np.any(steps < 1) and np.all(steps > 0)
    assert bool(res.posterior.family.in_domain(res.posterior.natural))


def test_retreat_is_halfway_to_the_boundary(x64):
    fam = ef.bind_ef_clients(beta_bernoulli, [(jnp.ones(3),)], {"p": "beta"}).config.family
    prev, new = jnp.array([2.0, 0.5]), jnp.array([-4.0, 3.0])  # (α − 1, β − 1): α = −3 is outside
    lam, t = ef.retreat_ef(fam, prev, new)
    boundary = (-1.0 - 2.0) / (-4.0 - 2.0)  # α − 1 reaches −1 at t = 1/2
    np.testing.assert_allclose(float(t), boundary / 2, rtol=1e-12)
    np.testing.assert_allclose(lam, prev + boundary / 2 * (new - prev), rtol=1e-12)
    inside = jnp.array([1.0, 1.0])
    same, one = ef.retreat_ef(fam, prev, inside)
    assert float(one) == 1.0 and np.array_equal(np.asarray(same), np.asarray(inside))


def _rogue_shards():
    d = _data(2)["bern"]
    shards = _shards("bern", d)
    return shards + [(jnp.ones(300),)]  # client 3: 300 examples, all y = 1 (ten times a shard, one label)


def test_bounded_aggregation_with_a_huge_bound_is_the_unbounded_run(x64):
    shards = _rogue_shards()
    plain = _quiet(federated.run, beta_bernoulli, shards, family={"p": "beta"}, rounds=2)
    huge = _quiet(federated.run, beta_bernoulli, shards, family={"p": "beta"}, rounds=2,
                  robust=Robustness(max_share=1e300, max_shift=1e300))
    np.testing.assert_array_equal(np.asarray(huge.posterior.natural), np.asarray(plain.posterior.natural))
    np.testing.assert_array_equal(np.asarray(huge.sites), np.asarray(plain.sites))
    assert all(h["clipped"] == 0 and h["clipped_clients"] == [] for h in huge.history)


def test_bounded_aggregation_limits_a_client_with_scaled_data(x64):
    # KL(q ‖ q_-k) of the unbounded run: 0.60, 2.60, 3.99 for the honest clients, 61 for the rogue; c = 3
    # bounds it by 4.5
    shards, shift = _rogue_shards(), 3.0
    plain = _quiet(federated.run, beta_bernoulli, shards, family={"p": "beta"}, rounds=2)
    res = _quiet(federated.run, beta_bernoulli, shards, family={"p": "beta"}, rounds=2,
                 robust=Robustness(max_shift=shift))
    fam, sites = res.posterior.family, np.asarray(res.sites)
    rest = np.asarray(res.state.prior) + sites[:3].sum(0)  # the posterior of the honest clients
    print("KL to the honest clients' posterior, unbounded / bounded:", float(fam.kl(plain.posterior.natural, rest)),
          float(fam.kl(res.posterior.natural, rest)))
    assert float(fam.kl(plain.posterior.natural, rest)) > 10 * 0.5 * shift**2  # the rogue owns the posterior
    # KL(q ‖ q_-k) ≤ c²/2 (1e-12: the sum recomputed here rounds differently)
    # and no more tempered than needed: the bisection puts the KL on the bound (to 1e-9)
    assert 0.5 * shift**2 * (1 - 1e-9) <= float(fam.kl(res.posterior.natural, rest)) <= 0.5 * shift**2 * (1 + 1e-12)
    assert all(h["clipped_clients"] == [3] and h["clipped"] == 1 for h in res.history)
    # the tempered site is the rogue's own, scaled: a tempered likelihood
    step = np.asarray(res.posterior.natural) - rest
    np.testing.assert_allclose(step, step[0] / sites[3, 0] * sites[3], rtol=1e-12, atol=1e-12)


def test_private_and_bounded_together(x64):
    """The bound acts on the released (noised) sites: the rogue is still held to KL ≤ c²/2 against the honest
    clients' posterior as the server holds it."""
    shards, shift = _rogue_shards(), 3.0
    mech = GaussianMechanism(1e4, 1e-5, releases=2, clip_natural=1.0)
    res = _quiet(federated.run, beta_bernoulli, shards, family={"p": "beta"}, rounds=2,
                 robust=Robustness(max_shift=shift), privacy=mech)
    fam, sites = res.posterior.family, np.asarray(res.sites)
    rest = np.asarray(res.state.prior) + sites[:3].sum(0)
    assert res.history[-1]["clipped_clients"] == [3] and res.history[-1]["epsilon"] == pytest.approx(1e4)
    assert float(fam.kl(res.posterior.natural, rest)) <= 0.5 * shift**2 * (1 + 1e-12)


def test_bounded_share_and_undefined_shift(x64):
    fam = ef.bind_ef_clients(beta_bernoulli, [(jnp.ones(3),)], {"p": "beta"}).config.family
    prior = jnp.array([0.0, 0.0])
    sites = jnp.array([[3.0, 1.0], [2.0, 4.0], [40.0, 25.0]])
    ref = prior + jnp.sum(sites[:2], 0)
    lam, tempered, undefined = ef.bound_sites_ef(fam, prior, sites, ref, (jnp.asarray(0.5), jnp.asarray(jnp.inf)))
    fisher = np.asarray(fam.fisher(ref))
    norm = lambda v: math.sqrt(v @ fisher @ v)  # noqa: E731
    own = np.asarray(lam - prior - sites[0] - sites[1])
    assert np.asarray(tempered).tolist() == [False, False, True] and not np.any(np.asarray(undefined))
    np.testing.assert_allclose(norm(own), 0.5 * norm(np.asarray(sites[0] + sites[1])), rtol=1e-12)
    np.testing.assert_allclose(own / np.asarray(sites[2]), own[0] / float(sites[2, 0]), rtol=1e-12)
    # the others' posterior outside the domain: the shift bound has no meaning there, and says so
    bad = sites.at[0].set(jnp.array([-50.0, 0.0]))
    _, _, undefined = ef.bound_sites_ef(fam, prior, bad, ref, (jnp.asarray(jnp.inf), jnp.asarray(1.0)))
    assert np.asarray(undefined).tolist() == [False, True, True]


def test_privacy_and_bound_refusals(x64):
    y = jnp.asarray(_data(4, n=12)["bern"])
    shards = [(y[:6],), (y[6:],)]
    run = lambda **kw: federated.run(beta_bernoulli, shards, family={"p": "beta"}, **kw)  # noqa: E731
    with pytest.raises(InvalidOptionError, match="admm"):
        run(algorithm="admm", rounds=3, privacy=GaussianMechanism(1.0, 1e-5, 4))
    with pytest.raises(InvalidOptionError, match="ADMM"):
        run(algorithm="admm", robust=Robustness(max_share=1.0))
    with pytest.raises(InvalidOptionError, match="calibrated for 3 release"):
        run(rounds=3, init="prior", privacy=GaussianMechanism(1.0, 1e-5, 3))
    with pytest.raises(InvalidOptionError, match="one client"):
        federated.run(beta_bernoulli, [(y,)], family={"p": "beta"}, robust=Robustness(max_shift=1.0))
    with pytest.raises(InvalidOptionError, match="positive"):
        run(robust=Robustness(max_share=-1.0))


def test_a_private_round_needs_its_own_key(x64):
    """Without a key every release would carry the same noise (PRNGKey(0)): the difference of two releases
    would be the noise-free difference of the clients' data sums. Refused; two keys give two noises."""
    y = jnp.asarray(_data(4, n=12)["bern"])
    clients = ef.bind_ef_clients(beta_bernoulli, [(y[:6],), (y[6:],)], {"p": "beta"})
    mech = GaussianMechanism(1.0, 1e-5, releases=4, clip_natural=1.0)
    state = ef.init_ef(clients)
    for call in (lambda: ef.client_round_ef(clients, state, 1.0, privacy=mech),
                 lambda: ef.round_ef(clients, state, 1.0, privacy=mech),
                 lambda: ef.init_ef(clients, init="prior", privacy=mech)):
        with pytest.raises(InvalidOptionError, match="own random key"):
            call()
    first, second = (np.asarray(ef.client_round_ef(clients, state, 1.0, privacy=mech, key=jax.random.PRNGKey(k))[1])
                     for k in (1, 2))
    assert np.all(first != second)


def data_scaled_prior(y=None):
    # a prior written with the data: its scale is the shard's first count. The binding checks (the per-example
    # terms must add up to the joint; clients must share their shared arguments) do not see it: the prior term
    # is evaluated on the first row both ways
    rate = numpyro.sample("rate", dist.Gamma(2.0, 1.0 / (1.0 + y[0])))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Poisson(rate), obs=y)


def test_a_private_run_refuses_a_prior_that_depends_on_the_data(x64):
    # λ_0 is computed on one row of client 0 and released outside the mechanism: with a data-dependent prior
    # it would reveal that row; the same data with a data-free prior (gamma_poisson) runs as before
    y = _data(3, n=30)["pois"]
    shards = [(jnp.asarray(p),) for p in np.array_split(y, 3)]
    scaled = shards
    assert len({float(p[0][0]) for p in shards} | {float(p[0][-1]) for p in shards}) > 1
    mech = GaussianMechanism(1e30, 1e-5, releases=2, clip_natural=1e3)
    with pytest.raises(pc.errors.PrivacyError, match="the prior depends on the data"):
        federated.run(data_scaled_prior, scaled, family={"rate": "gamma"}, rounds=2, privacy=mech)
    clients = ef.bind_ef_clients(data_scaled_prior, scaled, {"rate": "gamma"})
    with pytest.raises(pc.errors.PrivacyError, match=r"client 0's row 0 and client \d's row \d+"):
        ef.check_prior_data_free(clients)
    ef.check_prior_data_free(ef.bind_ef_clients(gamma_poisson, shards, {"rate": "gamma"}))  # nothing raised
    private = _quiet(federated.run, gamma_poisson, shards, family={"rate": "gamma"}, rounds=2, privacy=mech)
    exact = _quiet(federated.run, gamma_poisson, shards, family={"rate": "gamma"}, rounds=2)
    np.testing.assert_allclose(private.posterior.natural, exact.posterior.natural, rtol=1e-12)
    # without privacy the data-dependent prior is not refused (nothing is released outside a mechanism)
    _quiet(federated.run, data_scaled_prior, scaled, family={"rate": "gamma"}, rounds=1)
    # a private Flower client checks its own rows before it sends λ_0 (a statistic passed as a shared argument
    # is the same on all of them: only the comparison across clients above sees it)
    from numpyro_pc.federated.ef_transport import EFClientLogic, EFServerLogic

    config = EFServerLogic(1, {"rate": "gamma"}, x64=True).fit_config(0, "init")
    client = EFClientLogic(gamma_poisson, shards[0], privacy=mech)
    assert len(client.initial(config)) == 3 and client._checked is not None
