"""The incident's shape through the hooked SGLang functions on device cpu, judged by kvtrail's forensics.

Decode served an earlier request A (8 pages, fully transferred), then request B whose prompt prefill
replaced by the one-token placeholder after decode had reserved 8 pages for it: prefill sends 1 page,
decode commits, reads all 8 reserved pages (the lowest-first reuse hands it A's pages) and returns 200.
"""

from __future__ import annotations

import types
import zlib

import numpy as np
import pytest
import torch

from tests.conftest import stored_events
from tests.sglang.conftest import SharedStore
from tests.sglang.world import PAGE_SIZE, FakeMooncake, Node, req, sender

PROMPT = 32  # tokens: 8 pages of 4


@pytest.fixture
def nodes(plugin, tmp_path):
    store = SharedStore(tmp_path / "audit.duckdb")
    # decode's pool is small: B must reuse A's pages
    prefill, decode = Node("prefill", radix=True, checksum=True), Node("decode", num_pages=12)
    sessions = {"prefill": plugin.start(prefill.scheduler, sink=store),
                "decode": plugin.start(decode.scheduler, sink=store)}
    plugin.session = None
    closed = []

    def close():
        plugin.session = None
        if not closed:
            closed.append(True)
            for s in sessions.values():
                s.close()
            store.store.close()

    yield plugin, sessions, prefill, decode, tmp_path / "audit.duckdb", close
    close()


def _on(plugin, session):
    session.resolver.drain()
    plugin.session = session


