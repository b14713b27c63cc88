"""The negative log joint's curvature without a (d, d) array (numpyro_pc.solvers.hessian) against the dense one."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import numpyro_pc as pc
from models import logistic_model
from numpyro_pc.families.lowrank import LowRankGaussian
from numpyro_pc.families.registry import DiagonalGaussian, FullGaussian
from numpyro_pc.model.likelihood import bind_model
from numpyro_pc.protocols import capabilities
from numpyro_pc.solvers.hessian import (
    hessian,
    laplace_precision,
    lowest_curvature,
    newton_cg_polish,
    positive_part,
    value_and_grad,
)
from numpyro_pc.solvers.start import map_laplace


def _problem(d=40, n=60, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)) / np.sqrt(d) * 3.0
    y = (rng.uniform(size=n) < 1.0 / (1.0 + np.exp(-x @ rng.normal(size=d)))).astype(float)
    spec, data = bind_model(logistic_model, (x, y))
    return spec, data, jnp.ones(n)


def _minimum(spec, data, weights):
    found = map_laplace(spec, data, FullGaussian(), jnp.zeros(spec.latent.dim), weights)
    assert found.converged
    return found.start.mean


@pytest.fixture
def matrix_free(monkeypatch):
    """Every dimension counts as large: the diagonal and isotropic families' matrix-free sites at small d."""
    monkeypatch.setattr(capabilities, "MATRIX_FREE_DIM", 0)


@pytest.mark.slow  # 6-8 s
@pytest.mark.parametrize("free", [False, True])
def test_the_diagonal_laplace_precision_is_the_hessians_diagonal(x64, request, free):
    if free:
        request.getfixturevalue("matrix_free")
    spec, data, weights = _problem()
    z = _minimum(spec, data, weights)
    dense = np.diag(np.asarray(hessian(spec, z, data, weights)))
    diag = np.asarray(laplace_precision(spec, data, DiagonalGaussian(), z, weights))
    np.testing.assert_allclose(diag, dense, rtol=1e-10, atol=0)


@pytest.mark.slow  # 5-8 s
def test_the_lowrank_laplace_precision_is_the_projection_of_the_dense_hessian(x64):
    spec, data, weights = _problem()
    z = _minimum(spec, data, weights)
    family = LowRankGaussian(rank=4)
    hess = hessian(spec, z, data, weights)
    precision = np.asarray(laplace_precision(spec, data, family, z, weights))
    old = np.asarray(family.project_curvature(positive_part(hess, 1e-8)))  # what the dense start took
    np.testing.assert_allclose(precision, old, rtol=1e-8, atol=1e-10)
    diag, factor = precision[:, 0], precision[:, 1:]
    np.testing.assert_allclose(diag + np.sum(factor**2, 1), np.diag(np.asarray(hess)), rtol=1e-10)
    top = np.linalg.eigvalsh(np.asarray(hess))[::-1][:4]
    held = np.linalg.eigvalsh(factor.T @ factor)[::-1]
    # U Uᵀ holds the top eigenpairs of H minus the diagonal remainder D, which is small beside them here
    np.testing.assert_allclose(held, top, rtol=0.15)


@pytest.mark.slow  # 4-6 s
def test_lanczos_lowest_curvature_matches_the_dense_eigenproblem(x64):
    spec, data, weights = _problem()
    z = _minimum(spec, data, weights) * 0.5
    low, vec, scale = lowest_curvature(spec, z, data, weights, dense=False)
    d_low, d_vec, d_scale = lowest_curvature(spec, z, data, weights, dense=True)
    assert low == pytest.approx(d_low, rel=1e-3)
    assert scale == pytest.approx(d_scale, rel=1e-3)
    assert abs(float(np.dot(vec, d_vec))) == pytest.approx(1.0, abs=1e-3)


@pytest.mark.slow  # about 5 s (the full family's MAP, then the polish)
def test_newton_cg_polish_reaches_the_minimum(x64):
    spec, data, weights = _problem(d=10, n=30)
    z = _minimum(spec, data, weights)
    start = z + 1e-3
    value, grad = value_and_grad(spec, start, data, weights)
    polished, _, grad, converged, steps = newton_cg_polish(spec, start, float(value), grad, data, weights, 1e-10)
    assert converged and steps >= 1
    np.testing.assert_allclose(np.asarray(polished), np.asarray(z), atol=1e-8)


@pytest.mark.slow  # 20-40 s
@pytest.mark.parametrize("family", ["diagonal", "isotropic"])
def test_the_matrix_free_path_reaches_the_same_posterior(x64, monkeypatch, family):
    """Sparse Jacobian factors, a diagonal prior site and the CG Newton step give the fixed point of the
    dense path (the default below MATRIX_FREE_DIM)."""
    rng = np.random.default_rng(3)
    d, n = 50, 120
    x = rng.normal(size=(n, d)) / np.sqrt(d) * 3.0
    y = (rng.uniform(size=n) < 1.0 / (1.0 + np.exp(-x @ rng.normal(size=d)))).astype(float)
    dense = pc.fit(logistic_model, x, y, family=family, tol=1e-12)
    monkeypatch.setattr(capabilities, "MATRIX_FREE_DIM", 0)
    free = pc.fit(logistic_model, x, y, family=family, tol=1e-12)
    assert free.sites.curv.keeps_jacobian and not dense.sites.curv.keeps_jacobian  # factors (dense rows here)
    np.testing.assert_allclose(np.asarray(free.mean), np.asarray(dense.mean), atol=1e-8)
    np.testing.assert_allclose(np.asarray(free.state.precision), np.asarray(dense.state.precision), rtol=1e-8)
    gone_free = free.delete(np.arange(10), method="corrected", tol=1e-12)
    monkeypatch.setattr(capabilities, "MATRIX_FREE_DIM", 2048)
    gone_dense = dense.delete(np.arange(10), method="corrected", tol=1e-12)
    np.testing.assert_allclose(np.asarray(gone_free.mean), np.asarray(gone_dense.mean), atol=1e-8)


