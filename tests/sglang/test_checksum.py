"""SGLang's own KV checksum on both sides (--disaggregation-enable-kv-checksum): prefill's digest goes with the
last chunk, decode's verdict from its real _verify_kv_checksums is a receipt carrying decode's digest, and
kvtrail's forensics judges the pair (F3 where the landed bytes differ)."""

from __future__ import annotations

import pytest

from tests.conftest import stored_events
from tests.sglang.conftest import on_node
from tests.sglang.pd import (
    checksum_computer,
    commit,
    digest_of,
    finish,
    land,
    prefill_request,
    reserve,
    respond,
    streamer,
    verify,
)
from tests.sglang.world import FakeMooncake

PROMPT = 12  # 3 pages of 4


@pytest.fixture
def pd(checksum_pd):
    return checksum_pd


def test_landed_bytes_that_differ_fail_sglangs_checksum_and_yield_f3(pd, monkeypatch):
    from kvtrail.forensics import ask_findings, open_store

    plugin, (ps, ds, hs), pnode, dnode, tm, db, close = pd
    computer = checksum_computer(dnode, monkeypatch)
    mgr, reqs = FakeMooncake(), {}
    for rid, room, corrupt in (("G", 11, False), ("X", 12, True)):
        tokens = list(range(room * 100, room * 100 + PROMPT))
        on_node(plugin, ds)
        r, dst = reserve(dnode, rid, room, tokens)
        on_node(plugin, ps)
        _, src = prefill_request(pnode, rid, room, tokens, mgr, dst, digest="bytes")
        land(pnode, dnode, src, dst, flip_byte=corrupt)
        on_node(plugin, ds)
        commit(dnode, pnode, r, computer=computer)  # the slot carried prefill's digest: decode keeps it
        sent_digest = digest_of(pnode, src)
        assert r.expected_kv_checksum == sent_digest
        reqs[rid] = (r, sent_digest, digest_of(dnode, dst))
    kept = verify(dnode, [reqs["G"][0], reqs["X"][0]], computer)  # one batch: digests pair with requests in order
    assert [r.rid for r in kept] == ["G"]  # SGLang dropped X (500) and kept G
    x = reqs["X"][0]
    assert x.finished_reason.to_json()["status_code"] == 500
    finish(dnode, reqs["G"][0], streamer())
    assert respond(tm, x) == 500 and respond(tm, reqs["G"][0]) == 200
    for s in (ps, ds, hs):
        s.resolver.drain()
        assert s.recorder.flush(30) and s.resolver.failures == {}
    close()
    events = stored_events(db)
    assert not [e.get("detail") for e in events if e["kind"] == "recorder_gap"]

    def receipts(rid):
        return [e for e in events if e["kind"] == "transfer_received" and e["request"]["request_id"] == rid]

    commit_g, verdict_g = receipts("G")  # the commit's receipt, then decode's checksum verdict
    assert commit_g.get("digest") is None and verdict_g["status"] == "ok"
    assert verdict_g["digest"] == reqs["G"][1] == reqs["G"][2] and verdict_g["digest_algo"] == "adler32"
    assert verdict_g["pages"] == commit_g["pages"] and verdict_g["num_tokens"] == PROMPT
    _, verdict_x = receipts("X")
    assert verdict_x["status"] == "mismatch" and verdict_x["digest"] == reqs["X"][2] != reqs["X"][1]
    [sent_x] = [e for e in events if e["kind"] == "transfer_sent" and e["request"]["request_id"] == "X"]
    assert sent_x["digest"] == reqs["X"][1] and sent_x["digest_algo"] == "adler32"
    [abort_x] = [e for e in events if e["kind"] == "request_aborted" and e["request"]["request_id"] == "X"]
    assert abort_x["stage"] == "decode_transfer" and abort_x["http_status"] == 500
    freed_x = [e for e in events if e["kind"] == "pages_freed" and (e.get("request") or {}).get("request_id") == "X"]
    assert freed_x and freed_x[0]["free_reason"] == "abort"

    con = open_store(db)
    try:
        found = ask_findings(con).found
    finally:
        con.close()
    [f3] = [f for f in found if f.code == "F3"]
    assert f3.request_id == "X" and f"{reqs['X'][1]:#x}" in f3.detail and f"{reqs['X'][2]:#x}" in f3.detail
    assert not [f for f in found if f.request_id == "G"], [f for f in found if f.request_id == "G"]


def test_the_incidents_placeholder_fails_sglangs_checksum_when_both_roles_run_it(pd, monkeypatch):
    from kvtrail.forensics import ask_findings, open_store

    plugin, (ps, ds, hs), pnode, dnode, tm, db, close = pd
    computer = checksum_computer(dnode, monkeypatch)
    tokens = list(range(500, 532))  # 8 pages reserved at decode
    on_node(plugin, ds)
    r, dst = reserve(dnode, "B", 202, tokens)
    on_node(plugin, ps)
    _, src = prefill_request(pnode, "B", 202, tokens, FakeMooncake(), dst, placeholder=True, digest="bytes")
    assert len(src) == 1  # prefill ran the 1-token placeholder and sent 1 page
    land(pnode, dnode, src, dst)
    on_node(plugin, ds)
    commit(dnode, pnode, r, computer=computer)
    assert verify(dnode, [r], computer) == []  # decode digests all 8 reserved pages: SGLang drops B
    assert respond(tm, r) == 500
    for s in (ps, ds, hs):
        s.resolver.drain()
        assert s.recorder.flush(30)
    close()
    events = stored_events(db)
    verdict = [e for e in events if e["kind"] == "transfer_received"][-1]
    assert verdict["status"] == "mismatch" and verdict["digest"] == digest_of(dnode, dst)
    con = open_store(db)
    try:
        found = ask_findings(con).found
    finally:
        con.close()
    codes = {f.code for f in found if f.request_id == "B"}
    assert {"F2", "F3"} <= codes and not codes & {"F1", "F4"}, codes  # refused, not served; nothing read
