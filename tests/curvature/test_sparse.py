"""The low-rank family's matrix-free sites: sparse per-example storage and a diagonal prior site.

The oracle is the dense-storage path (``storage="factor"``: ``(N, k, d)`` Jacobians, ``(N, d)``
gradients and a dense ``(d, d)`` prior curvature), which the low-rank family used before.
"""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax.extend.core import jaxprs_in_params

import numpyro_pc as pc
from numpyro_pc.sites import gaussian as site_module
from numpyro_pc.curvature import sparse as curvature_sparse
from numpyro_pc.solvers import site_problem
from numpyro_pc.curvature.sparse import SparseFactor
from numpyro_pc.ops.diagnostics import site_mismatch
from numpyro_pc.sites.expectations import prepare_rule, get_rule
from numpyro_pc.families.registry import get_family
from numpyro_pc.model.likelihood import bind_model

TOL = 1e-11
WIDE = 24  # columns of the design arrays; the fit's rows use at most 10 of them, the update's all 24


def sparse_model(d):
    def model(idx, val, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([d]).to_event(1))
        with numpyro.plate("data", idx.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=jnp.sum(val * w[idx], -1)), obs=y)

    return model


def sparse_data(n, d, used, seed):
    """Rows with ``used`` distinct nonzero columns (the rest of the ``WIDE`` slots hold value 0)."""
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.choice(d, WIDE, replace=False) for _ in range(n)]).astype(np.int32)
    val = rng.normal(size=(n, WIDE)) * (np.arange(WIDE) < used)
    y = (rng.uniform(size=n) < 0.5).astype(np.float64)
    return idx, val, y


def _assert_same(a, b, rtol=1e-8):
    """Two low-rank posteriors are the same member: mean and the dense precision to ``rtol``."""
    np.testing.assert_allclose(a.mean, b.mean, rtol=rtol, atol=rtol)
    dense_a, dense_b = (np.asarray(p.family.dense_precision(p.state)) for p in (a, b))
    np.testing.assert_allclose(dense_a, dense_b, rtol=rtol, atol=rtol * np.abs(dense_b).max())


@pytest.fixture(scope="module")
def problem():
    d = 60
    fit = sparse_data(200, d, 10, seed=0)
    new = sparse_data(30, d, WIDE, seed=1)  # wider rows: the update widens the stored sites
    return sparse_model(d), fit, new


def test_sparse_sites_equal_the_dense_storage_path(x64, problem, tmp_path):
    model, (idx, val, y), (idx2, val2, y2) = problem
    options = dict(family="lowrank", rank=3, tol=TOL)
    sparse = pc.fit(model, idx, val, y, **options)
    dense = pc.fit(model, idx, val, y, storage="factor", **options)
    assert sparse.sites.storage == "sparse" and dense.sites.storage == "factor"
    assert sparse.sites.grad.shape == (200, 16) and sparse.sites.prior_curvature.shape == (60,)
    assert dense.sites.grad.shape == (200, 60) and dense.sites.prior_curvature.shape == (60, 60)
    assert int(jnp.max(sparse.sites.curv.nnz)) == 10
    _assert_same(sparse, dense)
    # the stored sites are the same sites: gradients, curvature products, the prior's curvature
    np.testing.assert_allclose(sparse.sites.dense_grad(), dense.sites.grad, rtol=1e-7, atol=1e-10)
    probe = jnp.asarray(np.random.default_rng(2).normal(size=(60, 4)))
    w = jnp.ones(200)
    np.testing.assert_allclose(sparse.sites.curv.weighted_matmat(w, probe), dense.sites.curv.weighted_matmat(w, probe),
                               rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(jnp.diag(sparse.sites.prior_curvature), dense.sites.prior_curvature, rtol=1e-12)
    # an exact update whose rows need 24 columns (the stored sites are widened to 32) ...
    up_sparse = sparse.update(idx2, val2, y2, correction="exact", tol=TOL)
    up_dense = dense.update(idx2, val2, y2, correction="exact", tol=TOL)
    assert up_sparse.sites.grad.shape == (230, 32)
    _assert_same(up_sparse, up_dense)
    np.testing.assert_allclose(up_sparse.record["correction_magnitude"]["magnitude"],
                               up_dense.record["correction_magnitude"]["magnitude"], rtol=1e-6, atol=1e-12)
    # ... corrected deletion, and a save/load round trip that keeps the sparse sites as they were
    gone = [3, 50, 210]
    _assert_same(up_sparse.delete(gone, method="corrected", tol=TOL), up_dense.delete(gone, method="corrected", tol=TOL))
    path = tmp_path / "sparse.npc"
    up_sparse.save(path)
    loaded = pc.load(path, model)
    assert loaded.sites.storage == "sparse"
    for name, value in up_sparse.sites.arrays().items():
        np.testing.assert_array_equal(loaded.sites.arrays()[name], value)
    assert loaded.residual < 1e-9
    # the init="prior" start is matrix-free for the family and lands on the same fixed point
    _assert_same(pc.fit(model, idx, val, y, init="prior", **options), dense)


def test_a_non_separable_prior_keeps_a_dense_prior_site(x64):
    d = 12

    def model(idx, val, y=None):
        w = numpyro.sample("w", dist.MultivariateNormal(jnp.zeros(d), 0.5 * jnp.eye(d) + 0.5))
        with numpyro.plate("data", idx.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=jnp.sum(val * w[idx], -1)), obs=y)

    rng = np.random.default_rng(4)
    idx = np.zeros((80, WIDE), np.int32)
    idx[:, :3] = np.stack([rng.choice(d, 3, replace=False) for _ in range(80)])
    val = rng.normal(size=(80, WIDE)) * (np.arange(WIDE) < 3)
    y = (rng.uniform(size=80) < 0.5).astype(np.float64)
    sparse = pc.fit(model, idx, val, y, family="lowrank", rank=2, tol=TOL)
    dense = pc.fit(model, idx, val, y, family="lowrank", rank=2, tol=TOL, storage="factor")
    assert sparse.sites.storage == "sparse" and sparse.sites.prior_curvature.shape == (d, d)
    _assert_same(sparse, dense)


