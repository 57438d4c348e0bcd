"""End to end with real components: ``kvtrail serve`` scraped by a real Prometheus (Debian ``prometheus``)
loading the shipped rules, alerting a real Alertmanager (``prometheus-alertmanager``) that posts to a
webhook receiver in this test. A clean deployment raises nothing; the incident's node configuration
and a foreign read reach the webhook as KvtrailPoolSmallerThanContext, KvtrailForeignRead and (the live
judge's model monitors) KvtrailModelViolation."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml

from kvtrail.alerts import rules_path
from kvtrail.audit.batch import from_dicts, to_jsonl
from kvtrail.audit.store import AuditStore
from kvtrail.service.tokens import add_token, ensure_tables
from tests.alerts.histories import DECODE, foreign_read, node_configs
from tests.conftest import event
from tests.service.conftest import ServiceProcess

PROMETHEUS, ALERTMANAGER = shutil.which("prometheus"), shutil.which("prometheus-alertmanager")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        PROMETHEUS is None or ALERTMANAGER is None, reason="Debian prometheus and prometheus-alertmanager not installed"
    ),
]
DEADLINE_S = 90.0
INCIDENT_ALERTS = ("KvtrailPoolSmallerThanContext", "KvtrailForeignRead", "KvtrailModelViolation")
QUIET_S = 6.0  # a clean store: this many seconds of 1 s scrapes and evaluations without an alert


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Hook(BaseHTTPRequestHandler):
    received: list[dict]

    def do_POST(self):  # noqa: N802 - the stdlib's name
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.received.append(json.loads(body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        return None


@contextmanager
def webhook() -> Iterator[tuple[str, list[dict]]]:
    received: list[dict] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("Hook", (_Hook,), {"received": received}))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/alerts", received
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@contextmanager
def process(argv: list[str], log: Path) -> Iterator[subprocess.Popen]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            proc.terminate()  # our own child, by its handle
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _get_json(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def wait_for(what: str, check, logs: list[Path], timeout_s: float = DEADLINE_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.5)
    tails = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.exists())
    raise AssertionError(f"timed out waiting for {what}\n{tails}")


def _post(url: str, token: str, events: list[dict]) -> None:
    r = httpx.post(
        url + "/v1/events",
        content=to_jsonl(from_dicts(events)).encode(),
        timeout=30,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/x-ndjson"},
    )
    assert r.status_code == 200, r.text


def _firing(received: list[dict]) -> dict[str, dict]:
    return {
        a["labels"]["alertname"]: a["labels"] for body in received for a in body["alerts"] if a["status"] == "firing"
    }


def test_prometheus_and_alertmanager_deliver_the_incident_and_nothing_on_a_clean_store(tmp_path):
    db = tmp_path / "svc.duckdb"
    with AuditStore(db) as store:
        ensure_tables(store.con)
        token = add_token(store.con, "producer")[1]
    prom_port, am_port = _free_port(), _free_port()
    logs = [tmp_path / "prometheus.log", tmp_path / "alertmanager.log"]
    svc = ServiceProcess(db)
    try:
        with webhook() as (hook_url, received):
            (tmp_path / "am.yml").write_text(
                yaml.safe_dump(
                    {
                        "route": {
                            "receiver": "hook",
                            "group_by": ["alertname", "node"],
                            "group_wait": "1s",
                            "group_interval": "1s",
                            "repeat_interval": "1h",
                        },
                        "receivers": [{"name": "hook", "webhook_configs": [{"url": hook_url, "send_resolved": False}]}],
                    }
                )
            )
            (tmp_path / "prom.yml").write_text(
                yaml.safe_dump(
                    {
                        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                        "rule_files": [str(rules_path())],
                        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
                        "scrape_configs": [
                            {
                                "job_name": "kvtrail",
                                "metrics_path": "/metrics",
                                "static_configs": [{"targets": [svc.url.removeprefix("http://")]}],
                            }
                        ],
                    }
                )
            )
            with (
                process(
                    [
                        str(ALERTMANAGER),
                        f"--config.file={tmp_path / 'am.yml'}",
                        f"--storage.path={tmp_path / 'am-data'}",
                        f"--web.listen-address=127.0.0.1:{am_port}",
                        "--cluster.listen-address=",
                    ],
                    logs[1],
                ),
                process(
                    [
                        str(PROMETHEUS),
                        f"--config.file={tmp_path / 'prom.yml'}",
                        f"--storage.tsdb.path={tmp_path / 'prom-data'}",
                        f"--web.listen-address=127.0.0.1:{prom_port}",
                    ],
                    logs[0],
                ),
            ):
                api = f"http://127.0.0.1:{prom_port}/api/v1"
                now = time.time_ns()
                # a clean deployment: decode's pool holds its context, nothing foreign
                _post(
                    svc.url,
                    token,
                    [
                        node_configs(wall_ns=now)[1],
                        event(
                            1,
                            "kv_read",
                            DECODE,
                            wall_ns=now + 1,
                            request={"request_id": "ok", "tenant_id": "t"},
                            pages=[],
                        ),
                    ],
                )
                q = urllib.parse.quote('kvtrail_node_kv_pool_tokens{node="decode-0"}')
                wait_for(
                    "Prometheus to scrape the service",
                    lambda: (_get_json(f"{api}/query?query={q}") or {}).get("data", {}).get("result"),
                    logs,
                )
                wait_for(
                    "Alertmanager to be ready",
                    lambda: _get_json(f"http://127.0.0.1:{am_port}/api/v2/status") is not None,
                    logs,
                )
                time.sleep(QUIET_S)
                alerts = (_get_json(f"{api}/alerts") or {}).get("data", {}).get("alerts", [])
                assert [a for a in alerts if a["state"] == "firing"] == [] and received == []
                # the incident: prefill's pool smaller than its context, a foreign read on decode
                _post(svc.url, token, node_configs(wall_ns=now + 10)[:1])
                _post(svc.url, token, foreign_read(seq0=2, wall_ns=now + 20))
                firing = wait_for(
                    "the three alerts at the webhook",
                    lambda: (lambda f: f if set(INCIDENT_ALERTS) <= set(f) else None)(_firing(received)),
                    logs,
                )
    finally:
        svc.stop()
    assert firing["KvtrailPoolSmallerThanContext"]["node"] == "prefill-0"
    assert firing["KvtrailPoolSmallerThanContext"]["severity"] == "critical"
    assert firing["KvtrailForeignRead"]["node"] == "decode-0"
    model = firing["KvtrailModelViolation"]  # the live judge's monitors, on the same read
    assert (model["node"], model["property"]) == ("decode-0", "no_foreign_read")
    annotations = {a["labels"]["alertname"]: a["annotations"] for b in received for a in b["alerts"]}
    assert "prefill-0" in annotations["KvtrailPoolSmallerThanContext"]["summary"]
    assert "kvtrail preflight" in annotations["KvtrailPoolSmallerThanContext"]["description"]
