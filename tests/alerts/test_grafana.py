"""The shipped Grafana dashboard: it is the generator's output, it loads through grafana-foundation-sdk's models,
its queries read only metrics kvtrail exposes (and SGLang's two), each alert rule is linked from a panel that
reads the rule's metrics, and every query (variables resolved as Grafana resolves them) parses and returns
series in a real Prometheus (Debian's) scraping ``kvtrail serve`` on a simulated incident and an SGLang-shaped
exporter."""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import yaml

from kvtrail.alerts import EXPOSED, grafana_dashboard_path, rule_names, rules_path
from kvtrail.alerts.dashboard import SGLANG_CONTEXT, SGLANG_POOL, render
from kvtrail.audit.batch import from_dicts, to_jsonl
from kvtrail.audit.store import AuditStore
from kvtrail.service.tokens import add_token, ensure_tables
from tests.alerts.incident import CLUSTER, incident_events
from tests.alerts.test_end_to_end import _free_port, process, wait_for
from tests.service.conftest import ServiceProcess

DASH = json.loads(grafana_dashboard_path().read_text())
PANELS = [p for p in DASH["panels"] if p["type"] != "row"]
PROMETHEUS = shutil.which("prometheus")
_NAME = re.compile(r"\b(kvtrail_[a-z0-9_]+|sglang:[a-z_]+)")
# Grafana's interval variables, as a 2 s scrape resolves them
INTERVALS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}
STALE_RETRY_S = 20.0
SGLANG_VALUES = {SGLANG_POOL: 128, SGLANG_CONTEXT: 1024}


def test_the_shipped_file_is_the_generators_output():
    assert grafana_dashboard_path().read_text() == render(), "run: python -m kvtrail.alerts.dashboard"


def test_it_loads_through_grafana_foundation_sdk():
    sdk = pytest.importorskip("grafana_foundation_sdk")
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models import dashboard as model
    from grafana_foundation_sdk.models import prometheus

    assert sdk is not None
    register_default_plugins()
    board = model.Dashboard.from_json(DASH)
    assert board.uid == "kvtrail" and board.title and board.panels is not None
    assert [v.name for v in board.templating.list_val or []] == ["cluster", "node", "role"]
    loaded = [p for p in board.panels if isinstance(p, model.Panel)]
    assert [p.title for p in loaded] == [p["title"] for p in PANELS]
    for p, raw in zip(loaded, PANELS):
        assert p.datasource is not None and p.datasource.uid == "${DS_PROMETHEUS}"
        queries = p.targets or []
        assert queries and all(isinstance(q, prometheus.Dataquery) for q in queries), p.title
        assert [q.expr for q in queries] == [t["expr"] for t in raw["targets"]]
    # and back: the SDK's encoder writes what was read
    again = json.loads(json.dumps(board, cls=JSONEncoder))
    assert [p["title"] for p in again["panels"]] == [p["title"] for p in DASH["panels"]]
    assert DASH["__inputs"][0]["name"] == "DS_PROMETHEUS" and DASH["__inputs"][0]["pluginId"] == "prometheus"


def test_queries_read_real_metrics_and_each_rule_is_linked_from_a_panel_reading_its_metrics():
    allowed = set(EXPOSED) | set(SGLANG_VALUES)
    for p in PANELS:
        for t in p["targets"]:
            names = set(_NAME.findall(t["expr"]))
            assert names and names <= allowed, (p["title"], names - allowed)
    rules = {
        r["alert"]: set(_NAME.findall(r["expr"]))
        for g in yaml.safe_load(rules_path().read_text())["groups"]
        for r in g["rules"]
    }
    linked: dict[str, list[set[str]]] = {}
    for p in PANELS:
        reads = {n for t in p["targets"] for n in _NAME.findall(t["expr"])}
        for link in p["links"]:
            name = link["url"].rsplit("search=", 1)[1]
            linked.setdefault(name, []).append(reads)
            assert name in p["description"]
    assert sorted(linked) == sorted(rule_names())
    for name, reads in linked.items():
        assert any(rules[name] <= r for r in reads), (name, rules[name])
    # the SGLang pair sits beside kvtrail's pool and context in one panel
    (cap,) = [p for p in PANELS if any(SGLANG_POOL in t["expr"] for t in p["targets"])]
    exprs = " ".join(t["expr"] for t in cap["targets"])
    assert SGLANG_CONTEXT in exprs and "kvtrail_node_kv_pool_tokens" in exprs


