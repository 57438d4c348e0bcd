"""The engine's own integrity signals, recorded through SGLang's real classes and shown by forensics: the KV
checksum's digested tokens on both roles, kv-canary violations from SGLang's reporter, speculative-decoding
acceptance per response from the meta_info SGLang computes."""

from __future__ import annotations

import functools
import types

import pytest
import torch

from tests.conftest import stored_events
from tests.sglang.conftest import SharedStore, on_node, start_node
from tests.sglang.pd import (
    checksum_computer,
    commit,
    land,
    prefill_request,
    reserve,
    respond,
    streamer,
    tokenizer,
    verify,
)
from tests.sglang.world import PAGE_SIZE, FakeMooncake, Node, req

PROMPT = 12  # 3 pages of 4


@pytest.fixture
def pd(checksum_pd):
    """The pair, whose ``close`` also checks every recorder flushed with no failure."""
    plugin, sessions, pnode, dnode, tm, db, close = checksum_pd
    return plugin, sessions, pnode, dnode, tm, db, functools.partial(close, check=True)


def _ask(db, **kw):
    from kvtrail.forensics import ask_findings, open_store

    con = open_store(db)
    try:
        return ask_findings(con, **kw)
    finally:
        con.close()


def _signals(db, **kw):
    from kvtrail.forensics import open_store
    from kvtrail.forensics.engine_signals import engine_signals

    con = open_store(db)
    try:
        return engine_signals(con, **kw)
    finally:
        con.close()


def test_both_roles_record_the_tokens_their_digest_covers(pd, monkeypatch):
    """A whole transfer's digests cover what decode reserved; the incident's placeholder digest covers 1 token on
    prefill while decode's covers the 32 it reserved: forensics names that beside the request's F2/F3."""
    plugin, (ps, ds, hs), pnode, dnode, tm, db, close = pd
    computer = checksum_computer(dnode, monkeypatch)
    for rid, room, n, placeholder in (("G", 11, PROMPT, False), ("B", 202, 32, True)):
        tokens = list(range(room * 100, room * 100 + n))
        on_node(plugin, ds)
        r, dst = reserve(dnode, rid, room, tokens)
        on_node(plugin, ps)
        _, src = prefill_request(pnode, rid, room, tokens, FakeMooncake(), dst, placeholder=placeholder, digest="bytes")
        land(pnode, dnode, src, dst)
        on_node(plugin, ds)
        commit(dnode, pnode, r, computer=computer)
        verify(dnode, [r], computer)
    close()
    events = stored_events(db)

    def one(kind, rid, **match):
        got = [
            e
            for e in events
            if e["kind"] == kind and e["request"]["request_id"] == rid and all(e.get(k) == v for k, v in match.items())
        ]
        assert len(got) == 1, got
        return got[0]

    for rid, reserved, sent_tokens in (("G", PROMPT, PROMPT), ("B", 32, 1)):
        assert one("transfer_reserved", rid)["num_tokens"] == reserved
        sent = one("transfer_sent", rid, is_last_chunk=True)
        assert sent["digest_tokens"] == sent_tokens and sent["digest"] is not None
        verdict = [e for e in events if e["kind"] == "transfer_received" and e["request"]["request_id"] == rid][-1]
        assert verdict["digest_tokens"] == reserved  # decode digests its whole reserved row
    commit_g = [e for e in events if e["kind"] == "transfer_received" and e["request"]["request_id"] == "G"][0]
    assert "digest_tokens" not in commit_g  # the commit's receipt carries no digest, so no digested tokens

    signals = _signals(db)
    assert signals["request_id"].to_list() == ["B"] and signals["signal"].to_list() == ["digest_tokens_differ"]
    [detail] = signals["detail"].to_list()
    assert "reserved 32 tokens" in detail and "prefill's digest covers 1 tokens" in detail
    answer = _ask(db)
    assert {f.code for f in answer.found if f.request_id == "B"} >= {"F2", "F3"}
    [note] = [n for n in answer.notes if n.startswith("engine signal digest_tokens_differ")]
    assert "beside findings: B (F2/F3)" in note and "no finding fired" not in note


def _reporter(mode):
    from sglang.srt.kv_canary.config import CanaryMode
    from sglang.srt.kv_canary.runner.violation_reporter import ViolationReporter
    from sglang.srt.kv_canary.state import ViolationLog

    log = ViolationLog.allocate(ring_capacity=8, device=torch.device("cpu"))
    state = types.SimpleNamespace(violation_log=log)  # the reporter reads only the violation log
    return ViolationReporter(config=types.SimpleNamespace(mode=CanaryMode(mode)), device_state=state), log


def _violate(log, tag, slot, position, bits):
    i = int(log.violation_write_index[0])
    log.violation_ring[i] = torch.tensor([int(tag), slot, position, 5, 0, 0x1234, 0x5678, int(bits)])
    log.violation_write_index[0] = i + 1


