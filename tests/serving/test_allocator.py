"""PageAllocator: SGLang's reuse orders, ownership checks, force_alloc."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrail.serving.allocator import PageAllocator


def _pages(*ids):
    return np.array(ids, np.int32)


# ---- reuse orders ---------------------------------------------------------------------------------


def test_lowest_reuse_merges_staged_pages_sorted():
    a = PageAllocator(10, reuse="lowest")
    assert a.alloc(4).tolist() == [1, 2, 3, 4]
    assert a.alloc(4).tolist() == [5, 6, 7, 8]
    assert a.alloc(2).tolist() == [9, 10]
    assert a.alloc(1) is None and a.available == 0
    a.free(_pages(7, 8))
    a.free(_pages(2))
    a.free(_pages(10, 9))
    assert a.available == 5 and a.merges == 0
    # Staged pages come back only when an allocation runs short, sorted: lowest ids first.
    assert a.alloc(3).tolist() == [2, 7, 8]
    assert a.merges == 1
    assert a.alloc(2).tolist() == [9, 10]
    assert a.alloc(1) is None


def test_lowest_reuse_keeps_unmerged_free_pages_first():
    a = PageAllocator(8)  # "lowest" is the default: SGLang's PD mode
    a.alloc(4)  # 1..4; 5..8 still on the free list
    a.free(_pages(1, 2))  # staged, not reused while the free list suffices
    assert a.alloc(3).tolist() == [5, 6, 7]
    assert a.alloc(2).tolist() == [1, 2]  # short: merge [8] with staged [1, 2] -> 1, 2, 8
    assert a.alloc(1).tolist() == [8]


def test_lifo_reuse_hands_out_most_recently_freed_first():
    a = PageAllocator(10, reuse="lifo")
    assert a.alloc(3).tolist() == [1, 2, 3]
    assert a.alloc(3).tolist() == [4, 5, 6]
    a.free(_pages(1, 2, 3))
    a.free(_pages(6, 4))
    assert a.alloc(2).tolist() == [6, 4]
    assert a.alloc(4).tolist() == [1, 2, 3, 7]


def test_page_zero_is_never_handed_out_and_results_are_int32():
    a = PageAllocator(5)
    pages = a.alloc(5)
    assert pages.dtype == np.int32 and 0 not in pages.tolist()
    assert a.alloc(0).tolist() == [] and a.alloc(0).dtype == np.int32


# ---- exhaustion and bad input ---------------------------------------------------------------------


@pytest.mark.parametrize("reuse", ["lowest", "lifo"])
def test_exhaustion_returns_none_and_changes_nothing(reuse):
    a = PageAllocator(6, reuse=reuse)
    a.alloc(4)
    assert a.alloc(3) is None
    assert a.available == 2
    assert a.alloc(2) is not None and a.available == 0


def test_refuses_double_free_foreign_and_out_of_range_pages():
    a = PageAllocator(10)
    pages = a.alloc(3)
    a.free(pages)
    with pytest.raises(ValueError, match="page 1 is not allocated"):
        a.free(pages)
    with pytest.raises(ValueError, match="page 9 is not allocated"):
        a.free(_pages(9))
    held = a.alloc(2)
    with pytest.raises(ValueError, match="twice"):
        a.free(np.array([held[0], held[0]], np.int32))
    for bad in (0, -1, 11):
        with pytest.raises(ValueError, match=f"page {bad} is out of range"):
            a.free([bad])
    assert a.available == 8  # the refused frees changed nothing


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"num_pages": 0}, "num_pages"),
        ({"num_pages": 2**31}, "num_pages"),
        ({"num_pages": 4, "reuse": "fifo"}, "reuse"),
    ],
)
def test_bad_construction_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PageAllocator(**kwargs)


def test_negative_alloc_is_refused():
    with pytest.raises(ValueError, match="n:"):
        PageAllocator(4).alloc(-1)


# ---- force_alloc (fault injection) ----------------------------------------------------------------


@pytest.mark.parametrize("reuse", ["lowest", "lifo"])
def test_force_alloc_double_allocates_a_held_page(reuse):
    a = PageAllocator(6, reuse=reuse)
    victim = a.alloc(3)
    a.force_alloc([int(victim[1])])  # a second request now owns page 2 as well
    assert a.hold_count(2) == 2 and a.available == 3
    a.free(victim)  # the first owner finishes: page 2 is still held by the second
    assert a.hold_count(2) == 1 and a.available == 5
    assert 2 not in a.alloc(5).tolist()
    a.free([2])
    assert a.hold_count(2) == 0
    assert a.alloc(1).tolist() == [2]


@pytest.mark.parametrize("reuse", ["lowest", "lifo"])
def test_force_alloc_takes_free_and_staged_pages_out_of_the_pool(reuse):
    a = PageAllocator(8, reuse=reuse)
    a.free(a.alloc(4))  # 1..4 freed (staged with "lowest"), 5..8 never used
    a.force_alloc([3, 6])
    assert a.available == 6
    got = a.alloc(6).tolist()
    assert sorted(got) == [1, 2, 4, 5, 7, 8]
    assert a.alloc(1) is None


def test_force_alloc_checks_range():
    with pytest.raises(ValueError, match="page 0 is out of range"):
        PageAllocator(4).force_alloc([0])


# ---- invariants under random traffic ---------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["lowest", "lifo"]), st.lists(st.tuples(st.booleans(), st.integers(0, 7)), max_size=60))
def test_random_traffic_never_hands_out_a_held_page(reuse, ops):
    a = PageAllocator(12, reuse=reuse)
    live: list[np.ndarray] = []
    held: set[int] = set()
    for is_alloc, k in ops:
        if is_alloc:
            got = a.alloc(k)
            if k > 12 - len(held):
                assert got is None
                continue
            assert got is not None and len(got) == k and not held & set(got.tolist())
            assert all(1 <= p <= 12 for p in got.tolist())
            if reuse == "lowest":
                assert (np.diff(got) > 0).all()  # every allocation is a sorted slice
            held |= set(got.tolist())
            live.append(got)
        elif live:
            pages = live.pop(k % len(live))
            a.free(pages)
            held -= set(pages.tolist())
        assert a.available == 12 - len(held)
