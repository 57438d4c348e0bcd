"""The incident's shape through the hooked SGLang functions on device cpu, judged by kvtrail's forensics.

Decode served an earlier request A (8 pages, fully transferred), then request B whose prompt prefill
replaced by the one-token placeholder after decode had reserved 8 pages for it: prefill sends 1 page,
decode commits, reads all 8 reserved pages (the lowest-first reuse hands it A's pages) and returns 200.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from tests.conftest import stored_events
from tests.sglang.conftest import SharedStore, start_node
from tests.sglang.pd import commit, decode_step, finish, prefill_request, reserve, respond, streamer, tokenizer
from tests.sglang.world import FakeMooncake, Node

PROMPT = 32  # tokens: 8 pages of 4


@pytest.fixture
def nodes(plugin, tmp_path):
    store = SharedStore(tmp_path / "audit.duckdb")
    # decode's pool is small: B must reuse A's pages
    prefill, decode = Node("prefill", radix=True, checksum=True), Node("decode", num_pages=12)
    sessions = {
        "prefill": start_node(plugin, prefill.scheduler, store, "sg-prefill"),
        "decode": start_node(plugin, decode.scheduler, store, "sg-decode"),
    }
    plugin.session = None
    tm = tokenizer("decode")  # decode server's HTTP process: the client's status
    sessions["http"] = plugin.start_frontend(tm, sink=store)
    closed = []

    def close():
        plugin.session = plugin.frontend = None
        if not closed:
            closed.append(True)
            for s in sessions.values():
                s.close()
            store.store.close()

    yield plugin, sessions, prefill, decode, tmp_path / "audit.duckdb", close, tm
    close()


def _on(plugin, session):
    session.resolver.drain()
    plugin.session = session


def test_placeholder_after_reservation_is_judged_f2_f4_and_f1_against_the_previous_holder(nodes):
    from kvtrail.forensics import ask_findings, open_store

    plugin, sessions, pnode, dnode, db, close, tm = nodes
    out = streamer()
    mgr = FakeMooncake()
    prompt_a, prompt_b = list(range(100, 100 + PROMPT)), list(range(500, 500 + PROMPT))

    _on(plugin, sessions["decode"])
    ra_d, a_pages = reserve(dnode, "A", 101, prompt_a)
    _on(plugin, sessions["prefill"])
    prefill_request(pnode, "A", 101, prompt_a, mgr, a_pages)
    _on(plugin, sessions["decode"])
    commit(dnode, pnode, ra_d)
    decode_step(dnode, ra_d)
    finish(dnode, ra_d, out)
    assert respond(tm, ra_d) == 200

    rb_d, b_pages = reserve(dnode, "B", 202, prompt_b)
    assert list(b_pages) == list(a_pages)  # lowest-first reuse: B gets A's 8 pages
    _on(plugin, sessions["prefill"])
    rb_p, sent = prefill_request(pnode, "B", 202, prompt_b, mgr, b_pages, placeholder=True)
    assert len(sent) == 1 and mgr.requests[-1][4] == 1  # prefill sent 1 page, 1 token
    _on(plugin, sessions["decode"])
    commit(dnode, pnode, rb_d)
    decode_step(dnode, rb_d)
    finish(dnode, rb_d, out)
    assert respond(tm, rb_d) == 200  # decode finished B normally: the client gets 200 and its output
    for s in sessions.values():
        s.resolver.drain()
        assert s.recorder.flush(30)
        assert s.resolver.failures == {}
    close()

    events = stored_events(db)
    assert not [e.get("detail") for e in events if e["kind"] == "recorder_gap"]  # no hook failed
    by = lambda kind, rid, node_role: [  # noqa: E731
        e
        for e in events
        if e["kind"] == kind
        and (e.get("request") or {}).get("request_id") == rid
        and e["producer"]["role"] == node_role
    ]
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
    [resp_b] = by("response_sent", "B", "decode")  # once: from the HTTP process, not also from the scheduler
    assert resp_b["http_status"] == 200 and resp_b["completion_tokens"] >= 1
    assert resp_b["latency_ns"] == 250_000_000 and resp_b["finish_reason"] == "length"
    [recv_b] = by("request_received", "B", "prefill")  # prefill's intake, before the placeholder
    assert recv_b["prompt_tokens"] == PROMPT and recv_b["request"]["transfer_id"] == 202
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

    from kvtrail.forensics import ask_findings, open_store

    plugin, sessions, pnode, dnode, db, close, tm = nodes
    plugin.config = dataclasses.replace(plugin.config, enforce_length=True)
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
        streamer().stream_output([rb_d], False)
        assert respond(tm, rb_d) == 500  # SGLang raises HTTPException(500): the client's status
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
