"""storage="auto" sizes dense sites by the machine's memory, and every SiteStorageError's advice works."""

import os
from dataclasses import replace

import jax.numpy as jnp
import numpy as np
import pytest
from models import logistic_model, make_logistic

import numpyro_pc as pc
from numpyro_pc.curvature import memory
from numpyro_pc.curvature import storage as site_storage
from numpyro_pc.sites import gaussian as sites
from numpyro_pc.curvature.stores import Dense, Diagonal, JacobianFactor
from numpyro_pc.sites.expectations import get_rule
from numpyro_pc.families.registry import FullGaussian
from numpyro_pc.model.likelihood import bind_model
from numpyro_pc.model.rows import bucket_size
from models import grouped_data, noncentred

# the Monte Carlo rule's error estimate (64 fixed draws) is reported, and not what these tests check
pytestmark = pytest.mark.filterwarnings("ignore::numpyro_pc.errors.MonteCarloErrorWarning")


def _fit(model, args, **options):
    post = pc.fit(model, *args, **options)
    assert post.residual < 1e-8, (options, post.residual)
    return post


def test_budget_is_a_share_of_the_machines_memory(monkeypatch, tmp_path):
    assert memory.dense_auto_budget(16 * 2**30) == 2 * 2**30
    assert memory.dense_auto_budget(None) == memory.DENSE_AUTO_FALLBACK == 2**30
    assert memory.DENSE_AUTO_FALLBACK > 16 * 59e6  # far above the 59 MB of the 40-group model's dense sites
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < memory.machine_memory() <= physical
    assert site_storage._DENSE_AUTO_LIMIT == memory.dense_auto_budget(memory.machine_memory())
    # a container's cgroup limit below the physical memory wins; "max" (unlimited) is ignored
    limit, unlimited = tmp_path / "memory.max", tmp_path / "unlimited"
    limit.write_text("1073741824\n")
    unlimited.write_text("max\n")
    monkeypatch.setattr(memory, "_CGROUP_LIMITS", (str(unlimited), str(limit), str(tmp_path / "absent")))
    assert memory.machine_memory() == min(physical, 2**30)
    monkeypatch.setattr(memory, "_CGROUP_LIMITS", (str(unlimited),))
    assert memory.machine_memory() == physical

    def unreadable(name):
        raise ValueError(name)

    monkeypatch.setattr(memory.os, "sysconf", unreadable)
    assert memory.machine_memory() is None
    assert memory.dense_auto_budget(memory.machine_memory()) == 2**30


def test_budget_counts_bytes_of_the_dtype(monkeypatch):
    g, x, y = grouped_data(40, 6)
    spec, _ = bind_model(noncentred, (g, x, y))
    n, d = spec.num_examples, spec.latent.dim
    assert not spec.affine and spec.num_params == 2
    monkeypatch.setattr(site_storage, "_DENSE_AUTO_LIMIT", n * d * d * 4)  # float32 fits, float64 does not
    mc = get_rule("mc")
    assert sites.resolve_storage("auto", FullGaussian(), spec, mc, "hessian", jnp.float32) is Dense
    with pytest.raises(pc.SiteStorageError) as err:
        sites.resolve_storage("auto", FullGaussian(), spec, mc, "hessian", jnp.float64)
    assert f"N·d² = {n * d * d:.3g} numbers ({memory.format_bytes(8 * n * d * d)})" in str(err.value)
    assert err.value.remedies == ({"expectation": "delta", "curvature": "ggn"}, {"family": "diagonal"},
                                  {"storage": "dense"})
    # with the delta rule, Gauss–Newton alone factorises
    with pytest.raises(pc.SiteStorageError) as err:
        sites.resolve_storage("auto", FullGaussian(), spec, get_rule("delta"), "hessian", jnp.float64)
    assert err.value.remedies[0] == {"curvature": "ggn"}
    assert sites.resolve_storage("auto", FullGaussian(), spec, get_rule("delta"), "ggn", jnp.float64) is JacobianFactor


def _raised(call):
    with pytest.raises(pc.SiteStorageError) as err:
        call()
    message = str(err.value)
    assert err.value.remedies
    for remedy in err.value.remedies:  # the message says each remedy as it is to be passed
        assert " with ".join(f"{k}={v!r}" for k, v in remedy.items()) in message
    return err.value.remedies