def test_canary_violations_are_recorded_on_their_page_and_attributed_to_its_holder(plugin, tmp_path, caplog):
    from sglang.kernels.ops.kv_canary.consts import FailReason
    from sglang.kernels.ops.kv_canary.verify import CanaryLaunchTag

    db = tmp_path / "audit.duckdb"
    store = SharedStore(db)
    dnode = Node("decode")
    ds = start_node(plugin, dnode.scheduler, store, "sg-decode")
    try:
        r, dst = reserve(dnode, "C", 31, list(range(3100, 3100 + PROMPT)))
        reporter, log = _reporter("log")
        chain = FailReason.VERIFY_CHAIN_HASH_MISMATCH | FailReason.VERIFY_POSITION_MISMATCH
        slot = int(dst[1]) * PAGE_SIZE + 2
        _violate(log, CanaryLaunchTag.HEAD_K_FULL, slot, 6, chain)
        _violate(log, CanaryLaunchTag.HEAD_K_SWA, 9, 1, chain)  # another pool's slot: not an audited page
        reporter.log_or_raise_violation(outer_step_counter=3)
        assert "kv_canary violation: launch_tag=HEAD_K_FULL" in caplog.text  # SGLang still logs it
        raising, rlog = _reporter("raise")
        _violate(rlog, CanaryLaunchTag.TAIL_K_FULL, 63 * PAGE_SIZE, 0, FailReason.VERIFY_POSITION_MISMATCH)
        with pytest.raises(RuntimeError, match="kv_canary violation"):  # raise mode: SGLang's error, unchanged
            raising.log_or_raise_violation(outer_step_counter=4)
        ds.resolver.drain()
        assert ds.recorder.flush(30) and ds.resolver.failures == {}
    finally:
        plugin.session = None
        ds.close()
        store.store.close()
    got = [e for e in stored_events(db) if e["kind"] == "kv_canary_violation"]
    assert [(e["pages"], e["canary_slot"], e["canary_tag"], e.get("canary_position")) for e in got] == [
        ([int(dst[1])], slot, "HEAD_K_FULL", 6),
        ([63], 63 * PAGE_SIZE, "TAIL_K_FULL", 0),
    ]
    assert got[0]["canary_reason"] == "verify_chain_hash+verify_position"
    assert "request" not in got[0]  # the engine names a slot, not a request

    signals = _signals(db)
    assert signals["request_id"].to_list() == ["C", None]  # page 63 was never allocated: no holder
    answer = _ask(db)
    [note] = [n for n in answer.notes if n.startswith("engine signal kv_canary_violation x2")]
    assert "no finding fired for 2" in note and f"page {int(dst[1])} slot {slot}" in note


def test_speculative_acceptance_per_response_from_sglangs_meta_info(plugin, tmp_path, monkeypatch):
    from sglang.srt.managers import tokenizer_manager
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    from kvtrail.forensics.engine_signals import SignalPolicy

    db = tmp_path / "audit.duckdb"
    store = SharedStore(db)
    tm = tokenizer("decode")
    sched = plugin.start(Node("decode").scheduler, sink=store)
    s = plugin.start_frontend(tm, sink=store)
    monkeypatch.setattr(tokenizer_manager, "get_spec", lambda: types.SimpleNamespace(speculative_num_draft_tokens=4))
    try:
        for rid, steps, correct, completion in (("fast", 10, 27, 37), ("slow", 10, 3, 13), ("plain", 0, 0, 5)):
            r = req(rid, list(range(10)), 70 + len(rid))
            r.finished_reason = FINISH_LENGTH(completion)
            r.output_ids.extend(range(completion))
            recv = types.SimpleNamespace(
                spec_verify_ct=[steps],
                spec_num_correct_drafts=[correct],
                completion_tokens=[completion],
                spec_correct_drafts_histogram=None,
            )
            meta: dict = {}
            tm._calculate_spec_decoding_metrics(meta, recv, 0)  # SGLang's own per-request figures
            assert respond(tm, r, extra_meta=meta) == 200
    finally:
        plugin.session = plugin.frontend = None
        s.close()
        sched.close()
        store.store.close()
    got = {e["request"]["request_id"]: e for e in stored_events(db) if e["kind"] == "response_sent"}
    assert (got["fast"]["spec_verify_steps"], got["fast"]["spec_accepted_drafts"]) == (10, 27)
    assert got["fast"]["spec_proposed_drafts"] == 30  # 10 passes x (4 draft tokens - 1)
    assert got["slow"]["spec_accepted_drafts"] == 3
    assert not {"spec_verify_steps", "spec_accepted_drafts", "spec_proposed_drafts"} & set(got["plain"])

    assert _signals(db).is_empty()  # off by default: acceptance varies too much to judge without a threshold
    on = SignalPolicy(spec_min_accept_rate=0.5, spec_min_verify_steps=5)
    flagged = _signals(db, policy=on)
    assert flagged["request_id"].to_list() == ["slow"]
    assert "rate 0.10 (3/30 drafts)" in flagged["detail"][0] and "length 1.30 over 10 passes" in flagged["detail"][0]
    assert any(n.startswith("engine signal spec_acceptance_low x1") for n in _ask(db, signals=on).notes)


def test_the_scheduler_records_the_counts_its_req_holds_where_it_records_the_response(plugin, tmp_path):
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    db = tmp_path / "audit.duckdb"
    s = plugin.start(Node("decode").scheduler, sink=str(db))  # a store file: the scheduler records responses
    try:
        assert s.records_responses
        done = []
        for rid, steps, correct in (("sp", 3, 4), ("none", 0, 0)):
            r = req(rid, list(range(10)), 90 + len(rid))
            r.finished_reason = FINISH_LENGTH(6)
            r.output_ids.extend(range(6))
            r.spec_verify_ct, r.spec_num_correct_drafts = steps, correct  # as SGLang's result processor counts
            done.append(r)
        streamer().stream_output(done, False)
    finally:
        plugin.session = None
        s.close()
    got = {e["request"]["request_id"]: e for e in stored_events(db) if e["kind"] == "response_sent"}
    assert (got["sp"]["spec_verify_steps"], got["sp"]["spec_accepted_drafts"]) == (3, 4)
    assert "spec_proposed_drafts" not in got["sp"]  # not on the Req: not recorded rather than guessed
    assert not {"spec_verify_steps", "spec_accepted_drafts"} & set(got["none"])