# ---- against a real Prometheus ------------------------------------------------------------------


@contextmanager
def sglang_exporter() -> Iterator[str]:
    """What SGLang's /metrics says of the prefill node's pool and context (gauges with a model_name label)."""
    text = "".join(
        f'# TYPE {name} gauge\n{name}{{model_name="m"}} {value}\n' for name, value in SGLANG_VALUES.items()
    ).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *args):
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def _escape(value: str) -> str:
    """A label value as Grafana puts it in a regex matcher (regex-escaped, in a PromQL string)."""
    return re.sub(r"([.^$*+?()\[\]{}|\\-])", r"\\\\\1", value)


def _resolve(api: str, variables: list[dict]) -> dict[str, str]:
    """Each variable's 'All' value as Grafana computes it: ``label_values`` run in order, the regex's capture
    applied, the values joined as ``(a|b)``."""
    out: dict[str, str] = {}
    for v in variables:
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", v["query"]["query"])
        assert m, v["query"]
        selector = _substitute(m.group(1), out)
        r = httpx.get(f"{api}/series", params={"match[]": selector}, timeout=30).json()
        assert r["status"] == "success", (selector, r)
        values = {s[m.group(2)] for s in r["data"] if m.group(2) in s}
        if v["regex"]:
            rx = re.compile(v["regex"].strip("/"))
            values = {mm.group(1) for x in values if (mm := rx.fullmatch(x))}
        assert values, f"variable {v['name']}: no values from {selector}"
        out[v["name"]] = "(" + "|".join(_escape(x) for x in sorted(values)) + ")"
    return out


def _substitute(expr: str, values: dict[str, str]) -> str:
    for k, v in {**INTERVALS, **{"$" + n: x for n, x in values.items()}}.items():
        expr = expr.replace(k, v)
    assert "$" not in expr, expr
    return expr


