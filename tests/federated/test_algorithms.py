"""Federated posterior correction against the joint posterior, and the PVI failure case."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpyro_pc as pc
from numpyro_pc import federated
from numpyro_pc.datasets.loaders import load_breast_cancer
from numpyro_pc.federated.options import LocalSolve, Safeguard

from models import linear_model, logistic_model, make_linear, make_logistic


def non_iid(X, y, k):
    """``k`` shards sorted by the first feature: each client sees a different input range."""
    order = np.argsort(np.asarray(X[:, 0]))
    return [(X[i], y[i]) for i in np.array_split(order, k)]


@pytest.fixture(scope="module")
def logistic_case():
    with jax.enable_x64(True):
        X, y = make_logistic(300, 3, seed=5)
        joint = pc.fit(logistic_model, X, y, family="full", tol=1e-12)
    return X, y, joint


@pytest.mark.parametrize("algorithm,rho", [("fedpc", 0.2), ("pvi", None), ("admm", 0.2)])
def test_federated_reaches_the_joint_posterior_with_non_iid_clients(x64, logistic_case, algorithm, rho):
    X, y, joint = logistic_case
    result = federated.run(logistic_model, non_iid(X, y, 10), family="full", algorithm=algorithm, rho=rho,
                           rounds=80, reference=joint)
    assert result.converged, result.history[-1]
    assert float(result.posterior.kl(joint)) < 1e-8
    assert result.history[-1]["kl_to_reference"] < 1e-8
    # the posterior over the union of the shards is a dual form at its optimum
    assert result.posterior.residual < 1e-6
    hist = result.history
    assert [h["round"] for h in hist] == list(range(1, len(hist) + 1))
    assert hist[-1]["bytes"] == sum(h["bytes_up"] + h["bytes_down"] for h in hist)
    d = joint.dim
    per_message = (d + d * d) * 8
    assert hist[0]["bytes_down"] == 10 * per_message


@pytest.fixture(scope="module")
def breast_cancer_case():
    # the case: 569 × 30, logistic, prior N(0, 1), six clients with label-sorted shards
    X, y, _ = load_breast_cancer()
    order = np.argsort(y, kind="stable")
    with jax.enable_x64(True):
        X, y = jnp.asarray(X), jnp.asarray(y)
        clients = [(X[i], y[i]) for i in np.array_split(order, 6)]
        joint = pc.fit(logistic_model, X, y, family="full", tol=1e-12)
    return clients, joint


@pytest.mark.parametrize("rho", [None, 0.05, 0.1, 0.2, 0.5, 1.0])
def test_fedpc_converges_for_every_rho_on_label_sorted_clients(x64, breast_cancer_case, rho):
    clients, joint = breast_cancer_case
    result = federated.run(logistic_model, clients, rho=rho, rounds=40, reference=joint, keep_data=False)
    kl = result.column("kl_to_reference")
    assert result.converged, result.history[-1]
    assert np.all(np.isfinite(kl)) and kl[-1] < 1e-10
    # the clients' weights never go below the requested floor, and stay ≤ 1 + margin
    assert min(h["rho_min"] for h in result.history) >= (rho or 1 / 6) - 1e-12
    assert max(h["rho_max"] for h in result.history) <= 1.3 + 1e-9


def test_without_the_safeguard_small_rho_diverges_on_label_sorted_clients(x64, breast_cancer_case):
    clients, joint = breast_cancer_case
    with pytest.warns(RuntimeWarning, match="diverged|lost finiteness"):
        result = federated.run(logistic_model, clients, rho=0.2, rounds=10, reference=joint, keep_data=False,
                               safeguard=False)
    assert result.status == "diverged" and not result.converged


def test_partial_participation_still_converges(x64, logistic_case):
    X, y, joint = logistic_case
    result = federated.run(logistic_model, non_iid(X, y, 10), family="full", rho=0.5, fraction=0.3, rounds=200,
                           reference=joint, seed=3)
    assert all(h["participants"] == 3 for h in result.history)
    assert result.converged
    assert float(result.posterior.kl(joint)) < 1e-8


# The documented case for the paper's claim (§3.4, after Tseng 1991): ridge-regularised
# least squares (MAP, isotropic family with τ = prior precision = 1), noise 3, 10 clients
# of 10 points sorted by x₁. One round multiplies the summed site error by about
# A (1 − ρK) / (A + ρτ) with A ≈ 1.1 the per-client curvature: ≈ −4.7 for PVI (ρ = 1),
# ≈ −1.9 with PVI's damping 0.5, while FedPC with ρ = 0.19 < 2/K contracts.
PVI_CASE = dict(noise=3.0, prior_scale=1.0)


@pytest.fixture(scope="module")
def ridge_case():
    with jax.enable_x64(True):
        X, y = make_linear(100, 2, seed=7, noise=3.0)
        joint = pc.fit(linear_model, X, y, family="isotropic", tol=1e-12, **PVI_CASE)
    return X, y, joint


def test_undamped_pvi_diverges_where_fedpc_with_small_rho_converges(x64, ridge_case):
    # the paper's claim (§3.4, after Tseng 1991): with a quadratic regulariser every ρ in (0, 2/K)
    # converges, to the joint solution; ρ = 1 (PVI) is outside that range for K > 2 and diverges here
    # (the plain iteration: the line search of the global step off)
    X, y, joint = ridge_case
    clients = non_iid(X, y, 10)
    plain = Safeguard(line_search=False)
    for rho in (0.05, 0.1, 0.19):  # across (0, 2/K) = (0, 0.2); rounds grow like 1/ρ (809 at ρ = 0.05)
        fedpc = federated.run(linear_model, clients, family="isotropic", algorithm="fedpc", rho=rho, rounds=1000,
                              reference=joint, kwargs=PVI_CASE, keep_data=False, safeguard=plain)
        assert fedpc.converged, (rho, fedpc.history[-1])
        assert fedpc.history[-1]["kl_to_reference"] < 1e-10
        np.testing.assert_allclose(np.asarray(fedpc.state.mean), np.asarray(joint.mean), rtol=1e-6, atol=1e-8)
    # outside the range nothing is promised: here ρ = 0.25 > 2/K already diverges
    with pytest.warns(RuntimeWarning, match="stopped after"):
        beyond = federated.run(linear_model, clients, family="isotropic", rho=0.25, rounds=100, reference=joint,
                               kwargs=PVI_CASE, keep_data=False, safeguard=plain)
    kl = beyond.column("kl_to_reference")
    assert kl[-1] > 1e3 * kl[0]
    # with the line search (the default) the same ρ converges: a round that raises the MAP objective is damped
    searched = federated.run(linear_model, clients, family="isotropic", rho=0.25, rounds=300, reference=joint,
                             kwargs=PVI_CASE, keep_data=False)
    assert searched.converged, searched.history[-1]
    assert searched.history[-1]["kl_to_reference"] < 1e-10
    with pytest.warns(RuntimeWarning, match="stopped after"):
        pvi = federated.run(linear_model, clients, family="isotropic", algorithm="pvi", rounds=30, reference=joint,
                            kwargs=PVI_CASE)
    kl = pvi.column("kl_to_reference")
    assert not pvi.converged
    assert kl[-1] > 1e6 * kl[0]  # the error grows geometrically, round after round
    assert np.all(np.diff(kl[5:]) > 0)
    with pytest.warns(RuntimeWarning):
        damped = federated.run(linear_model, clients, family="isotropic", algorithm="pvi", damping=0.5, rounds=30,
                               reference=joint, kwargs=PVI_CASE)
    assert damped.column("kl_to_reference")[-1] > 1e3


@pytest.mark.filterwarnings("ignore:federated:RuntimeWarning")
def test_ama_is_isotropic_delta_fedpc(x64, ridge_case):
    X, y, joint = ridge_case
    clients = non_iid(X, y, 10)
    ama = federated.run(linear_model, clients, algorithm="ama", rho=0.15, rounds=5, kwargs=PVI_CASE,
                        raise_on_failure=False, keep_data=False)
    iso = federated.run(linear_model, clients, family="isotropic", local=LocalSolve(expectation="delta"), rho=0.15, rounds=5,
                        kwargs=PVI_CASE, keep_data=False, safeguard=Safeguard(line_search=False))
    np.testing.assert_allclose(np.asarray(ama.state.mean), np.asarray(iso.state.mean), rtol=1e-12)
    # the AMA global step is the MAP condition of the prior plus linear sites: P0 (m − m0) = −Σ ĝ_k
    g = -jnp.sum(ama.sites.linear, 0)
    np.testing.assert_allclose(np.asarray(ama.state.mean), np.asarray(-g), rtol=1e-10)  # P0 = I, m0 = 0


def test_conjugate_full_gaussian_converges_in_one_round_for_any_rho(x64):
    # Gaussian likelihood, full family: every site is exact, so the first round is the joint.
    X, y = make_linear(60, 3, seed=2)
    joint = pc.fit(linear_model, X, y, family="full", tol=1e-12)
    for rho in (0.05, 1.0):
        result = federated.run(linear_model, non_iid(X, y, 6), rho=rho, rounds=3, reference=joint)
        assert result.converged
        assert result.history[0]["kl_to_reference"] < 1e-10


def test_bad_input_raises():
    X, y = make_linear(20, 2, seed=0)
    with pytest.raises(ValueError, match="unknown algorithm"):
        federated.run(linear_model, [(X, y)], algorithm="fedavg")
    with pytest.raises(ValueError, match="PVI uses"):
        federated.run(linear_model, [(X, y)], algorithm="pvi", rho=0.5)
    # refused by the family's capability, with the mathematical reason (FullGaussian learns its precision)
    for family in ("full", "diagonal"):
        with pytest.raises(pc.errors.MissingCapabilityError, match=r"needs a precision fixed by the prior .*"
                                                                    r"isotropic family.*precision is learned"):
            federated.run(linear_model, [(X, y)], algorithm="ama", family=family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        federated.run(linear_model, [(X, y)], algorithm="ama", family="isotropic", rounds=1)  # the family it needs
    with pytest.raises(ValueError, match="client_data is empty"):
        federated.run(linear_model, [])
    with pytest.raises(pc.DataShapeError, match="client 1"):
        federated.run(linear_model, [(X, y), (X[:, :1], y)])
    with pytest.raises(pc.ExpectationRuleError):
        federated.run(linear_model, [(X, y)], local=LocalSolve(expectation="mc"))


def test_a_client_with_another_number_of_features_is_told_both_shapes():
    # before: "expected ('w',) / ('y',)" — the same text on both sides of the comparison
    X, y = make_linear(20, 2, seed=0)
    wider = np.concatenate([np.asarray(X), np.ones((20, 1))], 1)
    with pytest.raises(pc.DataShapeError, match=r"client 1's shard .*w: shape \(3,\).* expected client 0's "
                                                r"\{w: shape \(2,\)\}"):
        federated.run(linear_model, [(X, y), (wider, y)])
