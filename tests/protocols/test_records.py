"""Typed records (numpyro_pc.protocols.records): the mapping view, construction checks, JSON form, and the
record each operation leaves on the posterior it returns."""

import dataclasses
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import beta_bernoulli, logistic_model, make_logistic

import numpyro_pc as pc
from numpyro_pc.protocols.records import (
    CorrectionMagnitude,
    DeleteInfo,
    FitInfo,
    IterationInfo,
    LoadInfo,
    MergeInfo,
    RefineInfo,
    StartInfo,
    UpdateInfo,
    plain,
)
from numpyro_pc import federated
from numpyro_pc.protocols.records import FederatedInfo


def test_mapping_view_lists_every_field_own_fields_first():
    info = UpdateInfo(correction="exact", corrected=3, new=2)
    assert list(info)[:4] == ["operation", "correction", "corrected", "new"]
    assert list(info)[-7:] == ["iterations", "residual", "converged", "rho", "max_site_nonlinearity",
                               "expectation_error", "coarse_iterations"]
    assert len(info) == len(dataclasses.fields(UpdateInfo))
    assert info["corrected"] == info.corrected == 3
    assert info["fallback"] is None and "fallback" in info  # a field that does not apply is None, not absent
    assert dict(info)["new"] == 2 and info.get("new", 0) == 2
    assert info.get("weight", "missing") == "missing" and info.get("nothing", 1.5) == 1.5  # as dict.get did


def test_unknown_field_is_refused_when_read_and_when_built():
    info = DeleteInfo(method="remove_site", deleted=1)
    with pytest.raises(KeyError, match="DeleteInfo has no field 'damped'; its fields are operation, method"):
        info["damped"]
    assert "damped" not in info
    with pytest.raises(TypeError, match="damped"):
        DeleteInfo(damped=0.5)
    with pytest.raises(TypeError):
        DeleteInfo("remove_site")  # keyword-only: a positional value cannot land in the wrong field


