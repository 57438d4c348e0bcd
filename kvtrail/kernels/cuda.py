"""The CUDA backend: Triton kernels reading the KV buffers in place, torch ops where Triton is missing.

Page digests and the Adler-32 checksum launch one program per (page, buffer) item, reading the
item where it lies (no gather copy), then fold or combine on the device; only the final 64-bit
(or 32-bit) value comes back to the host. Without Triton the same results come from the pure-torch
reference running on the GPU (gathered copies, slower). Tag checks are torch ops either way: a
gather and a compare are what torch already does at memory speed.

Not run on the development machine (no GPU there): its tests carry ``@pytest.mark.gpu``.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from kvtrail.kernels.adler import adler32_from_item_sums
from kvtrail.kernels.layout import KernelError, KvLayout, PageIds
from kvtrail.kernels.mixing import combine_page_digests, page_seed, signed, word_keys_torch
from kvtrail.kernels.reference import ReferenceBackend

_WORDS_PER_BLOCK = 1024  # 8 KiB per loop step: one whole item of a typical page
_BYTES_PER_BLOCK = 4096
_FOLD_BLOCK = 256


@lru_cache(maxsize=16)
def _keys(num_words: int, device: str) -> torch.Tensor:
    # keys depend on position only: one table per power of two serves every item length
    return word_keys_torch(max(1024, 1 << max(0, num_words - 1).bit_length()), device)


def _triton():
    try:
        from kvtrail.kernels import triton_kernels
    except ImportError:
        return None
    return triton_kernels


class CudaBackend(ReferenceBackend):
    """Triton page digests and Adler-32 on one CUDA device; identical results to the reference."""

    name = "cuda"

    def __init__(self, device: torch.device | str = "cuda"):
        super().__init__(device)
        if self.device.type != "cuda":
            raise KernelError("device", f"the cuda backend runs on cuda devices, not {self.device}")
        self._tk = _triton()

    @property
    def uses_triton(self) -> bool:
        return self._tk is not None

    def _prepare(self, layout: KvLayout, page_ids: PageIds):
        ids = self._ids(layout, page_ids)
        addrs = torch.tensor(layout.data_ptrs, dtype=torch.int64, device=layout.device)
        lens = torch.tensor(layout.item_lens, dtype=torch.int64, device=layout.device)
        return ids, addrs, lens

    def page_digests(self, layout: KvLayout, page_ids: PageIds) -> torch.Tensor:
        if self._tk is None:
            return super().page_digests(layout, page_ids)
        ids, addrs, lens = self._prepare(layout, page_ids)
        n, nb = ids.numel(), len(layout.item_lens)
        out = torch.empty(n, dtype=torch.int64, device=layout.device)
        if n == 0:
            return out
        aligned = all(v % 8 == 0 for v in layout.data_ptrs + layout.item_lens)
        keys = _keys(-(-max(layout.item_lens) // 8), str(layout.device))
        sums = torch.empty((n, nb, 2), dtype=torch.int64, device=layout.device)
        with torch.cuda.device(layout.device):
            self._tk.item_sums_kernel[(n, nb)](
                addrs, lens, ids, keys, sums, nb, BLOCK=_WORDS_PER_BLOCK, ALIGNED=aligned
            )
            self._tk.fold_kernel[(-(-n // _FOLD_BLOCK),)](
                sums, out, signed(page_seed(layout.page_bytes)), n, nb, BLOCK_N=_FOLD_BLOCK
            )
        return out

    def request_digest(self, layout: KvLayout, page_ids: PageIds) -> int:
        return combine_page_digests(self.page_digests(layout, page_ids))

    def adler32(self, layout: KvLayout, page_ids: PageIds) -> int:
        if self._tk is None:
            return super().adler32(layout, page_ids)
        ids, addrs, lens = self._prepare(layout, page_ids)
        n, nb = ids.numel(), len(layout.item_lens)
        if n == 0:
            return 1
        byte_sums = torch.empty(nb * n, dtype=torch.int64, device=layout.device)
        weighted = torch.empty(nb * n, dtype=torch.int64, device=layout.device)
        with torch.cuda.device(layout.device):
            self._tk.adler_items_kernel[(n, nb)](addrs, lens, ids, byte_sums, weighted, n, BLOCK=_BYTES_PER_BLOCK)
        return adler32_from_item_sums(byte_sums, weighted, lens.repeat_interleave(n))

    def verify_tags(self, table: torch.Tensor, page_ids: PageIds, held_tags: PageIds) -> torch.Tensor:
        if table.device.type != "cuda":
            raise KernelError("table", f"is on {table.device}; the cuda backend runs on cuda")
        return super().verify_tags(table, page_ids, held_tags)
