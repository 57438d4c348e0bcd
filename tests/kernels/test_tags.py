"""Page ownership tags catch every reuse, ABA included, with both CPU backends."""

from __future__ import annotations

import pytest
import torch

from kvtrail.kernels.cpu import _TAG_PARALLEL_MIN_PAGES
from kvtrail.kernels.layout import KernelError
from kvtrail.kernels.registry import get_backend
from kvtrail.kernels.tags import PageTags


def test_untouched_request_verifies(backend):
    tags = PageTags(16)
    held = tags.allocate([3, 7, 9])
    assert held.tolist() == [1, 1, 1]
    assert tags.verify([3, 7, 9], held, backend).numel() == 0


def test_reuse_by_another_request_is_caught(backend):
    tags = PageTags(16)
    held = tags.allocate([3, 7, 9])
    tags.free([7])
    tags.allocate([7])  # another request gets page 7
    assert tags.verify([3, 7, 9], held, backend).tolist() == [7]


def test_aba_same_request_id_is_caught(backend):
    # page freed and handed back to the same request id: the generation still moved on
    tags = PageTags(8)
    held = tags.allocate([2, 4])
    tags.free([2, 4])
    again = tags.allocate([4, 2])
    assert tags.verify([2, 4], held, backend).tolist() == [2, 4]
    assert tags.verify([4, 2], again, backend).numel() == 0


def test_read_after_free_is_caught_before_reuse(backend):
    tags = PageTags(8)
    held = tags.allocate([5])
    tags.free([5])
    assert tags.verify([5], held, backend).tolist() == [5]


def test_every_reuse_over_allocator_churn(backend):
    # request ids come from a small set, so pages often go back to the same id (ABA); live holders
    # always verify, every finished holder never does again
    g = torch.Generator().manual_seed(11)
    tags = PageTags(48)
    free = list(range(1, 49))
    live: dict[int, tuple[list[int], torch.Tensor]] = {}
    finished: list[tuple[list[int], torch.Tensor]] = []
    for _ in range(300):
        rid = int(torch.randint(0, 5, (1,), generator=g))
        if rid in live:
            pages, held = live.pop(rid)
            tags.free(pages)
            free.extend(pages)
            finished.append((pages, held))
        order = torch.randperm(len(free), generator=g).tolist()
        take = min(len(free), int(torch.randint(1, 9, (1,), generator=g)))
        pages = [free[i] for i in order[:take]]
        free = [free[i] for i in order[take:]]
        live[rid] = (pages, tags.allocate(pages))
        for pages, held in live.values():
            assert tags.verify(pages, held, backend).numel() == 0
        for pages, held in finished[-10:]:
            assert tags.verify(pages, held, backend).tolist() == pages
    assert len(finished) > 200


def test_allocated_tags_are_odd_and_duplicates_bump_twice():
    tags = PageTags(4)
    assert tags.allocate([1, 1]).tolist() == [2, 2]
    tags.allocate([3])
    tags.free([3])
    assert tags.current([3]).tolist() == [2]
    assert tags.allocate([3]).tolist() == [3]


def test_fast_and_reference_agree_on_a_large_request():
    # past the CPU backend's threshold for the parallel scan
    n = _TAG_PARALLEL_MIN_PAGES + 1000
    tags = PageTags(n)
    ids = torch.randperm(n, generator=torch.Generator().manual_seed(2)) + 1
    held = tags.allocate(ids)
    assert get_backend("cpu").verify_tags(tags.table, ids, held).numel() == 0
    bumped = ids[::9973]
    tags.allocate(bumped)
    fast = get_backend("cpu").verify_tags(tags.table, ids, held)
    ref = get_backend("cpu", "reference").verify_tags(tags.table, ids, held)
    assert fast.tolist() == ref.tolist() == bumped.tolist()


def test_default_backend_is_the_fast_one_of_the_table_device():
    tags = PageTags(4)
    held = tags.allocate([1, 2])
    assert tags.verify([1, 2], held).numel() == 0


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda t, b: t.verify([1, 2], [1], b), "held_tags"),
        (lambda t, b: t.verify([1, 9], [1, 1], b), "page_ids"),
        (lambda t, b: t.verify([-1], [1], b), "page_ids"),
        (lambda t, b: b.verify_tags(t.table.to(torch.int32), [1], [1]), "table"),
        (lambda t, b: t.allocate([0]), "page_ids"),
        (lambda t, b: t.allocate([5]), "page_ids"),
        (lambda t, b: t.free([0]), "page_ids"),
        (lambda t, b: PageTags(0), "num_pages"),
    ],
)
def test_bad_input_names_the_field(backend, call, field):
    tags = PageTags(4)
    tags.allocate([1, 2])
    with pytest.raises(KernelError) as err:
        call(tags, backend)
    assert err.value.field == field


@pytest.mark.parametrize("n", [10, _TAG_PARALLEL_MIN_PAGES])
def test_bad_id_is_refused_by_the_serial_and_the_parallel_pass(n):
    tags = PageTags(10)
    ids = torch.ones(n, dtype=torch.int64)
    ids[-1] = 11
    with pytest.raises(KernelError, match="page_ids: 1 ids outside 0..10"):
        get_backend("cpu").verify_tags(tags.table, ids, torch.zeros_like(ids))
