"""``kvtrail preflight`` end to end: server info, metrics text, a URL served locally, the checks, the JSON
shape, exit codes 0/1/2 and recording into a store."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvtrail.audit.store import connect_readonly
from kvtrail.cli import main
from kvtrail.preflight import NodeConfig, judge, parse_text
from kvtrail.preflight.checks import check_node

DATA = Path(__file__).parent / "data"
NODE_KEYS = {"source", "rank", "role", "pool_tokens", "context_tokens", "page_size", "version", "checks"}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["preflight", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_server_info_one_node_per_dp_rank_and_no_look_alike_keys():
    dp0, dp1 = parse_text((DATA / "decode_server_info.json").read_text(), "info.json")
    assert (dp0.rank, dp0.role, dp0.pool_tokens, dp0.context_tokens, dp0.page_size, dp0.version) == (
        "DP0",
        "decode",
        2_097_152,
        1_048_576,
        16,
        "0.5.23",
    )
    assert (dp1.rank, dp1.pool_tokens) == ("DP1", 2_080_768)  # its own capacity, not the top level's
    assert dp0.checksum_enabled is False and dp0.canary_enabled is False


def test_metrics_text_takes_the_pool_not_the_swa_pool():
    [n] = parse_text((DATA / "prefill_metrics.txt").read_text(), "m.txt")
    assert (n.role, n.pool_tokens, n.context_tokens, n.page_size) == ("prefill", 681_280, 1_048_576, 16)


def test_json_shape_and_exit_1_on_the_incident(capsys):
    code, out, _ = run(capsys, "--format", "json", str(DATA / "prefill_tp8.log"), str(DATA / "decode_mla.log"))
    doc = json.loads(out)
    assert code == 1 and set(doc) == {"ok", "nodes", "errors"} and doc["ok"] is False and doc["errors"] == []
    pre, dec = doc["nodes"]
    assert set(pre) == NODE_KEYS and pre["rank"] == "TP0" and pre["role"] == "prefill"
    checks = {c["check"]: c for c in pre["checks"]}
    assert checks["pool_vs_context"]["status"] == "fail"
    assert checks["engine_version"]["status"] == "fail" and "0.5.21" in checks["engine_version"]["detail"]
    assert checks["integrity_checksum"]["status"] == "fail"  # prefill off, decode on
    assert {c["check"]: c["status"] for c in dec["checks"]}["pool_vs_context"] == "pass"
    assert all(set(c) == {"check", "status", "detail"} for n in doc["nodes"] for c in n["checks"])


def test_table_names_node_pool_context_and_verdict(capsys):
    code, out, _ = run(capsys, str(DATA / "prefill_tp8.log"))
    assert code == 1
    assert "prefill TP0  pool 681,280 < context 1,048,576 tokens  FAIL" in out.splitlines()[0]


def test_exit_0_when_everything_passes(capsys):
    code, out, _ = run(capsys, "--role", "decode", str(DATA / "decode_mla.log"), str(DATA / "pasted_wrapped.log"))
    assert code == 0, out
    assert "every check passed" in out


def test_unknown_fails_closed_unless_allowed(capsys):
    code, out, _ = run(capsys, "--format", "json", str(DATA / "pool_only.log"))
    doc = json.loads(out)
    assert code == 1 and doc["nodes"][0]["context_tokens"] is None
    assert doc["nodes"][0]["checks"][0] == {
        "check": "pool_vs_context",
        "status": "unknown",
        "detail": f"context length not found in {DATA / 'pool_only.log'}",
    }
    assert run(capsys, "--allow-unknown", str(DATA / "pool_only.log"))[0] == 0


def test_exit_2_names_the_unreadable_source(capsys, tmp_path):
    code, out, _ = run(
        capsys,
        "--format",
        "json",
        str(DATA / "truncated.log"),
        str(tmp_path / "missing.log"),
        str(DATA / "decode_mla.log"),
    )
    doc = json.loads(out)
    assert code == 2 and doc["ok"] is False and len(doc["nodes"]) == 1
    assert any("truncated.log: no KV pool" in e for e in doc["errors"])
    assert any("missing.log: cannot read" in e for e in doc["errors"])
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    assert run(capsys, str(bad))[0] == 2


def test_transfer_bound_and_timeout_consistent_on_both_roles():
    base = dict(pool_tokens=10, context_tokens=10)
    pre = NodeConfig("a", role="prefill", release_timeout_ns=30 * 10**9, transfer_batch_max_pages=128, **base)
    dec = NodeConfig("b", role="decode", release_timeout_ns=30 * 10**9, transfer_batch_max_pages=128, **base)
    assert {c.check: c.status for c in check_node(pre, [pre, dec])}["transfer_bound"] == "pass"
    unbounded = NodeConfig("b", role="decode", release_timeout_ns=30 * 10**9, **base)
    assert {c.check: c.status for c in check_node(unbounded, [pre, unbounded])}["transfer_bound"] == "fail"
    other = NodeConfig("b", role="decode", release_timeout_ns=5 * 10**9, transfer_batch_max_pages=128, **base)
    assert {c.check: c.status for c in check_node(pre, [pre, other])}["transfer_bound"] == "fail"
    assert "transfer_bound" not in {c.check for c in check_node(NodeConfig("c", **base), [NodeConfig("c", **base)])}
    assert judge([pre, dec], []).exit_code() == 0


class _Saved(BaseHTTPRequestHandler):
    routes: dict[str, tuple[str, str]] = {}

    def do_GET(self):  # noqa: N802 - the stdlib's name
        body = self.routes.get(self.path)
        if body is None:
            self.send_error(404)
            return
        data = body[1].encode()
        self.send_response(200)
        self.send_header("Content-Type", body[0])
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        return None


@contextmanager
def saved_server(routes: dict[str, tuple[str, str]]) -> Iterator[str]:
    handler = type("Handler", (_Saved,), {"routes": routes})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_a_url_older_server_info_path_models_and_metrics(capsys, tmp_path):
    info = json.loads((DATA / "decode_server_info.json").read_text())
    info.update(context_length=None, internal_states=None, disaggregation_mode="prefill", version="0.5.22")
    routes = {
        "/get_server_info": ("application/json", json.dumps(info)),  # no /server_info: an older version
        "/v1/models": ("application/json", json.dumps({"data": [{"id": "glm", "max_model_len": 4_194_304}]})),
        "/metrics": ("text/plain", (DATA / "prefill_metrics.txt").read_text()),
    }
    with saved_server(routes) as url:
        db = tmp_path / "a.duckdb"
        code, out, err = run(capsys, "--format", "json", "--db", str(db), url)
        unreachable = run(capsys, url + "/nothing-here")
    doc = json.loads(out)
    [n] = doc["nodes"]
    assert (n["source"], n["role"], n["pool_tokens"], n["context_tokens"], n["version"]) == (
        url,
        "prefill",
        681_280,
        4_194_304,
        "0.5.22",
    )  # the smaller pool of server info and metrics
    assert code == 1 and "recorded 1 node configuration" in err
    con = connect_readonly(db)
    try:
        rows = con.execute(
            "SELECT node, role, pool_tokens, context_tokens, config_source FROM events_v WHERE kind = 'node_config'"
        ).fetchall()
    finally:
        con.close()
    assert rows == [(url.removeprefix("http://"), "prefill", 681_280, 4_194_304, "server_info+metrics")]
    assert unreachable[0] == 2 and "neither /server_info nor /get_server_info" in unreachable[1]


def test_a_url_nobody_listens_on(capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, out, _ = run(capsys, f"http://127.0.0.1:{port}")
    assert code == 2 and "cannot connect" in out


@pytest.mark.parametrize("argv", [["--url", "http://127.0.0.1:1"], ["--db", "x", "--url", "http://x", "--token", "t"]])
def test_recording_flags_are_checked(capsys, argv, monkeypatch):
    monkeypatch.delenv("KVTRAIL_TOKEN", raising=False)
    monkeypatch.delenv("KVTRAIL_URL", raising=False)
    assert main(["preflight", *argv, str(DATA / "decode_mla.log")]) == 2


def test_recording_through_a_running_service(capsys, tmp_path):
    """``--url``: the configurations go through the recorder's HttpSink into the service's store; a token
    the service refuses is one line, exit 2."""
    import socket

    from kvtrail.service.state import open_state
    from kvtrail.service.tokens import add_token
    from tests.service.conftest import served_in_thread

    state = open_state(tmp_path / "svc.duckdb")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    try:
        with state.write_lock:
            token = add_token(state.store.con, "producer")[1]
        with served_in_thread(state, sock) as url:
            code, _, err = run(capsys, "--url", url, "--token", token, str(DATA / "decode_mla.log"))
            refused = run(capsys, "--url", url, "--token", "kvt_not-a-token", str(DATA / "decode_mla.log"))
        assert code in (0, 1) and "recorded 1 node configuration" in err
        rows = (
            state.cursor()
            .execute("SELECT cluster, role, config_source FROM events_v WHERE kind = 'node_config'")
            .fetchall()
        )
        assert len(rows) == 1 and rows[0][0] == "preflight" and rows[0][1] == "decode"
        assert refused[0] == 2 and "cannot record" in refused[2] and "401" in refused[2]
    finally:
        sock.close()
        state.close()


def test_node_names_each_source_in_the_table_and_the_store(capsys, tmp_path):
    db = tmp_path / "a.duckdb"
    code, out, err = run(
        capsys,
        "--db",
        str(db),
        "--node",
        "pf-a17",
        "--node",
        "dc-b03",
        str(DATA / "prefill_tp8.log"),
        str(DATA / "decode_mla.log"),
    )
    assert code == 1 and "recorded 2 node configuration(s)" in err
    assert f"(node pf-a17: {DATA / 'prefill_tp8.log'})" in out.splitlines()[0]
    con = connect_readonly(db)
    try:
        rows = con.execute("SELECT node, role FROM events_v WHERE kind = 'node_config' ORDER BY node").fetchall()
    finally:
        con.close()
    assert rows == [("dc-b03", "decode"), ("pf-a17", "prefill")]  # not the files' stems
    code, out, err = run(capsys, "--node", "only-one", str(DATA / "prefill_tp8.log"), str(DATA / "decode_mla.log"))
    assert code == 2 and "--node: give one per SOURCE" in err


def test_an_integrity_setting_the_same_on_both_roles_reads_as_one_phrase():
    nodes = [
        NodeConfig("p.log", role="prefill", checksum_enabled=True),
        NodeConfig("d.log", role="decode", checksum_enabled=True),
    ]
    [checksum] = [c for c in check_node(nodes[0], nodes) if c.check == "integrity_checksum"]
    assert (checksum.status, checksum.detail) == ("pass", "checksum enabled on both roles")
    off = [NodeConfig(n.source, role=n.role, checksum_enabled=False) for n in nodes]
    [checksum] = [c for c in check_node(off[1], off) if c.check == "integrity_checksum"]
    assert checksum.detail == "checksum disabled on both roles"
