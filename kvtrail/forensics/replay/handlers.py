"""The replay engine's Python event handlers: the reference statement of the per-node findings rules.

:class:`EventHandlers` applies one :class:`~kvtrail.forensics.replay.event.ReplayEvent` to a
:class:`~kvtrail.forensics.replay.state.ReplayState` and emits the findings it proves (F1, F5, F6, F7, F8,
F10; the cross-node kinds go to :class:`~kvtrail.forensics.replay.joins.CrossNodeJoins`). The rules, including
those beyond the mission's definitions (block-hash-matched prefix hits, ``decode_growth`` pages, unverified
landings), are stated in ``docs/findings.md``.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable

import numpy as np

from kvtrail.forensics.findings import (
    REPEAT_DETAIL,
    UNVERIFIED,
    Finding,
    foreign_read_detail,
    late_write_detail,
    make_finding,
    unknown_writer_detail,
)
from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.forensics.replay.batch import JOIN_KINDS, PAGE_KINDS
from kvtrail.forensics.replay.event import EventKey, ReplayEvent, required
from kvtrail.forensics.replay.pagestate import PageState
from kvtrail.forensics.replay.state import ReplayState

# Kinds with a handler here (named on_<kind>); JOIN_KINDS are CrossNodeJoins' methods of the same name.
POOL_KINDS = ("node_config",) + PAGE_KINDS


class EventHandlers:
    """Applies events to a replay's state, one at a time; ``policy`` decides F10 (and F9, in the joins)."""

    def __init__(self, state: ReplayState, policy: ForensicsPolicy):
        self.state = state
        self.policy = policy
        self._by_kind: dict[str, Callable[[ReplayEvent], None]] = {
            **{kind: getattr(self, "on_" + kind) for kind in POOL_KINDS},
            **{kind: getattr(state.joins, kind) for kind in JOIN_KINDS},
            "transfer_received": self.on_transfer_received,
        }

    def handle(self, ev: ReplayEvent) -> None:
        """Apply one event (kinds without a handler change nothing)."""
        handler = self._by_kind.get(ev.kind)
        if handler is not None:
            handler(ev)

    def finding(
        self,
        code: str,
        ev: ReplayEvent,
        *,
        node: str | None = None,
        request: str | None = None,
        tenant: str | None = None,
        req: int | None = None,
        victims: Iterable[int] = (),
        pages: Iterable[int] = (),
        first_ns: int | None = None,
        evidence: Iterable[EventKey] = (),
        detail: str = "",
        lineage: tuple[int, int] = (0, 0),
        severity: str | None = None,
    ) -> Finding:
        """The finding ``code`` proved by ``ev`` (victims are request indices, -1 for nobody). Its request:
        ``req`` (an index: its tenant as known at ``ev``), else ``request`` of ``tenant`` (a cross-node
        finding: the event's tenant, else the first named for the id)."""
        state = self.state
        if req is not None:
            request, tenant = state.requests[req], state.tenant_at(req, ev.ord)
        elif request is not None and tenant is None:
            tenant = state.tenants.get(request)
        vic = sorted(
            {(state.requests[v], state.tenant_at(v, ev.ord)) if v >= 0 else (None, None) for v in victims},
            key=_by_id,
        )
        return make_finding(
            code,
            node=ev.node_key[1] if node is None else node,
            request_id=request,
            tenant_id=tenant if request is not None else None,
            victim_request_ids=tuple(v for v, _ in vic),
            victim_tenant_ids=tuple(t for _, t in vic),
            pages=_ints(pages),
            first_ns=ev.wall_ns if first_ns is None else int(first_ns),
            last_ns=ev.wall_ns,
            evidence=_keys([ev.key, *evidence]),
            detail=detail,
            lineage_checked=int(lineage[0]),
            lineage_matched=int(lineage[1]),
            **({"severity": severity} if severity else {}),
        )

    def emit(self, code: str, ev: ReplayEvent, **kw) -> None:
        self.state.found.append(self.finding(code, ev, **kw))

    def _pool(self, ev: ReplayEvent) -> PageState | None:
        pool = self.state.pools.get(ev.node_key)
        if pool is None or not len(ev.pages):
            return None
        pool.fit(ev.pages)
        return pool

    # ---- per-node events -----------------------------------------------------------------------------

    def on_node_config(self, ev: ReplayEvent) -> None:
        state, key, n = self.state, ev.node_key, int(required(ev.pool_pages, "pool_pages"))
        pool = state.pools.get(key)
        if pool is None or state.pool_instance.get(key) != ev.instance:
            # a new producer instance starts with a new, unwritten pool (its arrays sized by use, not by n)
            state.pools[key] = PageState.for_pool(n)
            state.pool_instance[key] = ev.instance
        state.joins.page_size[key] = int(required(ev.page_size, "page_size"))
        state.joins.configs[key] = ev
        pool_tokens = required(ev.pool_tokens, "pool_tokens")
        context_tokens = required(ev.context_tokens, "context_tokens")
        if pool_tokens < context_tokens:
            self.emit("F8", ev, detail=f"pool holds {pool_tokens} tokens, context is {context_tokens}")

    def on_pages_allocated(self, ev: ReplayEvent) -> None:
        pool, pages = self._pool(ev), ev.pages
        if pool is None:
            return
        r = self.state.req(ev.request_id, ev.tenant_id)
        self._check_repeats(ev, pages)
        if ev.purpose == "prefix_hit":  # shared radix-cache pages: many readers by design
            if ev.hashes is None:
                raise ValueError("replay: block_hashes missing on a prefix_hit allocation")
            for p, h in zip(pages.tolist(), ev.hashes.tolist()):
                pool.share(p, r, h)
            self.state.joins.prefix_hit(ev, len(pages))
            return
        owner = pool.owner[pages]
        busy = ((owner >= 0) & (owner != r)) | (pool.nshared[pages] > 0)
        if busy.any():
            victims: set[int] = set()
            evidence = []
            for p in pages[busy].tolist():
                victims |= pool.holders(p) - {r}
                if pool.owner[p] >= 0:
                    evidence.append(tuple(pool.alloc_ev[p]))
            busy_pages = [p for p in pages[busy].tolist() if pool.holders(p) - {r}]
            if busy_pages:
                self.emit(
                    "F6",
                    ev,
                    req=r,
                    victims=victims,
                    pages=busy_pages,
                    evidence=evidence,
                    detail=f"allocated ({ev.purpose}) while still held",
                )
        free = owner < 0
        pool.owner[pages[free]] = r
        for p in pages[~free & (owner != r)].tolist():
            pool.extra.setdefault(p, set()).add(r)
        pool.alloc_ev[pages[free | (owner == r)]] = ev.key
        pool.alloc_req[pages] = r
        pool.alloc_growth[pages] = ev.purpose == "decode_growth"
        pool.gen[pages] += 1

    def _check_repeats(self, ev: ReplayEvent, pages: np.ndarray) -> None:
        """A page listed twice in one allocation: the allocator handed it out twice (F6 on itself)."""
        if len(pages) < 2 or (len(pages) == len(np.unique(pages))):
            return
        listed = pages.tolist()
        counts = Counter(listed)
        dups = list(dict.fromkeys(p for p in listed if counts[p] > 1))  # in order of first listing
        self.emit(
            "F6",
            ev,
            req=(r := self.state.req(ev.request_id, ev.tenant_id)),
            victims=[r],
            pages=dups,
            detail=REPEAT_DETAIL,
        )

    def on_pages_freed(self, ev: ReplayEvent) -> None:
        pool, pages = self._pool(ev), ev.pages
        if pool is None:
            return
        if ev.request_id is not None:
            r = self.state.req(ev.request_id, ev.tenant_id)
            pool.drop_all(pages, r)
            pool.remember_release(r, pages)
            return
        # Radix eviction: the page leaves every holder (the set built as always: its order decides the
        # order of the drops). Dropping a page its holder does not hold changes nothing, and a drop does
        # not change whether another request holds the page: only the pages each one held are dropped.
        # A plain page's one holder is its owner (already in the set): it is cleared at once, the other
        # pages are dropped holder by holder as always (drops of different pages do not interact).
        everyone = {int(o) for o in pool.owner[pages] if o >= 0}
        plain = pool.plain(pages)
        shared = pages[~plain].tolist()
        holders_of = [pool.holders(p) for p in shared]
        for h in holders_of:
            everyone |= h
        pool.owner[pages[plain]] = -1
        held: dict[int, list[int]] = {r: [] for r in everyone}  # per holder, its shared pages in page order
        for p, h in zip(shared, holders_of):
            for r in h:
                held[r].append(p)
        for r in everyone:  # the same drops in the same order, without testing every page for every holder
            for p in held[r]:
                pool.drop(p, r)
            pool.remember_release(r, pages)

    def on_kv_written(self, ev: ReplayEvent) -> None:
        if ev.request_id is not None:
            self.state.joins.written(ev)
        pool, pages = self._pool(ev), ev.pages
        if pool is None:
            return
        r = self.state.req(ev.request_id, ev.tenant_id)
        outside = ~pool.held_by(pages, r)
        if outside.any():
            late = pages[outside]
            was_held = pool.released_by(r, late)
            victims: set[int] = set()
            for p in late.tolist():
                victims |= pool.holders(p)
            why = "after the request released them" if was_held.all() else "on pages the request never held"
            self.emit("F7", ev, req=r, victims=victims, pages=late, detail=late_write_detail(why))
            pool.remember_late(late, ev.key)
        pool.writer[pages] = r
        pool.write_ns[pages] = ev.wall_ns
        pool.write_gen[pages] = pool.gen[pages]
        pool.write_ev[pages] = ev.key
        pool.has_digest[pages] = ev.digests is not None
        if ev.digests is not None:
            pool.digest[pages] = ev.digests
        pool.has_bhash[pages] = ev.hashes is not None
        if ev.hashes is not None:
            pool.bhash[pages] = ev.hashes

    def on_transfer_received(self, ev: ReplayEvent) -> None:
        """A receipt feeds the joins; an ``unverified`` one also leaves its pages' writer unknown.

        Decode committed the transfer without evidence of what landed: the pages may hold what prefill sent
        or whatever was there before. Their writer becomes unknown (as never written), the receipt is
        remembered as the pages' last write event, so a later read's F1 names it.
        """
        self.state.joins.transfer_received(ev)
        if ev.status != UNVERIFIED:
            return
        pool, pages = self._pool(ev), ev.pages
        if pool is None:
            return
        pool.writer[pages] = -1
        pool.write_ns[pages] = ev.wall_ns
        pool.write_gen[pages] = pool.gen[pages]
        pool.write_ev[pages] = ev.key
        pool.has_digest[pages] = False
        pool.has_bhash[pages] = False

    def on_kv_read(self, ev: ReplayEvent) -> None:
        pool, pages = self._pool(ev), ev.pages
        if pool is None:
            return
        r = self.state.req(ev.request_id, ev.tenant_id)
        held = pool.held_by(pages, r)
        if not held.all():
            outside = pages[~held]
            victims = pool.holders_of(outside)
            self.emit(
                "F5",
                ev,
                req=r,
                victims=victims,
                pages=outside,
                detail="read of pages the request does not hold",
            )
        is_hit, hit_hash = pool.hit_hashes(pages, r)
        # A prefix-cache hit is the radix cache working when the page still holds what it was keyed by.
        cached = is_hit & pool.has_bhash[pages] & (pool.bhash[pages] == hit_hash)
        # A growth page it holds, not written since its allocation, is filled by the step that reads it.
        fresh = (
            held & (pool.alloc_req[pages] == r) & pool.alloc_growth[pages] & (pool.write_gen[pages] < pool.gen[pages])
        )
        writer = pool.writer[pages]
        foreign = (writer != r) & ~cached & ~fresh
        for w in np.unique(writer[foreign]).tolist():
            sel = foreign & (writer == w)
            if w < 0:
                landed = pool.write_ev[pages[sel]]
                unverified = landed[landed[:, 0] >= 0]  # unknown writer: an unverified landing's pages
                self.emit(
                    "F1",
                    ev,
                    req=r,
                    victims=[-1],
                    pages=pages[sel],
                    evidence={(int(k[0]), int(k[1])) for k in unverified.tolist()},
                    detail=unknown_writer_detail(len(unverified)),
                )
                continue
            num_late, num_lost = pool.late_writes(pages[sel], r)
            self.emit(
                "F1",
                ev,
                req=r,
                victims=[w],
                pages=pages[sel],
                first_ns=pool.write_ns[pages[sel]].min(),
                evidence=_write_keys(pool, pages[sel]),
                detail=foreign_read_detail(self.state.requests[w], num_late, num_lost),
                lineage=_lineage(pool, pages, sel, ev.digests),
            )
        cross = cached & (writer >= 0) & (writer != r)
        if cross.any() and not self.policy.allow_tenant_cache_sharing:
            mine = self.state.tenant_at(r, ev.ord) if ev.request_id is not None else None
            for w in np.unique(writer[cross]).tolist():
                theirs = self.state.tenant_at(w, ev.ord) if self.state.requests[w] is not None else None
                if mine is None or theirs is None or mine == theirs:
                    continue
                sel = pages[cross & (writer == w)]
                self.emit(
                    "F10",
                    ev,
                    req=r,
                    victims=[w],
                    pages=sel,
                    first_ns=pool.write_ns[sel].min(),
                    evidence=_write_keys(pool, sel),
                    detail=f"prefix-cache pages written for tenant {theirs} served to tenant {mine}",
                )


def _by_id(v: tuple[str | None, str | None]) -> tuple:
    """Victims' order: by request id, then tenant (no id, no tenant last)."""
    return (v[0] is None, v[0] or "", v[1] is None, v[1] or "")


def _write_keys(pool: PageState, pages: np.ndarray) -> set[EventKey]:
    return {(k[0], k[1]) for k in pool.write_ev[pages].tolist()}


def _lineage(pool: PageState, pages: np.ndarray, sel: np.ndarray, read_digests: np.ndarray | None) -> tuple[int, int]:
    """(pages checked, pages whose read digest equals what their last writer recorded)."""
    if read_digests is None:
        return 0, 0
    checked = sel & pool.has_digest[pages]
    return int(checked.sum()), int((checked & (pool.digest[pages] == read_digests)).sum())


def _ints(values: Iterable[int]) -> tuple[int, ...]:
    """Page ids as a tuple of Python ints (an array converts in one call)."""
    return tuple(values.tolist() if isinstance(values, np.ndarray) else (int(v) for v in values))


def _keys(items: Iterable[EventKey]) -> tuple[EventKey, ...]:
    return tuple(sorted({(int(p), int(s)) for p, s in items if p >= 0}))
