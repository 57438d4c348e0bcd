"""``kvtrail stack`` under the signals a supervisor sends: a killed worker stops it with exit 1 and one
line; SIGTERM to its process group (``systemctl stop``) mid-traffic drains, flushes every producer's
audit (each writes recorder_closed) and exits 0; and the killed worker's lost tail is reported."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import httpx
import pytest

from kvtrail.audit.verify import unclean_ends

pytestmark = pytest.mark.slow

_BANNER = re.compile(r"router: (http://127\.0\.0\.1:\d+)/v1/completions.*workers: prefill pid (\d+), decode pid (\d+)")
_START_TIMEOUT_S = 120.0
_HEADERS = {"Authorization": "Bearer key-acme"}


class Stack:
    """One ``kvtrail stack`` subprocess in its own process group, its output collected by reader threads."""

    def __init__(self, db: Path):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtrail", "stack", "--db", str(db), "--max-new-tokens", "16"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=db.parent,
            start_new_session=True,
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
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not (m := _BANNER.search("".join(self.out))):
            assert self.proc.poll() is None, f"stack exited with {self.proc.returncode}: {self.stderr[-2000:]}"
            assert time.monotonic() < deadline, f"no router URL after {_START_TIMEOUT_S:.0f} s: {self.stderr}"
            time.sleep(0.1)
        self.url, self.prefill_pid, self.decode_pid = m.group(1), int(m.group(2)), int(m.group(3))

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def wait(self, timeout_s: float = 60) -> int:
        try:
            return self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is None:  # only our own child, by its handle
                self.proc.kill()
                self.proc.wait(10)
            for r in self._readers:
                r.join(5)


def _complete(url: str, text: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": text, "max_tokens": 8}, headers=_HEADERS, timeout=60)


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """A first stack whose decode worker is SIGKILLed after two requests: (db, exit code, stderr)."""
    db = tmp_path_factory.mktemp("signals") / "s.duckdb"
    stack = Stack(db)
    try:
        for i in range(2):
            assert _complete(stack.url, f"first run {i}").status_code == 200
        # The recorder's contract: an event waits in memory at most its flush interval (1 s in the stack).
        # Wait well past it, so what the killed worker recorded before this point must be in the store.
        time.sleep(3.0)
        os.kill(stack.decode_pid, signal.SIGKILL)  # the worker this test's stack started, by its pid
    finally:
        rc = stack.wait()
    return db, rc, stack.stderr, stack.decode_pid


def test_a_dead_worker_stops_the_stack_non_zero_with_one_line(killed_run):
    _db, rc, stderr, _pid = killed_run
    assert rc == 1, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "decode worker exited with code -9" in lines[0] and "workers.log" in lines[0]


def test_sigterm_to_the_group_mid_traffic_drains_flushes_and_exits_0(killed_run):
    db = killed_run[0]
    stack = Stack(db)
    statuses: list[int] = []
    ids: list[str] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        for i in range(50):  # bounded; ends at the first refused connection once the router stops accepting
            try:
                r = _complete(stack.url, f"client {k} request {i}")
            except httpx.TransportError:
                return
            with lock:
                statuses.append(r.status_code)
                if r.status_code == 200:
                    ids.append(r.json()["id"].removeprefix("cmpl-"))

    clients = [threading.Thread(target=client, args=(k,)) for k in range(3)]
    try:
        for c in clients:
            c.start()
        deadline = time.monotonic() + 60
        while len(statuses) < 3:
            assert time.monotonic() < deadline, "no responses"
            time.sleep(0.01)
        os.killpg(stack.proc.pid, signal.SIGTERM)  # the group this test created: router and both workers
    finally:
        rc = stack.wait()
        for c in clients:
            c.join(60)
    assert rc == 0, stack.stderr[-3000:]
    assert statuses and set(statuses) == {200}, statuses  # requests in flight were drained, not cut
    con = duckdb.connect(str(db), read_only=True)
    try:
        rows = con.execute("""
            SELECT p.node, p.instance, max(e.seq), max(e.seq) FILTER (e.kind = 'recorder_closed')
            FROM events e JOIN producers p USING (producer_id) GROUP BY ALL ORDER BY ALL""").fetchall()
        sent = {
            r
            for (r,) in con.execute(
                "SELECT request_id FROM events_v WHERE node = 'router-0' AND kind = 'response_sent'"
            ).fetchall()
        }
        ends = unclean_ends(con)
    finally:
        con.close()
    # Two runs of three producers; every one but the killed decode worker closed cleanly, last.
    assert len(rows) == 6, rows
    unclosed = [(node, inst) for node, inst, last, closed in rows if closed is None or closed != last]
    assert len(unclosed) == 1 and unclosed[0][0] == "decode-0", rows
    assert unclosed[0][1].startswith(f"decode-{killed_run[3]}-")  # the instance of the killed pid
    assert set(ids) <= sent, "a client got a response the audit does not hold"
    # The killed worker's end is a reported coverage gap with its bound, found by the later instance.
    (end,) = ends
    assert (end.node, end.instance, end.bound_ns) == ("decode-0", unclosed[0][1], 10**9)
    assert "later instance" in end.reason