def test_records_are_frozen_and_replace_returns_a_copy():
    info = RefineInfo(iterations=4, converged=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.iterations = 5
    other = info.replace(iterations=5)
    assert (info.iterations, other.iterations, other.converged) == (4, 5, True)
    with pytest.raises(TypeError):
        info.replace(iteration=5)


def test_equality_is_the_mapping_s_and_the_json_form_is_plain():
    info = UpdateInfo(correction="memory", corrected=2, new=1,
                      restart=StartInfo(kind="map", reason="from q_t: StagnationError", candidates={"map": 1.5}),
                      correction_magnitude=CorrectionMagnitude(ids=np.array([4, 7]), magnitude=np.array([0.1, 0.2]),
                                                               total=np.float64(0.3)))
    assert info == dict(info) and info != dict(info, new=2)
    assert info != UpdateInfo(correction="memory")
    text = json.dumps(plain(info), default=lambda a: np.asarray(a).tolist())
    back = json.loads(text)
    assert back["restart"] == {"kind": "map", "reason": "from q_t: StagnationError", "iterations": None,
                               "grad_norm": None, "value": None, "converged": None, "saddle_escapes": None,
                               "candidates": {"map": 1.5}}
    assert back["correction_magnitude"]["ids"] == [4, 7] and back["correction_magnitude"]["total"] == 0.3
    assert type(plain(np.float64(0.3))) is float and plain((1, (2, 3))) == [1, [2, 3]]


def test_repr_shows_the_fields_that_are_set():
    assert repr(DeleteInfo(method="corrected", deleted=3)) == "DeleteInfo(operation='delete', method='corrected', deleted=3)"
    assert repr(LoadInfo()) == "LoadInfo(operation='load')"


@pytest.fixture(scope="module")
def fitted():
    X, y = make_logistic(48, 3, seed=0)
    with jax.enable_x64():
        post = pc.fit(logistic_model, X[:32], y[:32])
    return post, X, y


@pytest.mark.slow  # 8 s (measured alone, 2 cores)
def test_each_operation_leaves_its_own_record(fitted, tmp_path):
    """Float64 throughout: the fit is, and an update must run in the precision of its posterior."""
    with jax.enable_x64():
        _each_operation(*fitted, tmp_path)


def _each_operation(post, X, y, tmp_path):
    assert isinstance(post.record, FitInfo) and post.record.operation == "fit"
    assert isinstance(post.record.start, StartInfo) and post.record.start.kind == post.record["start"]["kind"]
    assert all(isinstance(h, IterationInfo) for h in post.history)
    assert [h.iteration for h in post.history] == list(range(len(post.history)))

    updated = post.update(X[32:40], y[32:40], correction="memory", memory=4)
    record = updated.record
    assert isinstance(record, UpdateInfo) and (record.correction, record.corrected, record.new) == ("memory", 4, 8)
    assert record.iterations == len(updated.history) - 1 and record.fallback is None and record.restart is None
    assert isinstance(record.correction_magnitude, CorrectionMagnitude)
    assert record.correction_magnitude.total == pytest.approx(float(np.sum(record.correction_magnitude.magnitude)))
    json.dumps(plain(record), default=lambda a: np.asarray(a).tolist())

    deleted = updated.delete([0, 1], method="remove_site")
    assert isinstance(deleted.record, DeleteInfo)
    assert (deleted.record.method, deleted.record.deleted, deleted.record.damping) == ("remove_site", 2, 1.0)
    assert deleted.record.kl_to_previous > 0.0

    refined = deleted.refine()
    assert isinstance(refined.record, RefineInfo) and refined.record.converged
    assert refined.record.iterations == len(refined.history) - 1

    other = post.update(X[40:], y[40:], correction="exact")
    merged = pc.merge(post, [updated, other])
    assert isinstance(merged.record, MergeInfo) and (merged.record.method, merged.record.num_tasks) == ("bayesian", 2)

    loaded = pc.load(refined.save(tmp_path / "p.npz"), logistic_model)
    assert isinstance(loaded.record, LoadInfo)
    assert loaded.record.residual == pytest.approx(float(refined.residual), rel=1e-6, abs=1e-12)


@pytest.mark.slow  # 6 s (measured alone, 2 cores)
def test_exponential_family_records_have_the_same_types():
    y = jnp.array([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    with jax.enable_x64():
        post = pc.fit(beta_bernoulli, y=y[:6], family={"p": "beta"})
        assert isinstance(post.record, FitInfo) and post.record.operation == "fit" and post.record.converged
        updated = post.update(y=y[6:], correction="exact")
        assert isinstance(updated.record, UpdateInfo) and updated.record.converged
        assert (updated.record.correction, updated.record.corrected, updated.record.new) == ("exact", 6, 2)
        deleted = updated.delete([0])
        assert isinstance(deleted.record, DeleteInfo) and deleted.record.deleted == 1
        refined = deleted.refine()
        assert isinstance(refined.record, RefineInfo) and refined.record.converged
        merged = pc.merge(post, [updated, post.update(y=y[6:7], correction="exact")])
    assert isinstance(merged.record, MergeInfo) and merged.record.num_tasks == 2


def test_a_refined_product_merge_reports_the_merge_and_its_solve():
    y = jnp.array([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    with jax.enable_x64():
        a = pc.fit(beta_bernoulli, y=y[:4], family={"p": "beta"})
        b = pc.fit(beta_bernoulli, y=y[4:], family={"p": "beta"})
        merged = a.merge(b, refine=True)
    assert isinstance(merged.record, MergeInfo) and merged.record.operation == "merge"
    assert merged.record.converged and merged.record.iterations is not None and merged.record.num_tasks == 2


@pytest.mark.parametrize("family", [pytest.param("full", marks=pytest.mark.slow), {"p": "beta"}],
                         ids=["gaussian", "product"])  # the Gaussian run takes 7 s: slow tier (tests/tiers.py)
def test_a_federated_run_s_posterior_records_the_run(family):
    with jax.enable_x64(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # three rounds stop before the tolerances: not judged here
        if isinstance(family, dict):  # beta_bernoulli(y): each client's shard is its y
            shards = [(jnp.array(v),) for v in ([1.0, 0.0, 1.0], [1.0, 1.0, 0.0])]
            result = federated.run(beta_bernoulli, shards, family=family, rounds=3)
        else:
            X, y = make_logistic(24, 2, seed=3)
            result = federated.run(logistic_model, [(X[:12], y[:12]), (X[12:], y[12:])], family=family, rounds=3)
    record = result.posterior.record
    assert isinstance(record, FederatedInfo) and record.operation == "federated"
    assert (record.algorithm, record.rounds, record.status) == ("fedpc", len(result.history), result.status)