def _result(api: str, expr: str) -> list[dict]:
    r = httpx.get(f"{api}/query", params={"query": expr}, timeout=30).json()
    assert r["status"] == "success", (expr, r)  # it parses
    return r["data"]["result"]


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None, reason="Debian prometheus not installed")
def test_every_panel_query_parses_and_the_incident_fills_every_panel(tmp_path):
    db = tmp_path / "svc.duckdb"
    with AuditStore(db) as store:
        ensure_tables(store.con)
        token = add_token(store.con, "producer")[1]
    prom_port = _free_port()
    logs = [tmp_path / "prometheus.log"]
    svc = ServiceProcess(db)
    try:
        by_node: dict[str, list[dict]] = {}
        for e in incident_events():
            by_node.setdefault(e["producer"]["node"], []).append(e)
        for events in by_node.values():  # one producer's batch per request
            r = httpx.post(
                svc.url + "/v1/events",
                content=to_jsonl(from_dicts(events)).encode(),
                headers={"Authorization": f"Bearer {token}", "Content-Type": "application/x-ndjson"},
                timeout=60,
            )
            assert r.status_code == 200, r.text
        with sglang_exporter() as sglang:
            (tmp_path / "prom.yml").write_text(
                yaml.safe_dump(
                    {
                        "global": {"scrape_interval": "2s", "scrape_timeout": "2s", "evaluation_interval": "2s"},
                        "scrape_configs": [
                            {"job_name": "kvtrail", "static_configs": [{"targets": [svc.url.removeprefix("http://")]}]},
                            {
                                "job_name": "sglang",
                                "static_configs": [{"targets": [sglang], "labels": {"node": "p", "role": "prefill"}}],
                            },
                        ],
                    }
                )
            )
            with process(
                [
                    str(PROMETHEUS),
                    f"--config.file={tmp_path / 'prom.yml'}",
                    f"--storage.tsdb.path={tmp_path / 'prom-data'}",
                    f"--web.listen-address=127.0.0.1:{prom_port}",
                ],
                logs[0],
            ):
                api = f"http://127.0.0.1:{prom_port}/api/v1"

                def ready():
                    # the judge has stored F2 and F3, both jobs are scraped, rates have two samples
                    try:
                        pairs = _result(api, "kvtrail_forensics_transfer_pair_mismatches_total")
                        sg = _result(api, SGLANG_POOL)
                        n = _result(api, "count_over_time(kvtrail_ingest_events_total[1m])")
                    except (httpx.HTTPError, AssertionError, ValueError):  # not up yet
                        return False
                    return len(pairs) == 2 and sg and n and min(float(s["value"][1]) for s in n) >= 3

                wait_for("Prometheus to scrape the incident", ready, logs)
                values = _resolve(api, DASH["templating"]["list"])
                assert values["cluster"] == f"({CLUSTER})"
                empty = []
                got: dict[tuple[str, str], list[dict]] = {}
                for p in PANELS:
                    for t in p["targets"]:
                        expr = _substitute(t["expr"], values)
                        # a scrape that times out on a loaded machine marks the series stale until the next one
                        deadline = time.monotonic() + STALE_RETRY_S
                        while not (res := _result(api, expr)) and time.monotonic() < deadline:
                            time.sleep(0.5)
                        got[(p["title"], t["legendFormat"])] = res
                        if not res:
                            empty.append((p["title"], t["expr"]))
    finally:
        svc.stop()
    assert empty == [], empty

    def series(title: str, legend: str) -> list[dict]:
        (key,) = [k for k in got if k[0].startswith(title) and k[1] == legend]
        return got[key]

    def val(title: str, legend: str, **labels: str) -> float:
        (s,) = [s for s in series(title, legend) if all(s["metric"].get(k) == v for k, v in labels.items())]
        return float(s["value"][1])

    # what the incident put there
    cap = "KV pool vs context"
    assert val(cap, "{{node}} ({{role}}) pool", node="p") < val(cap, "{{node}} ({{role}}) context", node="p")
    assert val(cap, "{{node}} ({{role}}) SGLang max_total_num_tokens", node="p") == SGLANG_VALUES[SGLANG_POOL]
    assert val(cap, "{{node}} ({{role}}) SGLang context_len", node="p") == SGLANG_VALUES[SGLANG_CONTEXT]
    assert val("Pool headroom", "{{node}} ({{role}})", node="p") < 0
    assert val("Foreign reads", "{{node}} F1", node="d") >= 1
    by_code = {s["metric"]["code"] for s in series("Findings by code", "{{code}}") if float(s["value"][1]) > 0}
    assert by_code >= {"F1", "F2", "F3", "F8", "F11"}
    for title in ("Transfer length mismatches", "Digest mismatches"):
        pairs = [
            (s["metric"]["prefill_node"], s["metric"]["decode_node"])
            for s in series(title, "{{prefill_node}} -> {{decode_node}}")
        ]
        assert pairs == [("p", "d")], title
    assert val("Transfers outliving", "{{node}} transfers", node="d") >= 1
    causes = {s["metric"]["cause"] for s in series("Aborts mid-transfer", "{{node}} ({{role}}) {{cause}}")}
    assert causes >= {"client_disconnect", "timeout"}
    assert val("Recorder drops", "{{producer}}", producer=f"{CLUSTER}/p/prefill") == 3
    assert val("Sequence gaps", "{{producer}} unexplained", producer=f"{CLUSTER}/d/decode") == 2
    assert val("Time since the last batch", "{{producer}}", producer=f"{CLUSTER}/p/prefill") >= 0
