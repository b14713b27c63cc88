"""The exponential-family solve's coarse start (numpyro_pc.solvers.expfam.coarse_config; issue 26 item 6).

A product with a Gaussian block first solves under the same design with fewer Gauss nodes per
scalar site, then under the configured design from there. Oracle: the coarse start changes where
the solve starts, never where it ends — the result is the configured design's fixed point, equal
to a solve from the usual start with no coarse phase (both to ``tol=1e-11``: two iterates within
1e-11 of one fixed point differ by ~1e-11/(1 − L), so 1e-8 relative leaves room for the
contraction ``L``). Both equal closed-form coordinate-ascent VB (the file's other oracle,
tests/families/test_expfam_gaussian.py). A coarse solve that stops short is not the user's failure,
and a converged warm start runs no coarse solve at all. All in float64.
"""

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import numpyro_pc as pc
from numpyro_pc.errors import ConvergenceError
from numpyro_pc.families.discrete import BernoulliFactor
from numpyro_pc.families.expfam import GammaFactor
from numpyro_pc.families.expfam_gaussian import FullGaussianFactor
from numpyro_pc.families.product import ProductFamily
from numpyro_pc.sites.expfam import EFConfig
from numpyro_pc.solvers import expfam as ef_solve
from models import _cavi_regression, _regression_data, regression

FAMILY = {"tau": "gamma", "w": "full"}


def _fit(**options):
    X, y = _regression_data()
    return pc.fit(regression, jnp.asarray(X), y=jnp.asarray(y), family=FAMILY, **options)


@pytest.mark.slow  # 25 s on 2 loaded cores (three fits, two designs compiled)
def test_coarse_start_ends_at_the_configured_designs_fixed_point(x64, monkeypatch):
    post = _fit(tol=1e-11)
    assert post.config.rule == "cubature" and post.config.num_nodes == 32
    assert ef_solve.coarse_config(post.config).num_nodes == ef_solve.COARSE_NODES
    # the coarse phase did the iterating; the configured design only polished its end
    assert post.record.coarse_iterations >= 5 and post.record.iterations <= 2
    assert post.record.converged and post.residual < 1e-11

    monkeypatch.setattr(ef_solve, "coarse_config", lambda config: None)
    plain = _fit(tol=1e-11)
    assert plain.record.coarse_iterations is None and plain.record.iterations >= 5  # the control: no coarse phase
    np.testing.assert_allclose(np.asarray(post.natural), np.asarray(plain.natural), rtol=1e-8, atol=1e-8)
    assert float(post.family.kl(post.natural, plain.natural)) <= 1e-12

    m, cov, a, b = _cavi_regression(*_regression_data())
    q = post.distributions()
    np.testing.assert_allclose(np.asarray(q["w"].loc), m, rtol=1e-8, atol=1e-8)
    np.testing.assert_allclose([float(q["tau"].concentration), float(q["tau"].rate)], [a, b], rtol=1e-8)


def test_coarse_design_only_where_it_is_cheaper():
    # the policy alone, on configurations without a model: products with Gaussian blocks and a scalar site with a
    # Gauss rule ("cubature", "mixed") get the same design with COARSE_NODES nodes; scalar products ("quadrature":
    # conjugate ones converge in one step), Monte Carlo, designs already that coarse, and grids that do not shrink
    # (a discrete factor enumerates its values whatever the nodes; Gaussian blocks alone have no grid) do not
    gamma_block = ProductFamily((GammaFactor("tau", ()), FullGaussianFactor("w", (3,))))
    for rule in ("cubature", "mixed"):
        coarse = ef_solve.coarse_config(EFConfig(None, gamma_block, rule, 32, 64, 3))
        assert coarse == EFConfig(None, gamma_block, rule, ef_solve.COARSE_NODES, 64, 3)
        assert ef_solve.coarse_config(EFConfig(None, gamma_block, rule, ef_solve.COARSE_NODES)) is None
    for rule in ("quadrature", "mc"):
        assert ef_solve.coarse_config(EFConfig(None, gamma_block, rule, 32)) is None
    switch_block = ProductFamily((BernoulliFactor("z", ()), FullGaussianFactor("w", (3,))))
    block_alone = ProductFamily((FullGaussianFactor("w", (3,)),))
    assert switch_block.grid_size(ef_solve.COARSE_NODES) == switch_block.grid_size(32)  # the premise
    for family in (switch_block, block_alone):
        assert ef_solve.coarse_config(EFConfig(None, family, "cubature", 32)) is None


@pytest.mark.slow  # 2 s alone warm, 10-20 s cold (compiles both designs)
def test_a_coarse_solve_that_stops_short_is_not_the_users_failure(x64):
    # three iterations are too few for either design: the coarse solve stops short (not reported), the configured
    # design's solve starts from the better of its start and the coarse iterate, and reports its own failure
    with pytest.raises(ConvergenceError):
        _fit(max_iters=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        last = _fit(max_iters=3, raise_on_failure=False)
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == [
        "the natural-parameter iteration did not reach tol=1e-08 in 3 iterations (relative residual "
        f"{last.record.residual:.3g}); the result is the last iterate (record['converged'] is False)"]
    assert last.record.coarse_iterations == 3 and not last.record.converged and last.record.iterations == 3


@pytest.mark.slow  # 10-30 s on 2 loaded cores (a fit, then refine)
def test_a_converged_start_runs_no_coarse_solve(x64):
    # a warm start within tol under the configured design stays: refine() of a converged posterior changes nothing
    post = _fit(tol=1e-11)
    again = post.refine(tol=1e-11)
    assert again.record.coarse_iterations is None and again.record.iterations == 0
    assert np.array_equal(np.asarray(again.natural), np.asarray(post.natural))
