"""Landings proven, never assumed: decode commits what no transfer of this room wrote.

Decode served A (fully transferred), then reserved 40 tokens (10 pages) for U, A's pages among them; no
prefill chunk of U's room ever came (0 tokens sent), and the metadata slot decode commits from still
holds A's. The plugin records U's receipt as ``unverified`` (0 tokens proven, every reserved page, no
``transfer_in`` write) and both engines flag U: F1 on the pages it reads, whose writer is unknown (never
A's on record), and F2 (40 reserved, nothing shown landed). SGLang's checksum, where it matches, is the
proof the slot lacked.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import stored_events
from tests.sglang.conftest import SharedStore
from tests.sglang.pd import (
    checksum_computer,
    commit,
    decode_step,
    finish,
    land,
    prefill_request,
    reserve,
    respond,
    streamer,
    tokenizer,
    verify,
)
from tests.sglang.world import FakeMooncake, Node, req

PROMPT = 40  # tokens: 10 pages of 4


@pytest.fixture
def pd(plugin, tmp_path):
    store = SharedStore(tmp_path / "audit.duckdb")
    prefill, decode = Node("prefill", checksum=True), Node("decode", num_pages=12, checksum=True)
    config = plugin.config
    plugin.config = dataclasses.replace(config, node="sg-prefill")  # two nodes, two pools
    try:
        sessions = {"prefill": plugin.start(prefill.scheduler, sink=store)}
    finally:
        plugin.config = config
    sessions["decode"] = plugin.start(decode.scheduler, sink=store)
    tm = tokenizer("decode")
    sessions["http"] = plugin.start_frontend(tm, sink=store)
    plugin.session = None
    done = []

    def close():
        plugin.session = plugin.frontend = None
        if not done:
            done.append(True)
            for s in sessions.values():
                s.resolver.drain()
                assert s.recorder.flush(30)
                assert s.resolver.failures == {}
                s.close()
            store.store.close()

    yield plugin, sessions, prefill, decode, tmp_path / "audit.duckdb", close, tm
    close()


def _on(plugin, session):
    session.resolver.drain()
    plugin.session = session


def _serve_a(plugin, sessions, pnode, dnode, tm, mgr):
    prompt = list(range(100, 100 + PROMPT))
    _on(plugin, sessions["decode"])
    ra, pages = reserve(dnode, "A", 101, prompt)
    _on(plugin, sessions["prefill"])
    prefill_request(pnode, "A", 101, prompt, mgr, pages)
    _on(plugin, sessions["decode"])
    commit(dnode, pnode, ra)
    decode_step(dnode, ra)
    finish(dnode, ra, streamer())
    assert respond(tm, ra) == 200
    return pages


def metadata_only(pnode, room):
    """Prefill without the plugin sends U's metadata (room, first token) and no KV chunk: 0 tokens sent."""
    from kvtrail.serving.sglang.transfer import SLOT_TAG

    r = req("U", [0], room)
    r.output_ids.append(7)
    r.metadata_buffer_index = 0
    pnode.metadata.set_buf(r)  # SGLang's own slot fill
    pnode.metadata.cached_tokens[0][SLOT_TAG] = 0  # what a prefill without the plugin leaves in the spare slot


def _judge(db):
    from kvtrail.forensics import ask_affected, open_store
    from kvtrail.forensics.replay.engine import replay_store
    from kvtrail.forensics.sql.engine import sql_findings

    con = open_store(db)
    try:
        found = replay_store(con)
        assert sql_findings(con) == found  # both engines, field for field
        return found, ask_affected(con)
    finally:
        con.close()


