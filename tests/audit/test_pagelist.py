import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrail.audit.pagelist import count_runs, decode_runs, encode_runs

page_lists = st.lists(st.lists(st.integers(1, 2**31 - 2), max_size=40), max_size=30)


def _flatten(lists):
    offsets = np.zeros(len(lists) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(x) for x in lists]) if lists else []
    flat = np.array([p for x in lists for p in x], dtype=np.int32)
    return flat, offsets


@settings(max_examples=300, deadline=None)
@given(page_lists)
def test_round_trip_is_exact_including_order(lists):
    flat, offsets = _flatten(lists)
    row, pos, start, length = encode_runs(flat, offsets)
    back, back_offsets = decode_runs(len(lists), row, start, length)
    assert back.tolist() == flat.tolist()
    assert back_offsets.tolist() == offsets.tolist()
    # pos is the index of each run's first page inside its own list
    for r, p, s in zip(row, pos, start):
        assert lists[r][p] == s


def test_contiguous_allocation_is_one_run_and_fragmented_one_is_several():
    lists = [list(range(100, 164)), [7, 8, 9, 42, 43, 3]]
    flat, offsets = _flatten(lists)
    row, pos, start, length = encode_runs(flat, offsets)
    assert row.tolist() == [0, 1, 1, 1]
    assert start.tolist() == [100, 7, 42, 3] and length.tolist() == [64, 3, 2, 1]
    assert count_runs(lists[1]) == 3


def test_runs_never_join_across_lists_or_descending_pages():
    lists = [[1, 2], [3, 4], [9, 8]]
    flat, offsets = _flatten(lists)
    row, _, start, length = encode_runs(flat, offsets)
    assert list(zip(row.tolist(), start.tolist(), length.tolist())) == [(0, 1, 2), (1, 3, 2), (2, 9, 1), (2, 8, 1)]


def test_the_largest_page_id_ends_a_run_in_its_own_type():
    top = np.iinfo(np.int32).max
    flat = np.array([top - 1, top, 0, 1], dtype=np.int32)  # top + 1 wraps in int32: still a break
    row, pos, start, length = encode_runs(flat, np.array([0, 4]))
    assert start.tolist() == [top - 1, 0] and length.tolist() == [2, 2] and pos.tolist() == [0, 2]
