"""A real PD pair on CPU (slow): ``launch_server`` prefill and decode, Mooncake over loopback TCP, kvtrail recording
each node into its own store. The client talks to both servers as SGLang's mini load balancer did (the same body,
with ``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room``, to each). Prefill's pool is smaller than the
context, as in the incident: on 0.5.23 a prompt over prefill's ``max_req_input_len`` is refused before transfer.
Mooncake listens on 0.0.0.0 on ports of its own choosing; the traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import signal
import threading
import time
from importlib.metadata import version

import pytest

from tests.conftest import stored_events
from tests.sglang.realserver import PD_ENV, PD_FLAGS, Server, check_shims, free_port

NEWEST = tuple(int(x) for x in version("sglang").split(".")[:3]) >= (0, 5, 23)
pytestmark = [pytest.mark.slow]
TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    from tests.sglang.tinymodel import make

    check_shims()
    base = tmp_path_factory.mktemp("pd")
    model = make(base / "model")
    bootstrap = free_port()
    prefill = Server(
        model,
        base / "prefill.duckdb",
        "pd-prefill",
        base / "prefill.log",
        *PD_FLAGS,
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-bootstrap-port",
        str(bootstrap),
        "--max-total-tokens",
        "2048",
        env=PD_ENV,
    )
    decode = Server(
        model,
        base / "decode.duckdb",
        "pd-decode",
        base / "decode.log",
        *PD_FLAGS,
        "--disaggregation-mode",
        "decode",
        "--disaggregation-decode-retraction-backup",
        "cpu_tensor",
        "--max-total-tokens",
        "4096",
        env=PD_ENV,
    )
    try:
        for s in (prefill, decode):
            s.wait_ready()
            TIMINGS[f"{s.node}_ready_s"] = s.ready_s or 0.0
        yield prefill, decode, bootstrap
    finally:
        for s in (prefill, decode):
            if s.proc.poll() is None:
                TIMINGS[f"{s.node}_stop_s"] = s.stop(signal.SIGTERM)
        print(f"real PD timings: {TIMINGS}")


def both(prefill, decode, bootstrap, room, text, tenant, decode_timeout=120.0, rid=None):
    """The request to prefill and decode at once, as a PD load balancer sends it; (prefill's, decode's) answers.
    A balancer answers prefill's error and hangs up on decode: ``decode_timeout`` bounds decode's wait."""
    more = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap, "bootstrap_room": room}
    if rid is not None:  # one request id on both nodes (a router gives each its own; joining them is open)
        more["rid"] = rid
    out: dict[str, tuple[int, dict]] = {}
    t = threading.Thread(target=lambda: out.__setitem__("p", prefill.generate(text, tenant, **more)))
    t.start()
    out["d"] = decode.generate(text, tenant, timeout=decode_timeout, **more)
    t.join(180)
    return out["p"], out["d"]


ROUTED: dict[str, object] = {}  # what the 0.5.23 test leaves for the judgement that needs forensics' room join


def _router_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang_router") is not None


@pytest.mark.skipif(not NEWEST, reason="0.5.23's door")
def test_pd_on_0_5_23_serves_and_refuses_the_over_long_prompt_before_transfer(pd, tmp_path):
    """The direct client and SGLang's router in front (several rooms), with health checks on (the router's, every
    2 s, and /health on each server): served requests are sent and land ok, the over-long prompt is refused at
    prefill's door before any transfer, and SGLang's health checks (fake bootstrap host, room 0) are recorded with
    no transfer id."""
    from tests.sglang.realserver import Router, get

    if not _router_available():
        pytest.skip("sglang_router is not installed in this environment: the router part needs it")
    prefill, decode, bootstrap = pd
    router = Router(prefill, bootstrap, decode, tmp_path / "router.log")
    try:
        router.wait_ready()
        rooms = {}
        for i, tenant in enumerate(("tenant-a", "tenant-b")):
            (ps, pb), (ds, db) = both(prefill, decode, bootstrap, 1000 + i, f"the tenant asked {i} " * 8, tenant)
            assert ps == 200 and ds == 200, (pb, db)
            rooms[1000 + i] = (pb["meta_info"]["id"], db["meta_info"]["id"])
        routed = []
        for i, tenant in enumerate(("tenant-a", "tenant-b", "tenant-c")):
            status, body = router.generate(f"through the router {i} " * 6, tenant)
            assert status == 200, (body, router.tail())
            routed.append((tenant, body))
        assert get(prefill.url("/health")) == 200 and get(decode.url("/health")) == 200  # SGLang's health generation
        long_text = (
            "kv cache pages move " * 700
        )  # over prefill's max_req_input_len (2048-token pool), under the context
        (ps, pb), (ds, db) = both(prefill, decode, bootstrap, 2000, long_text, "tenant-c", decode_timeout=10)
        assert ps == 400, pb  # 0.5.23 refuses it at prefill's door
        assert ds != 200, (
            db
        )  # decode does not serve it (it waits for a transfer that never starts; the client hangs up)
        time.sleep(3.0)  # at least one more round of the router's health checks
    finally:
        router.stop()
    time.sleep(1.0)
    TIMINGS["prefill_stop_s"] = prefill.stop(signal.SIGTERM)
    TIMINGS["decode_stop_s"] = decode.stop(signal.SIGTERM)
    p_events, d_events = stored_events(prefill.db), stored_events(decode.db)
    sent = {e["request"]["transfer_id"] for e in p_events if e["kind"] == "transfer_sent"}
    got = {e["request"]["transfer_id"]: e for e in d_events if e["kind"] == "transfer_received"}
    for room in rooms:
        assert room in sent and got[room]["status"] == "ok", (room, sorted(sent), got.get(room))
    assert 2000 not in sent  # refused before transfer
    assert not [e for e in p_events + d_events if e["kind"] == "recorder_gap"]
    # the router's requests: each one's room was sent by prefill and landed ok on decode, under the tenant
    d_ids = {e["request"]["request_id"]: e["request"] for e in d_events if e["kind"] == "response_sent"}
    routed_rooms = set()
    for tenant, body in routed:
        ref = d_ids.get(body["meta_info"]["id"])
        assert ref is not None and ref.get("transfer_id") is not None, (body["meta_info"]["id"], sorted(d_ids))
        room = ref["transfer_id"]
        assert room in sent and got[room]["status"] == "ok", (room, sorted(sent))
        assert got[room]["request"]["tenant_id"] == tenant
        routed_rooms.add(room)
    assert len(routed_rooms) == len(routed)  # one room per request
    # SGLang's health checks ran on both servers and carry no transfer id: room 0 is nobody's transfer
    checks = {
        node: {
            e["request"]["request_id"]
            for e in events
            if (e.get("request") or {}).get("request_id", "").startswith("HEALTH_CHECK")
        }
        for node, events in (("prefill", p_events), ("decode", d_events))
    }
    assert checks["prefill"] and checks["decode"], checks
    for e in p_events + d_events:
        req = e.get("request") or {}
        assert req.get("transfer_id") != 0, e
        if req.get("request_id", "").startswith("HEALTH_CHECK"):
            assert "transfer_id" not in req and not e["kind"].startswith("transfer_"), e
    ROUTED.update(prefill=prefill.db, decode=decode.db, rooms=set(rooms) | routed_rooms)


@pytest.mark.skipif(not NEWEST, reason="0.5.23's door")
def test_pd_on_0_5_23_one_room_is_one_request_and_nothing_is_suspect(tmp_path):
    """The record of the test above (router, direct client, health checks), merged and judged: no finding, and no
    warning that the producer's ids are suspect (each room's two request ids are one request's)."""
    from kvtrail.audit.export import export_parquet, import_parquet
    from kvtrail.forensics import ask_findings, open_store

    if not ROUTED:
        pytest.skip("the 0.5.23 PD test did not leave its record (it failed or was skipped)")
    export_parquet(ROUTED["prefill"], tmp_path / "prefill-export")
    import_parquet(tmp_path / "prefill-export", ROUTED["decode"])
    con = open_store(ROUTED["decode"])
    try:
        answer = ask_findings(con)
    finally:
        con.close()
    assert not [w for w in answer.warnings if "suspect" in w], answer.warnings
    assert [(f.code, f.request_id) for f in answer.found if f.code != "F8"] == []


