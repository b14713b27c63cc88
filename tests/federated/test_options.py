"""The option groups of ``federated.run`` / ``run_ef`` (issue 27) and the typed round records.

Oracles: each group's ``repr`` prints its defaults; a bad value raises the typed error the flat keyword
raised before (or, where the flat keyword was not checked, an ``InvalidOptionError`` naming the field); the
old flat keywords give a ``FutureWarning`` at the caller's line and the same run to the bit; a flat keyword
with its group is refused; every ``history`` entry is a ``RoundInfo`` that reads as the dict it replaced.
"""

import json
import math
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from numpyro_pc import federated
from numpyro_pc.errors import InvalidOptionError
from numpyro_pc.federated.options import MOVED, LocalSolve, Robustness, Safeguard, StopRule, resolve_options
from numpyro_pc.federated.records import RoundInfo, round_dicts
from numpyro_pc.protocols.records import Record, plain

from models import _data, beta_bernoulli, linear_model, make_linear


def test_each_group_prints_its_defaults():
    assert repr(LocalSolve()) == ("LocalSolve(iters=None, tol=None, expectation=None, num_nodes=None, "
                                  "num_samples=None, draw_seed=0)")
    assert repr(StopRule()) == "StopRule(tol=None, residual_tol=None)"
    assert repr(Safeguard()) == "Safeguard(enabled=None, margin=0.3, max_retries=6, line_search=None)"
    assert repr(Robustness()) == "Robustness(max_share=None, max_shift=None)"
    assert repr(Safeguard(margin=0.5)) == "Safeguard(enabled=None, margin=0.5, max_retries=6, line_search=None)"
    with pytest.raises(AttributeError):
        Safeguard().margin = 1.0  # frozen
    with pytest.raises(TypeError):
        StopRule(1e-8)  # keyword-only


@pytest.mark.parametrize("build, match", [
    (lambda: LocalSolve(iters=0), "LocalSolve.iters"),
    (lambda: LocalSolve(iters=2.5), "LocalSolve.iters"),
    (lambda: LocalSolve(tol=-1.0), "LocalSolve.tol"),
    (lambda: LocalSolve(expectation=3), "LocalSolve.expectation"),
    (lambda: LocalSolve(num_nodes=0), "LocalSolve.num_nodes"),
    (lambda: LocalSolve(draw_seed=-1), "LocalSolve.draw_seed"),
    (lambda: StopRule(tol=-1e-8), "StopRule.tol"),
    (lambda: StopRule(residual_tol=math.nan), "StopRule.residual_tol"),
    (lambda: Safeguard(enabled="yes"), "Safeguard.enabled"),
    (lambda: Safeguard(margin=-0.1), "Safeguard.margin"),
    (lambda: Safeguard(max_retries=-1), "Safeguard.max_retries"),
    # the message run(max_share=...) gave before the groups
    (lambda: Robustness(max_share=-1.0), "max_share and max_shift must be positive, got -1.0, None"),
    (lambda: Robustness(max_shift=math.nan), "max_share and max_shift must be positive"),
    (lambda: Robustness(max_share="big"), "max_share and max_shift must be positive"),
])
def test_a_bad_value_in_each_group_is_refused_when_built(build, match):
    with pytest.raises(InvalidOptionError, match=match):
        build()


def test_groups_keep_good_values_as_numbers():
    assert StopRule(tol=0).tol == 0.0 and Safeguard(enabled=np.bool_(False)).enabled is False
    assert Robustness(max_share=np.float32(2.0)) == Robustness(max_share=2.0)
    assert Robustness(max_shift=math.inf).active and not Robustness().active
    assert Safeguard().on("fedpc") and not Safeguard().on("pvi") and not Safeguard(enabled=False).on("admm")


def test_a_bad_flat_keyword_still_raises_what_it_raised(x64):
    y = jnp.asarray(_data(4, n=12)["bern"])
    shards = [(y[:6],), (y[6:],)]
    with pytest.warns(FutureWarning), pytest.raises(InvalidOptionError, match="positive"):
        federated.run(beta_bernoulli, shards, family={"p": "beta"}, max_share=-1.0)
    X, y = make_linear(20, 2, seed=0)
    with pytest.raises(InvalidOptionError, match="ADMM"):
        federated.run(linear_model, [(X, y)], algorithm="admm", robust=Robustness(max_shift=1.0))


def test_a_flat_keyword_with_its_group_is_refused():
    X, y = make_linear(20, 2, seed=0)
    with pytest.raises(InvalidOptionError, match=r"tol= and stop=StopRule"):
        federated.run(linear_model, [(X, y)], tol=1e-3, stop=StopRule())
    with pytest.raises(InvalidOptionError, match=r"safeguard_margin= and safeguard=Safeguard"):
        federated.run(linear_model, [(X, y)], safeguard=Safeguard(), safeguard_margin=0.5)
    with pytest.raises(InvalidOptionError, match=r"max_shift= and robust=Robustness"):
        federated.run_ef(beta_bernoulli, [(X, y)], {"p": "beta"}, robust=Robustness(), max_shift=1.0)
    with pytest.raises(InvalidOptionError, match="stop must be a StopRule"):
        federated.run(linear_model, [(X, y)], stop=dict(tol=1e-3))
    with pytest.raises(TypeError, match="unexpected keyword argument 'local_iter'"):
        federated.run(linear_model, [(X, y)], local_iter=3)


