"""The prelude's grouping and holder checks, against plain Python on random inputs."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrail.forensics.lake.prelude import _Builder, _groups

small = st.integers(-3, 3)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_groups_are_the_distinct_values_ascending_each_with_its_pages_in_order(data):
    n = data.draw(st.integers(0, 40))
    ncols = data.draw(st.integers(1, 4))
    pages = np.array(data.draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)), np.int64)
    cols = [np.array(data.draw(st.lists(small, min_size=n, max_size=n)), np.int64) for _ in range(ncols)]
    want: dict[tuple, list[int]] = {}
    for i in range(n):
        want.setdefault(tuple(int(c[i]) for c in cols), []).append(int(pages[i]))
    got = [(values, ps.tolist()) for values, ps in _groups(pages, *cols)]
    assert got == sorted(want.items())
    assert all(type(v) is int for values, _ in got for v in values)


class _Pool:
    """What ``_Builder.holds`` reads of a pool: owners by page, further exclusive holders, prefix hits."""

    def __init__(self, owner: np.ndarray, extra: dict[int, set[int]], shared: dict[int, dict[int, int]]):
        self.owner, self.extra, self._shared = owner, extra, shared

    def shared(self) -> dict[int, dict[int, int]]:
        return self._shared


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_holds_names_owners_further_holders_and_prefix_hits(data):
    pages_n = data.draw(st.integers(1, 12))
    req = st.integers(-1, 6)
    owner = np.array(data.draw(st.lists(req, min_size=pages_n, max_size=pages_n)), np.int64)
    page = st.integers(0, pages_n - 1)
    extra = data.draw(st.dictionaries(page, st.sets(st.integers(0, 6), max_size=3), max_size=pages_n))
    shared = data.draw(st.dictionaries(page, st.dictionaries(st.integers(0, 6), st.integers(), max_size=3)))
    k = data.draw(st.integers(0, 30))
    pages = np.array(data.draw(st.lists(page, min_size=k, max_size=k)), np.int64)
    reqs = np.array(data.draw(st.lists(req, min_size=k, max_size=k)), np.int64)
    b = _Builder(_Pool(owner, extra, shared), [], [], None, 0)
    want = [
        int(owner[p]) == r or (r >= 0 and (r in extra.get(int(p), ()) or r in shared.get(int(p), {})))
        for p, r in zip(pages.tolist(), reqs.tolist())
    ]
    assert b.holds(pages, reqs).tolist() == want
