"""The physical K/V buffers of one node, laid out like SGLang's MHA token-to-KV pool.

Per layer one K and one V buffer of shape ``(num_pages + 1, page_size, num_heads, head_dim)``, made once
with ``torch.zeros`` and never zeroed again: freeing or reusing a page (see
:mod:`kvtrail.serving.allocator`) changes index lists only, so a page keeps its last writer's K/V until
a forward or a transfer overwrites it. Row 0 is the padding page.

Buffer ``i`` of :meth:`KVPool.buffers` is K of layer ``i`` for ``i < num_layers`` and V of layer
``i - num_layers`` after that (SGLang's order). Page ``p`` of buffer ``i`` is the ``item_len`` bytes at
``data_ptr(i) + p * item_len``: the address a transfer engine reads or writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class KVPoolConfig:
    """Shape, dtype and device of a pool; pages are numbered ``1..num_pages`` (0 is padding)."""

    num_layers: int
    num_pages: int
    page_size: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: str = "cpu"

    def __post_init__(self):
        for name in ("num_layers", "num_pages", "page_size", "num_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"dtype: must be a floating torch.dtype, got {self.dtype!r}")

    @property
    def item_len(self) -> int:
        """Bytes of one page in one buffer."""
        return self.page_size * self.num_heads * self.head_dim * self.dtype.itemsize


class KVPool:
    """Per-layer K and V buffers, written per token and read per page table."""

    def __init__(self, config: KVPoolConfig):
        self.config = config
        c = config
        shape = (c.num_pages + 1, c.page_size, c.num_heads, c.head_dim)
        self.k = [torch.zeros(shape, dtype=c.dtype, device=c.device) for _ in range(c.num_layers)]
        self.v = [torch.zeros(shape, dtype=c.dtype, device=c.device) for _ in range(c.num_layers)]
        self.device = self.k[0].device
        self.item_len = c.item_len

    @property
    def num_buffers(self) -> int:
        return 2 * self.config.num_layers

    def buffers(self) -> list[torch.Tensor]:
        """``[K0, ..., K{L-1}, V0, ..., V{L-1}]``, the order transfers and checksums walk."""
        return [*self.k, *self.v]

    def data_ptr(self, i: int) -> int:
        """Address of buffer ``i`` (for registering memory with a transfer engine)."""
        return self._buffer(i).data_ptr()

    def nbytes(self, i: int) -> int:
        """Size of buffer ``i`` in bytes, padding page included."""
        return self._buffer(i).nbytes

    def slots(self, pages, positions) -> torch.Tensor:
        """Flat slot ids (``page * page_size + position % page_size``) of token positions in a page table."""
        ps = self.config.page_size
        table = self._pages(pages)
        pos = torch.as_tensor(positions, dtype=torch.long, device=self.device).reshape(-1)
        if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= table.numel() * ps):
            raise ValueError(f"positions: must lie in 0..{table.numel() * ps - 1} for {table.numel()} pages")
        return table[pos // ps] * ps + pos % ps

    def write(self, layer: int, pages, positions, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V rows ``(n, num_heads, head_dim)`` of token ``positions`` of the page table ``pages``."""
        self._check_layer(layer)
        c = self.config
        slots = self.slots(pages, positions)
        want = (slots.numel(), c.num_heads, c.head_dim)
        for name, rows in (("k", k), ("v", v)):
            if tuple(rows.shape) != want:
                raise ValueError(f"{name}: shape {tuple(rows.shape)} != {want}")
        flat = (-1, c.num_heads, c.head_dim)
        self.k[layer].view(flat).index_copy_(0, slots, k.to(self.device, c.dtype))
        self.v[layer].view(flat).index_copy_(0, slots, v.to(self.device, c.dtype))

    def gather(self, layer: int, pages, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``(seq_len, num_heads, head_dim)`` of positions ``0..seq_len-1`` of a page table.

        Whatever the covered slots hold is returned: rows nobody wrote for this request are another
        request's stale K/V (or zeros if the slot was never written since the pool was made).
        """
        self._check_layer(layer)
        c = self.config
        table = self._pages(pages)
        if not 0 <= seq_len <= table.numel() * c.page_size:
            raise ValueError(
                f"seq_len: {seq_len} is outside 0..{table.numel() * c.page_size} for {table.numel()} pages"
            )
        flat = (-1, c.num_heads, c.head_dim)
        return (
            self.k[layer].index_select(0, table).view(flat)[:seq_len],
            self.v[layer].index_select(0, table).view(flat)[:seq_len],
        )

    def page_bytes(self, pages) -> bytes:
        """The bytes of ``pages``: for each buffer in :meth:`buffers` order, each page in the given order.

        This is the byte stream SGLang's KV checksum digests (``zlib.adler32`` of it equals its value).
        """
        table = self._pages(pages)
        parts = [
            b.index_select(0, table).contiguous().view(torch.uint8).cpu().numpy().tobytes() for b in self.buffers()
        ]
        return b"".join(parts)

    def write_page_bytes(self, pages, data: bytes) -> None:
        """Overwrite ``pages`` with bytes laid out as :meth:`page_bytes` returns them (a loopback transfer)."""
        table = self._pages(pages)
        per_buffer = table.numel() * self.item_len
        if len(data) != per_buffer * self.num_buffers:
            raise ValueError(f"data: {len(data)} bytes, expected {per_buffer * self.num_buffers}")
        raw = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy()).to(self.device)
        c = self.config
        for i, buf in enumerate(self.buffers()):
            chunk = raw[i * per_buffer : (i + 1) * per_buffer].view(c.dtype)
            buf.index_copy_(0, table, chunk.view(table.numel(), c.page_size, c.num_heads, c.head_dim))

    def _pages(self, pages) -> torch.Tensor:
        if not isinstance(pages, torch.Tensor):
            pages = torch.from_numpy(np.asarray(pages, dtype=np.int64))
        table = pages.to(self.device, torch.long).reshape(-1)
        if table.numel() and (int(table.min()) < 0 or int(table.max()) > self.config.num_pages):
            bad = int(table.min()) if int(table.min()) < 0 else int(table.max())
            raise ValueError(f"pages: page {bad} is out of range 0..{self.config.num_pages}")
        return table

    def _buffer(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.num_buffers:
            raise ValueError(f"i: buffer {i} is out of range 0..{self.num_buffers - 1}")
        return self.buffers()[i]

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.config.num_layers:
            raise ValueError(f"layer: {layer} is out of range 0..{self.config.num_layers - 1}")
