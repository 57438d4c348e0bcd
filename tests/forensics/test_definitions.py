"""The clarified definitions of the findings, on hand-built histories, through both engines and the answers.

Each test is a history the mission brief's definitions decide and that kvtrail once judged wrongly: the
direction of a late write (the writer is a source, its reader the recipient), F4 needs output, F2
counts what landed whatever the receipt's status, a transfer id is no key on its own, and a page
listed twice in one allocation is a finding rather than a rejected batch.
"""

from __future__ import annotations

from kvtrail.audit.batch import from_dicts
from kvtrail.forensics import Window, ask_affected, ask_exposure, ask_findings, ask_node_configurations
from kvtrail.forensics.options import ReportOptions
from kvtrail.forensics.replay.engine import replay_store
from kvtrail.forensics.sql.engine import sql_findings
from kvtrail.report.build import build_report
from tests.conftest import T0
from tests.forensics.test_replay import Timeline, pd_request, pd_timeline


def judged(store, tl):
    """Both engines' findings of the timeline's events (asserted equal, detail and severity included)."""
    store.append(from_dicts(tl.events))
    replay, sql = replay_store(store.con), sql_findings(store.con)
    assert sql == replay
    return replay


def producer_id(store, node):
    return store.con.execute("SELECT producer_id FROM producers WHERE node = ?", [node]).fetchone()[0]


def late_write_history(r_writes_first: bool, r_pages_written=(1, 2)):
    """W's transfer is in flight when W is aborted; decode frees W's pages at once; R gets them; W's KV
    lands after (or before) R's own write; R reads and is served."""
    tl = Timeline()
    tl.tenant_of.update(w="tenant-w", r="tenant-r")
    tl.node("d")
    tl.node("router", "router")
    tl.alloc("d", "w", [1, 2], "decode_reservation")
    tl.add("d", "request_aborted", "w", stage="transfer", abort_reason="client_disconnected", http_status=499)
    tl.free("d", "w", [1, 2], "abort")
    tl.add("router", "response_sent", "w", http_status=499, prompt_tokens=30, completion_tokens=0, latency_ns=5)
    tl.alloc("d", "r", [1, 2], "decode_reservation")
    if r_writes_first:
        tl.write("d", "r", list(r_pages_written), source="transfer_in")
        tl.write("d", "w", [1, 2], source="transfer_in")  # the RDMA write posted before the abort lands now
    else:
        tl.write("d", "w", [1, 2], source="transfer_in")
        tl.write("d", "r", list(r_pages_written), source="transfer_in")
    tl.read("d", "r", [1, 2])
    tl.add("router", "response_sent", "r", http_status=200, prompt_tokens=30, completion_tokens=7, latency_ns=9)
    return tl


def test_late_writer_is_a_source_and_its_reader_the_recipient(mem_store):
    store = mem_store
    found = judged(store, late_write_history(r_writes_first=True))
    assert [(f.code, f.request_id, f.victim_request_ids, f.pages) for f in found] == [
        ("F7", "w", ("r",), (1, 2)),
        ("F1", "r", ("w",), (1, 2)),
    ]
    f7, f1 = found
    assert "source" in f7.detail
    # R's own KV was there first: the late bytes corrupted it, and R's finding says so
    assert f1.victim_tenant_ids == ("tenant-w",) and "its own KV was corrupted" in f1.detail
    assert "2 page(s) written late by w" in f1.detail

    affected = ask_affected(store.con).rows
    assert affected.select("request_id", "tenant_id", "http_status", "completion_tokens").rows() == [
        ("r", "tenant-r", 200, 7)
    ]
    row = affected.row(0, named=True)
    assert (row["codes"], row["victim_tenants"], row["victim_requests"]) == (["F1"], ["tenant-w"], ["w"])

    exposure = ask_exposure(store.con).rows
    assert exposure.select("recipient_tenant", "victim_tenant", "responses", "pages").rows() == [
        ("tenant-r", "tenant-w", 1, 2)
    ]

    report = build_report(store.con, ReportOptions(T0 - 10**9, T0 + 10**9))
    counts = report.counts
    assert (counts["affected_responses"], counts["recipient_tenants"], counts["victim_tenants"]) == (1, 1, 1)
    assert report.exposed["victim_tenant"].to_list() == ["tenant-w"]


def test_late_bytes_overwritten_by_the_readers_own_write_expose_nobody(mem_store):
    store = mem_store
    found = judged(store, late_write_history(r_writes_first=False))
    assert [(f.code, f.request_id) for f in found] == [("F7", "w")]  # a source with no reader
    assert ask_affected(store.con).rows.is_empty()
    assert ask_exposure(store.con).rows.is_empty()


def test_late_bytes_on_a_page_the_reader_never_wrote_are_read_but_did_not_corrupt_its_kv(mem_store):
    store = mem_store
    found = judged(store, late_write_history(r_writes_first=False, r_pages_written=(1,)))
    f1 = [f for f in found if f.code == "F1"]
    assert [(f.request_id, f.victim_request_ids, f.pages) for f in f1] == [("r", ("w",), (2,))]
    assert "1 page(s) written late by w" in f1[0].detail and "corrupted" not in f1[0].detail


