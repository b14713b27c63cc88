"""Clients bucketed by shard size (issue 28 item 3): the same run as padding every client to the largest shard,
with at most twice the real rows processed."""

import math

import numpy as np
import pytest

from numpyro_pc import federated
from numpyro_pc.federated import stacking
from numpyro_pc.federated.core import bind_shards
from numpyro_pc.federated.options import Safeguard, StopRule

from models import logistic_model, make_logistic

SIZES = (3, 5, 9, 17, 40, 126)  # six buckets of powers of two, the largest shard 42× the smallest


def uneven_shards():
    X, y = make_logistic(sum(SIZES), 3, seed=4)
    cuts = np.cumsum(SIZES)[:-1]
    order = np.random.default_rng(1).permutation(sum(SIZES))
    return [(X[i], y[i]) for i in np.split(order, cuts)]


def test_buckets_bound_the_padding_and_keep_the_clients_order(x64):
    _, datas = bind_shards(logistic_model, uneven_shards())
    buckets = stacking.bucket_clients(datas, 2.0)
    assert len(buckets.stacks) == len(SIZES) and buckets.num_clients == len(SIZES)
    assert buckets.rows <= 2 * sum(SIZES)  # padded rows bounded by the real ones
    assert stacking.bucket_clients(datas, math.inf).rows == len(SIZES) * max(SIZES)
    # each client's rows come back in its own place: the per-client sum of weights is its shard size
    counts = stacking.map_buckets(lambda ex, mk: mk.sum(), buckets)
    np.testing.assert_array_equal(np.asarray(counts), SIZES)


@pytest.mark.slow  # 19 s and 7 s on 2 cores (six buckets compiled, twice)
@pytest.mark.filterwarnings("ignore:federated:RuntimeWarning")
@pytest.mark.parametrize("search", [False, True])
def test_bucketed_run_equals_the_run_padded_to_the_largest_shard(x64, monkeypatch, search):
    # the oracle: the layout before buckets (every client padded to the largest shard, one vmap)
    parts = uneven_shards()
    kw = dict(rho=0.5, rounds=3, stop=StopRule(tol=0.0, residual_tol=0.0), keep_data=False,
              safeguard=Safeguard(line_search=search))
    padded = federated.run(logistic_model, parts, **kw)  # the default layout
    monkeypatch.setattr(stacking, "BUCKET_BASE", 2.0)
    bucketed = federated.run(logistic_model, parts, **kw)
    np.testing.assert_allclose(np.asarray(bucketed.state.mean), np.asarray(padded.state.mean), rtol=0, atol=1e-10)
    np.testing.assert_allclose(np.asarray(bucketed.state.precision), np.asarray(padded.state.precision), rtol=0,
                               atol=1e-10)
    np.testing.assert_allclose(np.asarray(bucketed.sites.precision), np.asarray(padded.sites.precision), rtol=0,
                               atol=1e-10)
    np.testing.assert_allclose(bucketed.column("kl_to_previous"), padded.column("kl_to_previous"), rtol=1e-8,
                               atol=1e-14)