def test_every_moved_keyword_warns_and_fills_its_field():
    for name, (group, field) in MOVED.items():
        value = 7 if field in ("iters", "num_nodes", "num_samples", "draw_seed", "max_retries") else (
            "delta" if field == "expectation" else 0.5)
        with pytest.warns(FutureWarning, match=rf"run\({name}=\.\.\.\) is deprecated: use {group}=") as got:
            groups = resolve_options("run", {name: value})
        assert got[0].filename == __file__
        chosen = groups[("local", "stop", "safeguard", "robust").index(group)]
        assert getattr(chosen, field) == value
    # safeguard=False with a flat safeguard keyword: both kept
    with pytest.warns(FutureWarning):
        _, _, guard, _ = resolve_options("run", {"safeguard_margin": 0.5}, safeguard=False)
    assert guard == Safeguard(enabled=False, margin=0.5)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:federated:RuntimeWarning")
def test_the_flat_keywords_give_the_same_gaussian_run_to_the_bit(x64):
    X, y = make_linear(40, 2, seed=3)
    clients = [(X[:20], y[:20]), (X[20:], y[20:])]
    seen = []
    new = federated.run(linear_model, clients, rounds=3, local=LocalSolve(iters=5, tol=1e-10, expectation="delta"),
                        stop=StopRule(tol=0.0, residual_tol=0.0), safeguard=Safeguard(margin=0.5, max_retries=2),
                        robust=Robustness(max_share=10.0), keep_data=False, callback=seen.append)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = federated.run(linear_model, clients, rounds=3, local_iters=5, local_tol=1e-10, expectation="delta",
                            tol=0.0, residual_tol=0.0, safeguard_margin=0.5, max_retries=2, max_share=10.0,
                            keep_data=False)
    future = [w for w in caught if issubclass(w.category, FutureWarning)]
    assert len(future) == 8 and all(w.filename == __file__ for w in future)
    assert "use local=LocalSolve(iters=...)" in " ".join(str(w.message) for w in future)
    np.testing.assert_array_equal(np.asarray(new.state.mean), np.asarray(old.state.mean))
    np.testing.assert_array_equal(np.asarray(new.state.precision), np.asarray(old.state.precision))
    assert new.rounds == old.rounds and new.status == old.status  # the same run (an exact posterior may stop early)
    # the history: RoundInfo records, read as the dicts they replaced, and saved as JSON
    assert all(isinstance(h, RoundInfo) and isinstance(h, Record) for h in new.history)
    assert seen == new.history and isinstance(seen[0], RoundInfo)
    last = new.history[-1]
    assert last["round"] == last.round == new.rounds and last["kl_to_reference"] is None and last["clipped"] == 0
    assert math.isnan(last.get("kl_to_reference", math.nan)) and last.get("nonsense", 1) == 1
    assert last.get("retries", 5) == 0 and last.get("epsilon") is None
    assert np.isnan(new.column("kl_to_reference")).all() and new.column("round").tolist() == list(range(1, new.rounds + 1))
    saved = json.loads(json.dumps(plain(new.history)))
    assert saved[-1]["bytes"] == last["bytes"] and saved[-1]["epsilon"] is None
    compact = round_dicts(new.history)
    assert set(compact[0]) == {"round", "kl_to_previous", "residual", "participants", "local_iterations",
                               "bytes_up", "bytes_down", "bytes", "seconds", "rho_min", "rho_max", "rho_floor",
                               "retries", "clipped", "clipped_clients"}  # bounded: the plain step, no search fields
    with pytest.raises(TypeError):
        last["round"] = 4  # read-only
    with pytest.raises(TypeError):
        RoundInfo(round=1, kl_to_previus=0.0)  # a misspelt field


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:federated:RuntimeWarning")
def test_the_flat_keywords_give_the_same_exponential_family_run_to_the_bit(x64):
    y = jnp.asarray(_data(4, n=12)["bern"])
    shards = [(y[:6],), (y[6:],)]
    new = federated.run(beta_bernoulli, shards, family={"p": "beta"}, rounds=2, local=LocalSolve(iters=50),
                        stop=StopRule(tol=0.0, residual_tol=0.0), safeguard=Safeguard(margin=0.4), keep_data=False)
    with pytest.warns(FutureWarning) as caught:
        old = federated.run_ef(beta_bernoulli, shards, {"p": "beta"}, rounds=2, local_iters=50, tol=0.0,
                               residual_tol=0.0, safeguard_margin=0.4, keep_data=False)
    assert {w.filename for w in caught if issubclass(w.category, FutureWarning)} == {__file__}
    np.testing.assert_array_equal(np.asarray(new.sites), np.asarray(old.sites))
    assert new.rounds == old.rounds == 2 and all(isinstance(h, RoundInfo) for h in new.history)
    assert new.history[-1]["kl_rounding"] is not None and new.history[-1]["bytes_up"] is None
    saved = json.loads(json.dumps(plain(new.history)))
    assert saved[-1]["kl_to_previous"] == new.history[-1].kl_to_previous and saved[-1]["failure"] is None
