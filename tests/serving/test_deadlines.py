"""Slow clients cannot hold ``kvtrail serve`` or the stack's router: headers sent a line at a time, a body a
byte at a time and many half-sent requests all get 408 and a closed connection once their deadline passes,
while a client that keeps to the deadlines is answered (bounded slow clients on loopback)."""

from __future__ import annotations

import pytest

from kvtrail.service import tokens
from kvtrail.serving.config import StackConfig
from kvtrail.serving.deadlines import ReadTimeouts
from kvtrail.serving.stack import Stack
from tests.service.conftest import ServiceProcess
from tests.serving.slow_client import half_sent, send_slowly

INTERVAL_S = 0.25
SLOW_HEADERS = [b"GET /healthz HTTP/1.1\r\n", *(b"X-Slow-%d: 1\r\n" % i for i in range(40)), b"Host: x\r\n\r\n"]


def _slow_body(secret: str) -> list[bytes]:
    head = (
        "POST /v1/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-ndjson\r\n"
        f"Authorization: Bearer {secret}\r\nContent-Length: 40\r\n\r\n"
    )
    return [head.encode(), *(b"{" for _ in range(40))]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("slow")
    token_id, secret, stored = tokens.new_token("producer")
    (d / "tokens.txt").write_text(tokens.token_line(token_id, "producer", stored) + "\n")
    service = ServiceProcess(
        d / "svc.duckdb", "--tokens", str(d / "tokens.txt"), "--header-timeout-s", "1", "--body-timeout-s", "1"
    )
    try:
        yield service, int(service.url.rsplit(":", 1)[1]), secret
    finally:
        service.stop()


def test_serve_closes_slow_header_lines_with_408(served):
    service, port, _ = served
    r = send_slowly(port, SLOW_HEADERS, INTERVAL_S)
    assert r.closed and r.received.startswith(b"HTTP/1.1 408 ") and b"headers not received" in r.received
    assert r.pieces_sent < len(SLOW_HEADERS)  # closed while the client was still sending


def test_serve_closes_a_body_sent_a_byte_at_a_time_with_408(served):
    service, port, secret = served
    pieces = _slow_body(secret)
    r = send_slowly(port, pieces, INTERVAL_S)
    assert r.closed and r.received.startswith(b"HTTP/1.1 408 ") and b"body not received" in r.received
    assert r.pieces_sent < len(pieces)
    assert "Traceback" not in service.stderr


def test_serve_closes_many_half_sent_requests(served):
    service, port, _ = served
    got = half_sent(port, 100, wait_s=10)
    assert all(g is not None and g.startswith(b"HTTP/1.1 408 ") for g in got)


def test_serve_answers_a_client_within_the_deadlines(served):
    _, port, _ = served
    # three header pieces a quarter second apart: within one second, so answered
    r = send_slowly(port, [b"GET /healthz HTTP/1.1\r\n", b"Host: x\r\n", b"Connection: close\r\n\r\n"], INTERVAL_S)
    assert r.received.startswith(b"HTTP/1.1 200 ")


def test_the_stacks_router_closes_slow_clients_with_408(tmp_path):
    small = dict(page_size=16, prefill_pool_tokens=2048, decode_pool_tokens=8192, context_tokens=8192)
    cfg = StackConfig(**small, read_timeouts=ReadTimeouts(header_s=1, body_s=1))
    with Stack(cfg, tmp_path / "stack.duckdb") as st:
        assert st.url is not None
        port = int(st.url.rsplit(":", 1)[1])
        headers = send_slowly(port, SLOW_HEADERS, INTERVAL_S)
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 40\r\n\r\n"
        )
        body = send_slowly(port, [head, *(b" " for _ in range(40))], INTERVAL_S)
        half = half_sent(port, 50, wait_s=10)
    assert headers.closed and headers.received.startswith(b"HTTP/1.1 408 ")
    assert headers.pieces_sent < len(SLOW_HEADERS)
    assert body.closed and body.received.startswith(b"HTTP/1.1 408 ") and body.pieces_sent < 41
    assert all(g is not None and g.startswith(b"HTTP/1.1 408 ") for g in half)
