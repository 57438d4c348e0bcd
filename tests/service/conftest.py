"""Fixtures of the service tests: an open service state, an in-process client, tokens, request bodies,
and a real uvicorn server in a thread (for the HTTP sink) or in a subprocess (for the process tests)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pytest
import uvicorn
from fastapi.testclient import TestClient

from kvtrail.audit.batch import from_dicts, to_jsonl, write_ipc
from kvtrail.service.app import create_app
from kvtrail.service.state import ServiceState, open_state
from kvtrail.service.tokens import add_token

NDJSON = "application/x-ndjson"
ARROW = "application/vnd.apache.arrow.stream"
BANNER = re.compile(r"^kvtrail service listening on (http://127\.0\.0\.1:(\d+))$")
START_TIMEOUT_S = 60.0


@pytest.fixture
def service_state(tmp_path: Path) -> Iterator[ServiceState]:
    state = open_state(tmp_path / "svc.duckdb")
    yield state
    state.close()


@pytest.fixture
def client(service_state: ServiceState) -> Iterator[TestClient]:
    with TestClient(create_app(service_state, max_body_bytes=1 << 20)) as c:
        yield c


def make_token(state: ServiceState, role: str = "producer", nodes: tuple[str, ...] = ()) -> str:
    with state.write_lock:
        return add_token(state.store.con, role, nodes=nodes)[1]


@pytest.fixture
def producer_token(service_state: ServiceState) -> str:
    return make_token(service_state)


def auth(token: str, content_type: str = ARROW) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", "Content-Type": content_type}


def arrow_body(events: list[dict] | pa.Table) -> bytes:
    return write_ipc(events if isinstance(events, pa.Table) else from_dicts(events))


def jsonl_body(events: list[dict]) -> bytes:
    return to_jsonl(from_dicts(events)).encode()


def free_socket() -> socket.socket:
    """A TCP socket bound to a free loopback port and not listening: connecting to it is refused."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextmanager
def served_in_thread(state: ServiceState, sock: socket.socket) -> Iterator[str]:
    """Serve ``state`` with uvicorn on ``sock`` in a thread (no signal handlers); yields the base URL."""
    sock.listen(128)
    server = uvicorn.Server(uvicorn.Config(create_app(state), log_level="warning", access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield "http://127.0.0.1:%d" % sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(30)


class ServiceProcess:
    """``kvtrail serve`` in a subprocess: its banner's URL, its output collected by reader threads."""

    def __init__(self, db: Path, *extra: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtrail", "serve", "--db", str(db), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=db.parent,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [
            threading.Thread(target=lambda s=s, into=into: into.extend(s), daemon=True)
            for s, into in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for r in self._readers:
            r.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.out:
            assert self.proc.poll() is None, f"serve exited with {self.proc.returncode}: {self.stderr[-2000:]}"
            assert time.monotonic() < deadline, f"no banner after {START_TIMEOUT_S:.0f} s: {self.stderr[-2000:]}"
            time.sleep(0.05)
        m = BANNER.match(self.out[0].rstrip("\n"))
        assert m, f"first line of stdout is not the banner: {self.out[0]!r}"
        self.url = m.group(1)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def wait(self, timeout_s: float = 60) -> int:
        try:
            return self.proc.wait(timeout_s)
        finally:
            self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:  # only our own child, by its handle
            self.proc.kill()
            self.proc.wait(10)
        for r in self._readers:
            r.join(5)
