"""The pure-torch reference backend: the definitions of ``mixing`` and ``adler`` written plainly.

It gathers the selected pages into copies (``byte_view(b)[ids]``) and runs whole-tensor torch ops,
so it is slow and memory-hungry for big requests, but it runs on any device torch supports and is
what every fast path is tested against.
"""

from __future__ import annotations

import torch

from kvtrail.kernels.adler import adler32_from_item_sums
from kvtrail.kernels.layout import KernelError, KvLayout, PageIds, as_page_ids, check_page_range
from kvtrail.kernels.mixing import (
    LO32,
    _lsr,
    combine_page_digests,
    mix64_torch,
    page_seed,
    signed,
    word_keys_torch,
)


def tag_args(table: torch.Tensor, page_ids: PageIds, held_tags: PageIds) -> tuple[torch.Tensor, torch.Tensor]:
    """Check a tag table and a request's (page, tag) pairs; the ids and tags as int64 on the table's device."""
    if not isinstance(table, torch.Tensor) or table.dim() != 1 or table.dtype != torch.int64:
        raise KernelError("table", "must be a 1-D int64 tensor (one generation tag per page)")
    ids = as_page_ids(page_ids, table.device)
    held = as_page_ids(held_tags, table.device, "held_tags")
    if held.numel() != ids.numel():
        raise KernelError("held_tags", f"has {held.numel()} tags for {ids.numel()} pages")
    return ids, held


class ReferenceBackend:
    """Pure-torch page digests, request digests, SGLang Adler-32 and tag checks on one device type."""

    name = "reference"

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={str(self.device)!r})"

    def check_layout(self, layout: KvLayout) -> None:
        if not isinstance(layout, KvLayout):
            raise KernelError("layout", f"must be a KvLayout, got {type(layout).__name__}")
        if layout.device.type != self.device.type:
            raise KernelError(
                "layout", f"buffers are on {layout.device}; the {self.name} backend runs on {self.device.type}"
            )

    def _ids(self, layout: KvLayout, page_ids: PageIds) -> torch.Tensor:
        self.check_layout(layout)
        ids = as_page_ids(page_ids, layout.device)
        check_page_range(ids, layout.num_pages)
        return ids

    def page_digests(self, layout: KvLayout, page_ids: PageIds) -> torch.Tensor:
        """One 64-bit digest per page (int64 bit patterns), in the order of ``page_ids``."""
        ids = self._ids(layout, page_ids)
        h = torch.full((ids.numel(),), signed(page_seed(layout.page_bytes)), dtype=torch.int64, device=layout.device)
        keys = word_keys_torch(-(-max(layout.item_lens) // 8), layout.device)
        for b in range(len(layout.buffers)):
            rows = layout.byte_view(b)[ids]
            pad = -rows.shape[1] % 8
            if pad:
                rows = torch.nn.functional.pad(rows, (0, pad))
            words = rows.view(torch.int64)
            v = words ^ keys[: words.shape[1]]
            a = ((v & LO32) * _lsr(v, 32)).sum(1)
            c = words.sum(1)
            h = mix64_torch(mix64_torch(h ^ a) ^ c)
        return h

    def request_digest(self, layout: KvLayout, page_ids: PageIds) -> int:
        """The order-binding digest of the request's pages (an int in ``[0, 2**64)``)."""
        return combine_page_digests(self.page_digests(layout, page_ids))

    def adler32(self, layout: KvLayout, page_ids: PageIds) -> int:
        """SGLang's KV checksum: ``zlib.adler32`` of every (buffer, page) item, buffer-major."""
        ids = self._ids(layout, page_ids)
        byte_sums, weighted, lens = [], [], []
        for b, item_len in enumerate(layout.item_lens):
            rows = layout.byte_view(b)[ids].to(torch.int64)
            weights = torch.arange(item_len, 0, -1, dtype=torch.int64, device=layout.device)
            byte_sums.append(rows.sum(1))
            weighted.append((rows * weights).sum(1))
            lens.append(torch.full((ids.numel(),), item_len, dtype=torch.int64, device=layout.device))
        return adler32_from_item_sums(torch.cat(byte_sums), torch.cat(weighted), torch.cat(lens))

    def verify_tags(self, table: torch.Tensor, page_ids: PageIds, held_tags: PageIds) -> torch.Tensor:
        """The page ids whose tag in ``table`` is not the tag the request holds (empty when all match)."""
        ids, held = tag_args(table, page_ids, held_tags)
        check_page_range(ids, table.numel() - 1)
        return ids[table[ids] != held]
