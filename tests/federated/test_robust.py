"""Bounded aggregation against one rogue client (:mod:`numpyro_pc.federated.robust`, issue 28 item 2).

The honest sites are the exact sites of conjugate Bayesian linear regression (``S_k = X_kᵀX_k``,
``h_k = X_kᵀy_k``, prior ``N(0, I)``; orthogonal columns for the diagonal family): no model runs, and the
honest posterior is known exactly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg
import pytest

from numpyro_pc import errors
from numpyro_pc.families.registry import GaussianNatural, get_family
from numpyro_pc.federated.robust import aggregate_sites

SHARE, SHIFT = 1.0, 3.0
BOUND = SHIFT * (1 + 2 * SHARE) / (1 + SHARE)  # the module docstring's c (1 + 2γ) / (1 + γ): 4.5 sds
DIM, HONEST = 4, 5


def _honest(family_name, seed=3):
    """The honest clients' sites in the family's format and the prior's natural parameters."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=DIM)
    lin, prec = [], []
    for _ in range(HONEST):
        X = rng.normal(size=(40, DIM))
        if family_name == "diagonal":  # orthogonal columns: the diagonal site is the exact one
            X = np.linalg.qr(X)[0] * np.sqrt(40 * rng.uniform(0.5, 1.5, DIM))
        y = X @ w + rng.normal(size=40)
        lin.append(X.T @ y)
        prec.append(X.T @ X if family_name == "full" else np.diag(X.T @ X))
    prior = GaussianNatural(jnp.zeros(DIM), jnp.eye(DIM) if family_name == "full" else jnp.ones(DIM))
    return GaussianNatural(jnp.asarray(np.stack(lin)), jnp.asarray(np.stack(prec))), prior


def _dense(p):
    p = np.asarray(p)
    return p if p.ndim == 2 else np.diag(p)


def _posterior(prior, lin, prec):
    P = _dense(prior.precision) + sum(_dense(p) for p in prec)
    return P, np.linalg.solve(P, np.asarray(prior.linear) + sum(np.asarray(h) for h in lin))


def _rogues(family_name, sites, prior):
    """Every message the issue lists, and near-replays of all honest data but one client's (the case in which
    the stated bound exceeds ``c``: such a rogue is measured against that reference)."""
    fmt = (lambda m: m) if family_name == "full" else np.diag  # noqa: E731
    out = {f"linear {lin:g}, precision {p:g} I": (np.full(DIM, lin), fmt(p * np.eye(DIM)))
           for lin in (1e3, 1e6, 1e11) for p in (1e-6, 1.0, 1e9)}
    out["linear -1e11, precision 1e9 I"] = (np.full(DIM, -1e11), fmt(1e9 * np.eye(DIM)))
    out["replay of client 0"] = (np.asarray(sites.linear[0]), np.asarray(sites.precision[0]))
    out["replay of client 0, times 1e3"] = (1e3 * np.asarray(sites.linear[0]), 1e3 * np.asarray(sites.precision[0]))
    P_H, m_H = _posterior(prior, sites.linear, sites.precision)
    for i in range(HONEST):
        keep = np.array([j for j in range(HONEST) if j != i])
        P_i, m_i = _posterior(prior, sites.linear[keep], sites.precision[keep])
        S = (1 - 1e-9) * SHARE * P_i  # within the share against P_H ⪰ P_i
        u = P_i @ (m_i - m_H)
        u *= (1 - 1e-9) * SHIFT / np.sqrt(u @ np.linalg.solve(P_i, u))  # a pull of c sds of P_i towards m_i
        if family_name == "diagonal":  # the diagonal family's posteriors are diagonal: so is P_i
            S = np.diag(S)
            out[f"near-replay of all but client {i}"] = (S * m_i + u, S)
        else:
            out[f"near-replay of all but client {i}"] = (S @ m_i + u, S)
    return out


def _shift(prior, total, P_H, m_H):
    P = _dense(prior.precision) + _dense(total.precision)
    m = np.linalg.solve(P, np.asarray(prior.linear + total.linear))
    return np.sqrt((m - m_H) @ P_H @ (m - m_H)), scipy.linalg.eigh(P, P_H, eigvals_only=True)


