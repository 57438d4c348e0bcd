"""Hooks on SGLang's KV memory: allocation at prefill and decode, growth and reads, releases, page returns.

Each hook reads only host-side lengths in SGLang's thread and snapshots index tensors without a
device sync (:func:`~kvtrail.serving.sglang.resolver.snapshot`); page lists are computed and recorded
on the resolver thread.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtrail.serving.sglang.pages import block_hashes, pages_of
from kvtrail.serving.sglang.resolver import Snapshot, snapshot
from kvtrail.serving.sglang.session import Session


def is_aborted(req: Any) -> bool:
    for reason in (getattr(req, "finished_reason", None), getattr(req, "to_finish", None)):
        if reason is not None and type(reason).__name__ == "FINISH_ABORT":
            return True
    return False


# ---- prefill: alloc_for_extend (AFTER) ------------------------------------------------------------------


def on_extend(s: Session, result: Any, batch: Any) -> None:
    """Pages a prefill (or unified) extend allocated, the radix prefix it reused, and the KV it will write."""
    out = snapshot(result[0])
    table = batch.req_to_token_pool.req_to_token
    items = []
    for i, req in enumerate(batch.reqs):
        prefix_len, extend_len = int(batch.prefix_lens[i]), int(batch.extend_lens[i])
        ref, st = s.ref(req), s.state(str(req.rid))
        if ref.transfer_id is not None:
            s.rooms[ref.transfer_id] = ref
        # A request's first extend starts from a radix-cache match (shared pages); a later chunk from its own.
        hit = snapshot(table[req.kv.req_pool_idx, :prefix_len]) if prefix_len and not st.extended else None
        st.extended = True
        # origin_input_ids is replaced (never mutated in place) by SGLang, so a reference is a snapshot
        items.append((ref, prefix_len, extend_len, hit, req.origin_input_ids))
    s.later("alloc_for_extend", _record_extend, s, out, items)


def _record_extend(s: Session, out: Snapshot, items: list) -> None:
    tokens, ps, rec, offset = out.numpy(), s.page_size, s.recorder, 0
    for ref, prefix_len, extend_len, prefix, ids in items:
        new = tokens[offset : offset + extend_len]
        offset += extend_len
        if prefix is not None:
            hit = pages_of(prefix.numpy(), ps)
            rec.pages_allocated(ref, hit, "prefix_hit", block_hashes(ids, 0, len(hit), ps))
        pages = pages_of(new, ps)
        first_new = 1 if prefix_len % ps and len(pages) else 0  # the prefix's partial last page is not new
        if len(pages) > first_new:
            rec.pages_allocated(ref, pages[first_new:], "prefill_extend")
        if len(pages):
            start_page = prefix_len // ps
            rec.kv_written(
                ref,
                pages,
                prefix_len,
                prefix_len + extend_len,
                "forward",
                block_hashes=block_hashes(ids, start_page, len(pages), ps),
            )


# ---- decode: alloc_for_decode_prealloc (AFTER), alloc_for_decode (AFTER) -------------------------------


def on_prealloc(
    s: Session,
    result: Any,
    allocator: Any,
    *,
    req: Any,
    fill_len: int,
    total_prefix_len: int,
    prefix_len: int = 0,
    prefix_indices: Any = None,
    **_: Any,
) -> None:
    """Decode reserved pages to receive the request's KV: ``fill_len - total_prefix_len`` tokens expected.
    With decode's radix cache, the prefix it matched (``prefix_indices``, page-aligned) is a prefix hit."""
    if result is None:
        return
    st = s.state(str(req.rid))
    st.reserved_pages = snapshot(result)
    st.prefix_tokens = int(total_prefix_len)
    st.reserved_tokens = int(fill_len) - int(total_prefix_len)
    hit = snapshot(prefix_indices[:prefix_len]) if prefix_len and prefix_indices is not None else None
    s.later(
        "alloc_for_decode_prealloc",
        _record_prealloc,
        s,
        s.ref(req),
        st.reserved_pages,
        st.reserved_tokens,
        hit,
        req.origin_input_ids,
    )


def _record_prealloc(s: Session, ref: Any, loc: Snapshot, num_tokens: int, hit: Snapshot | None, ids: Any) -> None:
    if hit is not None:
        shared = pages_of(hit.numpy(), s.page_size)
        s.recorder.pages_allocated(ref, shared, "prefix_hit", block_hashes(ids, 0, len(shared), s.page_size))
    pages = pages_of(loc.numpy(), s.page_size)
    s.recorder.pages_allocated(ref, pages, "decode_reservation")
    if ref.transfer_id is not None:  # SGLang's fake transfers (health checks, warm-up) reserve for no transfer
        s.recorder.transfer_reserved(ref, pages, num_tokens)


def on_decode(s: Session, result: Any, batch: Any, token_per_req: int) -> None:
    """Decode step growth (a new page when a sequence crosses a page boundary) and what attention reads:
    the whole page table once, at the request's first step, then each page it adds."""
    ps = s.page_size
    seq_lens = batch.seq_lens_cpu.tolist()  # a CPU tensor: no device sync
    out = None
    table = batch.req_to_token_pool.req_to_token
    for i, req in enumerate(batch.reqs):
        st = s.state(str(req.rid))
        seq_len = int(seq_lens[i])
        grows = (seq_len % ps == 0) if ps > 1 else True
        row = None
        if not st.has_read:
            st.has_read = True
            row = snapshot(table[req.kv.req_pool_idx, : seq_len + token_per_req])
        elif not grows:
            continue
        if grows and out is None:
            out = snapshot(result)
        s.later("alloc_for_decode", _record_decode, s, s.ref(req), out if grows else None, i * token_per_req, row)


