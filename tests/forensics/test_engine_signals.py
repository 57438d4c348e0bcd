"""The engine's own signals on synthetic histories: beside the findings they corroborate, on their own where no
rule fired, never changing a finding (both engines still agree on the findings)."""

from __future__ import annotations

import pytest

from kvtrail.audit.batch import from_dicts
from kvtrail.forensics import ask_findings
from kvtrail.forensics.engine_signals import SignalPolicy, engine_signals
from kvtrail.forensics.replay.engine import replay_store
from kvtrail.forensics.sql.engine import sql_findings
from tests.forensics.test_replay import Timeline

DIGEST = 0x5A17C0DE


def pid(store, node):
    return store.con.execute("SELECT producer_id FROM producers WHERE node = ?", [node]).fetchone()[0]


def judged(store, tl):
    store.append(from_dicts(tl.events))
    replay = replay_store(store.con)
    assert sql_findings(store.con) == replay
    return replay


def transfer(
    tl, *, reserved, sent, landed, sent_digest_tokens, recv_digest_tokens, recv_digest=DIGEST, prefill_rid="b"
):
    """Decode reserves ``reserved`` tokens (3 pages) for b, prefill sends ``sent``, decode's checksum receipt
    says ``landed`` with the digests and the tokens each covers; b reads its pages, the client gets 200.
    ``prefill_rid``: the id prefill records the request under (SGLang's PD: its own, the room joins them)."""
    tl.node("p", "prefill")
    tl.node("d", "decode")
    tl.node("router", "router")
    tl.add("d", "transfer_reserved", "b", 77, pages=[1, 2, 3], num_tokens=reserved)
    tl.alloc("d", "b", [1, 2, 3], "decode_reservation")
    tl.alloc("p", prefill_rid, [9, 10, 11])
    tl.write("p", prefill_rid, [9, 10, 11])
    sent_ev = tl.add(
        "p",
        "transfer_sent",
        prefill_rid,
        77,
        pages=[9, 10, 11],
        dst_pages=[1, 2, 3],
        num_tokens=sent,
        is_last_chunk=True,
        digest=DIGEST,
        digest_algo="adler32",
        digest_tokens=sent_digest_tokens,
    )
    tl.write("d", "b", [1, 2, 3], source="transfer_in")
    recv = tl.add(
        "d",
        "transfer_received",
        "b",
        77,
        pages=[1, 2, 3],
        num_tokens=landed,
        status="ok",
        digest=recv_digest,
        digest_algo="adler32",
        digest_tokens=recv_digest_tokens,
    )
    tl.read("d", "b", [1, 2, 3])
    tl.add("router", "response_sent", "b", http_status=200, prompt_tokens=40, completion_tokens=5, latency_ns=9)
    return sent_ev, recv


def test_a_matching_digest_over_fewer_tokens_than_reserved_is_not_clean(mem_store):
    """No rule fires (lengths agree, digests match), yet the digests cover 16 of the 40 reserved tokens: the
    signal stands on its own and says what the match proves."""
    tl = Timeline()
    sent, recv = transfer(tl, reserved=40, sent=40, landed=40, sent_digest_tokens=16, recv_digest_tokens=16)
    found = judged(mem_store, tl)
    assert not [f for f in found if f.request_id == "b"], found  # the F-rules are unchanged
    sig = engine_signals(mem_store.con)
    assert sig["signal"].to_list() == ["digest_tokens_differ"] and sig["request_id"].to_list() == ["b"]
    detail = sig["detail"][0]
    assert "reserved 40 tokens" in detail and "covers 16 tokens, decode's 16 tokens" in detail
    assert "the digests match: they prove the digested tokens only" in detail
    evidence = sig["evidence"][0].to_list()
    assert [pid(mem_store, "p"), sent["seq"]] in evidence and [pid(mem_store, "d"), recv["seq"]] in evidence
    [note] = [n for n in ask_findings(mem_store.con).notes if "digest_tokens_differ" in n]
    assert "no finding fired for 1 (a symptom to investigate): b:" in note


