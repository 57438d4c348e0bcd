"""Page and request digests: parity across backends and the faults they must catch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrail.kernels.layout import KernelError, KvLayout
from kvtrail.kernels.mixing import combine_page_digests
from kvtrail.kernels.registry import get_backend

from .conftest import DTYPES, random_buffers, random_layout

REF = get_backend("cpu", "reference")
FAST = get_backend("cpu")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "num_layers, page_size, row_bytes",
    [
        (1, 1, 8),
        (2, 16, 64),
        (3, 5, 12),
        (4, 7, 36),
        (1, 3, 1028),
    ],
)
def test_fast_path_equals_reference(dtype, num_layers, page_size, row_bytes):
    layout = random_layout(
        num_layers,
        num_pages=23,
        page_size=page_size,
        row_bytes=row_bytes,
        dtype=dtype,
        seed=num_layers * 100 + page_size,
    )
    ids = torch.randint(0, 24, (37,), generator=torch.Generator().manual_seed(page_size))
    ref = REF.page_digests(layout, ids)
    assert torch.equal(FAST.page_digests(layout, ids), ref)
    assert FAST.request_digest(layout, ids) == REF.request_digest(layout, ids) == combine_page_digests(ref)


@pytest.mark.parametrize("row_bytes", [1, 3, 13, 20])
def test_odd_item_lengths_and_unaligned_bases(row_bytes):
    # item lengths that are not a multiple of 8, and a buffer whose base is not 8-byte aligned
    raw = torch.randint(
        0, 256, (6 * 3 * row_bytes + 3,), generator=torch.Generator().manual_seed(row_bytes), dtype=torch.uint8
    )
    shifted = raw[3:]  # contiguous view, base address 3 bytes past an aligned allocation
    other = random_buffers(1, 5, 3, row_bytes, seed=row_bytes)[0]
    layout = KvLayout([shifted, other], num_pages=5)
    assert layout.data_ptrs[0] % 8 == 3
    ids = [5, 0, 3, 3, 1, 2, 4]
    assert torch.equal(FAST.page_digests(layout, ids), REF.page_digests(layout, ids))


@settings(max_examples=40, deadline=None)
@given(
    num_buffers=st.integers(1, 4),
    item_len=st.integers(1, 200),
    num_pages=st.integers(1, 12),
    offset=st.integers(0, 7),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_fast_equals_reference_on_random_geometry(num_buffers, item_len, num_pages, offset, seed, data):
    rng = np.random.default_rng(seed)
    size = (num_pages + 1) * item_len
    bufs = [torch.from_numpy(rng.integers(0, 256, size + offset, dtype=np.uint8))[offset:] for _ in range(num_buffers)]
    layout = KvLayout(bufs, num_pages)
    ids = data.draw(st.lists(st.integers(0, num_pages), max_size=20))
    assert torch.equal(FAST.page_digests(layout, ids), REF.page_digests(layout, ids))
    assert FAST.request_digest(layout, ids) == REF.request_digest(layout, ids)


def test_many_pages_cover_every_lockstep_tail():
    # the fast path digests pages eight at a time; every remainder of n mod 8 must agree
    layout = random_layout(2, num_pages=40, page_size=2, row_bytes=64)
    for n in range(0, 18):
        ids = list(range(40, 40 - n, -1))
        assert torch.equal(FAST.page_digests(layout, ids), REF.page_digests(layout, ids))
        assert FAST.request_digest(layout, ids) == REF.request_digest(layout, ids)


def test_page_digest_depends_on_content_not_page_id(backend):
    layout = random_layout(2, num_pages=6, page_size=4, row_bytes=16)
    for buf in layout.byte_view(0), layout.byte_view(1), layout.byte_view(2), layout.byte_view(3):
        buf[5] = buf[2]
    d = backend.page_digests(layout, [2, 5, 3])
    assert d[0] == d[1] != d[2]
    # a transfer to other page ids on the receiver gives the same request digest
    assert backend.request_digest(layout, [2, 3]) == backend.request_digest(layout, [5, 3])


def test_every_single_bit_flip_changes_the_request_digest(backend):
    layout = random_layout(2, num_pages=4, page_size=2, row_bytes=8)  # 4 buffers x 16 bytes per page
    ids = [3, 1, 4]
    before = backend.request_digest(layout, ids)
    page_digest = backend.page_digests(layout, [1])
    for b in range(len(layout.buffers)):
        view = layout.byte_view(b)
        for byte in range(layout.item_lens[b]):
            for bit in range(8):
                view[1, byte] ^= 1 << bit
                assert backend.request_digest(layout, ids) != before, (b, byte, bit)
                assert backend.page_digests(layout, [1]) != page_digest
                view[1, byte] ^= 1 << bit
    assert backend.request_digest(layout, ids) == before


def test_swapped_stale_and_truncated_pages_change_the_request_digest(backend):
    layout = random_layout(3, num_pages=16, page_size=4, row_bytes=32)
    ids = [7, 2, 9, 4, 11]
    good = backend.request_digest(layout, ids)
    assert backend.request_digest(layout, [7, 9, 2, 4, 11]) != good  # two pages swapped
    assert backend.request_digest(layout, ids[:4]) != good  # truncated
    assert backend.request_digest(layout, ids[:1]) != good
    assert backend.request_digest(layout, []) != good
    assert backend.request_digest(layout, ids + [0]) != good  # padding page appended
    assert backend.request_digest(layout, [7, 2, 12, 4, 11]) != good  # another page read instead
    # a stale page: the page still holds what an older writer left in one layer's V
    older = layout.byte_view(5)[9].clone()
    layout.byte_view(5)[9] = torch.randint(0, 256, older.shape, dtype=torch.uint8)
    fresh = backend.request_digest(layout, ids)
    layout.byte_view(5)[9] = older
    assert backend.request_digest(layout, ids) == good != fresh


def test_buffer_order_and_row_moves_are_bound(backend):
    bufs = random_buffers(4, num_pages=3, page_size=2, row_bytes=24, seed=9)
    ids = [1, 2, 3]
    kv = backend.page_digests(KvLayout(bufs, 3), ids)
    swapped = backend.page_digests(KvLayout([bufs[1], bufs[0], bufs[2], bufs[3]], 3), ids)
    assert not torch.equal(kv, swapped)
    # two token rows of one page exchanged: same bytes, other positions
    rows = bufs[0].view(4, 2, 24)
    rows[2] = rows[2].flip(0)
    assert backend.page_digests(KvLayout(bufs, 3), ids)[1] != kv[1]


def test_out_of_range_pages_are_refused(backend):
    layout = random_layout(1, num_pages=5)
    for bad in ([6], [1, -1], [0, 2, 99]):
        with pytest.raises(KernelError, match="page_ids"):
            backend.page_digests(layout, bad)
        with pytest.raises(KernelError, match="page_ids"):
            backend.request_digest(layout, bad)


def test_empty_request(backend):
    layout = random_layout(1, num_pages=5)
    assert backend.page_digests(layout, []).shape == (0,)
    assert backend.request_digest(layout, []) == combine_page_digests(torch.empty(0, dtype=torch.int64))


def test_layout_on_another_device_type_is_refused():
    layout = random_layout(1, num_pages=2)
    with pytest.raises(KernelError, match="layout"):
        get_backend("cpu").page_digests("not a layout", [1])
    meta = KvLayout([torch.empty(3, 8, device="meta")], num_pages=2)
    with pytest.raises(KernelError, match="layout: buffers are on meta"):
        FAST.page_digests(meta, [1])
    assert FAST.page_digests(layout, [1]).dtype == torch.int64
