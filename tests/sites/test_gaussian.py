"""Site computation: storage forms agree, jit equals eager, no retrace, device sharding."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import numpyro_pc as pc
from numpyro_pc.sites.expectations import get_rule, prepare_rule
from numpyro_pc.families.registry import DiagonalGaussian, FullGaussian, Gaussian
from numpyro_pc.model.likelihood import bind_model, example_loss
from numpyro_pc.sites.gaussian import compute_sites, trace_count

from models import logistic_model, make_linear, make_logistic, scale_model


def _q_full(d, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(d, d))
    return Gaussian(jnp.asarray(0.3 * rng.normal(size=d)), jnp.asarray(a @ a.T + d * np.eye(d)))


def test_delta_sites_are_per_example_gradients_and_hessians(x64):
    X, y = make_linear(9, 3)
    spec, data = bind_model(scale_model, (X, y))
    q = _q_full(4)
    sites, _ = compute_sites(spec, data, FullGaussian(), q, get_rule("delta"), storage="dense")
    for i in [0, 4, 8]:
        ex = tuple(x[i] for x in data.per_example)
        f = lambda z: example_loss(spec, z, ex, data.shared)  # noqa: E731
        np.testing.assert_allclose(sites.grad[i], jax.grad(f)(q.mean), rtol=1e-12)
        np.testing.assert_allclose(sites.curv.curvature[i], jax.hessian(f)(q.mean), rtol=1e-12)
    assert sites.storage == "dense"


@pytest.mark.parametrize("rule", ["delta", "gh", "mc"])
def test_storage_forms_agree_for_a_glm(x64, rule):
    X, y = make_logistic(40, 3)
    spec, data = bind_model(logistic_model, (X, y))
    q = _q_full(4)
    r = prepare_rule(get_rule(rule, **({"num_samples": 16} if rule == "mc" else {})), spec, data, q.mean)
    fac, _ = compute_sites(spec, data, FullGaussian(), q, r, storage="factor")
    den, _ = compute_sites(spec, data, FullGaussian(), q, r, storage="dense") if rule != "gh" else (None, None)
    ggn, _ = compute_sites(spec, data, FullGaussian(), q, r, curvature="ggn", storage="factor")
    # GLM with canonical link: Hessian == Gauss-Newton exactly
    np.testing.assert_allclose(fac.dense_curvature(), ggn.dense_curvature(), rtol=1e-12, atol=1e-14)
    if den is not None:
        np.testing.assert_allclose(fac.dense_curvature(), den.curv.curvature, rtol=1e-10, atol=1e-13)
        np.testing.assert_allclose(fac.grad, den.grad, rtol=1e-12, atol=1e-14)
    diag_q = Gaussian(q.mean, jnp.diag(q.precision))
    dg, _ = compute_sites(spec, data, DiagonalGaussian(), diag_q, r)
    fac_d, _ = compute_sites(spec, data, FullGaussian(), Gaussian(q.mean, jnp.diag(jnp.diag(q.precision))), r,
                             storage="factor")
    np.testing.assert_allclose(dg.curv.curvature, jnp.diagonal(fac_d.dense_curvature(), axis1=1, axis2=2),
                               rtol=1e-10, atol=1e-14)
    # O(N·k·d) storage: gradient, Jacobian and a 1x1 curvature per example
    assert fac.stored_numbers() <= 3 * 40 * 4


def test_gauss_hermite_is_exact_for_a_gaussian_likelihood(x64):
    """Linear-Gaussian: E_q[∇ℓ_i] is linear in z so GH and the delta rule coincide."""
    from models import linear_model
    X, y = make_linear(15, 3)
    spec, data = bind_model(linear_model, (X, y))
    q = _q_full(3, seed=2)
    gh = prepare_rule(get_rule("gh"), spec, data, q.mean)
    a, _ = compute_sites(spec, data, FullGaussian(), q, gh)
    b, _ = compute_sites(spec, data, FullGaussian(), q, get_rule("delta"))
    np.testing.assert_allclose(a.grad, b.grad, rtol=1e-11, atol=1e-13)
    np.testing.assert_allclose(a.dense_curvature(), b.dense_curvature(), rtol=1e-11)


def test_jit_and_eager_give_the_same_sites_and_no_retrace(x64):
    X, y = make_logistic(30, 3, seed=4)
    spec, data = bind_model(logistic_model, (X, y))
    q = _q_full(4)
    rule = prepare_rule(get_rule("gh"), spec, data, q.mean)
    jitted, _ = compute_sites(spec, data, FullGaussian(), q, rule)
    with jax.disable_jit():
        eager, _ = compute_sites(spec, data, FullGaussian(), q, rule)
    for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    before = trace_count()
    for seed in range(5, 9):  # new data of the same size binds to an equal spec: no new trace
        X2, y2 = make_logistic(30, 3, seed=seed)
        spec2, data2 = bind_model(logistic_model, (X2, y2))
        compute_sites(spec2, data2, FullGaussian(), q, rule)
    assert trace_count() == before


def test_chunking_does_not_change_the_result(x64):
    X, y = make_logistic(37, 3, seed=5)
    spec, data = bind_model(logistic_model, (X, y))
    q = _q_full(4)
    rule = get_rule("delta")
    a, sa = compute_sites(spec, data, FullGaussian(), q, rule, chunk_size=37, need_hessian_sum=True)
    b, sb = compute_sites(spec, data, FullGaussian(), q, rule, chunk_size=5, need_hessian_sum=True)
    np.testing.assert_allclose(a.grad, b.grad, rtol=1e-13)
    np.testing.assert_allclose(sa.hessian, sb.hessian, rtol=1e-12)
    np.testing.assert_allclose(sa.loss, sb.loss, rtol=1e-13)



def test_diagonal_sites_form_no_dense_curvature_unless_its_sum_is_asked(x64):
    """The diag store takes diag(J_iᵀ Λ_i J_i) from the factors, so without the dense sum its
    default chunks are the factorised store's: one chunk here, no padded (N, d) copies (core v2
    sized them for a d × d curvature per example: 3 chunks, 2.35·N·d temporary numbers vs 1.04)."""
    from numpyro_pc.curvature.stores import Diagonal, JacobianFactor
    from numpyro_pc.sites.gaussian import default_chunk_size

    X, y = make_logistic(2000, 99, seed=6)
    spec, data = bind_model(logistic_model, (X, y))
    n, d = X.shape[0], X.shape[1] + 1
    one_chunk = default_chunk_size(spec, JacobianFactor, "hessian", n)
    assert one_chunk == n
    assert default_chunk_size(spec, Diagonal, "hessian", n, need_hessian_sum=False) == one_chunk
    assert default_chunk_size(spec, Diagonal, "hessian", n, need_hessian_sum=True) < n  # d × d each: budgeted
    q = Gaussian(jnp.asarray(0.1 * np.random.default_rng(0).normal(size=d)), jnp.full((d,), 3.0))
    rule = get_rule("delta")
    fn = jax.jit(lambda q_, data_: compute_sites(spec, data_, DiagonalGaussian(), q_, rule, storage="diag")[0])
    compiled = fn.lower(q, data).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 1.5 * 8 * n * d  # about one (N, d) float64 array
    small, _ = compute_sites(spec, data, DiagonalGaussian(), q, rule, storage="diag", chunk_size=300)
    np.testing.assert_allclose(compiled(q, data).curv.curvature, small.curv.curvature, rtol=1e-13)


def _tanh_regression(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1], 2]).to_event(2))
    v = numpyro.sample("v", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(jnp.tanh(X @ w) @ v, 0.5), obs=y)


def test_auto_storage_refuses_huge_dense_and_gh_needs_a_fixed_subspace(x64):
    # gh integrates over each example's fixed dependence subspace (a GLM, a learned noise scale:
    # scale_model has r = 2); a network's examples depend on a subspace that moves with z
    X, y = make_linear(20, 3)
    spec, data = bind_model(scale_model, (X, y))
    assert prepare_rule(get_rule("gh"), spec, data, jnp.zeros(4)).subspace_dim == 2
    net_spec, net_data = bind_model(_tanh_regression, (X, y))
    with pytest.raises(pc.ExpectationRuleError, match="subspace"):
        prepare_rule(get_rule("gh"), net_spec, net_data, jnp.full(8, 0.3))
    with pytest.raises(pc.SiteStorageError, match="factor"):
        compute_sites(spec, data, FullGaussian(), _q_full(4), get_rule("mc"), storage="factor")


SHARD_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_enable_x64", True)
    assert jax.local_device_count() == 2, jax.devices()
    import sys; sys.path.insert(0, {tests!r})
    from models import logistic_model, make_logistic
    from numpyro_pc.model.likelihood import bind_model
    from numpyro_pc.sites.expectations import get_rule
    from numpyro_pc.families.registry import FullGaussian, Gaussian
    from numpyro_pc.sites.gaussian import compute_sites
    X, y = make_logistic(45, 3)
    spec, data = bind_model(logistic_model, (X, y))
    q = Gaussian(jnp.full(4, 0.1), 3.0 * jnp.eye(4))
    a, sa = compute_sites(spec, data, FullGaussian(), q, get_rule("delta"), num_devices=2, chunk_size=4,
                          need_hessian_sum=True)
    b, sb = compute_sites(spec, data, FullGaussian(), q, get_rule("delta"), num_devices=1, need_hessian_sum=True)
    np.testing.assert_allclose(a.grad, b.grad, rtol=1e-13)
    np.testing.assert_allclose(a.curv.lam, b.curv.lam, rtol=1e-13)
    np.testing.assert_allclose(sa.hessian, sb.hessian, rtol=1e-12)
    print("sharded-ok")
""")


def test_sharding_over_two_fake_cpu_devices():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    script = SHARD_SCRIPT.format(tests=os.path.dirname(os.path.dirname(__file__)))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert "sharded-ok" in out.stdout, out.stderr[-3000:]
