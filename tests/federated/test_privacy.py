"""Differentially private sites: calibration, clipping, noise scale, budget, in-process and Flower clients."""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpyro_pc as pc
from numpyro_pc import federated
from numpyro_pc.federated.core import LocalConfig, bind_clients, client_site, clipped_site, local_update
from numpyro_pc.federated.flower import ClientLogic, ServerLogic
from numpyro_pc.federated.privacy import GaussianMechanism, add_noise, clip_factors, clip_rows, finite_rows
from numpyro_pc.families.registry import Gaussian, GaussianNatural

from models import logistic_model, make_logistic, scale_model, make_linear


def test_mechanism_is_calibrated_to_the_stated_epsilon_delta():
    mech = GaussianMechanism(1.0, 1e-5, releases=6)
    # T releases of sensitivity √2 and noise σ: T/σ²-zCDP, then ε = ρ + 2√(ρ log 1/δ) (Bun & Steinke 2016)
    rho = 6 / mech.noise**2
    assert math.isclose(rho + 2 * math.sqrt(rho * math.log(1e5)), 1.0, rel_tol=1e-12)
    assert math.isclose(mech.epsilon_after(6), 1.0, rel_tol=1e-12)
    assert mech.epsilon_after(1) < mech.epsilon_after(3) < 1.0
    # more releases at the same ε need more noise per release: σ ∝ √T
    assert math.isclose(GaussianMechanism(1.0, 1e-5, releases=24).noise, 2 * mech.noise, rel_tol=1e-12)
    for bad in (dict(epsilon=0.0), dict(delta=1.0), dict(releases=0), dict(clip_linear=-1.0), dict(releases=2.5)):
        kw = dict(epsilon=1.0, delta=1e-5, releases=3) | bad
        with pytest.raises(pc.errors.InvalidOptionError):
            GaussianMechanism(**kw)


def _cfg(model, X, y, family, privacy, rule="delta"):
    spec, stack, _ = bind_clients(model, [(X, y)])
    cfg = LocalConfig(spec, pc.families.get_family(family), rule, 16, privacy=privacy, chunk_size=16)
    return cfg, tuple(x[0] for x in stack.per_example), stack.mask[0], stack.shared


@pytest.mark.parametrize("model,family,rule", [(logistic_model, "full", "gh"), (logistic_model, "diagonal", "delta"),
                                               (scale_model, "full", "delta")])
def test_clipped_site_without_clipping_is_the_exact_site(x64, model, family, rule):
    # GLM (per-example a aᵀ terms) and a non-GLM model (per-example Hessians): the same sums
    X, y = make_linear(37, 3, seed=4) if model is scale_model else make_logistic(37, 3, seed=4)
    cfg, ex, mask, shared = _cfg(model, X, y, family, GaussianMechanism(1.0, 1e-5, 1, 1e12, 1e12), rule)
    d = cfg.spec.latent.dim
    q = Gaussian(0.1 * jnp.arange(d, dtype=float), cfg.family.project_curvature(3.0 * jnp.eye(d)))
    exact, clipped = client_site(cfg, q, ex, mask, shared), clipped_site(cfg, q, ex, mask, shared)
    for a, b in zip(clipped, exact):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-12)


def test_each_example_moves_the_clipped_site_by_at_most_the_clip_norms(x64):
    X, y = make_logistic(40, 3, seed=2)
    X = X * 10.0  # large features: every example is clipped
    mech = GaussianMechanism(1.0, 1e-5, 1, clip_linear=0.3, clip_precision=0.2)
    cfg, ex, mask, shared = _cfg(logistic_model, X, y, "full", mech)
    q = Gaussian(jnp.full(4, 0.2), jnp.eye(4))
    full = clipped_site(cfg, q, ex, mask, shared)
    for j in (0, 17, 39):  # remove one example (weight 0): the neighbouring shard
        site = clipped_site(cfg, q, ex, mask.at[j].set(0.0), shared)
        assert np.linalg.norm(np.asarray(full.linear - site.linear)) <= 0.3 * (1 + 1e-12)
        assert np.linalg.norm(np.asarray(full.precision - site.precision)) <= 0.2 * (1 + 1e-12)


