"""Monte Carlo sites differentiated along each example's dependence subspace give every
operation the numbers of dense per-example Hessians (the same draws, ``∇²ℓ_i = P_iᵀ ∇²_u P_i``)."""

import jax
import numpy as np
import pytest
from test_storage_budget import grouped_data, noncentred

import numpyro_pc as pc
from numpyro_pc.curvature import Dense, Factor

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


def test_the_default_rule_is_the_subspace_one(pair):
    posts, _ = pair
    assert isinstance(posts["dense"].sites.curv, Dense) and isinstance(posts["along"].sites.curv, Factor)
    assert posts["along"].rule.subspace_dim == 6 and posts["dense"].rule.subspace_dim == 0


def test_updates_and_deletions_agree(pair, x64):
    posts, new = pair
    for correction in ("exact", "none", "memory"):
        a, b = (p.update(*new, correction=correction, memory=10) for p in (posts["dense"], posts["along"]))
        _close(b.mean, a.mean)
        assert float(b.kl(a)) < 1e-8, correction
    for method in ("remove_site", "corrected"):
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
    assert back.rule == posts["along"].rule and isinstance(back.sites.curv, Factor)
    np.testing.assert_array_equal(np.asarray(back.mean), np.asarray(posts["along"].mean))
    assert float(back.update(*new).kl(posts["along"].update(*new))) < 1e-12
