"""Random paged KV layouts for the kernel tests."""

from __future__ import annotations

import pytest
import torch

from kvtrail.kernels.layout import KvLayout
from kvtrail.kernels.registry import get_backend

FP8 = getattr(torch, "float8_e4m3fn", None)
DTYPES = [torch.float16, torch.bfloat16, torch.float32] + ([FP8] if FP8 is not None else []) + [torch.uint8]


def random_buffers(
    num_buffers: int,
    num_pages: int,
    page_size: int,
    row_bytes: int,
    dtype: torch.dtype = torch.uint8,
    seed: int = 0,
    device: str = "cpu",
) -> list[torch.Tensor]:
    """Token-major buffers of random bytes viewed as ``dtype`` (every bit pattern, NaNs included)."""
    g = torch.Generator().manual_seed(seed)
    rows = (num_pages + 1) * page_size
    out = []
    for _ in range(num_buffers):
        raw = torch.randint(0, 256, (rows, row_bytes), generator=g, dtype=torch.uint8)
        out.append(raw.view(dtype).to(device))
    return out


def random_layout(
    num_layers: int = 2,
    num_pages: int = 12,
    page_size: int = 4,
    row_bytes: int = 32,
    dtype: torch.dtype = torch.uint8,
    seed: int = 0,
    device: str = "cpu",
) -> KvLayout:
    """K then V buffers of ``num_layers`` layers; one page is ``page_size * row_bytes`` bytes per buffer."""
    bufs = random_buffers(2 * num_layers, num_pages, page_size, row_bytes, dtype, seed, device)
    return KvLayout.from_token_rows(bufs, page_size)


def page_bytes_concat(layout: KvLayout, page_ids) -> bytes:
    """The bytes SGLang's checksum covers: each buffer in order, each page in request order."""
    return b"".join(
        layout.byte_view(b)[int(p)].cpu().numpy().tobytes() for b in range(len(layout.buffers)) for p in page_ids
    )


@pytest.fixture(params=["reference", "fast"])
def backend(request):
    """Both CPU backends: every property test runs against the reference and the numba fast path."""
    return get_backend("cpu", request.param)
