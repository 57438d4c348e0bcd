"""A prefill -> decode incident that gives every panel of the Grafana dashboard something to show: a prefill pool
smaller than its context, a transfer that sent 1 of 8 pages (F2, and the foreign reads it leaves, F1), a digest
mismatch (F3), transfers longer than decode's release timeout (F11), aborts mid-transfer, a recorder that
dropped events, a producer with a sequence hole and a decode node that declares a mode it does not audit."""

from __future__ import annotations

from tests.forensics.test_replay import Timeline, pd_request

CLUSTER = "c1"  # tests.conftest.producer's default


def incident_events() -> list[dict]:
    tl = Timeline()
    tl.node("p", "prefill", pool_pages=8, context_tokens=1024)  # 128 tokens < 1024
    tl.add("p", "recorder_started", flush_interval_ns=10**9)
    tl.node("d", "decode")
    tl.add(
        "d",
        "node_config",
        pool_tokens=512,
        pool_pages=32,
        page_size=16,
        context_tokens=512,
        release_timeout_ns=1,
        config_source="sglang-plugin; hooks all patched; not audited: HiCache load-back and write-back allocations",
    )
    tl.node("router", "router")
    pd_request(tl, "r1", 42, [1], list(range(1, 9)), 120, sent_tokens=1, sent_pages=1)
    pd_request(tl, "r2", 43, [2], [12], 10, digest=5, received_digest=6, status="mismatch")
    tl.add("d", "request_aborted", "r9", stage="transfer", abort_reason="client disconnected", http_status=499)
    tl.add("p", "recorder_gap", dropped_events=3, gap_reason="buffer_full")
    tl.seqs["d"] += 2  # two events of decode never arrive, and no gap event says so
    tl.add("d", "request_aborted", "r8", stage="transfer", abort_reason="transfer timed out", http_status=504)
    return tl.events