@pytest.mark.slow  # 53 s at load 12 on the 2-core machine
def test_the_matrix_free_diagonal_path_in_float32(monkeypatch):
    """float32 (the package default) through the float32 representability check with a sparse store, whose
    integer column index must stay an integer."""
    rng = np.random.default_rng(4)
    d, n = 30, 80
    x = (rng.normal(size=(n, d)) / np.sqrt(d) * 3.0).astype(np.float32)
    y = (rng.uniform(size=n) < 1.0 / (1.0 + np.exp(-x @ rng.normal(size=d)))).astype(np.float32)
    dense = pc.fit(logistic_model, x, y, family="diagonal")
    monkeypatch.setattr(capabilities, "MATRIX_FREE_DIM", 0)
    free = pc.fit(logistic_model, x, y, family="diagonal")
    assert free.sites.curv.keeps_jacobian and free.mean.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(free.mean), np.asarray(dense.mean), rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(np.asarray(free.state.precision), np.asarray(dense.state.precision), rtol=1e-3)


def test_the_full_family_refuses_a_dimension_it_cannot_hold():
    from numpyro_pc.errors import InvalidOptionError
    from numpyro_pc.families.gaussians import FULL_MAX_DIM

    FullGaussian().check_dimension(FULL_MAX_DIM)
    with pytest.raises(InvalidOptionError, match=r"11.9 GB in float64 .* d = 20,000.*lowrank"):
        FullGaussian().check_dimension(20_000)


@pytest.mark.slow  # 20-40 s at load 12
def test_a_matrix_free_diagonal_posterior_saves_and_loads(x64, monkeypatch, tmp_path):
    monkeypatch.setattr(capabilities, "MATRIX_FREE_DIM", 0)
    rng = np.random.default_rng(5)
    d, n = 20, 50
    x = rng.normal(size=(n, d)) / np.sqrt(d) * 3.0
    y = (rng.uniform(size=n) < 1.0 / (1.0 + np.exp(-x @ rng.normal(size=d)))).astype(float)
    post = pc.fit(logistic_model, x, y, family="diagonal")
    path = post.save(tmp_path / "post.npz")
    back = pc.load(path, logistic_model)
    assert back.sites.curv.name == post.sites.curv.name and post.sites.curv.keeps_jacobian
    np.testing.assert_array_equal(np.asarray(back.mean), np.asarray(post.mean))
    np.testing.assert_array_equal(np.asarray(back.state.precision), np.asarray(post.state.precision))
    assert float(back.residual) == pytest.approx(float(post.residual), rel=1e-6, abs=1e-12)


@pytest.mark.slow  # 25-45 s
@pytest.mark.parametrize("family", ["diagonal", "isotropic"])
def test_partial_corrections_on_the_matrix_free_path_equal_the_dense_path(x64, monkeypatch, family):
    """A memory correction and a K-prior update keep stale sites and an offset: both are the family's own
    sites (diagonals of Ĥ_i, or none for the isotropic family) whatever the store keeps for the Newton step,
    so the matrix-free path reaches the dense path's posterior (a convex model: one fixed point; 1e-8) with
    the dual-form identity λ = offset + Σ sites holding (1e-8). Control: the same stored sites read with full
    matrices — the quadratic the store could give — break the identity by more than 1e-3."""
    from dataclasses import replace

    from numpyro_pc.curvature.stores import FULL
    from numpyro_pc.solvers.site_problem import dual_residual

    rng = np.random.default_rng(5)
    d, n = 30, 160
    x = rng.normal(size=(n, d)) / np.sqrt(d) * 3.0
    y = (rng.uniform(size=n) < 1.0 / (1.0 + np.exp(-x @ rng.normal(size=d)))).astype(float)

    def run():
        first = pc.fit(logistic_model, x[:80], y[:80], family=family, tol=1e-12)
        memory = first.update(x[80:], y[80:], correction="memory", memory=np.arange(0, 80, 4), tol=1e-12)
        kprior = first.keep_memory(20, selection="residual").update(x[80:], y[80:], correction="kprior", memory=10,
                                                                    selection="residual", tol=1e-12)
        return memory, kprior

    dense = run()
    monkeypatch.setattr(capabilities, "MATRIX_FREE_DIM", 0)
    free = run()
    for a, b in zip(dense, free):
        assert b.sites.curv.keeps_jacobian and not a.sites.curv.keeps_jacobian
        assert b.site_identity_residual < 1e-8
        np.testing.assert_allclose(np.asarray(b.mean), np.asarray(a.mean), atol=1e-8)
        np.testing.assert_allclose(np.asarray(b.state.precision), np.asarray(a.state.precision), rtol=1e-8)
    full = replace(free[0].sites, detail=FULL)
    assert dual_residual(free[0].family, free[0].state, full, free[0].offset)[0] > 1e-3
