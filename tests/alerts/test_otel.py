"""OpenTelemetry export: a real ``kvtrail serve --otlp-endpoint`` judges a simulated incident and exports through
the SDK's OTLP/HTTP exporters to a receiver in this test that decodes the protobuf; the export's bounds (a
full queue, a receiver that refuses) drop and count; without the extra the service still serves and the
flag exits 2 naming it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk", reason="the 'otel' extra is not installed")
pytest.importorskip("opentelemetry.proto", reason="opentelemetry-proto is not installed")

from kvtrail.alerts.otel import (  # noqa: E402
    FINDING_EVENT,
    SCHEMA_URL,
    SPAN_NAME,
    OtelExport,
    otlp_export,
    responses_of,
)
from kvtrail.audit.batch import from_dicts, to_jsonl  # noqa: E402
from kvtrail.audit.store import AuditStore, connect_readonly  # noqa: E402
from kvtrail.forensics import AFFECTED_CODES  # noqa: E402
from kvtrail.forensics.findings import make_finding  # noqa: E402
from kvtrail.service.tokens import add_token, ensure_tables  # noqa: E402
from tests.alerts.histories import DECODE, foreign_read, node_configs  # noqa: E402
from tests.alerts.otlp import otlp_receiver  # noqa: E402
from tests.conftest import event  # noqa: E402
from tests.service.conftest import ServiceProcess  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 60.0
# The incident's responses on decode: r1 (the victim) and r2 (the reader) succeed, r3 fails.
RESPONSES: dict[str, dict[str, Any]] = {
    "r1": {"http_status": 200, "prompt_tokens": 40, "completion_tokens": 7, "ttft_ns": 2_000_000},
    "r2": {"http_status": 200, "prompt_tokens": 48, "completion_tokens": 5, "finish_reason": "length"},
    "r3": {"http_status": 500, "prompt_tokens": 12, "completion_tokens": 0},
}


def _incident(t0: int) -> list[dict]:
    evs = [node_configs(wall_ns=t0)[1], *foreign_read(seq0=1, wall_ns=t0 + 1000)]
    for i, (rid, fields) in enumerate(RESPONSES.items()):
        evs.append(
            event(
                10 + i,
                "response_sent",
                DECODE,
                wall_ns=t0 + 100_000 + i,
                request={"request_id": rid, "tenant_id": "t-" + rid},
                latency_ns=50_000,
                **fields,
            )
        )
    return evs


def _wait(what: str, check, svc: ServiceProcess | None = None):
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}" + (f"\n{svc.stderr[-3000:]}" if svc else ""))


def _store_findings(db: Path) -> list[dict]:
    con = connect_readonly(db)
    try:
        cur = con.execute(
            "SELECT code, node, request_id, tenant_id, victim_request_ids, victim_tenant_ids, pages FROM findings"
        )
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, r)) for r in cur.fetchall()]
    finally:
        con.close()


def test_serve_exports_findings_as_logs_and_one_span_per_judged_response(tmp_path):
    db = tmp_path / "svc.duckdb"
    with AuditStore(db) as store:
        ensure_tables(store.con)
        token = add_token(store.con, "producer")[1]
    with otlp_receiver() as (url, received):
        svc = ServiceProcess(db, "--otlp-endpoint", url + "/")
        try:
            events = _incident(time.time_ns())
            r = httpx.post(
                svc.url + "/v1/events",
                content=to_jsonl(from_dicts(events)).encode(),
                headers={"Authorization": f"Bearer {token}", "Content-Type": "application/x-ndjson"},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            _wait("three spans and the findings' log records", lambda: len(received.spans) >= 3 and received.logs, svc)
            metrics = httpx.get(svc.url + "/metrics", timeout=30).text
            svc.proc.terminate()  # a clean stop: the export is flushed and closed
            assert svc.proc.wait(60) == 0, svc.stderr[-3000:]
        finally:
            svc.stop()
    found = _store_findings(db)
    assert found, "the incident has findings"
    spans = {s["attributes"]["gen_ai.response.id"]: s for s in received.spans}
    assert sorted(spans) == sorted(RESPONSES) and len(received.spans) == len(RESPONSES)
    victims = {v for f in found for v in [*f["victim_request_ids"], *f["victim_tenant_ids"]] if v}
    assert victims, "the foreign read names its victim in the store"
    for rid, span in spans.items():
        a = span["attributes"]
        assert span["name"] == SPAN_NAME and span["resource_schema_url"] == SCHEMA_URL
        assert span["scope_schema_url"] == SCHEMA_URL and span["resource"]["service.name"] == "kvtrail"
        mine = [f for f in found if f["request_id"] == rid]
        assert a["kvtrail.finding.codes"] == sorted({f["code"] for f in mine}, key=lambda c: int(c[1:]))
        assert a["kvtrail.affected"] == any(f["code"] in AFFECTED_CODES for f in mine)
        assert a["kvtrail.pages_read_foreign"] == len(
            {p for f in mine if f["code"] in AFFECTED_CODES for p in f["pages"]}
        )
        assert a["kvtrail.victim_count"] == len(
            {v for f in mine for v in f["victim_request_ids"] if v and not v.startswith("(")}
        )
        assert a["kvtrail.node"] == DECODE["node"] and a["kvtrail.tenant_id"] == "t-" + rid
        assert span["end_ns"] - span["start_ns"] == 50_000
        status = RESPONSES[rid]["http_status"]
        assert a["http.response.status_code"] == status
        if status < 300:
            assert a["gen_ai.usage.input_tokens"] == RESPONSES[rid]["prompt_tokens"]
            assert a["gen_ai.usage.output_tokens"] == RESPONSES[rid]["completion_tokens"]
            assert "error.type" not in a
        else:  # never made-up usage for a failed response
            assert not [k for k in a if k.startswith("gen_ai.usage.")]
            assert a["error.type"] == str(status) and span["status_code"] == 2  # STATUS_CODE_ERROR
    reader = spans["r2"]["attributes"]
    assert reader["kvtrail.affected"] is True and "F1" in reader["kvtrail.finding.codes"]
    assert reader["kvtrail.pages_read_foreign"] > 0
    assert reader["gen_ai.response.finish_reasons"] == ["length"]
    assert spans["r1"]["attributes"]["gen_ai.response.time_to_first_chunk"] == pytest.approx(0.002)
    # the victim's identity is in no span but its own, and in no log record
    for s in received.spans:
        if s["attributes"]["gen_ai.response.id"] != "r1":
            assert not victims & {str(v) for v in s["attributes"].values()}, s
    # one log record per stored finding, with what the store says of it
    assert sorted(lg["attributes"]["kvtrail.finding.code"] for lg in received.logs) == sorted(f["code"] for f in found)
    for lg in received.logs:
        a = lg["attributes"]
        assert lg["event_name"] == FINDING_EVENT and lg["resource_schema_url"] == SCHEMA_URL
        assert not victims & {str(v) for v in a.values()} and not any(v in str(lg["body"]) for v in victims)
        assert a["kvtrail.finding.code"] in str(lg["body"])
        stored = [
            f
            for f in found
            if f["code"] == a["kvtrail.finding.code"] and f["request_id"] == a.get("gen_ai.response.id")
        ]
        assert stored and a["kvtrail.finding.num_pages"] == len(stored[0]["pages"])
    assert f'kvtrail_otel_exported_records_total{{signal="span"}} {float(len(RESPONSES))}' in metrics
    assert 'kvtrail_otel_dropped_records_total{signal="span"} 0.0' in metrics


def test_gen_ai_names_are_those_of_the_pinned_conventions():
    from opentelemetry.semconv._incubating.attributes import gen_ai_attributes
    from opentelemetry.semconv.schemas import Schemas

    assert SCHEMA_URL in {s.value for s in Schemas}
    defined = {v for k, v in vars(gen_ai_attributes).items() if k.startswith("GEN_AI_") and isinstance(v, str)}
    source = (ROOT / "kvtrail" / "alerts" / "otel.py").read_text()
    import re

    used = set(re.findall(r'"(gen_ai\.[a-z_.]+)"', source))
    assert used and used <= defined, used - defined


def _poll(i: int) -> tuple[list, list, list]:
    evs = [
        event(
            i,
            "response_sent",
            DECODE,
            request={"request_id": f"q{i}", "tenant_id": "t"},
            http_status=200,
            prompt_tokens=1,
            completion_tokens=1,
            latency_ns=1,
        )
    ]
    f = make_finding(
        "F6", node="decode-0", request_id=f"q{i}", tenant_id="t", first_ns=1, last_ns=2, evidence=(), detail=""
    )
    return [f], [from_dicts(evs)], [f]


def test_a_stalled_receiver_never_blocks_the_judge_and_what_does_not_fit_is_dropped_and_counted():
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    with otlp_receiver() as (url, received):
        received.gate.clear()  # every export request waits
        export = OtelExport(
            OTLPSpanExporter(endpoint=url + "/v1/traces", timeout=30),
            OTLPLogExporter(endpoint=url + "/v1/logs", timeout=30),
            max_queued=2,
        )
        polls = 20
        for i in range(polls):
            export.judged(*_poll(i))  # returns although nothing can be delivered
        dropped = export.stats()
        assert dropped["span_dropped"] > 0 and dropped["log_dropped"] > 0 and export.dropped_polls > 0
        received.gate.set()
        export.close(30)
        got = export.stats()
    assert got["span_exported"] + got["span_dropped"] == polls
    assert got["log_exported"] + got["log_dropped"] == polls
    assert got["span_exported"] == len(received.spans) > 0
    assert len(responses_of(_poll(0)[1])) == 1


def test_a_refusing_receiver_counts_drops(tmp_path):
    from tests.service.conftest import free_socket

    sock = free_socket()  # bound, not listening: connections are refused
    try:
        export = otlp_export(f"http://127.0.0.1:{sock.getsockname()[1]}", timeout_s=1)
        export.judged(*_poll(0))
        export.close(30)
    finally:
        sock.close()
    assert export.stats() == {"span_exported": 0, "span_dropped": 1, "log_exported": 0, "log_dropped": 1}


def _without_otel(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter where the OpenTelemetry SDK and exporters cannot be imported."""
    prelude = (
        "import sys\n"
        "for m in ('opentelemetry.sdk', 'opentelemetry.exporter', 'opentelemetry.exporter.otlp'):\n"
        "    sys.modules[m] = None\n"
    )
    return subprocess.run(
        [sys.executable, "-c", prelude + code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
        timeout=120,
    )


def test_without_the_extra_serve_works_and_the_flag_exits_2_naming_it(tmp_path):
    serves = _without_otel(
        "from fastapi.testclient import TestClient\n"
        "from kvtrail.service.app import create_app\n"
        "from kvtrail.service.state import open_state\n"
        "state = open_state('s.duckdb')\n"
        "with TestClient(create_app(state)) as c:\n"
        "    assert c.get('/healthz').status_code == 200\n"
        "    assert 'kvtrail_otel' not in c.get('/metrics').text\n"
        "state.close()\n"
        "print('served')\n",
        tmp_path,
    )
    assert serves.returncode == 0 and "served" in serves.stdout, serves.stderr[-2000:]
    flag = _without_otel(
        "from kvtrail.cli import main\n"
        "sys.exit(main(['serve', '--db', 'f.duckdb', '--otlp-endpoint', 'http://127.0.0.1:4318']))\n",
        tmp_path,
    )
    assert flag.returncode == 2, flag.stderr[-2000:]
    assert "'otel' extra" in flag.stderr and "Traceback" not in flag.stderr
    assert not (tmp_path / "f.duckdb").exists()  # refused before the store was opened


@pytest.mark.parametrize("url", ["127.0.0.1:4318", "ftp://collector:4318", "http://"])
def test_a_bad_endpoint_exits_2_naming_the_flag(tmp_path, url):
    from kvtrail.cli import main

    assert main(["serve", "--db", str(tmp_path / "x.duckdb"), "--otlp-endpoint", url]) == 2
    assert not (tmp_path / "x.duckdb").exists()