@pytest.mark.parametrize("family_name", ["full", "diagonal"])
def test_one_rogue_moves_the_mean_by_at_most_the_stated_bound_and_clips_no_honest_client(x64, family_name):
    family = get_family(family_name)
    sites, prior = _honest(family_name)
    bounds = (jnp.asarray(SHARE), jnp.asarray(SHIFT))
    P_H, m_H = _posterior(prior, sites.linear, sites.precision)
    # the premise: each honest client is within both bounds against the other honest clients
    for i in range(HONEST):
        keep = np.array([j for j in range(HONEST) if j != i])
        P_i, m_i = _posterior(prior, sites.linear[keep], sites.precision[keep])
        g = np.asarray(sites.linear[i]) - _dense(sites.precision[i]) @ m_i
        assert scipy.linalg.eigh(_dense(sites.precision[i]), P_i, eigvals_only=True).max() <= SHARE
        assert np.sqrt(g @ np.linalg.solve(P_i, g)) <= SHIFT
    worst = 0.0
    for name, (h, S) in _rogues(family_name, sites, prior).items():
        eta = jax.tree.map(lambda a, b: jnp.concatenate([a, jnp.asarray(b)[None]]), sites, GaussianNatural(h, S))
        total, clipped = aggregate_sites(family, prior, eta, bounds)
        clipped = np.asarray(clipped)
        assert not clipped[:-1].any(), (name, clipped)  # no honest client is clipped because of the rogue
        shift, eig = _shift(prior, total, P_H, m_H)
        assert shift <= BOUND * (1 + 1e-9), (name, shift)
        assert eig.max() <= 1 + SHARE + 1e-9 and eig.min() >= 1 - 1e-9, (name, eig)  # P_H ⪯ P ⪯ (1 + γ) P_H
        unbounded, _ = _shift(prior, aggregate_sites(family, prior, eta, None)[0], P_H, m_H)
        if unbounded > BOUND:
            assert clipped[-1], name
        worst = max(worst, shift)
    # the rogues that pull hardest are held at c itself (clipped against the honest posterior), not below it
    np.testing.assert_allclose(worst, SHIFT, rtol=1e-6)


@pytest.mark.parametrize("family_name", ["full", "diagonal"])
def test_a_run_whose_bounds_no_client_reaches_is_the_unbounded_sum_bit_for_bit(x64, family_name):
    family = get_family(family_name)
    sites, prior = _honest(family_name)
    want, _ = aggregate_sites(family, prior, sites, None)
    for bounds in ((SHARE, SHIFT), (1e300, 1e300)):  # the honest clients are within (γ, c) = (1, 3)
        got, clipped = aggregate_sites(family, prior, sites, tuple(map(jnp.asarray, bounds)))
        assert not np.asarray(clipped).any()
        np.testing.assert_array_equal(np.asarray(got.linear), np.asarray(want.linear))
        np.testing.assert_array_equal(np.asarray(got.precision), np.asarray(want.precision))


def test_the_isotropic_family_bounds_each_client_alone(x64):
    # the isotropic global step ignores the sites' precisions (P = τ I): a rogue's precision changes nothing
    family = get_family("isotropic")
    tau = 4.0
    prior = GaussianNatural(jnp.zeros(DIM), jnp.asarray(tau))
    honest = jnp.asarray(np.random.default_rng(0).normal(size=(HONEST, DIM)))  # ‖h‖ / √τ ≈ 1 < c
    for h, p in ((1e11, 0.0), (1e3, 1e9), (-1e6, 1.0)):
        eta = GaussianNatural(jnp.concatenate([honest, jnp.full((1, DIM), h)]), jnp.asarray([0.0] * HONEST + [p]))
        total, clipped = aggregate_sites(family, prior, eta, (jnp.asarray(SHARE), jnp.asarray(SHIFT)))
        assert np.asarray(clipped).tolist() == [False] * HONEST + [True]
        moved = np.asarray(total.linear - honest.sum(0)) / tau  # m − m_H
        np.testing.assert_allclose(np.sqrt(tau) * np.linalg.norm(moved), SHIFT, rtol=1e-12)  # exactly c sds


def test_low_rank_sites_are_refused(x64):
    family = get_family("lowrank-1")
    eta = GaussianNatural(jnp.zeros((2, DIM)), jnp.zeros((2, DIM, 2)))
    with pytest.raises(errors.MissingCapabilityError, match="projection of the site sum"):
        aggregate_sites(family, GaussianNatural(jnp.zeros(DIM), jnp.zeros((DIM, 2))), eta, (1.0, 2.0))