def test_a_rooms_prefill_digest_under_its_own_id_is_compared_with_decodes_reservation(mem_store):
    """SGLang's PD: prefill names the request by its own id, decode by another, one bootstrap room. Prefill's
    digest covers 16 of the 40 tokens decode reserved: the signal names decode's request, as the F-rules do."""
    tl = Timeline()
    sent, _ = transfer(
        tl, reserved=40, sent=40, landed=40, sent_digest_tokens=16, recv_digest_tokens=40, prefill_rid="pre-b"
    )
    judged(mem_store, tl)
    sig = engine_signals(mem_store.con)
    assert sig["signal"].to_list() == ["digest_tokens_differ"] and sig["request_id"].to_list() == ["b"]
    assert "prefill's digest covers 16 tokens, decode's 40 tokens" in sig["detail"][0]
    assert [pid(mem_store, "p"), sent["seq"]] in sig["evidence"][0].to_list()


def test_digested_tokens_that_differ_corroborate_f2_and_f3(mem_store):
    tl = Timeline()
    transfer(tl, reserved=40, sent=16, landed=40, sent_digest_tokens=16, recv_digest_tokens=40, recv_digest=7)
    found = judged(mem_store, tl)
    assert {f.code for f in found if f.request_id == "b"} >= {"F2", "F3"}
    [note] = [n for n in ask_findings(mem_store.con).notes if "digest_tokens_differ" in n]
    assert "beside findings: b (F2/F3)" in note and "the digests differ" in note


def test_digests_over_the_reserved_tokens_are_no_signal(mem_store):
    tl = Timeline()
    transfer(tl, reserved=40, sent=40, landed=40, sent_digest_tokens=40, recv_digest_tokens=40)
    assert judged(mem_store, tl) == []
    assert engine_signals(mem_store.con).is_empty()
    assert not [n for n in ask_findings(mem_store.con).notes if n.startswith("engine signal")]


def canary(tl, node, page, slot, tag="HEAD_K_FULL"):
    return tl.add(
        node,
        "kv_canary_violation",
        pages=[page],
        canary_slot=slot,
        canary_tag=tag,
        canary_reason="verify_chain_hash+verify_position",
        canary_position=slot % 16,
    )


def test_a_canary_violation_names_the_request_holding_its_page_beside_its_f1(mem_store):
    tl = Timeline()
    tl.node("d", "decode")
    tl.alloc("d", "a", [1, 2], "decode_reservation")
    tl.write("d", "a", [1, 2], source="transfer_in")
    tl.free("d", "a", [1, 2])
    taken = tl.alloc("d", "b", [1, 2], "decode_reservation")  # b reads a's stale pages: F1
    tl.read("d", "b", [1, 2])
    v1 = canary(tl, "d", 2, 2 * 16 + 3)
    tl.free("d", "b", [1, 2])
    v2 = canary(tl, "d", 2, 2 * 16 + 5)  # the page is free now: nobody held it
    found = judged(mem_store, tl)
    assert {(f.code, f.request_id) for f in found} == {("F1", "b")}  # the canary adds no finding
    sig = engine_signals(mem_store.con)
    assert sig["request_id"].to_list() == ["b", None]
    d = pid(mem_store, "d")
    assert sig["evidence"].to_list() == [[[d, v1["seq"]], [d, taken["seq"]]], [[d, v2["seq"]]]]
    assert "page 2 slot 35 position 3: HEAD_K_FULL verify_chain_hash+verify_position; held by b" in sig["detail"][0]
    [note] = [n for n in ask_findings(mem_store.con).notes if "kv_canary_violation" in n]
    assert "x2" in note and "beside findings: b (F1)" in note and "no finding fired for 1" in note
    only_d = engine_signals(mem_store.con, tenant_window("t-b"))
    assert only_d["request_id"].to_list() == ["b"]  # the tenant filter keeps the attributed one


def tenant_window(tenant):
    from kvtrail.forensics.window import Window

    return Window(tenant=tenant)


