"""Example ids: every iterable of integers is read the same way, nothing else is read at all."""

import numpy as np
import pytest

from numpyro_pc.errors import InvalidIdsError
from numpyro_pc.model.rows import as_ids


@pytest.mark.parametrize("ids", [[4, 1, 4, 7], (7, 1, 4), np.array([[7], [4], [1]]), {1, 4, 7}, frozenset({7, 1, 4}),
                                 iter([4, 7, 1]), (i for i in (1, 7, 4, 4)), range(1, 8, 3)])
def test_ids_from_any_iterable_of_integers_are_the_same_sorted_unique_int64(ids):
    got = as_ids(ids)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, [1, 4, 7])


@pytest.mark.parametrize("ids", [[], (), set(), iter(()), np.zeros(0)])
def test_no_ids_are_an_empty_int64_array(ids):
    got = as_ids(ids)
    assert got.dtype == np.int64 and got.shape == (0,)


@pytest.mark.parametrize("ids", [[1.0, 2.0], np.array([True, False]), iter([1.5]), {0.5}, ["1"], [1, "a"]])
def test_ids_that_are_not_integers_are_refused_not_rounded(ids):
    with pytest.raises(InvalidIdsError, match="must be integers"):
        as_ids(ids)