def test_a_private_local_update_moves_by_at_most_the_clip_norms_when_one_example_is_removed(x64):
    # end to end: the whole local step (not only the clipped sum) has the sensitivity the
    # accounting assumes; same noise key on both neighbouring shards, and the PSD projection
    # is non-expansive, so the released sites differ by at most (C_h, C_S)
    X, y = make_logistic(60, 3, seed=6)
    mech = GaussianMechanism(1.0, 1e-5, 3, clip_linear=0.5, clip_precision=0.5)
    cfg, ex, mask, shared = _cfg(logistic_model, X, y, "full", mech, "gh")
    q_jnt = Gaussian(jnp.array([0.1, -0.2, 0.3, 0.0]), 4.0 * jnp.eye(4))
    eta = GaussianNatural(jnp.zeros(4), 2.0 * jnp.eye(4))
    key = jax.random.PRNGKey(0)
    step = jax.jit(local_update, static_argnums=0)
    full = step(cfg, q_jnt, eta, 0.5, ex, mask, shared, key)
    # the released site is the mechanism applied at the server's q_jnt (a point the removed
    # example does not move), not at the client's local optimum
    expected = add_noise(cfg.family, mech, clipped_site(cfg, q_jnt, ex, mask, shared), key)
    for a, b in zip(full.site, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-12)
    for j in (0, 31, 59):
        near = step(cfg, q_jnt, eta, 0.5, ex, mask.at[j].set(0.0), shared, key)
        assert np.linalg.norm(np.asarray(full.site.linear - near.site.linear)) <= 0.5 * (1 + 1e-9)
        assert np.linalg.norm(np.asarray(full.site.precision - near.site.precision)) <= 0.5 * (1 + 1e-9)


def test_noise_has_the_calibrated_scale_and_the_precision_stays_psd(x64):
    mech = GaussianMechanism(2.0, 1e-5, releases=4, clip_linear=0.5, clip_precision=2.0)
    keys = jax.random.split(jax.random.PRNGKey(0), 4000)
    diag = pc.families.get_family("diagonal")
    big = GaussianNatural(jnp.zeros(5), jnp.full(5, 1e6))  # far from zero: the PSD projection never acts
    out = jax.vmap(lambda k: add_noise(diag, mech, big, k))(keys)
    # 20 000 draws each: the sample sd is within 2 % of the calibrated one (≈ 7 standard errors)
    assert abs(np.std(np.asarray(out.linear)) / (mech.noise * 0.5) - 1) < 0.02
    assert abs(np.std(np.asarray(out.precision)) / (mech.noise * 2.0) - 1) < 0.02
    full = pc.families.get_family("full")
    noisy = add_noise(full, mech, GaussianNatural(jnp.zeros(5), jnp.eye(5)), jax.random.PRNGKey(1))
    p = np.asarray(noisy.precision)
    np.testing.assert_array_equal(p, p.T)
    assert np.linalg.eigvalsh(p).min() >= -1e-9 * np.abs(p).max()


@pytest.fixture(scope="module")
def skewed():
    with jax.enable_x64(True):
        X, y = make_logistic(400, 3, seed=1)
        order = np.argsort(np.asarray(y), kind="stable")
        clients = [(X[i], y[i]) for i in np.array_split(order, 4)]
        joint = pc.fit(logistic_model, X, y, family="full", tol=1e-12)
    return clients, joint


