"""An unclean end of a producer is a coverage gap in every answer, and what it leaves incomplete is judged so.

Prefill instance i1 dies with its transfer's send still in memory; decode saw the transfer break and
reported a mismatch. Without the send, that looks like a digest mismatch (F3), but the record is
incomplete, not the transfer: the answers withhold the transfer findings of the requests in flight and
name them, with the producer's end and its bound.
"""

from __future__ import annotations

from kvtrail.audit.batch import from_dicts
from kvtrail.audit.store import AuditStore
from kvtrail.forensics import Window, ask_affected, ask_findings
from kvtrail.forensics.options import ReportOptions
from kvtrail.forensics.replay.engine import replay_store
from kvtrail.forensics.sql.engine import sql_findings
from kvtrail.report.build import build_report
from tests.conftest import T0
from tests.forensics.test_replay import Timeline

FLUSH_NS = 1_000_000_000


def crashed_prefill(tl: Timeline, restart: bool = True) -> None:
    tl.node("p", "prefill", instance="i1")
    tl.node("d", "decode")
    tl.node("router", "router")
    for node in ("p", "d", "router"):
        tl.add(node, "recorder_started", flush_interval_ns=FLUSH_NS)
    # r0 completes before the crash: a real mismatch, judged as usual
    tl.add("d", "transfer_reserved", "r0", 40, pages=[1], num_tokens=10)
    tl.add(
        "p",
        "transfer_sent",
        "r0",
        40,
        pages=[1],
        dst_pages=[1],
        num_tokens=10,
        is_last_chunk=True,
        digest=5,
        digest_algo="adler32",
    )
    tl.add("d", "transfer_received", "r0", 40, pages=[1], num_tokens=10, status="ok", digest=6, digest_algo="adler32")
    tl.add("p", "request_received", "r1", 41, prompt_tokens=20)  # prefill's last stored event
    # prefill's transfer_sent of r1 was in memory when i1 died; decode saw the transfer break
    tl.add("d", "transfer_reserved", "r1", 41, pages=[2, 3], num_tokens=20)
    tl.add("d", "transfer_received", "r1", 41, pages=[2, 3], num_tokens=20, status="mismatch")
    if restart:
        tl.events[-1]["wall_ns"] = tl.events[-2]["wall_ns"] + 1  # in flight, inside the flush bound
        tl.node("p", "prefill", instance="i2")
        tl.add("p", "recorder_started", flush_interval_ns=FLUSH_NS)


def test_an_unclean_end_withholds_the_incomplete_transfer_findings_and_says_why(mem_store):
    tl = Timeline()
    crashed_prefill(tl)
    mem_store.append(from_dicts(tl.events))
    # both engines judge the record as it stands: two F3s
    for engine in (replay_store(mem_store.con), sql_findings(mem_store.con)):
        assert sorted(f.request_id for f in engine if f.code == "F3") == ["r0", "r1"]
    answer = ask_findings(mem_store.con)
    assert [(f["code"], f["request_id"]) for f in answer.rows.iter_rows(named=True)] == [("F3", "r0")]
    end, incomplete = answer.warnings
    assert "p producer" in end and "(instance i1): unclean end after seq" in end and "1 s after it" in end
    assert "1 request(s) were in flight" in incomplete and "(r1)" in incomplete and "(1 withheld)" in incomplete
    assert ask_affected(mem_store.con).warnings[0] == end  # every answer says so
    report = build_report(mem_store.con, ReportOptions(T0 - 10**9, T0 + 10**10))
    c = report.counts
    assert (c["unclean_ends"], c["incomplete_requests"], c["withheld_findings"]) == (1, 1, 1)
    assert report.findings.filter(report.findings["code"] == "F3")["request_id"].to_list() == ["r0"]


def test_a_window_before_the_end_and_a_producer_still_running_carry_no_warning(mem_store):
    tl = Timeline()
    crashed_prefill(tl)
    mem_store.append(from_dicts(tl.events))
    before = tl.events[3]["wall_ns"] - 1
    assert ask_findings(mem_store.con, Window(to_ns=before)).warnings == ()
    other = Timeline()
    crashed_prefill(other, restart=False)  # no later instance, no reopened store: still running
    with AuditStore(":memory:") as running:
        running.append(from_dicts(other.events))
        answer = ask_findings(running.con)
    assert answer.warnings == () and sorted(answer.rows["request_id"].to_list()) == ["r0", "r1"]
