"""The paged KV buffer layout every integrity kernel reads, and the checks on what callers pass in.

A layout is the list of buffers of one KV pool in a fixed order (SGLang's order: the K buffer of
every layer, then the V buffer of every layer; other buffers may follow, such as state buffers).
Each buffer is one contiguous tensor holding ``num_pages + 1`` pages of ``item_len`` bytes each
(SGLang's ``kv_item_lens``: ``page_size`` token rows of that buffer); page 0 is the padding page.
Page ``p`` of buffer ``b`` is the ``item_len_b`` bytes at ``data_ptr_b + p * item_len_b``, whether
the tensor's shape is token-major like SGLang's ``((num_pages + 1) * page_size, heads, dim)`` or
page-major like :class:`kvtrail.serving.kvpool.KVPool`'s ``(num_pages + 1, page_size, heads, dim)``.
Buffers may differ in dtype and width (MLA, fp8 K with bf16 V); the kernels only ever see bytes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Sequence, Union

import numpy as np
import torch

from kvtrail.errors import KvtrailError

# Digests are defined over little-endian 64-bit words; the kernels read words in host order.
assert sys.byteorder == "little", "kvtrail.kernels digests are defined for little-endian hosts"


class KernelError(KvtrailError, ValueError):
    """Bad input to an integrity kernel or the backend registry; ``field`` names the argument."""

    def __init__(self, field: str, reason: str):
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


PageIds = Union[torch.Tensor, np.ndarray, Sequence[int]]
"""Page ids as callers hold them: a 1-D integer tensor (int32 or int64), ndarray or sequence."""


# eq=False: two layouts are the same layout only if they are the same object (tensors have no value equality)
@dataclass(frozen=True, eq=False)
class KvLayout:
    """The buffers of one paged KV pool, in digest order, split into ``num_pages + 1`` pages each.

    ``item_lens[b]`` is the byte length of one page in buffer ``b``; ``page_bytes`` their sum (the
    bytes one page covers across all buffers). The layout keeps the tensors alive, and with them the
    addresses in ``data_ptrs`` that the fast paths read; rebuild it if a buffer is reallocated.
    """

    buffers: tuple[torch.Tensor, ...]
    num_pages: int
    item_lens: tuple[int, ...] = field(init=False)
    data_ptrs: tuple[int, ...] = field(init=False)
    device: torch.device = field(init=False)

    def __post_init__(self) -> None:
        if isinstance(self.num_pages, bool) or not isinstance(self.num_pages, int) or self.num_pages < 1:
            raise KernelError("num_pages", f"must be an int >= 1 (page 0 is padding), got {self.num_pages!r}")
        buffers = tuple(self.buffers) if isinstance(self.buffers, (list, tuple)) else None
        if not buffers:
            raise KernelError("buffers", "must be a non-empty list or tuple of tensors")
        lens = []
        for b, buf in enumerate(buffers):
            name = f"buffers[{b}]"
            if not isinstance(buf, torch.Tensor):
                raise KernelError(name, f"must be a torch.Tensor, got {type(buf).__name__}")
            if not buf.is_contiguous():
                raise KernelError(name, "must be contiguous (pages are read at base + page * item_len)")
            if buf.device != buffers[0].device:
                raise KernelError(name, f"is on {buf.device}, buffers[0] on {buffers[0].device}")
            nbytes = buf.numel() * buf.element_size()
            if nbytes == 0 or nbytes % (self.num_pages + 1):
                raise KernelError(name, f"{nbytes} bytes do not split into {self.num_pages + 1} equal pages")
            lens.append(nbytes // (self.num_pages + 1))
        object.__setattr__(self, "buffers", buffers)
        object.__setattr__(self, "item_lens", tuple(lens))
        object.__setattr__(self, "data_ptrs", tuple(buf.data_ptr() for buf in buffers))
        object.__setattr__(self, "device", buffers[0].device)

    @classmethod
    def from_kv(cls, k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor], num_pages: int) -> KvLayout:
        """The usual MHA layout: every layer's K buffer, then every layer's V buffer."""
        return cls(buffers=tuple(k_buffers) + tuple(v_buffers), num_pages=num_pages)

    @classmethod
    def from_token_rows(cls, buffers: Sequence[torch.Tensor], page_size: int) -> KvLayout:
        """Token-major buffers (SGLang's ``k_buffer[layer]``): ``num_pages = rows // page_size - 1``."""
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise KernelError("page_size", f"must be an int >= 1, got {page_size!r}")
        if not buffers or not isinstance(buffers[0], torch.Tensor) or buffers[0].dim() < 1:
            raise KernelError("buffers", "must be a non-empty sequence of tensors with token rows first")
        rows = buffers[0].shape[0]
        if rows % page_size or rows // page_size < 2:
            raise KernelError("buffers", f"{rows} token rows are not 2 or more whole {page_size}-token pages")
        for b, buf in enumerate(buffers):
            if not isinstance(buf, torch.Tensor) or buf.dim() < 1 or buf.shape[0] != rows:
                raise KernelError(f"buffers[{b}]", f"must be a tensor with {rows} token rows, like buffers[0]")
        return cls(buffers=tuple(buffers), num_pages=rows // page_size - 1)

    @property
    def page_bytes(self) -> int:
        return sum(self.item_lens)

    def byte_view(self, b: int) -> torch.Tensor:
        """Buffer ``b`` as a ``(num_pages + 1, item_len)`` uint8 view (no copy)."""
        return self.buffers[b].reshape(-1).view(torch.uint8).view(self.num_pages + 1, self.item_lens[b])


def as_page_ids(page_ids: PageIds, device: torch.device | str, field_name: str = "page_ids") -> torch.Tensor:
    """``page_ids`` (tensor, ndarray or sequence of ints) as a contiguous 1-D int64 tensor on ``device``.

    Range is not checked here: the kernels check it in the same pass that reads the pages.
    """
    if isinstance(page_ids, torch.Tensor):
        if (
            page_ids.dtype == torch.int64
            and page_ids.dim() == 1
            and page_ids.device == torch.device(device)
            and page_ids.is_contiguous()
        ):
            return page_ids  # the common case, kept cheap: tag checks run before every attention read
        ids = page_ids
    elif isinstance(page_ids, np.ndarray):
        if page_ids.dtype.kind not in "iu":
            raise KernelError(field_name, f"must hold integers, got dtype {page_ids.dtype}")
        ids = torch.from_numpy(np.ascontiguousarray(page_ids, dtype=np.int64))
    else:
        try:
            seq = list(page_ids)
            # no dtype= here: torch would silently truncate floats to ints
            ids = torch.as_tensor(seq) if seq else torch.empty(0, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise KernelError(field_name, f"must be a sequence of ints ({exc})") from None
    if ids.dim() != 1:
        raise KernelError(field_name, f"must be 1-D, got shape {tuple(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise KernelError(field_name, f"must hold integers, got dtype {ids.dtype}")
    return ids.to(device=device, dtype=torch.int64).contiguous()


def check_page_range(ids: torch.Tensor, num_pages: int, field_name: str = "page_ids") -> None:
    """Raise unless every id is a page of the pool (0..num_pages; 0 is the padding page)."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) > num_pages):
        bad = ids[(ids < 0) | (ids > num_pages)]
        raise KernelError(field_name, f"{bad.numel()} ids outside 0..{num_pages}, first {int(bad[0])}")