def test_the_unwritten_commit_is_unverified_and_flagged_by_both_engines(pd):
    from kvtrail.forensics import NEVER_WRITTEN

    plugin, sessions, pnode, dnode, db, close, tm = pd
    a_pages = _serve_a(plugin, sessions, pnode, dnode, tm, FakeMooncake())
    _on(plugin, sessions["decode"])
    ru, u_pages = reserve(dnode, "U", 404, list(range(500, 500 + PROMPT)))
    assert set(a_pages) <= set(u_pages.tolist())  # lowest-first reuse: U gets A's pages
    metadata_only(pnode, 404)
    commit(dnode, pnode, ru)  # SGLang checks the room (it matches) and commits; no KV of U's room came
    assert type(ru.finished_reason).__name__ != "FINISH_ABORT"  # SGLang committed it
    decode_step(dnode, ru)
    finish(dnode, ru, streamer())
    assert respond(tm, ru) == 200
    close()

    events = stored_events(db)
    [got] = [e for e in events if e["kind"] == "transfer_received" and e["request"]["request_id"] == "U"]
    assert got["status"] == "unverified" and got["num_tokens"] == 0 and got["pages"] == u_pages.tolist()
    assert not [e for e in events if e["kind"] == "kv_written" and e["request"]["request_id"] == "U"]
    assert not [e for e in events if e["kind"] == "transfer_sent" and e["request"]["request_id"] == "U"]

    found, affected = _judge(db)
    by = {(f.code, f.request_id): f for f in found if f.code != "F8"}
    assert set(by) == {("F1", "U"), ("F2", "U")}, found
    f1 = by["F1", "U"]
    assert f1.victim_request_ids == (None,) and set(f1.pages) == set(u_pages.tolist())
    assert "decode could not verify" in f1.detail
    assert "received 0 tokens" in by["F2", "U"].detail and "unverified" in by["F2", "U"].detail
    [row] = affected.rows.filter(affected.rows["request_id"] == "U").iter_rows(named=True)
    assert row["victim_tenants"] == [NEVER_WRITTEN]
    assert any(
        "unverified landings" in n and "(no prefill record) -> sg-node: 1 transfer(s), 10 page(s)" in n
        for n in affected.notes
    ), affected.notes


def test_enforcement_refuses_a_commit_it_cannot_verify(pd):
    plugin, sessions, pnode, dnode, db, close, tm = pd
    plugin.config = dataclasses.replace(plugin.config, enforce_length=True)
    try:
        _serve_a(plugin, sessions, pnode, dnode, tm, FakeMooncake())
        _on(plugin, sessions["decode"])
        ru, _ = reserve(dnode, "U", 405, list(range(PROMPT)))
        metadata_only(pnode, 405)
        commit(dnode, pnode, ru)
        assert type(ru.finished_reason).__name__ == "FINISH_ABORT"
        assert ru.finished_reason.to_json()["status_code"] == 500
        assert "no transfer metadata" in ru.finished_reason.to_json()["message"]
    finally:
        plugin.config = dataclasses.replace(plugin.config, enforce_length=False)
    close()
    [got] = [e for e in stored_events(db) if e["kind"] == "transfer_received" and e["request"]["request_id"] == "U"]
    assert got["status"] == "mismatch" and got["num_tokens"] == 0


def test_a_matching_checksum_proves_a_landing_the_slot_could_not(pd, monkeypatch):
    """Prefill ran without the plugin's slot (its tag overwritten), the pages landed; SGLang's checksum matches:
    the second receipt covers the digested tokens and records the transfer's write, and nothing is flagged."""
    from kvtrail.serving.sglang.transfer import SLOT_TAG

    plugin, sessions, pnode, dnode, db, close, tm = pd
    computer = checksum_computer(dnode, monkeypatch)
    mgr = FakeMooncake()
    prompt = list(range(200, 200 + PROMPT))
    _on(plugin, sessions["decode"])
    rv, v_pages = reserve(dnode, "V", 606, prompt)
    _on(plugin, sessions["prefill"])
    _, sent = prefill_request(pnode, "V", 606, prompt, mgr, v_pages, digest="bytes")
    pnode.metadata.cached_tokens[0][SLOT_TAG] = 0  # as a prefill without the plugin leaves it
    land(pnode, dnode, sent, v_pages)
    _on(plugin, sessions["decode"])
    commit(dnode, pnode, rv, computer=computer)
    assert verify(dnode, [rv], computer) == [rv]  # SGLang's own check passed
    decode_step(dnode, rv)
    finish(dnode, rv, streamer())
    assert respond(tm, rv) == 200
    close()

    events = stored_events(db)
    receipts = [e for e in events if e["kind"] == "transfer_received" and e["request"]["request_id"] == "V"]
    assert [(e["status"], e["num_tokens"]) for e in receipts] == [("unverified", 0), ("ok", PROMPT)]
    [wrote] = [
        e
        for e in events
        if e["kind"] == "kv_written" and e["request"]["request_id"] == "V" and e["producer"]["role"] == "decode"
    ]
    assert wrote["source"] == "transfer_in" and wrote["pages"] == v_pages.tolist()
    found, _ = _judge(db)
    assert [f for f in found if f.code != "F8"] == []
