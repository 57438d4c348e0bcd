"""Parts the fleet simulator's nodes share: the request, its fates, and the prefix cache.

Nodes allocate pages with the serving stack's own :class:`~kvtrail.serving.allocator.PageAllocator`
(one per node, SGLang's lowest-first staged reuse), so page churn and fragmentation come from the same
allocator the reference stack uses.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

# Request fates, decided at routing.
OK, ROUTER_REJECT, PREFILL_REJECT, PLACEHOLDER = range(4)


class Request:
    """One simulated request and its progress through router, prefill and decode."""

    __slots__ = (
        "serial",
        "rid",
        "tenant",
        "tenant_idx",
        "transfer_id",
        "t_arrival_ns",
        "prompt_tokens",
        "max_new_tokens",
        "completion_tokens",
        "abort_at_token",
        "fate",
        "doc_key",
        "doc_tokens",
        "prefill",
        "decode",
        "dst",
        "need_pages",
        "target_tokens",
        "progress",
        "hit",
        "hit_checked",
        "own",
        "land_ns",
        "sent_digest",
        "t_start_ns",
        "t_first_token_ns",
        "growth",
        "next_growth",
        "dst_freed",
        "cancelled",
        "prefill_released",
        "role",
        "plant",
        "on_first_landing",
        "end_token",
        "http_status",
        "ident",
    )

    def __init__(
        self,
        serial,
        rid,
        tenant,
        tenant_idx,
        api_key,
        transfer_id,
        t_arrival_ns,
        prompt_tokens,
        max_new_tokens,
        completion_tokens,
        abort_at_token,
    ):
        self.serial = serial
        self.rid = rid
        self.tenant = tenant
        self.tenant_idx = tenant_idx
        self.transfer_id = transfer_id
        self.ident = (rid, tenant, api_key, transfer_id)  # what every event of the request carries
        self.t_arrival_ns = t_arrival_ns
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.completion_tokens = completion_tokens
        self.abort_at_token = abort_at_token  # 0: the client waits for the whole response
        self.fate = OK
        self.doc_key = None  # prefix-cache key of the shared document the prompt starts with
        self.doc_tokens = 0
        self.prefill = None
        self.decode = None
        self.dst = None  # decode page table (reserved pages, page-table order)
        self.need_pages = 0  # decode pages committed for prompt plus generation
        self.target_tokens = 0  # tokens prefill computes and sends (1 for the placeholder)
        self.progress = 0  # prefill tokens scheduled so far (prefix-cache hit included)
        self.hit = None  # the prefix-cache entry this request hit
        self.hit_checked = False
        self.own: list[np.ndarray] = []  # prefill pages allocated to this request, per chunk
        self.land_ns = 0  # when the latest chunk lands on decode
        self.sent_digest = None
        self.t_start_ns = 0  # decode start (page table read)
        self.t_first_token_ns = 0
        self.growth: list[np.ndarray] = []  # decode growth pages
        self.next_growth = 0  # token index of the next growth page
        self.dst_freed = False  # the reserved pages were already freed (use-after-free, late write)
        self.cancelled = False  # transfers still in flight do not land (decode aborted the request)
        self.prefill_released = False
        self.role = None  # "plant" / "partner" once a planted bug uses this request
        self.plant = None  # the plant whose recipient this request is
        self.on_first_landing = None  # plant continued when this (partner) request's KV first lands
        self.end_token = 0
        self.http_status = 0


class CacheEntry:
    """Pages a prefill node keeps for one prefix-cache key (one shared document), LRU-ordered."""

    __slots__ = ("key", "pages", "hashes", "doc_tokens", "writer_serial", "writer_tenant_idx", "pins")

    def __init__(self, key, pages, hashes, doc_tokens, writer_serial, writer_tenant_idx):
        self.key = key
        self.pages = pages
        self.hashes = hashes  # block hashes the writer stored (int64, one per page)
        self.doc_tokens = doc_tokens
        self.writer_serial = writer_serial
        self.writer_tenant_idx = writer_tenant_idx
        self.pins = 0  # running requests using the entry as a hit (not evictable while > 0)


class RadixCache:
    """A prefix cache of whole documents: lookup by key, LRU eviction of unpinned entries."""

    def __init__(self, max_pages: int):
        self.max_pages = max_pages
        self.entries: OrderedDict[int, CacheEntry] = OrderedDict()
        self.num_pages = 0

    def lookup(self, key) -> CacheEntry | None:
        e = self.entries.get(key)
        if e is not None:
            self.entries.move_to_end(key)
        return e

    def insert(self, entry: CacheEntry) -> None:
        assert entry.key not in self.entries, "insert: key already cached"
        self.entries[entry.key] = entry
        self.num_pages += len(entry.pages)

    def evict_one(self) -> CacheEntry | None:
        """Remove and return the least recently used unpinned entry (None if every entry is pinned)."""
        for key, e in self.entries.items():
            if e.pins == 0:
                del self.entries[key]
                self.num_pages -= len(e.pages)
                return e
        return None
