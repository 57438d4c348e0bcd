"""KvLayout geometry and the checks on buffers and page ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtrail.errors import KvtrailError
from kvtrail.kernels.layout import KernelError, KvLayout, as_page_ids, check_page_range

from .conftest import random_buffers


def test_token_major_geometry():
    bufs = random_buffers(4, num_pages=7, page_size=3, row_bytes=10)
    layout = KvLayout.from_token_rows(bufs, page_size=3)
    assert layout.num_pages == 7
    assert layout.item_lens == (30, 30, 30, 30)
    assert layout.page_bytes == 120
    assert layout.data_ptrs == tuple(b.data_ptr() for b in bufs)
    view = layout.byte_view(2)
    assert view.shape == (8, 30)
    assert view.data_ptr() == bufs[2].data_ptr()  # a view, not a copy
    assert bytes(view[5].numpy()) == bytes(bufs[2][15:18].contiguous().view(torch.uint8).numpy().reshape(-1))


def test_page_major_pool_and_mixed_dtypes():
    # KVPool-style (num_pages + 1, page_size, heads, dim) buffers, fp16 K and fp32 V
    k = torch.zeros(6, 4, 2, 8, dtype=torch.float16)
    v = torch.zeros(6, 4, 2, 8, dtype=torch.float32)
    layout = KvLayout.from_kv([k], [v], num_pages=5)
    assert layout.item_lens == (4 * 2 * 8 * 2, 4 * 2 * 8 * 4)
    assert layout.buffers == (k, v)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"buffers": [], "num_pages": 3}, "buffers"),
        ({"buffers": "nope", "num_pages": 3}, "buffers"),
        ({"buffers": [torch.zeros(8)], "num_pages": 0}, "num_pages"),
        ({"buffers": [torch.zeros(8)], "num_pages": True}, "num_pages"),
        ({"buffers": [torch.zeros(8), "x"], "num_pages": 3}, "buffers[1]"),
        ({"buffers": [torch.zeros(9, dtype=torch.uint8)], "num_pages": 3}, "buffers[0]"),
        ({"buffers": [torch.zeros(8), torch.zeros(4, 4).t()], "num_pages": 3}, "buffers[1]"),
        ({"buffers": [torch.zeros(8), torch.zeros(0)], "num_pages": 3}, "buffers[1]"),
    ],
)
def test_bad_layouts_name_the_field(kwargs, field):
    with pytest.raises(KernelError) as err:
        KvLayout(**kwargs)
    assert err.value.field == field
    assert str(err.value).startswith(field)
    assert isinstance(err.value, ValueError) and isinstance(err.value, KvtrailError)


def test_from_token_rows_checks():
    with pytest.raises(KernelError, match="page_size"):
        KvLayout.from_token_rows([torch.zeros(8, 2)], page_size=0)
    with pytest.raises(KernelError, match="whole"):
        KvLayout.from_token_rows([torch.zeros(9, 2)], page_size=4)
    with pytest.raises(KernelError, match="whole"):
        KvLayout.from_token_rows([torch.zeros(4, 2)], page_size=4)  # only the padding page
    with pytest.raises(KernelError, match=r"buffers\[1\]"):
        KvLayout.from_token_rows([torch.zeros(8, 2), torch.zeros(12, 2)], page_size=4)


def test_layouts_compare_by_identity():
    bufs = random_buffers(2, 3, 2, 8)
    a, b = KvLayout(bufs, 3), KvLayout(bufs, 3)
    assert a == a and a != b
    with pytest.raises(AttributeError):
        a.num_pages = 4  # frozen


def test_page_ids_forms():
    for ids in (
        [3, 1, 2],
        (3, 1, 2),
        np.array([3, 1, 2], dtype=np.int32),
        torch.tensor([3, 1, 2], dtype=torch.int32),
        torch.tensor([9, 3, 1, 2])[1:],
    ):
        out = as_page_ids(ids, "cpu")
        assert out.dtype == torch.int64 and out.tolist() == [3, 1, 2]
    assert as_page_ids([], "cpu").shape == (0,)
    for bad in ([1.5], [True], ["a"], np.array([1.0]), np.array(["x"]), torch.tensor([[1, 2]]), torch.tensor([0.5])):
        with pytest.raises(KernelError, match="page_ids"):
            as_page_ids(bad, "cpu")
    with pytest.raises(KernelError, match="held_tags"):
        as_page_ids([[1]], "cpu", "held_tags")


def test_page_range():
    check_page_range(torch.tensor([0, 5]), 5)
    with pytest.raises(KernelError, match=r"page_ids: 2 ids outside 0..5, first 6"):
        check_page_range(torch.tensor([6, 1, -1]), 5)