def test_private_run_spends_its_budget_and_costs_accuracy(x64, skewed):
    clients, joint = skewed
    with pytest.raises(pc.errors.InvalidOptionError, match="calibrated for 3 release"):
        federated.run(logistic_model, clients, rounds=3, privacy=GaussianMechanism(1.0, 1e-5, 3))
    with pytest.raises(pc.errors.InvalidOptionError, match="admm"):
        federated.run(logistic_model, clients, algorithm="admm", rounds=3, privacy=GaussianMechanism(1.0, 1e-5, 4))
    kls = {}
    for eps in (1.0, 1e4):
        mech = GaussianMechanism(eps, 1e-5, releases=5, clip_linear=5.0, clip_precision=5.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # ends on its round budget
            result = federated.run(logistic_model, clients, rounds=4, reference=joint, keep_data=False, privacy=mech)
        eps_spent = result.column("epsilon")
        assert np.all(np.diff(eps_spent) > 0) and math.isclose(eps_spent[-1], eps, rel_tol=1e-9)
        assert np.all(np.isfinite(result.column("kl_to_reference")))
        kls[eps] = result.history[-1]["kl_to_reference"]
    # ε = 1 on 100 examples a client is mostly noise; ε = 1e4 is close to the exact fixed point
    assert kls[1e4] < 1e-2 < kls[1.0], kls


def test_flower_client_noises_its_sites_and_stops_when_its_budget_is_spent(x64, skewed):
    clients, _ = skewed
    mech = GaussianMechanism(1.0, 1e-5, releases=2)
    server = ServerLogic(2, "fedpc", "full", x64=True)
    private = ClientLogic(logistic_model, clients[0], privacy=mech, seed=3)
    honest = ClientLogic(logistic_model, clients[1])
    first = private.initial(server.config)
    exact = ClientLogic(logistic_model, clients[0]).initial(server.config)
    assert not np.allclose(first[0], exact[0])  # noised
    # the server's checks accept the noised, PSD-projected site
    server.aggregate_initial({"p": first, "h": honest.initial(server.config)})
    arrays = [np.asarray(server.state.mean), np.asarray(server.state.precision)]
    server.aggregate({"p": private.update(arrays, server.config)[0], "h": honest.update(arrays, server.config)[0]})
    assert server.history[-1]["rejected"] == {} and private.releases == 2
    with pytest.raises(pc.PrivacyError, match="covers 2 message"):
        private.update(arrays, server.config)
    with pytest.raises(pc.PrivacyError, match="admm"):
        ClientLogic(logistic_model, clients[0], privacy=mech).initial(dict(server.config, algorithm="admm"))


def test_client_app_takes_its_privacy_from_the_node_config_and_keeps_the_count_in_its_state(x64, skewed, tmp_path):
    pytest.importorskip("flwr", reason="Flower is not installed (optional extra numpyro-pc[federated])")
    from flwr.app import Context, RecordDict
    from flwr.common import FitIns, ndarrays_to_parameters, parameters_to_ndarrays

    from numpyro_pc.federated import flower

    X, y = skewed[0][0]
    np.savez(tmp_path / "shard.npz", arg0=np.asarray(X), arg1=np.asarray(y))
    run_config = {"model": "models:logistic_model", "num-clients": 1, "rounds": 1, "x64": True}
    node = {"data": str(tmp_path / "shard.npz"), "dp-epsilon": 1.0, "dp-releases": 2}
    state, server = RecordDict(), ServerLogic(1, "fedpc", "full", x64=True)

    def fit(arrays, phase):  # a ClientApp is rebuilt for every message: budget and site come from the state
        client = flower._client_fn(Context(0, 5, node, state, run_config))
        return client.fit(FitIns(ndarrays_to_parameters(arrays), dict(server.config, phase=phase)))

    first = parameters_to_ndarrays(fit([], "init").parameters)
    exact = ClientLogic(logistic_model, (X, y)).initial(server.config)
    assert not np.allclose(first[0], exact[0])  # the node's own setting noised the site
    server.aggregate_initial({5: first})
    arrays = [np.asarray(server.state.mean), np.asarray(server.state.precision)]
    fit(arrays, "update")
    with pytest.raises(pc.PrivacyError, match="covers 2 message"):
        fit(arrays, "update")


def test_a_row_without_a_norm_is_dropped_not_spread():
    """A NaN or infinite example term has no norm to clip: its factor is 0 and the row is zeroed, so the
    clipped sum stays finite and equals the clipped sum of the other rows."""
    terms = jnp.asarray([[3.0, 4.0], [jnp.inf, 0.0], [jnp.nan, 1.0], [0.3, 0.4]])
    factors = clip_rows(terms, 1.0)
    np.testing.assert_allclose(np.asarray(factors), [0.2, 0.0, 0.0, 1.0], rtol=1e-6)  # float32 rounding of 1/5
    np.testing.assert_allclose(np.asarray(factors @ finite_rows(terms)), [0.9, 1.2], rtol=1e-6)


def test_a_gaussian_example_term_without_a_norm_is_dropped_not_spread(x64):
    """The Gaussian path's counterpart: an example whose site term is NaN or infinite gets clipping
    factors 0 (both parts) and adds nothing, so the clipped site stays finite and equals the clipped
    site of the other examples."""
    d = 2
    terms = GaussianNatural(jnp.asarray([[3.0, 4.0], [jnp.nan, 0.0], [0.1, 0.2], [0.3, 0.4]]),
                            jnp.asarray([np.eye(d), np.eye(d), np.full((d, d), np.inf), 0.1 * np.eye(d)]))
    mech = GaussianMechanism(1.0, 1e-5, 1, clip_linear=1.0, clip_precision=1.0)
    c_lin, c_prec = clip_factors(terms, mech)
    np.testing.assert_allclose(np.asarray(c_lin), [0.2, 0.0, 0.0, 1.0], rtol=1e-12)
    np.testing.assert_allclose(np.asarray(c_prec), [1 / np.sqrt(2), 0.0, 0.0, 1.0], rtol=1e-12)
    # end to end: one example's features so large (finite data) that its curvature term overflows to
    # ∞ / NaN; the release is finite, the clipped site of the other examples
    X, y = make_logistic(12, 2, seed=3)
    cfg, ex, mask, shared = _cfg(logistic_model, X.at[5].set(1e200), y, "full", mech)
    q = Gaussian(jnp.full(3, 0.1), jnp.eye(3))
    site = clipped_site(cfg, q, ex, mask, shared)
    assert all(bool(jnp.all(jnp.isfinite(v))) for v in site)
    rest = clipped_site(cfg, q, ex, mask.at[5].set(0.0), shared)
    for a, b in zip(site, rest):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-14)