def test_acceptance_collapse_is_off_by_default_and_judged_with_a_threshold(mem_store):
    tl = Timeline()
    tl.node("d", "decode")
    for rid, steps, accepted, proposed in (
        ("good", 20, 50, 60),
        ("low", 20, 6, 60),
        ("short", 3, 0, 9),
        ("off", 0, 0, 0),
    ):
        spec = {"spec_verify_steps": steps, "spec_accepted_drafts": accepted, "spec_proposed_drafts": proposed}
        tl.add("d", "response_sent", rid, http_status=200, prompt_tokens=10, completion_tokens=40, latency_ns=9,
               **(spec if steps else {}))  # fmt: skip
    judged(mem_store, tl)
    assert engine_signals(mem_store.con).is_empty()
    on = SignalPolicy(spec_min_accept_rate=0.3, spec_min_verify_steps=8)
    sig = engine_signals(mem_store.con, policy=on)
    assert sig["request_id"].to_list() == ["low"]  # "short" has too few passes to judge
    assert "rate 0.10 (6/60 drafts) below 0.30; acceptance length 2.00 over 20 passes" in sig["detail"][0]
    notes = ask_findings(mem_store.con, signals=on).notes
    assert [n for n in notes if n.startswith("engine signal spec_acceptance_low x1: no finding fired for 1")]


@pytest.mark.parametrize("bad", [dict(spec_min_accept_rate=0.0), dict(spec_min_accept_rate=1.5),
                                 dict(spec_min_verify_steps=0)])  # fmt: skip
def test_signal_thresholds_name_the_field_they_refuse(bad):
    field = next(iter(bad))
    with pytest.raises(ValueError, match=field):
        SignalPolicy(**bad)


def test_a_lake_says_the_same_signal_notes_as_its_store(tmp_path):
    from kvtrail.audit.lake.export import export_lake
    from kvtrail.audit.store import AuditStore
    from kvtrail.forensics.lake.checkpointer import write_checkpoints
    from kvtrail.forensics.lake.questions import ask_lake_findings, open_lake

    tl = Timeline()
    transfer(tl, reserved=40, sent=40, landed=40, sent_digest_tokens=16, recv_digest_tokens=16)
    canary(tl, "d", 2, 2 * 16 + 1)
    db, lake_dir = tmp_path / "audit.duckdb", tmp_path / "lake"
    with AuditStore(db) as store:
        store.append(from_dicts(tl.events))
        want = ask_findings(store.con).notes
    export_lake(db, str(lake_dir), checkpoints=write_checkpoints)
    with open_lake(str(lake_dir)) as lake:
        got = ask_lake_findings(lake).notes
    assert [n for n in want if n.startswith("engine signal")] == [n for n in got if n.startswith("engine signal")]
    assert len([n for n in got if n.startswith("engine signal")]) == 2


def test_the_cli_turns_acceptance_collapse_on_with_a_threshold_and_refuses_a_bad_one(tmp_path, capsys):
    from kvtrail.audit.store import AuditStore
    from tests.conftest import run_cli

    tl = Timeline()
    tl.node("d", "decode")
    spec = {"spec_verify_steps": 20, "spec_accepted_drafts": 6, "spec_proposed_drafts": 60}
    tl.add("d", "response_sent", "low", http_status=200, prompt_tokens=10, completion_tokens=40, latency_ns=9, **spec)
    db = tmp_path / "audit.duckdb"
    with AuditStore(db) as store:
        store.append(from_dicts(tl.events))
    rc, out, err = run_cli(capsys, "forensics", "findings", "--db", str(db))
    assert rc == 0 and "spec_acceptance_low" not in "\n".join(out + err)  # off by default
    rc, out, err = run_cli(capsys, "forensics", "findings", "--db", str(db), "--spec-min-accept-rate", "0.3")
    assert rc == 0 and "engine signal spec_acceptance_low x1" in "\n".join(out + err), (out, err)
    rc, _, err = run_cli(capsys, "forensics", "findings", "--db", str(db), "--spec-min-accept-rate", "0")
    assert rc == 2 and "--spec-min-accept-rate" in "\n".join(err)