def _shapes(fn, *args):
    """Every array shape in the jaxpr of ``fn(*args)``, sub-jaxprs included."""
    found = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            for var in list(eqn.invars) + list(eqn.outvars):
                if hasattr(var, "aval"):
                    found.add(tuple(getattr(var.aval, "shape", ())))
            for sub in jaxprs_in_params(eqn.params):
                walk(sub)

    closed = jax.make_jaxpr(fn)(*args)
    found.update(tuple(v.aval.shape) for v in closed.jaxpr.invars + closed.jaxpr.outvars)
    walk(closed.jaxpr)
    return found


def _offending(shapes, n, d):
    """Shapes with two axes of length ``d``, or an axis ``n`` (examples) together with an axis ``d``."""
    return sorted(s for s in shapes if list(s).count(d) >= 2 or (d in s and n in s))


@pytest.mark.parametrize("storage", ["sparse", "factor"])
def test_no_d_by_d_and_no_n_by_d_array_on_the_path(storage, monkeypatch):
    # d = 20,000, N = 96 in chunks of 32: the site computation, the solver's sums (and the family's
    # projection in them), the update's mismatch diagnostic and the prior probes are traced at the
    # shapes a fit uses; with storage="sparse" no intermediate is (d, d) or (N, d). The control, the
    # dense-storage path, must show both (the (N, d) gradients and the (d, d) prior curvature). Chunks
    # and densifying batches (32 examples here) are transient and bounded by a budget, not by N.
    d, n = 20000, 96
    monkeypatch.setattr(curvature_sparse, "_SPARSE_BATCH", 32 * d)  # densifying batches of 32 examples (a budget, not N)
    model = sparse_model(d)
    idx, val, y = sparse_data(n, d, 10, seed=3)
    spec, data = bind_model(model, (jnp.asarray(idx), jnp.asarray(val, jnp.float32), jnp.asarray(y, jnp.float32)))
    family = get_family("lowrank", rank=5)
    z = jnp.zeros(d, jnp.float32)
    q = pc.families.Gaussian(z, family.project_diagonal(jnp.ones(d, jnp.float32)))
    rule = prepare_rule(get_rule("auto"), spec, data, z)
    sites, _ = site_module.compute_sites(spec, data, family, q, rule, storage=storage, chunk_size=32)
    cfg = site_module.SiteConfig(rule=rule, storage=type(sites.curv), chunk_size=32,
                                 width=sites.grad.shape[1] if storage == "sparse" else 0,
                                 prior_diagonal=sites.prior_curvature.ndim == 1)
    weights = jnp.ones(n, jnp.float32)
    problem = site_problem.SiteProblem(spec, data, family, rule, "hessian", storage, 32, sites.ids, None, True, weights)
    found = {
        "sites": _shapes(lambda qq: site_module._compute(spec, cfg, family, qq, data, sites.ids, weights), q),
        "totals": _shapes(lambda qq, ss: site_problem.problem_totals(problem, qq, ss)[:3], q, sites),
        "mismatch": _shapes(lambda qq, a, b: site_mismatch(a, b, qq, family, True), q, sites, sites),
    }
    stored = {tuple(x.shape) for x in jax.tree.leaves(sites)}
    if storage == "sparse":
        assert isinstance(sites.curv, SparseFactor) and sites.prior_curvature.shape == (d,)
        for name, shapes in found.items():
            assert not _offending(shapes, n, d), f"{name} forms {_offending(shapes, n, d)}"
        assert not _offending(stored, n, d)
        from numpyro_pc.sites.expectations import _prior_hvps
        probe = jnp.ones((4, d), jnp.float32)
        first = tuple(x[:1] for x in data.per_example)
        hvps = _shapes(lambda p: _prior_hvps(replace(spec, num_examples=1), p, first, data.shared, probe),
                       jnp.stack([z, z]))
        assert not _offending(hvps, n, d)
    else:  # the control: the check finds what the dense path forms
        assert (n, d) in stored and (d, d) in stored
        assert (d, d) in found["sites"] and (n, d) in found["totals"]
