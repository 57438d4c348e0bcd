"""``kvtrail.keys.unique_first`` gives what ``np.unique(..., return_index=True, return_inverse=True)`` gives."""

from __future__ import annotations

import numpy as np
import pytest

from kvtrail.keys import unique_first


@pytest.mark.parametrize(
    ("n", "bound"),
    [(0, 1), (1, 1), (7, 3), (6800, 2500), (6800, 7000), (50, 100_000)],  # the last: np.unique's own path
)
def test_the_same_as_numpys_unique(n, bound):
    keys = np.random.default_rng(n + bound).integers(0, bound, n)
    uniq, first, inverse = unique_first(keys, bound)
    want = np.unique(keys, return_index=True, return_inverse=True)
    assert uniq.tolist() == want[0].tolist()
    assert first.tolist() == want[1].tolist()
    assert inverse.tolist() == want[2].reshape(-1).tolist()
    assert (uniq[inverse] == keys).all() and (keys[first] == uniq).all()


def test_a_key_outside_the_bound_is_refused():
    with pytest.raises(ValueError, match="keys must lie in 0 .. 9"):
        unique_first(np.array([3, 10]), 10)
    with pytest.raises(ValueError):
        unique_first(np.array([-1, 2]), 10)