@pytest.mark.skipif(NEWEST, reason="the incident's release")
def test_pd_on_0_5_19_serves_the_over_long_prompt_and_the_record_is_judged_f4_f2_f1(pd, tmp_path):
    from kvtrail.audit.export import export_parquet, import_parquet
    from kvtrail.forensics import ask_findings, open_store

    prefill, decode, bootstrap = pd
    for i, tenant in enumerate(("tenant-a", "tenant-b")):
        (ps, pb), (ds, db) = both(
            prefill, decode, bootstrap, 1000 + i, f"the tenant asked {i} " * 8, tenant, rid=f"r{i}"
        )
        assert ps == 200 and ds == 200, (pb, db)
    long_text = "kv cache pages move " * 700  # over prefill's max_req_input_len (2048-token pool), under the context
    (ps, pb), (ds, db) = both(prefill, decode, bootstrap, 2000, long_text, "tenant-c", rid="long")
    assert ps == 200 and pb["meta_info"]["prompt_tokens"] == 1, pb  # 0.5.19: the placeholder was prefilled and sent
    assert ds == 200 and db["meta_info"]["prompt_tokens"] > 2042, db  # and decode served the whole prompt
    time.sleep(1.0)
    TIMINGS["prefill_stop_s"] = prefill.stop(signal.SIGTERM)
    TIMINGS["decode_stop_s"] = decode.stop(signal.SIGTERM)
    for s in (prefill, decode):
        assert not [e for e in stored_events(s.db) if e["kind"] == "recorder_gap"], s.node
    export_parquet(prefill.db, tmp_path / "prefill-export")
    import_parquet(tmp_path / "prefill-export", decode.db)  # one record of both nodes
    con = open_store(decode.db)
    try:
        found = ask_findings(con).found
    finally:
        con.close()
    per_request = {(f.code, f.request_id) for f in found if f.request_id is not None}
    assert {c for c, _ in per_request} >= {"F1", "F2", "F4"} and {r for _, r in per_request} == {"long"}, per_request