def prefill_request(pnode, rid, room, tokens, mgr, dst_pages, placeholder=False):
    from sglang.srt.mem_cache import allocation

    r = req(rid, tokens, room)
    if placeholder:  # intake rejected it: SGLang swaps in the 1-token placeholder (origin_input_ids = [0])
        r.set_finish_with_abort("Input length exceeds the maximum allowed length")
    r.init_next_round_input(pnode.tree)
    b = pnode.batch([r])
    n = len(r.origin_input_ids)
    b.prefix_lens, b.extend_lens, b.extend_num_tokens = [0], [n], n
    b.seq_lens = b.seq_lens_cpu = torch.tensor([n])
    allocation.alloc_for_extend(b)
    r.output_ids.append(7)
    r.metadata_buffer_index, r.disagg_decode_prefix_len = 0, 0
    pnode.metadata.set_buf(r)
    # SGLang's own digest of what it sends (--disaggregation-enable-kv-checksum); zlib.adler32 of the bytes
    pnode.metadata.set_kv_checksum(r, zlib.adler32(bytes(np.asarray(r.origin_input_ids, dtype=np.int64))), 0x5151)
    row = pnode.pool.req_to_token[r.kv.req_pool_idx, :n]
    pages = (row[::PAGE_SIZE] // PAGE_SIZE).numpy().astype(np.int32)
    sender(mgr, room, len(pages), dst_pages).send(pages, num_kv_tokens=n)
    return r, pages


def reserve(dnode, rid, room, tokens):
    from sglang.srt.disaggregation import decode as dmod

    r = req(rid, tokens, room)
    dnode.pool.alloc([r])
    loc = dmod.alloc_for_decode_prealloc(dnode.allocator, req=r, fill_len=len(tokens), delta_len=len(tokens),
                                         prefix_len=0, total_prefix_len=0, prefix_indices=None,
                                         uses_swa_tail=False, swa_tail_len=0, req_to_token_pool=dnode.pool)
    dnode.pool.write((r.kv.req_pool_idx, slice(0, len(loc))), loc.to(torch.int32))
    r.kv.kv_committed_len = len(tokens)
    return r, (loc[::PAGE_SIZE] // PAGE_SIZE).numpy()


def commit(dnode, pnode, r):
    from sglang.srt.disaggregation.decode import DecodeRequest, DecodeTransferQueue
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    slot = 1
    for name in ("output_ids", "cached_tokens", "bootstrap_room"):  # what Mooncake's aux copy carries
        getattr(dnode.metadata, name)[slot] = getattr(pnode.metadata, name)[0]
    q = object.__new__(DecodeTransferQueue)
    q.metadata_buffers, q.spec_algorithm = dnode.metadata, SpeculativeAlgorithm.NONE
    q.scheduler = types.SimpleNamespace(kv_checksum_computer=None, batch_result_processor=types.SimpleNamespace(
        _maybe_update_reasoning_tokens=lambda *a: None))
    dr = DecodeRequest(req=r, kv_receiver=types.SimpleNamespace(clear=lambda: None), metadata_buffer_index=slot)
    q._commit_transfer_to_req(dr)


def decode_step(dnode, r):
    from sglang.srt.mem_cache import allocation

    b = dnode.batch([r])
    n = len(r.origin_input_ids)
    b.seq_lens = torch.tensor([n])
    b.seq_lens_cpu = torch.tensor([n])
    b.req_pool_indices = b.req_pool_indices_cpu = torch.tensor([r.kv.req_pool_idx])
    allocation.alloc_for_decode(b, 1)


def finish(dnode, r, streamer):
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.common import release_kv_cache

    r.finished_reason = FINISH_LENGTH(len(r.output_ids))
    r.output_ids.append(9)
    streamer.stream_output([r], False)
    r.finished_len = len(r.output_ids)
    r.kv.kv_committed_len = r.kv.kv_allocated_len
    release_kv_cache(r, dnode.tree, checkpoint=False)


def test_placeholder_after_reservation_is_judged_f2_f4_and_f1_against_the_previous_holder(nodes):
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer

    from kvtrail.forensics import ask_findings, open_store

    plugin, sessions, pnode, dnode, db, close = nodes
    class Streamer(SchedulerOutputStreamer):  # the hooked stream_output, without a detokenizer to send to
        is_generation = True

        def _stream_output_generation(self, *args):
            return None

    streamer = object.__new__(Streamer)
    mgr = FakeMooncake()
    prompt_a, prompt_b = list(range(100, 100 + PROMPT)), list(range(500, 500 + PROMPT))

    _on(plugin, sessions["decode"])
    ra_d, a_pages = reserve(dnode, "A", 101, prompt_a)
    _on(plugin, sessions["prefill"])
    prefill_request(pnode, "A", 101, prompt_a, mgr, a_pages)
    _on(plugin, sessions["decode"])
    commit(dnode, pnode, ra_d)
    decode_step(dnode, ra_d)
    finish(dnode, ra_d, streamer)

    rb_d, b_pages = reserve(dnode, "B", 202, prompt_b)
    assert list(b_pages) == list(a_pages)  # lowest-first reuse: B gets A's 8 pages
    _on(plugin, sessions["prefill"])
    rb_p, sent = prefill_request(pnode, "B", 202, prompt_b, mgr, b_pages, placeholder=True)
    assert len(sent) == 1 and mgr.requests[-1][4] == 1  # prefill sent 1 page, 1 token
    _on(plugin, sessions["decode"])
    commit(dnode, pnode, rb_d)
    decode_step(dnode, rb_d)
    finish(dnode, rb_d, streamer)
    for s in sessions.values():
        s.resolver.drain()
        assert s.recorder.flush(30)
        assert s.resolver.failures == {}
    close()

    events = stored_events(db)
    assert not [e for e in events if e["kind"] == "recorder_gap"]  # no hook failed
    by = lambda kind, rid, node_role: [e for e in events if e["kind"] == kind  # noqa: E731
                                        and (e.get("request") or {}).get("request_id") == rid
                                        and e["producer"]["role"] == node_role]
    [res_b] = by("transfer_reserved", "B", "decode")
    assert res_b["pages"] == list(b_pages) and res_b["num_tokens"] == PROMPT
    assert res_b["request"]["transfer_id"] == 202
    [sent_b] = by("transfer_sent", "B", "prefill")
    assert sent_b["num_tokens"] == 1 and sent_b["dst_pages"] == [int(b_pages[0])] and sent_b["is_last_chunk"]
    assert sent_b["digest"] == zlib.adler32(bytes(np.asarray([0], dtype=np.int64)))  # the placeholder's
    assert sent_b["digest_algo"] == "adler32"
    [alloc_b] = by("pages_allocated", "B", "prefill")
    [wrote_b] = by("kv_written", "B", "prefill")
    assert alloc_b["pages"] == wrote_b["pages"] == sent_b["pages"] == [int(p) for p in sent]
    assert (wrote_b["token_start"], wrote_b["token_end"], wrote_b["source"]) == (0, 1, "forward")
    [got_b] = by("transfer_received", "B", "decode")
    assert got_b["num_tokens"] == 1 and got_b["pages"] == [int(b_pages[0])]
    [abort_b] = by("request_aborted", "B", "prefill")
    assert abort_b["prompt_tokens"] == PROMPT and abort_b["http_status"] == 400
    reads_b = by("kv_read", "B", "decode")
    assert reads_b[0]["pages"][:8] == list(b_pages)
    [resp_b] = by("response_sent", "B", "decode")
    assert resp_b["http_status"] == 200 and resp_b["completion_tokens"] >= 1
    [landed_b] = by("kv_written", "B", "decode")
    assert landed_b["source"] == "transfer_in" and landed_b["pages"] == [int(b_pages[0])]
    [landed_a] = by("kv_written", "A", "decode")
    assert landed_a["pages"] == list(a_pages) and landed_a["token_end"] == PROMPT
    freed_a = by("pages_freed", "A", "decode")
    assert sorted(p for e in freed_a for p in e["pages"])[:8] == sorted(a_pages)

    con = open_store(db)
    try:
        found = ask_findings(con).found
    finally:
        con.close()
    codes = {(f.code, f.request_id) for f in found}
    assert ("F2", "B") in codes and ("F4", "B") in codes, codes
    [f1] = [f for f in found if f.code == "F1" and f.request_id == "B"]
    assert set(f1.pages) == {int(p) for p in b_pages[1:]} and f1.victim_request_ids == ("A",)
    assert not [f for f in found if f.request_id == "A"], [f for f in found if f.request_id == "A"]


def test_enforced_length_check_aborts_the_placeholder_request_with_500_instead_of_serving_it(nodes):
    import dataclasses

    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer

    from kvtrail.forensics import ask_findings, open_store

    plugin, sessions, pnode, dnode, db, close = nodes
    plugin.config = dataclasses.replace(plugin.config, enforce_length=True)

    class Streamer(SchedulerOutputStreamer):
        is_generation = True

        def _stream_output_generation(self, *args):
            return None

    mgr = FakeMooncake()
    try:
        _on(plugin, sessions["decode"])
        rb_d, b_pages = reserve(dnode, "B", 303, list(range(PROMPT)))
        _on(plugin, sessions["prefill"])
        prefill_request(pnode, "B", 303, list(range(PROMPT)), mgr, b_pages, placeholder=True)
        _on(plugin, sessions["decode"])
        commit(dnode, pnode, rb_d)
        assert type(rb_d.finished_reason).__name__ == "FINISH_ABORT"
        assert rb_d.finished_reason.to_json()["status_code"] == 500
        assert len(rb_d.output_ids) == 0  # the commit did not run: no first token was taken
        object.__new__(Streamer).stream_output([rb_d], False)
    finally:
        plugin.config = dataclasses.replace(plugin.config, enforce_length=False)
    close()
    events = stored_events(db)
    [got] = [e for e in events if e["kind"] == "transfer_received"]
    assert got["status"] == "mismatch" and got["num_tokens"] == 1
    [resp] = [e for e in events if e["kind"] == "response_sent"]
    assert resp["http_status"] == 500 and resp["completion_tokens"] == 0
    con = open_store(db)
    try:
        found = ask_findings(con).found
    finally:
        con.close()
    codes = {f.code for f in found}
    assert "F2" in codes  # the mismatch is still on record: decode reserved 32 tokens, prefill sent 1
    assert "F4" not in codes and "F1" not in codes  # nothing was served, nothing read