def _record_decode(s: Session, ref: Any, out: Snapshot | None, at: int, row: Snapshot | None) -> None:
    ps = s.page_size
    new = None
    if out is not None:
        new = pages_of(out.numpy()[at : at + 1], ps)
        s.recorder.pages_allocated(ref, new, "decode_growth")
    if row is not None:
        s.recorder.kv_read(ref, pages_of(row.numpy(), ps))
    elif new is not None:
        s.recorder.kv_read(ref, new)


# ---- releases: release_kv_cache (AROUND), page returns (BEFORE), free groups -----------------------------


def release_pre(
    s: Session, req: Any, tree_cache: Any, is_insert: bool = True, *, checkpoint: bool | None = None
) -> Any:
    """Attribute the pages the release returns to the request (the page-return hook reads this).

    ``release_kv_cache(req, tree_cache, *, checkpoint)`` from 0.5.22, ``(req, tree_cache, is_insert=True)`` before:
    either flag false is a release whose KV the radix cache does not keep (an abort)."""
    keep = is_insert if checkpoint is None else checkpoint
    if getattr(req, "is_retracted", False) or getattr(s.local, "retracting", False):
        reason = "retract"
    elif is_aborted(req) or not keep:
        reason = "abort"
    else:
        reason = "finish"
    prev = getattr(s.local, "releasing", None)
    s.local.releasing = (s.ref(req), reason)
    return prev, str(req.rid), getattr(req, "bootstrap_room", None)


def release_post(s: Session, token: Any, _result: Any) -> None:
    if token is None:
        s.local.releasing = None
        return
    prev, rid, room = token
    s.local.releasing = prev
    # Decode and unified nodes keep the request's facts until its response is recorded.
    s.forget(rid if s.role == "prefill" else "", room)


def retract_pre(s: Session, *_: Any, **__: Any) -> bool:
    """schedule_batch.release_req (AROUND): it releases the KV before reset_for_retract marks the request."""
    prev = getattr(s.local, "retracting", False)
    s.local.retracting = True
    return prev


def retract_post(s: Session, prev: Any, _result: Any) -> None:
    s.local.retracting = bool(prev)


class GroupRelease:
    """The frees a free group postponed, each with the request being released when it was asked for.

    Handled on the resolver thread only: the first page return of the group's end records them all."""

    __slots__ = ("entries", "recorded", "pages")

    def __init__(self, entries: list) -> None:
        self.entries = entries  # (who, Snapshot, is_token_indices)
        self.recorded = False
        self.pages: set[int] = set()


def grouped(s: Session, allocator: Any, free_index: Any, token_indices: bool) -> bool:
    """Inside a free group: remember who asked for this free (True), else False (it returns pages now)."""
    if getattr(allocator, "free_group", None) is None:
        return False
    if free_index is not None and free_index.numel():
        who = getattr(s.local, "releasing", None)
        s.groups.setdefault(id(allocator), []).append((who, snapshot(free_index), token_indices))
    return True


def group_free_pages(s: Session, allocator: Any, page_ids: Any) -> None:
    """PagedTokenToKVPoolAllocator.free_page_ids (BEFORE): a free the group postpones."""
    grouped(s, allocator, page_ids, False)


def group_free_tokens(s: Session, allocator: Any, free_index: Any) -> None:
    """PagedTokenToKVPoolAllocator.free (BEFORE): a free the group postpones (token indices)."""
    grouped(s, allocator, free_index, s.page_size > 1)


def group_end_pre(s: Session, allocator: Any) -> Any:
    """free_group_end (AROUND, base and paged): the page returns inside it belong to the postponed frees."""
    if getattr(s.local, "group", None) is not None:  # the paged end calls the base end: one group
        return None
    s.local.group = GroupRelease(s.groups.pop(id(allocator), []))
    return True


def group_end_post(s: Session, token: Any, _result: Any) -> None:
    if token is not None:
        s.local.group = None


def pages_returned(s: Session, _allocator: Any, *page_ids: Any) -> None:
    """Pages going back to the pool: of the request being released, else a radix eviction (no request)."""
    who = getattr(s.local, "releasing", None)
    snaps = [snapshot(p) for p in page_ids if p is not None and p.numel()]
    if snaps:
        s.later("_release_page_ids", _record_returned, s, who, snaps, getattr(s.local, "group", None))


def tokens_returned(s: Session, allocator: Any, free_index: Any) -> None:
    """page_size 1: the token allocator's free takes token indices, which are its pages."""
    if not grouped(s, allocator, free_index, False):
        pages_returned(s, allocator, free_index)


def _record_returned(s: Session, who: Any, snaps: list[Snapshot], group: GroupRelease | None) -> None:
    pages = np.concatenate([x.numpy().reshape(-1) for x in snaps])
    if group is not None:
        if not group.recorded:
            group.recorded = True
            for owner, snap, token_indices in group.entries:
                ids = snap.numpy().reshape(-1)
                got = np.unique(ids // s.page_size) if token_indices else ids
                group.pages.update(int(p) for p in got)
                _record_free(s, owner, got)
        pages = np.array([p for p in pages.tolist() if p not in group.pages], dtype=np.int64)
        if not len(pages):
            return
    _record_free(s, who, pages)


def _record_free(s: Session, who: Any, pages: np.ndarray) -> None:
    if who is None:
        s.recorder.pages_freed(None, pages, "eviction")
    else:
        s.recorder.pages_freed(who[0], pages, who[1])
