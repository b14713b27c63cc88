"""The diagonal and isotropic families' Newton step by conjugate gradients (numpyro_pc.families.newton_cg)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from numpyro_pc.curvature.stores import JacobianFactor
from numpyro_pc.families.newton_cg import DiagonalNewton, newton_cg, newton_diagonal, newton_matvec


def _operator(n=40, k=2, d=12, seed=0, base=None):
    rng = np.random.default_rng(seed)
    jac = rng.normal(size=(n, k, d))
    lam = np.einsum("nkl,nml->nkm", a := rng.normal(size=(n, k, k)), a)  # positive semi-definite Λ_i
    weights = rng.uniform(0.5, 1.5, n)
    prior = rng.uniform(0.5, 2.0, d)
    op = DiagonalNewton(JacobianFactor(jnp.asarray(jac), jnp.asarray(lam)), jnp.asarray(weights), jnp.asarray(prior),
                        base)
    dense = np.einsum("n,nkd,nkl,nle->de", weights, jac, lam, jac) + np.diag(prior)
    if base is not None:
        dense = dense + np.diag(np.broadcast_to(np.asarray(base), (d,)))
    return op, dense


@pytest.mark.slow  # about 6 s (three compilations of the CG loop)
def test_newton_cg_solves_with_the_dense_sum(x64):
    for base in (None, jnp.asarray(0.7), jnp.linspace(0.1, 1.0, 12)):
        op, dense = _operator(base=base)
        b = np.random.default_rng(1).normal(size=12)
        np.testing.assert_allclose(np.asarray(newton_matvec(op, jnp.asarray(b))), dense @ b, rtol=1e-12)
        np.testing.assert_allclose(np.asarray(newton_diagonal(op)), np.diag(dense), rtol=1e-12)
        np.testing.assert_allclose(np.asarray(newton_cg(op, jnp.asarray(b))), np.linalg.solve(dense, b), rtol=1e-6)


def test_newton_cg_falls_back_to_the_diagonal_step_where_the_sum_is_indefinite(x64):
    op, dense = _operator()
    op = op._replace(prior_curvature=-10.0 * jnp.ones(12))  # T far from positive definite
    b = jnp.ones(12)
    out = np.asarray(newton_cg(op, b))
    assert np.all(np.isfinite(out))
