"""One site-table protocol for every posterior (issue 26): the Gaussian ``Sites`` and the
exponential-family ``EFSiteTable`` answer the same operations, and those operations satisfy
the identities of the dual form in float64.

* row operations: ``Σ`` over ``concat(take(a), take(b))`` equals ``Σ`` over the whole table
  (to rounding: the same numbers added in another order);
* tempering: ``scale(α).natural_sum == α · natural_sum``;
* the dual form: ``λ_0 + Σ_i λ̂_i == λ`` at the fixed point, for the families whose ``q``
  is the product of its sites (``SiteDivision``: full and diagonal Gaussians, every product family);
* files: ``from_arrays(arrays())`` is the same table.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numpyro_pc.sites.cached import Sites
from numpyro_pc.protocols.capabilities import SiteDivision, SiteSum, capability
from numpyro_pc.sites.expfam_table import EFSiteTable
from numpyro_pc.errors import InvalidOptionError
from numpyro_pc.protocols.sites import SiteTable

from models import CASES, N, _fit


@pytest.fixture(params=list(CASES))
def post(request, x64):
    return _fit(request.param), request.param


def _additive(family):
    """Whether sums of sites add in the family's own format (``SiteSum``); a low-rank sum is a projection."""
    return capability(family, SiteSum) is not None


def _linear(family, natural):
    """Natural parameters in linear coordinates: a low-rank family's ``[D | U]`` as ``diag(D) + UUᵀ``
    (its format is not linear: ``α [D | U]`` is not the projection of ``α`` times the sum)."""
    if family is None or _additive(family):
        return natural
    return natural._replace(precision=family.dense_precision(natural))


def _gap(family, a, b):
    """Largest relative difference between two natural parameters of ``family``, in linear coordinates."""
    la, lb = jax.tree.leaves(_linear(family, a)), jax.tree.leaves(_linear(family, b))
    assert len(la) == len(lb)
    return max(float(jnp.max(jnp.abs(x - y)) / (1.0 + jnp.max(jnp.abs(y)))) for x, y in zip(la, lb))


def _sum(*naturals):
    return jax.tree.map(lambda *xs: sum(xs), *naturals)


def test_both_kinds_are_site_tables(post):
    p, name = post
    table = p.sites
    assert isinstance(table, SiteTable)
    assert isinstance(table, Sites if CASES[name][0] == "gaussian" else EFSiteTable)
    assert table.kind == CASES[name][0]
    assert table.num_examples == p.num_examples == N
    np.testing.assert_array_equal(np.asarray(table.ids), np.asarray(p.ids))
    assert not isinstance(np.zeros(3), SiteTable)


def test_take_and_concat_keep_the_sum(post):
    p, _ = post
    table, family = p.sites, p.family
    whole = table.natural_sum(family)
    rng = np.random.default_rng(0)
    order = rng.permutation(N)
    a, b = np.sort(order[:7]), np.sort(order[7:])
    joined = table.take(a).concat(table.take(b))
    assert joined.num_examples == N
    np.testing.assert_array_equal(np.asarray(joined.ids), np.concatenate([np.asarray(table.ids)[a],
                                                                          np.asarray(table.ids)[b]]))
    assert _gap(family, joined.natural_sum(family), whole) < 1e-12
    if _additive(family):  # a low-rank sum is a projection: not additive over parts
        assert _gap(family, _sum(table.take(a).natural_sum(family), table.take(b).natural_sum(family)), whole) < 1e-12
    assert _gap(family, joined.prior_natural(family), table.prior_natural(family)) == 0.0
    # weights pick rows: the weighted sum over the whole is the sum over the rows taken
    weights = np.zeros(N)
    weights[a] = 1.0
    assert _gap(family, table.natural_sum(family, jnp.asarray(weights)), table.take(a).natural_sum(family)) < 1e-12


def test_tempered_halves_add_up_to_the_whole(post):
    p, _ = post
    table, family = p.sites, p.family
    halves = table.scale(0.25).concat(table.scale(0.75), prior_from="self")
    assert halves.num_examples == 2 * N
    assert _gap(family, halves.natural_sum(family), table.natural_sum(family)) < 1e-12


@pytest.mark.parametrize("alpha", [0.0, 0.3, 2.5])
def test_scale_is_tempering(post, alpha):
    p, _ = post
    table, family = p.sites, p.family
    scaled = table.scale(alpha)
    assert scaled.num_examples == N
    np.testing.assert_array_equal(np.asarray(scaled.ids), np.asarray(table.ids))
    expected = jax.tree.map(lambda x: alpha * x, _linear(family, table.natural_sum(family)))
    assert _gap(None, _linear(family, scaled.natural_sum(family)), expected) < 1e-12
    assert _gap(family, scaled.prior_natural(family), table.prior_natural(family)) == 0.0  # the prior is not tempered
    # scaling commutes with taking rows
    rows = np.arange(2, 9)
    assert _gap(family, scaled.take(rows).natural_sum(family), table.take(rows).scale(alpha).natural_sum(family)) < 1e-12


def test_prior_plus_sites_is_the_posterior(post):
    p, _ = post
    table, family = p.sites, p.family
    if capability(family, SiteDivision) is None:
        pytest.skip("q is not the product of its sites in this family (a projection, or a fixed precision)")
    assert _gap(family, _sum(table.prior_natural(family), table.natural_sum(family)), p.natural) < 1e-8


def test_arrays_round_trip(post):
    p, name = post
    table = p.sites
    static = {"storage": table.storage} if CASES[name][0] == "gaussian" else {}
    back = type(table).from_arrays(table.arrays(), **static)
    assert back.kind == table.kind
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(table)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_ef_table_refuses_what_it_does_not_take(x64):
    table = _fit("beta").sites
    with pytest.raises(InvalidOptionError, match="static"):
        EFSiteTable.from_arrays(table.arrays(), storage="factor")
    with pytest.raises(InvalidOptionError, match="prior_from"):
        table.concat(table, prior_from="neither")
    assert list(table.arrays()) == ["grads", "prior", "ids"]  # the "ef" file's names, in its order
