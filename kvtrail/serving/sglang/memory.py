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
        new = tokens[offset:offset + extend_len]
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
            rec.kv_written(ref, pages, prefix_len, prefix_len + extend_len, "forward",
                           block_hashes=block_hashes(ids, start_page, len(pages), ps))


# ---- decode: alloc_for_decode_prealloc (AFTER), alloc_for_decode (AFTER) -------------------------------

def on_prealloc(s: Session, result: Any, allocator: Any, *, req: Any, fill_len: int, total_prefix_len: int,
                **_: Any) -> None:
    """Decode reserved pages to receive the request's KV: ``fill_len - total_prefix_len`` tokens expected."""
    if result is None:
        return
    st = s.state(str(req.rid))
    st.reserved_pages = snapshot(result)
    st.prefix_tokens = int(total_prefix_len)
    st.reserved_tokens = int(fill_len) - int(total_prefix_len)
    s.later("alloc_for_decode_prealloc", _record_prealloc, s, s.ref(req), st.reserved_pages, st.reserved_tokens)


def _record_prealloc(s: Session, ref: Any, loc: Snapshot, num_tokens: int) -> None:
    pages = pages_of(loc.numpy(), s.page_size)
    s.recorder.pages_allocated(ref, pages, "decode_reservation")
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
            row = snapshot(table[req.kv.req_pool_idx, :seq_len + token_per_req])
        elif not grows:
            continue
        if grows and out is None:
            out = snapshot(result)
        s.later("alloc_for_decode", _record_decode, s, s.ref(req), out if grows else None, i * token_per_req, row)


def _record_decode(s: Session, ref: Any, out: Snapshot | None, at: int, row: Snapshot | None) -> None:
    ps = s.page_size
    new = None
    if out is not None:
        new = pages_of(out.numpy()[at:at + 1], ps)
        s.recorder.pages_allocated(ref, new, "decode_growth")
    if row is not None:
        s.recorder.kv_read(ref, pages_of(row.numpy(), ps))
    elif new is not None:
        s.recorder.kv_read(ref, new)


# ---- releases: release_kv_cache (AROUND), page returns (AROUND) ----------------------------------------

def release_pre(s: Session, req: Any, tree_cache: Any, *, checkpoint: bool) -> Any:
    """Attribute the pages the release returns to the request (the page-return hook reads this)."""
    if getattr(req, "is_retracted", False):
        reason = "retract"
    elif is_aborted(req) or not checkpoint:
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


def pages_returned(s: Session, _allocator: Any, *page_ids: Any) -> None:
    """Pages going back to the pool: of the request being released, else a radix eviction (no request)."""
    who = getattr(s.local, "releasing", None)
    snaps = [snapshot(p) for p in page_ids if p is not None and p.numel()]
    if snaps:
        s.later("_release_page_ids", _record_returned, s, who, snaps)


def tokens_returned(s: Session, allocator: Any, free_index: Any) -> None:
    """page_size 1: the token allocator's free takes token indices, which are its pages."""
    if getattr(allocator, "free_group", None) is None:
        pages_returned(s, allocator, free_index)


def _record_returned(s: Session, who: Any, snaps: list[Snapshot]) -> None:
    pages = np.concatenate([x.numpy().reshape(-1) for x in snaps])
    if who is None:
        s.recorder.pages_freed(None, pages, "eviction")
    else:
        s.recorder.pages_freed(who[0], pages, who[1])
