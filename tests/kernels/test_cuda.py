"""The CUDA backend against the reference on the same GPU tensors (skipped without CUDA)."""

from __future__ import annotations

import zlib

import pytest
import torch

from kvtrail.kernels.registry import get_backend
from kvtrail.kernels.tags import PageTags

from .conftest import DTYPES, page_bytes_concat, random_layout

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_layers, page_size, row_bytes", [(1, 1, 8), (2, 16, 256), (3, 5, 13)])
def test_cuda_equals_reference(dtype, num_layers, page_size, row_bytes):
    layout = random_layout(
        num_layers, num_pages=40, page_size=page_size, row_bytes=row_bytes, dtype=dtype, seed=page_size, device="cuda"
    )
    ids = torch.randint(0, 41, (33,), device="cuda")
    cuda, ref = get_backend("cuda"), get_backend("cuda", "reference")
    assert torch.equal(cuda.page_digests(layout, ids), ref.page_digests(layout, ids))
    assert cuda.request_digest(layout, ids) == ref.request_digest(layout, ids)
    # and the same numbers as the CPU fast path on a copy of the buffers
    cpu_layout = type(layout)([b.cpu() for b in layout.buffers], layout.num_pages)
    assert cuda.request_digest(layout, ids) == get_backend("cpu").request_digest(cpu_layout, ids.cpu())
    assert cuda.adler32(layout, ids) == zlib.adler32(page_bytes_concat(layout, ids.tolist()))


def test_cuda_empty_and_tags():
    layout = random_layout(1, num_pages=4, device="cuda")
    cuda = get_backend("cuda")
    assert cuda.adler32(layout, []) == 1
    assert cuda.page_digests(layout, []).numel() == 0
    tags = PageTags(8, device="cuda")
    held = tags.allocate([1, 2, 3])
    tags.free([2])
    tags.allocate([2])
    assert tags.verify([1, 2, 3], held).tolist() == [2]
