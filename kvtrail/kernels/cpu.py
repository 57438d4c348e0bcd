"""The fast CPU backend: numba kernels reading torch CPU tensors in place.

Importing this module imports numba (the registry does so only when the CPU fast path is asked
for). Kernels run on numba's thread pool (``numba.set_num_threads`` / ``NUMBA_NUM_THREADS``) and
release the GIL; calling them from several Python threads at once needs numba's OpenMP or TBB
threading layer (its fallback "workqueue" layer aborts on concurrent use).
"""

from __future__ import annotations

import numpy as np
import torch

from kvtrail.kernels import cpu_kernels as k
from kvtrail.kernels.adler import adler32_from_item_sums
from kvtrail.kernels.layout import KernelError, KvLayout, PageIds, as_page_ids
from kvtrail.kernels.mixing import finish_request, page_seed, word_keys
from kvtrail.kernels.reference import ReferenceBackend, tag_args

# Tag checks are one random gather per page, bound by memory latency: two threads gain ~1.5x only
# on huge requests, and on a busy machine a parallel region waits for its slowest thread (measured
# 7 ms per call with the second core taken), so below this size one serial pass does it all.
_TAG_PARALLEL_MIN_PAGES = 262_144


def _raise_bad_ids(bad: int, num_pages: int, field_name: str = "page_ids") -> None:
    raise KernelError(field_name, f"{bad} ids outside 0..{num_pages}")


class CpuBackend(ReferenceBackend):
    """Numba (``parallel=True``) page digests, Adler-32 and tag checks; same results as the reference."""

    name = "cpu"

    def _prepare(self, layout: KvLayout, page_ids: PageIds):
        self.check_layout(layout)
        ids = as_page_ids(page_ids, "cpu").numpy()
        addrs = np.asarray(layout.data_ptrs, dtype=np.int64)
        lens = np.asarray(layout.item_lens, dtype=np.int64)
        return ids, addrs, lens

    def _digest(self, layout: KvLayout, page_ids: PageIds) -> tuple[np.ndarray, int]:
        ids, addrs, lens = self._prepare(layout, page_ids)
        # 8-byte loads need 8-byte aligned pages; other buffers take the byte-assembling path
        aligned = ((addrs % 8) == 0) & ((lens % 8) == 0)
        keys = word_keys(-(-int(lens.max()) // 8))
        out = np.empty(ids.shape[0], dtype=np.uint64)
        seed = np.uint64(page_seed(layout.page_bytes))
        total, bad = k.digest_pages(addrs, lens, aligned, ids, layout.num_pages, keys, seed, out)
        if bad:
            _raise_bad_ids(bad, layout.num_pages)
        return out, int(total)

    def page_digests(self, layout: KvLayout, page_ids: PageIds) -> torch.Tensor:
        out, _ = self._digest(layout, page_ids)
        return torch.from_numpy(out.view(np.int64))

    def request_digest(self, layout: KvLayout, page_ids: PageIds) -> int:
        # the position terms are summed inside the digest kernel: one pass over the pages
        out, total = self._digest(layout, page_ids)
        return finish_request(out.shape[0], total)

    def adler32(self, layout: KvLayout, page_ids: PageIds) -> int:
        ids, addrs, lens = self._prepare(layout, page_ids)
        n = ids.shape[0]
        out_s = np.empty(n * len(lens), dtype=np.uint64)
        out_w = np.empty(n * len(lens), dtype=np.uint64)
        bad_items = k.adler_items(addrs, lens, ids, layout.num_pages, out_s, out_w)
        if bad_items:
            _raise_bad_ids(bad_items // len(lens), layout.num_pages)  # a bad page is bad in every buffer
        # sums are < 65521, so the int64 view is the same number
        return adler32_from_item_sums(
            torch.from_numpy(out_s.view(np.int64)),
            torch.from_numpy(out_w.view(np.int64)),
            torch.from_numpy(np.repeat(lens, n)),
        )

    def verify_tags(self, table: torch.Tensor, page_ids: PageIds, held_tags: PageIds) -> torch.Tensor:
        ids, held = tag_args(table, page_ids, held_tags)
        if not table.is_cpu:
            raise KernelError("table", f"is on {table.device}; the cpu backend runs on cpu")
        t, i, h = table.contiguous().numpy(), ids.numpy(), held.numpy()
        if i.shape[0] >= _TAG_PARALLEL_MIN_PAGES:
            mismatched, bad = k.tag_scan(t, i, h)
            if bad:
                _raise_bad_ids(bad, t.shape[0] - 1)
            if not mismatched:
                return ids[:0]
            out = np.empty(mismatched, dtype=np.int64)
        else:
            out = np.empty(i.shape[0], dtype=np.int64)
        found, bad = k.tag_collect(t, i, h, out)
        if bad:
            _raise_bad_ids(bad, t.shape[0] - 1)
        return torch.from_numpy(out[:found])