def test_advice_of_a_too_large_auto_storage_works(x64, monkeypatch):
    # the Monte Carlo rule with dense per-example Hessians (expectation="mc"; "auto" would
    # differentiate along each example's 6-dimensional dependence subspace and factorise)
    args = grouped_data(40, 6)
    dense = pc.fit(noncentred, *args, expectation="mc", storage="dense")
    auto = _fit(noncentred, args, expectation="mc")  # the budget of this machine holds the dense sites
    assert isinstance(auto.sites.curv, Dense)
    np.testing.assert_allclose(auto.mean, dense.mean, rtol=0, atol=1e-8)
    np.testing.assert_allclose(auto.state.precision, dense.state.precision, rtol=1e-8)
    monkeypatch.setattr(site_storage, "_DENSE_AUTO_LIMIT", 1024)
    remedies = _raised(lambda: pc.fit(noncentred, *args, expectation="mc"))
    assert remedies == ({"expectation": "delta", "curvature": "ggn"}, {"family": "diagonal"}, {"storage": "dense"})
    fits = {i: _fit(noncentred, args, **{"expectation": "mc", **r}) for i, r in enumerate(remedies)}
    assert isinstance(fits[0].sites.curv, JacobianFactor) and isinstance(fits[1].sites.curv, Diagonal)
    np.testing.assert_allclose(fits[2].mean, dense.mean, rtol=0, atol=1e-8)
    # the factorised Laplace–Gauss–Newton posterior is the one dense storage gives
    ggn_dense = _fit(noncentred, args, expectation="delta", curvature="ggn", storage="dense")
    np.testing.assert_allclose(fits[0].mean, ggn_dense.mean, rtol=0, atol=1e-8)
    np.testing.assert_allclose(fits[0].state.precision, ggn_dense.state.precision, rtol=1e-8)


def test_advice_of_a_factor_storage_without_a_factorisation_works(x64):
    args = grouped_data(40, 6)
    remedies = _raised(lambda: pc.fit(noncentred, *args, expectation="mc", storage="factor"))
    assert remedies == ({"expectation": "delta", "curvature": "ggn"}, {"storage": "dense"})
    for remedy in remedies:
        _fit(noncentred, args, **{"expectation": "mc", "storage": "factor", **remedy})


def test_advice_of_a_store_too_small_for_the_family_works(x64):
    X, y = make_logistic(30, 3)
    remedies = _raised(lambda: pc.fit(logistic_model, X, y, storage="diag"))
    assert remedies == ({"storage": "auto"},)
    assert isinstance(_fit(logistic_model, (X, y), **remedies[0]).sites.curv, JacobianFactor)


def _forty_groups():
    return grouped_data(615, 40)


def test_a_forty_group_noncentred_regression_is_stored_dense(monkeypatch):
    # N = 615 padded to 1,024, d = 85: 7.4e6 numbers, 59 MB (56.4 MiB) in float64 — refused by the former
    # fixed limit of 2**22 numbers, stored dense under the fallback budget of a machine whose memory is unknown
    spec, data = bind_model(noncentred, _forty_groups(), {"num_groups": 40})
    spec = replace(spec, num_examples=bucket_size(spec.num_examples))
    assert (spec.num_examples, spec.latent.dim) == (1024, 85)
    mc = get_rule("mc")
    monkeypatch.setattr(site_storage, "_DENSE_AUTO_LIMIT", memory.dense_auto_budget(None))
    assert sites.resolve_storage("auto", FullGaussian(), spec, mc, "hessian", jnp.float64) is Dense
    monkeypatch.setattr(site_storage, "_DENSE_AUTO_LIMIT", 2**22 * 8)
    with pytest.raises(pc.SiteStorageError, match=r"7\.4e\+06 numbers \(56\.4 MiB\)"):
        sites.resolve_storage("auto", FullGaussian(), spec, mc, "hessian", jnp.float64)


@pytest.mark.slow
def test_a_forty_group_noncentred_regression_fits_with_the_defaults(x64):
    # r = 6 of d = 85 (μ_a + x μ_b, log s_a, ã_g, log s_b, b̃_g, log σ): the Monte Carlo sites are differentiated
    # along that subspace and stored factorised (bench_hierarchical.py: 124 / 107 s → 32 / 12 s cold / warm)
    post = _fit(noncentred, _forty_groups(), num_groups=40)
    assert isinstance(post.sites.curv, JacobianFactor) and post.rule.kind == "mc" and post.rule.subspace_dim == 6

