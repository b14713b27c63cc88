"""Family capabilities (issue 26, item 1): what each family can do beyond the core is declared and
looked up, operations refuse by capability (never by class), and families written against the old
flags keep working through a deprecation bridge.

Oracles: the expected table of every shipped family's capabilities written out by hand from the
mathematics (a family whose precision is a projection of the site sum has no site sum; a fixed
precision has no cavities); operations on a user family that differs from a shipped one only in
its declared capabilities, which must change what the operation does.
"""

import warnings
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
import pytest

import numpyro_pc as pc
from numpyro_pc import errors
from numpyro_pc.protocols.capabilities import (FixedPrecision, GaussianSolver, SiteCurvature, SiteDivision, SiteSum, capability,
                                     require)
from numpyro_pc.families.registry import FullGaussian, IsotropicGaussian, get_family
from numpyro_pc.families.lowrank import LowRankGaussian

from models import linear_model, make_linear
from models import beta_bernoulli

# (SiteSum, SiteDivision, FixedPrecision, (detail, default storage, matrix-free), (dense sum, by objective,
# dense checks)); None: the family lacks it
EXPECTED = {
    "full": (True, True, False, (2, None, False), (False, True, True)),
    "diagonal": (True, True, False, (1, "diag", False), (True, True, True)),
    "isotropic": (True, False, True, (0, "none", False), (True, True, True)),
    "lowrank-3": (False, False, False, (2, None, True), (False, False, False)),
}


def _table(family):
    curvature, solver = capability(family, SiteCurvature), capability(family, GaussianSolver)
    return (capability(family, SiteSum) is not None, capability(family, SiteDivision) is not None,
            capability(family, FixedPrecision) is not None,
            None if curvature is None else (curvature.detail, curvature.default_storage, curvature.matrix_free),
            None if solver is None else (solver.dense_sum, solver.minimises_objective, solver.dense_checks))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_gaussian_family_declares_what_its_mathematics_gives(name):
    assert _table(get_family(name)) == EXPECTED[name]


def test_an_exponential_family_product_has_site_sums_and_cavities_but_no_gaussian_sites():
    post = pc.fit(beta_bernoulli, y=jnp.asarray([1, 0, 1, 1, 0, 1.0]), family={"p": "beta"})
    assert _table(post.family) == (True, True, False, None, None)
    with pytest.raises(errors.MissingCapabilityError, match=r"the Gaussian site solver needs .* the product\(beta\) "
                       r"family lacks it: the fixed point is solved by natural-gradient"):
        require(post.family, GaussianSolver, "the Gaussian site solver")


def test_a_refusal_names_the_operation_the_need_and_the_reason_and_is_caught_as_either_old_type():
    lowrank = get_family("lowrank-2")
    with pytest.raises(errors.UnsupportedGuideError) as guide_err:
        require(lowrank, SiteDivision, "pc.loo")
    with pytest.raises(errors.UnsupportedModelError):
        require(lowrank, SiteSum, "pc.delete")
    message = str(guide_err.value)
    assert message.startswith("pc.loo needs dividing sites out of q")
    assert "the lowrank-2 family lacks it: the precision is a projection of the site sum" in message
    assert "family='full' or 'diagonal'" in message
    assert require(get_family("full"), SiteDivision, "pc.loo") == SiteDivision()


@dataclass(frozen=True, repr=False)
class _NoCavityFull(FullGaussian):
    """The full Gaussian, declared without cavities: operations must follow the declaration."""

    name: str = "full-without-cavities"
    capabilities = tuple(c for c in FullGaussian.capabilities if not isinstance(c, SiteDivision))
    lacks = {SiteDivision: "this test family does not offer cavities"}


def test_operations_follow_the_declared_capabilities_not_the_class(x64):
    X, y = make_linear(30, 3, seed=4)
    family = _NoCavityFull()
    post = pc.fit(linear_model, X, y, family=family)
    reference = pc.fit(linear_model, X, y, family="full")
    np.testing.assert_allclose(post.mean, reference.mean, rtol=0, atol=1e-10)  # the core is the full family's
    with pytest.raises(errors.MissingCapabilityError,
                       match="the full-without-cavities family lacks it: this test family does not offer cavities"):
        pc.loo(post)
    with pytest.raises(errors.MissingCapabilityError, match="this test family does not offer cavities"):
        pc.information_gain(post, post)
    assert np.all(np.isfinite(pc.loo(reference).pointwise))


def test_old_flags_are_bridged_to_capabilities_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match=r"declares \['linear_precision'\]") as caught:
        class Projected(FullGaussian):
            name = "full-projected"
            linear_precision = False
    assert caught[0].filename == __file__  # attributed to the class statement, so default filters show it

    held = Projected()
    assert capability(held, SiteSum) is None and capability(held, SiteDivision) is None
    with pytest.raises(errors.MissingCapabilityError, match=r"lacks it: its precision is not the sum of its sites' "
                       r"precisions \(linear_precision = False\)"):
        require(held, SiteDivision, "pc.loo")
    # what the class does not declare is inherited from the full family's capabilities
    assert capability(held, SiteCurvature) == SiteCurvature(2, None, False)
    assert capability(held, GaussianSolver) == GaussianSolver(dense_sum=False)

    with pytest.warns(DeprecationWarning, match="capability\\(family, FixedPrecision\\)"):
        assert IsotropicGaussian().fixed_precision is True
    with pytest.warns(DeprecationWarning):
        assert LowRankGaussian(rank=2).minimises_objective is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        class Declared(FullGaussian):  # a family written against capabilities warns about nothing
            name = "full-declared"
            capabilities = FullGaussian.capabilities
        assert capability(Declared(), SiteDivision) == SiteDivision()
    # a flag made per-instance cannot be bridged by a class: refused where the class is defined
    with pytest.raises(TypeError, match="'fixed_precision' a field or a property"):
        @dataclass(frozen=True)
        class PerInstance(FullGaussian):
            fixed_precision: bool = False
    with pytest.raises(TypeError, match="'linear_precision' a field or a property"):
        class AsProperty(FullGaussian):
            @property
            def linear_precision(self):
                return False


def test_a_registered_family_without_gaussian_sites_does_not_break_loading_gaussian_files(x64, tmp_path):
    # the storage a Gaussian file may hold is looked up for every registered family when a file is read
    from numpyro_pc.families.registry import _FAMILIES, register_family

    @dataclass(frozen=True, repr=False)
    class NoSites(FullGaussian):
        name: str = "full-without-gaussian-sites"
        capabilities = (SiteSum(),)

    X, y = make_linear(12, 2, seed=1)
    path = pc.fit(linear_model, X, y).save(tmp_path / "full.npz")
    register_family(NoSites())
    try:
        assert pc.load(path, linear_model).family.name == "full"
    finally:
        _FAMILIES.pop("full-without-gaussian-sites")