def test_f4_needs_output_and_an_empty_2xx_after_an_abort_stays_visible(mem_store):
    store = mem_store
    tl = pd_timeline()
    tl.add("p", "request_aborted", "r1", 7, stage="prefill_queue", abort_reason="input too long", http_status=400)
    tl.add(
        "router",
        "response_sent",
        "r1",
        7,
        http_status=200,
        prompt_tokens=900,
        completion_tokens=0,
        latency_ns=10,
        finish_reason="length",
    )
    tl.add("p", "request_aborted", "r2", 8, stage="prefill_queue", abort_reason="input too long", http_status=400)
    tl.add("router", "response_sent", "r2", 8, http_status=200, prompt_tokens=900, completion_tokens=12, latency_ns=10)
    assert [(f.code, f.request_id) for f in judged(store, tl)] == [("F4", "r2")]
    answer = ask_findings(store.con)
    assert answer.rows["request_id"].to_list() == ["r2"]
    (note,) = answer.notes
    assert "r1" in note and "no output after an abort" in note and "r2" not in note
    report = build_report(store.con, ReportOptions(T0 - 10**9, T0 + 10**9))
    assert report.empty_after_abort["request_id"].to_list() == ["r1"]
    assert report.counts["responses_2xx_empty_after_abort"] == 1 and report.counts["affected_responses"] == 0


def test_f2_counts_what_landed_on_a_failed_transfer_and_is_critical_when_served(mem_store):
    store = mem_store
    tl = pd_timeline()
    tl.add("d", "transfer_reserved", "r1", 5, pages=[1, 2, 3], num_tokens=40)
    tl.add("p", "transfer_sent", "r1", 5, pages=[1, 2, 3], dst_pages=[1, 2, 3], num_tokens=40, is_last_chunk=True)
    tl.add("d", "transfer_received", "r1", 5, pages=[1], num_tokens=16, status="failed")
    resp = tl.add(
        "router", "response_sent", "r1", 5, http_status=200, prompt_tokens=40, completion_tokens=3, latency_ns=10
    )
    tl.add("d", "transfer_reserved", "r2", 6, pages=[4, 5], num_tokens=20)
    tl.add("d", "transfer_received", "r2", 6, pages=[4], num_tokens=10, status="aborted")  # not served
    f2 = {f.request_id: f for f in judged(store, tl) if f.code == "F2"}
    assert set(f2) == {"r1", "r2"}
    assert f2["r1"].severity == "critical" and f2["r2"].severity == "high"
    assert "received 16 tokens" in f2["r1"].detail and "decode reported failed" in f2["r1"].detail
    assert "client got HTTP 200 with 3 completion tokens" in f2["r1"].detail
    assert (producer_id(store, "router"), resp["seq"]) in f2["r1"].evidence  # the response that served it
    assert "decode reported aborted" in f2["r2"].detail and "no 2xx response" in f2["r2"].detail


def test_a_transfer_id_shared_by_two_requests_joins_neither_with_the_other(mem_store):
    store = mem_store
    tl = pd_timeline()
    pd_request(tl, "r1", 9, [1], [10], 10)  # clean
    pd_request(tl, "r2", 9, [2], [12], 12, sent_tokens=11)  # same transfer id, one token short
    for rid in ("r1", "r2"):
        tl.add("router", "response_sent", rid, 9, http_status=200, prompt_tokens=20, completion_tokens=2, latency_ns=10)
    found = judged(store, tl)
    assert [(f.code, f.request_id, f.pages) for f in found] == [("F2", "r2", (12,))]
    assert "reserved 12 tokens/1 pages; sent 11 tokens/1 pages" in found[0].detail
    # every answer says that the record itself is suspect
    for answer in (
        ask_findings(store.con),
        ask_affected(store.con),
        ask_exposure(store.con),
        ask_node_configurations(store.con),
    ):
        (warning,) = answer.warnings
        assert "1 transfer id(s) carried by more than one request" in warning and "9: r1, r2" in warning
    report = build_report(store.con, ReportOptions(T0 - 10**9, T0 + 10**9))
    assert report.counts["shared_transfer_ids"] == 1 and report.warnings
    # a window that holds only one of them has nothing to warn about
    first_r2 = next(e["wall_ns"] for e in tl.events if e.get("request", {}).get("request_id") == "r2")
    assert ask_findings(store.con, Window(to_ns=first_r2 - 1)).warnings == ()


def test_a_page_listed_twice_in_one_allocation_is_an_allocator_finding(mem_store):
    store = mem_store
    tl = Timeline()
    tl.node("d")
    alloc = tl.alloc("d", "r1", [4, 1, 2, 1, 4, 6])
    tl.write("d", "r1", [1, 2, 4, 6])
    tl.read("d", "r1", [1, 2, 4, 6])
    found = judged(store, tl)  # ingested whole: the evidence of the bug is kept
    assert [(f.code, f.request_id, f.victim_request_ids, f.pages, f.evidence) for f in found] == [
        ("F6", "r1", ("r1",), (4, 1), ((producer_id(store, "d"), alloc["seq"]),))
    ]
    assert "listed more than once" in found[0].detail
