"""The SGLang-compatible Adler-32 equals zlib.adler32 of the concatenated item bytes."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrail.kernels.adler import adler32_combine, adler32_from_item_sums, item_adler32
from kvtrail.kernels.layout import KernelError, KvLayout
from kvtrail.kernels.registry import get_backend

from .conftest import DTYPES, page_bytes_concat, random_layout

REF = get_backend("cpu", "reference")
FAST = get_backend("cpu")


@settings(max_examples=60, deadline=None)
@given(
    num_buffers=st.integers(1, 5),
    item_len=st.integers(1, 300),
    num_pages=st.integers(1, 6),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_equals_zlib_of_concatenation(num_buffers, item_len, num_pages, seed, data):
    rng = np.random.default_rng(seed)
    bufs = [
        torch.from_numpy(rng.integers(0, 256, (num_pages + 1) * item_len, dtype=np.uint8)) for _ in range(num_buffers)
    ]
    layout = KvLayout(bufs, num_pages)
    ids = data.draw(st.lists(st.integers(0, num_pages), max_size=9))
    want = zlib.adler32(page_bytes_concat(layout, ids))
    assert FAST.adler32(layout, ids) == want
    assert REF.adler32(layout, ids) == want


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes_and_long_items(dtype):
    # 2 layers x 16 tokens x 4,100-byte rows: items longer than one 64 KiB block, with a ragged tail
    layout = random_layout(2, num_pages=5, page_size=16, row_bytes=4100, dtype=dtype, seed=3)
    ids = [5, 1, 1, 4]
    want = zlib.adler32(page_bytes_concat(layout, ids))
    assert FAST.adler32(layout, ids) == want == REF.adler32(layout, ids)


def test_worst_case_bytes_do_not_overflow():
    layout = KvLayout([torch.full((3 * 200_000,), 255, dtype=torch.uint8)], num_pages=2)
    assert FAST.adler32(layout, [1, 2]) == zlib.adler32(b"\xff" * 400_000) == REF.adler32(layout, [1, 2])


def test_empty_set_gives_one(backend):
    assert backend.adler32(random_layout(1, num_pages=3), []) == 1
    assert adler32_from_item_sums(*(torch.empty(0, dtype=torch.int64),) * 3) == 1


def test_pairwise_combine_is_zlib():
    rng = np.random.default_rng(5)
    parts = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (0, 1, 7, 65521, 70000, 3)]
    acc = 1
    for part in parts:
        acc = adler32_combine(acc, zlib.adler32(part), len(part))
    assert acc == zlib.adler32(b"".join(parts))
    # per-item values from the sums the kernels produce
    item = parts[2]
    s = sum(item)
    w = sum((len(item) - j) * x for j, x in enumerate(item))
    assert item_adler32(s, w, len(item)) == zlib.adler32(item)


def test_out_of_range_pages_are_refused(backend):
    with pytest.raises(KernelError, match="page_ids"):
        backend.adler32(random_layout(1, num_pages=3), [1, 4])
