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
from tests.sglang.realserver import Server, check_shims, free_port

NEWEST = tuple(int(x) for x in version("sglang").split(".")[:3]) >= (0, 5, 23)
pytestmark = [pytest.mark.slow]
PD_ENV = {"MC_FORCE_TCP": "1", "MC_LOG_LEVEL": "ERROR"}
PD_FLAGS = ["--disaggregation-transfer-backend", "mooncake", "--disable-overlap-schedule"]
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


@pytest.mark.skipif(not NEWEST, reason="0.5.23's door")
def test_pd_on_0_5_23_serves_and_refuses_the_over_long_prompt_before_transfer(pd):
    prefill, decode, bootstrap = pd
    rooms = {}
    for i, tenant in enumerate(("tenant-a", "tenant-b")):
        (ps, pb), (ds, db) = both(prefill, decode, bootstrap, 1000 + i, f"the tenant asked {i} " * 8, tenant)
        assert ps == 200 and ds == 200, (pb, db)
        rooms[1000 + i] = (pb["meta_info"]["id"], db["meta_info"]["id"])
    long_text = "kv cache pages move " * 700  # over prefill's max_req_input_len (2048-token pool), under the context
    (ps, pb), (ds, db) = both(prefill, decode, bootstrap, 2000, long_text, "tenant-c", decode_timeout=10)
    assert ps == 400, pb  # 0.5.23 refuses it at prefill's door
    assert ds != 200, db  # decode does not serve it (it waits for a transfer that never starts; the client hangs up)
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