def _label_prior_logistic(X, y=None):
    """Logistic regression whose intercept prior is written with the data (its mean is the first label)."""
    import numpyro
    import numpyro.distributions as dist

    b = numpyro.sample("b", dist.Normal(y[0], 1.0))
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def test_a_private_gaussian_run_refuses_a_prior_that_depends_on_the_data(x64, skewed):
    # the prior (m_0, P_0) leaves outside the mechanism: written with the data it would reveal a label
    clients, _ = skewed
    mech = GaussianMechanism(1e30, 1e-5, releases=3, clip_linear=1e6, clip_precision=1e6)
    with pytest.raises(pc.PrivacyError, match=r"the prior depends on the data"):
        federated.run(_label_prior_logistic, clients, rounds=2, privacy=mech)
    server = ServerLogic(2, "fedpc", "full", x64=True)
    mixed = (jnp.concatenate([clients[0][0][:3], clients[3][0][:3]]), jnp.concatenate([clients[0][1][:3],
                                                                                        clients[3][1][:3]]))
    with pytest.raises(pc.PrivacyError, match="client 0's row 0 and client 0's row 5"):  # a Flower client: its rows
        ClientLogic(_label_prior_logistic, mixed, privacy=mech).initial(server.config)
    with warnings.catch_warnings():  # without privacy nothing leaves outside a mechanism: not refused
        warnings.simplefilter("ignore", RuntimeWarning)
        federated.run(_label_prior_logistic, clients, rounds=1)
    ClientLogic(logistic_model, clients[0], privacy=mech).initial(server.config)  # a data-free prior: as before
