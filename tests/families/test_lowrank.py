"""The low-rank-plus-diagonal family (numpyro_pc.families.lowrank) against dense algebra and the other families."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend.core import jaxprs_in_params
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoLowRankMultivariateNormal

import numpyro_pc as pc
from numpyro_pc.curvature.stores import JacobianFactor
from numpyro_pc.datasets.loaders import load_breast_cancer
from numpyro_pc.errors import InvalidOptionError, UnsupportedModelError
from numpyro_pc.families.registry import Gaussian, get_family
from numpyro_pc.model.likelihood import bind_model
from numpyro_pc.families.lowrank import LowRankGaussian, lowrank_from_covariance
from numpyro_pc.sites.gaussian import compute_sites

from models import logistic_model, make_logistic

TOL = 1e-11  # solver tolerance of the oracles below


def _member(d, r, seed):
    rng = np.random.default_rng(seed)
    precision = np.concatenate([rng.uniform(0.5, 2.0, (d, 1)), rng.normal(size=(d, r))], 1)
    return Gaussian(jnp.asarray(rng.normal(size=d)), jnp.asarray(precision))


def _shapes(fn, *args):
    """Every array shape in the jaxpr of ``fn(*args)``, sub-jaxprs included."""
    found = set()

    def walk(jaxpr):
        for var in list(jaxpr.invars) + list(jaxpr.outvars) + list(jaxpr.constvars):
            if hasattr(var, "aval"):
                found.add(tuple(getattr(var.aval, "shape", ())))
        for eqn in jaxpr.eqns:
            for var in list(eqn.invars) + list(eqn.outvars):
                if hasattr(var, "aval"):
                    found.add(tuple(getattr(var.aval, "shape", ())))
            for sub in jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_matrix_free_algebra_equals_dense_algebra(x64):
    fam = LowRankGaussian(rank=3)
    q, p = _member(7, 3, 0), _member(7, 3, 1)
    s_q, s_p = np.asarray(fam.dense_precision(q)), np.asarray(fam.dense_precision(p))
    cov_q = np.linalg.inv(s_q)
    np.testing.assert_allclose(fam.dense_covariance(q), cov_q, rtol=1e-10, atol=1e-12)
    dense = pc.FullGaussian()
    fq, fp = Gaussian(q.mean, jnp.asarray(s_q)), Gaussian(p.mean, jnp.asarray(s_p))
    np.testing.assert_allclose(fam.entropy(q), dense.entropy(fq), rtol=1e-12)
    np.testing.assert_allclose(fam.kl(q, p), dense.kl(fq, fp), rtol=1e-10)
    z = jnp.asarray(np.random.default_rng(2).normal(size=(4, 7)))
    np.testing.assert_allclose(fam.log_prob(q, z), dense.log_prob(fq, z), rtol=1e-12)
    nat = fam.natural(q)
    np.testing.assert_allclose(fam.from_natural(nat).mean, q.mean, rtol=1e-10)
    np.testing.assert_allclose(fam.marginal_variance(q), np.diag(cov_q), rtol=1e-10)
    a = jnp.asarray(np.random.default_rng(3).normal(size=7))
    np.testing.assert_allclose(fam.quad_form_cov(q, fam.covariance_operand(q), a), a @ cov_q @ a, rtol=1e-10)
    np.testing.assert_allclose(fam.trace_with_covariance(q, p.precision), np.trace(s_p @ cov_q), rtol=1e-10)
    # draws: z = m + Cε with C Cᵀ = Σ exactly (checked on the identity as noise)
    c = np.asarray(fam.draws(Gaussian(jnp.zeros(7), q.precision), jnp.eye(7)))
    np.testing.assert_allclose(c.T @ c, cov_q, rtol=1e-10, atol=1e-12)
    target = _member(7, 3, 4).precision
    expected = np.linalg.norm(s_q - np.asarray(fam.dense_precision(Gaussian(q.mean, target)))) / np.linalg.norm(s_q)
    np.testing.assert_allclose(fam.precision_residual(q.precision, target), expected, rtol=1e-8)
    half = fam.blend(q.precision, target, 0.5)  # a damped step keeps the diagonal of (S + T)/2
    both = 0.5 * (s_q + np.asarray(fam.dense_precision(Gaussian(q.mean, target))))
    np.testing.assert_allclose(np.diag(fam.dense_precision(Gaussian(q.mean, half))), np.diag(both), rtol=1e-10)


def test_projection_keeps_the_diagonal_stays_below_and_is_exact_at_rank_d_minus_1(x64):
    rng = np.random.default_rng(0)
    d = 40
    basis = np.linalg.qr(rng.normal(size=(d, d)))[0]
    spectrum = np.concatenate([[400.0, 200.0, 100.0], np.full(d - 3, 1.0)]) + rng.uniform(0, 0.1, d)
    t = jnp.asarray((basis * spectrum) @ basis.T)
    fam = LowRankGaussian(rank=3)
    projected = fam.project_curvature(t)
    s = np.asarray(fam.dense_precision(Gaussian(jnp.zeros(d), projected)))
    np.testing.assert_allclose(np.diag(s), np.diag(t), rtol=1e-10)
    factor = np.asarray(projected[:, 1:])
    assert np.linalg.eigvalsh(np.asarray(t) - factor @ factor.T).min() > -1e-8  # U Uᵀ ⪯ T, so D ≥ 0
    top = basis[:, np.argsort(spectrum)[-3:]]
    # U Uᵀ holds the three leading eigenpairs of T
    np.testing.assert_allclose(top.T @ factor @ factor.T @ top, top.T @ np.asarray(t) @ top, rtol=1e-6, atol=1e-6)
    for rank in (d - 1, d):
        exact = LowRankGaussian(rank=rank).project_curvature(t)
        assert exact.shape == (d, rank + 1)
        np.testing.assert_allclose(LowRankGaussian(rank=rank).dense_precision(Gaussian(jnp.zeros(d), exact)), t,
                                   rtol=1e-10, atol=1e-10)


def test_precision_residual_is_accurate_below_sqrt_eps(x64):
    # the residual is formed in O(d r²); it must agree with the dense ‖S − T‖_F / ‖S‖_F at the size
    # of the solver's tolerance and below (the expanded ‖S‖² + ‖T‖² − 2⟨S, T⟩ read 0 at 1.4e-8)
    fam = LowRankGaussian(rank=10)
    rng = np.random.default_rng(0)
    p = _member(124, 10, 0).precision * jnp.concatenate([jnp.ones((124, 1)), 3.0 * jnp.ones((124, 10))], 1)
    dense = lambda x: np.asarray(fam.dense_precision(Gaussian(jnp.zeros(124), x)))  # noqa: E731
    for size in (1e-6, 1e-8, 1e-10, 1e-12):
        t = p * (1.0 + size * jnp.asarray(rng.normal(size=p.shape)))
        expected = np.linalg.norm(dense(p) - dense(t)) / np.linalg.norm(dense(p))
        np.testing.assert_allclose(fam.precision_residual(p, t), expected, rtol=1e-3)


@pytest.mark.parametrize("init", [None, "prior"], ids=["map-start", "prior-start"])
@pytest.mark.parametrize("rank", [2, 8])
def test_fits_that_stalled_converge_to_the_projected_fixed_point(x64, rank, init):
    # breast cancer (d = 31), default tolerance: with the mean preconditioned by S = Π_r(T) these
    # stopped with StagnationError ("no step size made progress") — r = 2 from both starts, r = 8
    # from the MAP start. The fixed point is checked from scratch: fresh sites at the returned q
    # (dense storage), the target T summed densely, and S compared with Π_r(T) and its properties.
    X, y, _ = load_breast_cancer()
    X, y = jnp.asarray(X), jnp.asarray(y)
    post = pc.fit(logistic_model, X, y, family="lowrank", rank=rank, init=init)
    assert post.residual <= 1e-8
    spec, data = bind_model(logistic_model, (X, y))
    sites, _ = compute_sites(spec, data, post.family, post.state, post.rule, storage="dense")
    grads = np.concatenate([np.asarray(sites.grad), np.asarray(sites.prior_grad)[None]])
    assert np.linalg.norm(grads.sum(0)) <= 1e-8 * np.linalg.norm(grads, axis=1).sum()  # Σ ĝ_i = 0
    target = np.asarray(sites.curv.dense()).sum(0) + np.asarray(sites.prior_curvature)
    s = np.asarray(post.family.dense_precision(post.state))
    projected = np.asarray(post.family.dense_precision(Gaussian(post.mean, post.family.project_curvature(
        jnp.asarray(target)))))
    assert np.linalg.norm(s - projected) <= 2e-8 * np.linalg.norm(s)  # S = Π_r(T)
    np.testing.assert_allclose(np.diag(s), np.diag(target), rtol=1e-7)  # Π_r keeps diag T
    factor = np.asarray(post.state.precision[:, 1:])
    assert np.linalg.eigvalsh(target - factor @ factor.T).min() > -2e-8 * np.linalg.norm(s)  # U Uᵀ ⪯ T (to tol)


@pytest.mark.parametrize("extra", [-1, 0], ids=["r=d-1", "r=d"])
def test_rank_d_minus_1_and_d_equal_the_full_family(x64, extra):
    X, y = make_logistic(120, 4, seed=5)
    full = pc.fit(logistic_model, X, y, family="full", tol=1e-12)
    d = full.mean.shape[0]
    low = pc.fit(logistic_model, X, y, family="lowrank", rank=d + extra, tol=1e-12)
    assert low.family == LowRankGaussian(rank=d + extra) and low.family.name == f"lowrank-{d + extra}"
    np.testing.assert_allclose(low.mean, full.mean, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(low.precision, full.precision, rtol=1e-8, atol=1e-8)
    assert float(pc.FullGaussian().kl(Gaussian(low.mean, low.precision), full.state)) < 1e-12


@pytest.fixture(scope="module")
def data():
    return make_logistic(150, 6, seed=11)


@pytest.fixture(scope="module")
def batch_fit(data):
    X, y = data
    with jax.enable_x64(True):
        return pc.fit(logistic_model, X, y, family="lowrank", rank=2, tol=TOL)


def test_low_rank_fit_is_the_projected_fixed_point_not_the_full_one(x64, data, batch_fit):
    X, y = data
    full = pc.fit(logistic_model, X, y, family="full", tol=TOL)
    assert batch_fit.residual < 1e-10 and batch_fit.state.precision.shape == (7, 3)
    # the diagonal of the precision is the full family's target's diagonal at its own mean:
    # close to the full posterior's, but the off-diagonal part is only rank 2
    np.testing.assert_allclose(np.diag(batch_fit.precision), np.diag(full.precision), rtol=0.05)
    assert np.abs(np.asarray(batch_fit.precision - full.precision)).max() > 1e-3


def test_exact_streaming_over_shuffled_batches_equals_the_batch_fit(x64, data, batch_fit):
    X, y = data
    order = np.random.default_rng(0).permutation(X.shape[0])
    chunks = np.array_split(order, 4)
    post = pc.fit(logistic_model, X[chunks[0]], y[chunks[0]], family="lowrank", rank=2, tol=TOL)
    for rows in chunks[1:]:
        post = post.update(X[rows], y[rows], correction="exact", tol=TOL)
    assert post.family == batch_fit.family and post.num_examples == X.shape[0]
    # same fixed point of the same projected map, both solved to residual 1e-11
    assert float(post.kl(batch_fit)) < 1e-12
    np.testing.assert_allclose(post.mean, batch_fit.mean, rtol=1e-7, atol=1e-9)


def test_corrected_deletion_equals_retraining(x64, data, batch_fit):
    X, y = data
    gone = [3, 17, 40, 77, 120]
    corrected = batch_fit.delete(gone, method="corrected", tol=TOL)
    keep = np.setdiff1d(np.arange(X.shape[0]), gone)
    oracle = pc.fit(logistic_model, X[keep], y[keep], family="lowrank", rank=2, tol=TOL)
    assert float(corrected.kl(oracle)) < 1e-12
    assert corrected.tombstones == tuple(gone)
    assert float(batch_fit.delete(gone, method="retrain", tol=TOL).kl(oracle)) < 1e-12


def test_partial_corrections_are_refused_with_a_typed_error(x64, data, batch_fit):
    X, y = data
    with pytest.raises(UnsupportedModelError, match="projection"):
        batch_fit.delete([0], method="remove_site")
    with pytest.raises(UnsupportedModelError, match="projection"):
        batch_fit.update(X[:5], y[:5], correction="memory", memory=10)
    with pytest.raises(UnsupportedModelError, match="stale sites"):
        batch_fit.update(X[:5], y[:5], correction="prior")


def test_an_uncorrected_update_is_vcl_with_the_old_posterior_as_prior(x64, data):
    # correction="none" divides nothing out, so it is defined for a projected family: the new
    # posterior is Π_r(S_old + new sites) at its fixed point. At r = d − 1 the projection is the
    # identity, so the stream must equal the full family's VCL stream to solver accuracy (1e-8);
    # at r = 2 it must run and differ from the exact (batch) answer by more than rounding.
    X, y = data
    d = X.shape[1] + 1
    first, second, third = np.array_split(np.arange(X.shape[0]), 3)
    streams = {}
    for name, options in (("full", dict(family="full")), ("low", dict(family="lowrank", rank=d - 1)),
                          ("rank2", dict(family="lowrank", rank=2))):
        post = pc.fit(logistic_model, X[first], y[first], tol=TOL, **options)
        for rows in (second, third):
            post = post.update(X[rows], y[rows], correction="none", tol=TOL)
        streams[name] = post
    full, low = streams["full"], streams["low"]
    np.testing.assert_allclose(low.mean, full.mean, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(low.precision, full.precision, rtol=1e-8, atol=1e-10)
    batch = pc.fit(logistic_model, X, y, family="lowrank", rank=2, tol=TOL)
    assert 1e-8 < float(streams["rank2"].kl(batch)) < 1.0


def test_merge_then_refine_equals_the_joint_fit(x64, data, batch_fit):
    X, y = data
    halves = np.array_split(np.arange(X.shape[0]), 2)
    tasks = [pc.fit(logistic_model, X[h], y[h], family="lowrank", rank=2, tol=TOL) for h in halves]
    merged = pc.merge(None, tasks)
    assert merged.family == batch_fit.family
    # Bayesian arithmetic alone leaves the task corrections out, but beats either task
    assert float(merged.kl(batch_fit)) < 0.5 * min(float(t.kl(batch_fit)) for t in tasks)
    refined = merged.refine(tol=TOL)
    assert float(refined.kl(batch_fit)) < 1e-12


def test_save_load_round_trip(x64, data, batch_fit, tmp_path):
    X, y = data
    path = tmp_path / "lowrank.npc"
    batch_fit.save(path)
    loaded = pc.load(path, logistic_model)
    assert loaded.family == batch_fit.family and loaded.family.name == "lowrank-2"
    np.testing.assert_array_equal(loaded.state.precision, batch_fit.state.precision)
    np.testing.assert_array_equal(loaded.mean, batch_fit.mean)
    assert loaded.residual < 1e-10
    a = loaded.update(X[:7], y[:7], correction="exact", tol=TOL)
    b = batch_fit.update(X[:7], y[:7], correction="exact", tol=TOL)
    assert float(a.kl(b)) < 1e-14


def test_options_are_checked(x64, data):
    X, y = data
    with pytest.raises(InvalidOptionError, match="rank >= 1"):
        pc.fit(logistic_model, X, y, family="lowrank", rank=0)
    with pytest.raises(InvalidOptionError, match="exceeds the latent dimension"):
        pc.fit(logistic_model, X, y, family="lowrank", rank=8)
    with pytest.raises(InvalidOptionError, match="needs a rank"):
        get_family("lowrank")
    with pytest.raises(InvalidOptionError, match="takes no options"):
        pc.fit(logistic_model, X, y, family="full", rank=3)
    assert get_family("lowrank-4") == get_family("lowrank", rank=4) == LowRankGaussian(rank=4)


def test_auto_low_rank_guide_maps_to_the_family_natively(x64, data, batch_fit):
    X, y = data
    guide = AutoLowRankMultivariateNormal(logistic_model, rank=2)
    res = SVI(logistic_model, guide, optax.adam(0.02), Trace_ELBO()).run(
        jax.random.PRNGKey(0), 600, X, y, progress_bar=False)
    post = pc.dual_form(logistic_model, guide, res.params, X, y, tol=TOL)
    assert post.family == LowRankGaussian(rank=2)
    assert float(post.kl(batch_fit)) < 1e-12  # the same fixed point as pc.fit in the family
    params = post.to_guide_params()
    assert params["auto_cov_factor"].shape == (7, 2)
    # with rank >= d - 1 the mapping is exact both ways
    spec, _ = bind_model(logistic_model, (X, y))
    w = jnp.asarray(np.random.default_rng(0).normal(size=(7, 6)))
    s = jnp.asarray(np.random.default_rng(1).uniform(0.5, 1.0, 7))
    big = AutoLowRankMultivariateNormal(logistic_model, rank=6)
    family, q = pc.guides.from_guide(big, {"auto_loc": jnp.zeros(7), "auto_cov_factor": w, "auto_scale": s},
                                     spec.latent, (X, y))
    assert family == LowRankGaussian(rank=6)
    np.testing.assert_allclose(family.dense_covariance(q), w @ w.T + jnp.diag(s**2), rtol=1e-9)
    back = pc.guides.to_guide_params(big, family, q, spec.latent)
    cov = back["auto_cov_factor"] @ back["auto_cov_factor"].T + jnp.diag(back["auto_scale"] ** 2)
    np.testing.assert_allclose(cov, w @ w.T + jnp.diag(s**2), rtol=1e-9)


def test_no_d_by_d_array_on_the_solver_path():
    # d = 3,000, r = 5: every function the solver, the sites and the guide adapter call on
    # this family is traced and no intermediate has two axes of length d
    d, r, n = 3000, 5, 64
    fam = LowRankGaussian(rank=r)
    rng = np.random.default_rng(0)
    q = Gaussian(jnp.asarray(rng.normal(size=d), jnp.float32),
                 jnp.asarray(np.concatenate([np.ones((d, 1)), 0.1 * rng.normal(size=(d, r))], 1), jnp.float32))
    store = JacobianFactor(jac=jnp.asarray(rng.normal(size=(n, 1, d)), jnp.float32), lam=jnp.ones((n, 1, 1), jnp.float32))
    weights = jnp.ones(n, jnp.float32)
    grad = q.mean
    calls = {
        "target": lambda s, w, b: fam.target_precision(s, w, None, b),
        "precondition": lambda p, g: fam.precondition(p, g),
        "blend": lambda a, b: fam.blend(a, b, 0.5),
        "residual": fam.precision_residual,
        "entropy": lambda p: fam.entropy(Gaussian(grad, p)),
        "kl": lambda a, b: fam.kl(Gaussian(grad, a), Gaussian(grad, b)),
        "draws": lambda p, e: fam.draws(Gaussian(grad, p), e),
        "log_prob": lambda p, z: fam.log_prob(Gaussian(grad, p), z),
        "natural": lambda p: fam.from_natural(fam.natural(Gaussian(grad, p))),
        "variance": lambda p: fam.marginal_variance(Gaussian(grad, p)),
        "guide": lambda c, w: lowrank_from_covariance(c, w, r),
        "newton": lambda p, s, w, g: fam.precondition(fam.fixed_point(None, p, fam.newton_operator(s, w))[1], g),
    }
    args = {
        "target": (store, weights, q.precision), "precondition": (q.precision, grad), "blend": (q.precision,) * 2,
        "residual": (q.precision,) * 2, "entropy": (q.precision,), "kl": (q.precision,) * 2,
        "draws": (q.precision, jnp.ones((4, d), jnp.float32)), "log_prob": (q.precision, jnp.ones((4, d), jnp.float32)),
        "natural": (q.precision,), "variance": (q.precision,),
        "guide": (jnp.ones(d, jnp.float32), jnp.ones((d, r), jnp.float32)),
        "newton": (q.precision, store, weights, grad),
    }
    for name, fn in calls.items():
        square = [s for s in _shapes(fn, *args[name]) if list(s).count(d) >= 2]
        assert not square, f"{name} forms {square}"
    # the check can fail: the dense precision has the shape it looks for
    assert (d, d) in _shapes(lambda p: fam.dense_precision(Gaussian(grad, p)), q.precision)
