"""Example ids: every iterable of integers is read the same way, nothing else is read at all."""

import numpy as np
import pytest

from numpyro_pc.errors import InvalidIdsError
from numpyro_pc.model.rows import as_ids


# factories: an iterator can be read once, and a parametrised test may run more than once
@pytest.mark.parametrize("make", [lambda: [4, 1, 4, 7], lambda: (7, 1, 4), lambda: np.array([[7], [4], [1]]),
                                  lambda: {1, 4, 7}, lambda: frozenset({7, 1, 4}), lambda: iter([4, 7, 1]),
                                  lambda: (i for i in (1, 7, 4, 4)), lambda: range(1, 8, 3),
                                  lambda: dict.fromkeys([7, 4, 1]).keys(), lambda: np.int64(4)],
                         ids=["list", "tuple", "array", "set", "frozenset", "iterator", "generator", "range", "keys",
                              "scalar"])
def test_ids_from_any_iterable_of_integers_are_the_same_sorted_unique_int64(make):
    got = as_ids(make())
    if got.size == 1:  # the scalar
        np.testing.assert_array_equal(got, [4])
        return
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, [1, 4, 7])


@pytest.mark.parametrize("make", [list, tuple, set, lambda: iter(()), lambda: np.zeros(0)],
                         ids=["list", "tuple", "set", "iterator", "array"])
def test_no_ids_are_an_empty_int64_array(make):
    got = as_ids(make())
    assert got.dtype == np.int64 and got.shape == (0,)


@pytest.mark.parametrize("make", [lambda: [1.0, 2.0], lambda: np.array([True, False]), lambda: iter([1.5]),
                                  lambda: {0.5}, lambda: ["1"], lambda: [1, "a"], lambda: "12"],
                         ids=["floats", "bools", "iterator-of-float", "set-of-float", "strings", "mixed", "string"])
def test_ids_that_are_not_integers_are_refused_not_rounded(make):
    with pytest.raises(InvalidIdsError, match="must be integers"):
        as_ids(make())
