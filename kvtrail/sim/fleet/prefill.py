"""A simulated prefill node: FIFO chunked prefill at its own rate, a page allocator, a radix cache.

Each forward step takes up to ``chunk_tokens`` tokens from the head of the queue (several requests
when the head finishes early), allocates their pages when the step starts and writes and sends them
when it ends, ``tokens / rate`` later; so a request's forward writes always take at least (computed
tokens) / rate after it arrived, which is what a latency finding (F9) measures against. Prompts that
start with a shared document hit the radix cache when an earlier request in the same cache
namespace left its pages there; hit pages are sent along but not computed. The cache keeps each
document's pages (owned by the request that wrote them) until LRU eviction frees them.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from kvtrail.audit.events import KIND_CODES
from kvtrail.serving.allocator import PageAllocator
from kvtrail.sim.fleet.log import ProducerLog
from kvtrail.sim.fleet.parts import (
    OK,
    PLACEHOLDER,
    PREFILL_REJECT,
    CacheEntry,
    RadixCache,
    Request,
)

_RECV, _ALLOC, _FREED, _WRITTEN, _READ, _SENT, _ABORTED = (
    KIND_CODES[k]
    for k in (
        "request_received",
        "pages_allocated",
        "pages_freed",
        "kv_written",
        "kv_read",
        "transfer_sent",
        "request_aborted",
    )
)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class PrefillNode:
    """One prefill node of a running :class:`~kvtrail.sim.fleet.loop.FleetSim`."""

    def __init__(
        self, sim, name: str, log: ProducerLog, *, pool_tokens: int, rate_tokens_per_s: float, vulnerable: bool
    ):
        cfg = sim.cfg
        self.sim = sim
        self.name = name
        self.log = log
        self.page_size = cfg.page_size
        self.pool_pages = pool_tokens // cfg.page_size
        self.pool_tokens = self.pool_pages * cfg.page_size
        self.rate_tokens_per_s = rate_tokens_per_s
        self.vulnerable = vulnerable  # runs the engine with the placeholder bug
        self.checksum = not vulnerable  # the patched release sends per-transfer checksums
        self.alloc = PageAllocator(self.pool_pages, "lowest")
        self.cache = RadixCache(int(self.pool_pages * cfg.cache_max_fraction))
        self.queue: deque[Request] = deque()
        self.busy = False  # a forward step is in flight
        self.blocked = False  # the head of the queue waits for pages

    def config_fields(self) -> dict:
        """The node's ``node_config`` payload."""
        return {
            "pool_tokens": self.pool_tokens,
            "pool_pages": self.pool_pages,
            "page_size": self.page_size,
            "context_tokens": self.sim.cfg.context_tokens,
            "max_running_requests": 4096,
            "checksum_enabled": self.checksum,
            "deferred_release": not self.vulnerable,
            "canary_enabled": False,
            "page_tags": False,
            "config_source": "server_info",
        }

    def doc_hashes(self, key: int, first_page: int, end_page: int) -> np.ndarray:
        """Block hashes (content keys) of a document's pages under one cache key."""
        base = np.uint64(self.sim.hash_key(key))
        return (base + np.arange(first_page, end_page, dtype=np.uint64) * _GOLDEN).view(np.int64)

    # ---- admission ---------------------------------------------------------------------------------

    def receive(self, req: Request) -> None:
        t, P = self.sim.now, req.prompt_tokens
        self.log.add(t, _RECV, req, prompt_tokens=P, max_new_tokens=req.max_new_tokens)
        if req.fate in (PREFILL_REJECT, PLACEHOLDER):
            self.log.add(
                t, _ABORTED, req, stage="prefill_queue", abort_reason="input_too_long", http_status=400, prompt_tokens=P
            )
        if req.fate == PREFILL_REJECT:
            self.sim.push(t + self.sim.hop_ns, req.decode.drop, req)
            return
        if req.fate == PLACEHOLDER:
            # The pre-0.5.20 PD admission checked "finished", not "rejected": the rejected request runs
            # a forward pass on a one-token placeholder, ahead of the queue (it is tiny).
            req.target_tokens = 1
            self.queue.appendleft(req)
            self.sim.hooks.placeholder(req)
        else:
            req.target_tokens = P
            self.queue.append(req)
        if not self.busy:
            self.step()

    def _match_prefix(self, req: Request) -> None:
        req.hit_checked = True
        if req.doc_key is None:
            return
        entry = self.cache.lookup(req.doc_key)
        if entry is None:
            return
        entry.pins += 1
        req.hit = entry
        req.progress = entry.doc_tokens
        self.log.add(self.sim.now, _ALLOC, req, entry.pages, purpose="prefix_hit", block_hashes=entry.hashes)
        if entry.writer_tenant_idx != req.tenant_idx:
            self.sim.hooks.cross_tenant_hit(self, req, entry)

    def _alloc(self, num_pages: int) -> np.ndarray | None:
        pages = self.alloc.alloc(num_pages)
        while pages is None:
            if not self._evict():
                return None
            pages = self.alloc.alloc(num_pages)
        return pages

    def _evict(self) -> bool:
        entry = self.cache.evict_one()
        if entry is None:
            return False
        self.log.add(self.sim.now, _FREED, None, entry.pages, free_reason="eviction")
        self.alloc.free(entry.pages)
        return True

    # ---- forward steps -----------------------------------------------------------------------------

    def step(self, _=None) -> None:
        """Start one forward step: up to chunk_tokens from the head of the queue, pages allocated now."""
        self.busy = False
        queue, ps, t = self.queue, self.page_size, self.sim.now
        budget, total, done = self.sim.cfg.chunk_tokens, 0, 0
        work = []
        while budget > 0 and done < len(queue):
            req = queue[done]
            if not req.hit_checked:
                self._match_prefix(req)
            start = req.progress
            # Chunks end on page boundaries (so each starts on a fresh page) except a request's last.
            left = req.target_tokens - start
            num_tokens = left if left <= budget else budget - budget % ps
            if num_tokens == 0:
                break
            if req.hit is None and start < req.doc_tokens:
                num_tokens = min(num_tokens, req.doc_tokens - start)  # the document's pages in chunks of their own
            end = start + num_tokens
            pages = self._alloc(-(-end // ps) - start // ps)
            if pages is None:
                break
            self.log.add(t, _ALLOC, req, pages, purpose="prefill_extend")
            work.append((req, start, end, pages))
            req.progress = end
            budget -= num_tokens
            total += num_tokens
            if end == req.target_tokens:
                done += 1
        for _ in range(done):
            queue.popleft()
        self.blocked = not work and bool(queue)  # retried when pages are released
        if work:
            self.busy = True
            self.sim.push(t + max(1, int(total * 1e9 / self.rate_tokens_per_s)), self._step_end, work)

    def _step_end(self, work) -> None:
        sim, t, ps, log = self.sim, self.sim.now, self.page_size, self.log
        for req, start, end, pages in work:
            req.own.append(pages)
            hit = req.hit
            first = start == (hit.doc_tokens if hit is not None else 0)
            if hit is None and end <= req.doc_tokens:
                log.add(
                    t,
                    _WRITTEN,
                    req,
                    pages,
                    token_start=start,
                    token_end=end,
                    source="forward",
                    block_hashes=self.doc_hashes(req.doc_key, start // ps, end // ps),
                )
            else:
                if first and hit is not None:
                    log.add(t, _READ, req, hit.pages)  # attention over the cached prefix
                log.add(t, _WRITTEN, req, pages, token_start=start, token_end=end, source="forward")
            lo = 0 if first else start
            src = np.concatenate((hit.pages, pages)) if first and hit is not None else pages
            dst = req.dst[lo // ps : -(-end // ps)]
            last = end == req.target_tokens
            if last and self.checksum:
                req.sent_digest = sim.hash_key(req.transfer_id) & 0xFFFFFFFF
                log.add(
                    t,
                    _SENT,
                    req,
                    src,
                    dst_pages=dst,
                    num_tokens=end - lo,
                    is_last_chunk=True,
                    digest=req.sent_digest,
                    digest_algo="adler32",
                )
            else:
                log.add(t, _SENT, req, src, dst_pages=dst, num_tokens=end - lo, is_last_chunk=last)
            land = max(req.land_ns, t) + sim.hop_ns + int(len(src) * sim.xfer_ns_per_page)
            req.land_ns = land
            sim.push(land, req.decode.land, (req, dst, lo, end, last))
            if last:
                sim.hooks.last_chunk_sent(req, lo, end, dst)
        self.step()

    # ---- release -----------------------------------------------------------------------------------

    def release(self, req: Request, reason: str = "finish") -> None:
        """Transfer complete (or aborted): free the request's pages, leaving its document's in the cache."""
        if req.prefill_released:
            return
        req.prefill_released = True
        t, ps, own = self.sim.now, self.page_size, req.own
        pages = own[0] if len(own) == 1 else (np.concatenate(own) if own else np.empty(0, np.int32))
        keep = 0
        if (
            reason == "finish"
            and req.fate == OK
            and req.hit is None
            and req.doc_key is not None
            and req.doc_key not in self.cache.entries
        ):
            keep = req.doc_tokens // ps  # the cache keeps the document's pages; the writer owns them
            self.cache.insert(
                CacheEntry(
                    req.doc_key,
                    pages[:keep],
                    self.doc_hashes(req.doc_key, 0, keep),
                    req.doc_tokens,
                    req.serial,
                    req.tenant_idx,
                )
            )
        if len(pages) > keep:
            rest = pages[keep:]
            self.log.add(t, _FREED, req, rest, free_reason=reason)
            self.alloc.free(rest)
        if req.hit is not None:
            req.hit.pins -= 1
        while self.cache.num_pages > self.cache.max_pages and self._evict():
            pass
        if self.blocked and not self.busy:
            self.step()

    def ack(self, req: Request) -> None:
        """Decode confirmed the last chunk landed."""
        self.release(req)

    def abort(self, req: Request) -> None:
        """Decode aborted the request."""
        self.release(req, "abort")
