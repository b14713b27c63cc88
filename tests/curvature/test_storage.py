"""Monte Carlo sites differentiated along each example's dependence subspace give every
operation the numbers of dense per-example Hessians (the same draws, ``∇²ℓ_i = P_iᵀ ∇²_u P_i``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import grouped_data, noncentred

import numpyro_pc as pc
from numpyro_pc.io import validation
from numpyro_pc.curvature.stores import Dense, JacobianFactor
from numpyro_pc.sites.expectations import ExpectationRule
from numpyro_pc.sites.gaussian import compute_sites

# both posteriors carry the same Monte Carlo error, and it is not what these tests compare
pytestmark = pytest.mark.filterwarnings("ignore::numpyro_pc.errors.MonteCarloErrorWarning")

# the two paths differ only by rounding (site Hessians agree to 1e-14), amplified by the solver's
# tolerance 1e-8 on the residual: means to 1e-8, derived quantities to 1e-6 of their scale
TOL = 1e-6


@pytest.fixture(scope="module")
def pair():
    with jax.enable_x64(True):
        g, x, y = grouped_data(48, 6, seed=3)
        first = (g[:40], x[:40], y[:40])
        posts = {"dense": pc.fit(noncentred, *first, expectation="mc"), "along": pc.fit(noncentred, *first)}
        yield posts, (g[40:], x[40:], y[40:])


def _close(a, b, scale=1.0):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=TOL, atol=TOL * scale)


def test_the_default_rule_is_the_subspace_one_with_the_dense_numbers(pair, x64):
    posts, _ = pair
    dense, along = posts["dense"], posts["along"]
    assert isinstance(dense.sites.curv, Dense) and isinstance(along.sites.curv, JacobianFactor)
    assert (along.rule.kind, along.rule.subspace_dim) == ("mc", 6) and dense.rule.subspace_dim == 0
    assert along.sites.curv.stored_numbers() < dense.sites.curv.stored_numbers() / 2
    np.testing.assert_allclose(along.mean, dense.mean, rtol=0, atol=1e-8)
    scale = float(jnp.max(jnp.abs(dense.state.precision)))  # structural zeros come back as ~1e-15
    np.testing.assert_allclose(along.state.precision, dense.state.precision, rtol=1e-8, atol=1e-10 * scale)
    # the site computations themselves, at one state, agree to rounding
    at_dense = compute_sites(along.spec, along.data, along.family, dense.state, along.rule)[0]
    np.testing.assert_allclose(at_dense.grad, dense.sites.grad, rtol=0, atol=1e-10)
    ones = jnp.ones(dense.num_examples)
    np.testing.assert_allclose(at_dense.curv.weighted_dense(ones), dense.sites.curv.weighted_dense(ones),
                               rtol=1e-10, atol=1e-10)


def test_updates_and_deletions_agree(pair, x64):
    posts, new = pair
    for correction, options in (("exact", {}), ("memory", dict(memory=10))):
        a, b = (p.update(*new, correction=correction, **options) for p in (posts["dense"], posts["along"]))
        _close(b.mean, a.mean)
        assert float(b.kl(a)) < 1e-8, correction
    for method in ("corrected",):
        a, b = (p.delete([0, 7, 11], method=method) for p in (posts["dense"], posts["along"]))
        assert float(b.kl(a)) < 1e-8, method


def test_criticism_agrees(pair, x64):
    posts, new = pair
    loo = {k: pc.loo(p) for k, p in posts.items()}
    _close(loo["along"].pointwise, loo["dense"].pointwise, scale=1.0)
    _close(loo["along"].pareto_k, loo["dense"].pareto_k)
    for post in posts.values():  # the log joint's Hessian at the mean is indefinite here: both paths refuse
        with pytest.raises(pc.NotPositiveDefiniteError, match="without some example"):
            pc.influence(post)
    mag = {k: pc.correction_magnitude(p, *new) for k, p in posts.items()}
    _close(mag["along"]["magnitude"], mag["dense"]["magnitude"])
    gain = {k: pc.information_gain(p, p.update(*new, correction="exact")) for k, p in posts.items()}
    for part in ("kl", "new_data", "correction", "log_normaliser_ratio"):
        _close(gain["along"][part], gain["dense"][part], scale=10.0)


def test_a_saved_subspace_posterior_loads_and_updates(pair, x64, tmp_path):
    posts, new = pair
    path = posts["along"].save(tmp_path / "along.npz")
    back = pc.load(path, noncentred)
    assert back.rule == posts["along"].rule and isinstance(back.sites.curv, JacobianFactor)
    np.testing.assert_array_equal(np.asarray(back.mean), np.asarray(posts["along"].mean))
    assert float(back.update(*new).kl(posts["along"].update(*new))) < 1e-12


def test_examples_that_leave_the_measured_subspace_are_refused_not_integrated_wrongly(x64):
    # every x = 0: the slope terms vanish and each example depends on 4 directions only, so the rule
    # differentiates along 4; a later batch with x ≠ 0 depends on 6 — its sites along 4 would be wrong
    # (Hessian errors of 6-44 % measured), so the update refuses them with the reason
    g, x, y = grouped_data(48, 6, seed=5)
    flat = pc.fit(noncentred, g[:40], jnp.zeros(40), y[:40])
    assert (flat.rule.kind, flat.rule.subspace_dim) == ("mc", 4)
    with pytest.raises(pc.ExpectationRuleError, match="more than the 4 directions"):
        flat.update(g[40:], x[40:], y[40:], correction="exact")
    # the subspace is measured on examples spread over the data: x = 0 on the first rows does not hide r = 6
    mixed_x = x.at[:8].set(0.0)
    post = pc.fit(noncentred, g, mixed_x, y)
    dense = pc.fit(noncentred, g, mixed_x, y, expectation="mc")
    assert post.rule.subspace_dim == 6 and float(post.kl(dense)) < 1e-8


def test_explicit_subspaces_are_checked_and_saved_ones_bounded(x64):
    g, x, y = grouped_data(40, 6, seed=6)
    with pytest.raises(pc.ExpectationRuleError, match="subspace_dim=5"):  # smaller than the model's 6: would miss one
        pc.fit(noncentred, g, x, y, expectation=ExpectationRule("mc", subspace_dim=5))
    for bad in (40, 33):  # beyond d = 17 / beyond the largest subspace the rule differentiates along
        with pytest.raises(pc.errors.InvalidOptionError, match="subspace_dim"):
            pc.fit(noncentred, g, x, y, expectation=ExpectationRule("mc", subspace_dim=bad))
    with pytest.raises(pc.errors.CorruptFileError, match="subspace_dim"):  # 3^20 tensor nodes from a file: refused
        validation._check_rule({"kind": "gh", "subspace_dim": 20})
    validation._check_rule({"kind": "mc", "subspace_dim": 20})
