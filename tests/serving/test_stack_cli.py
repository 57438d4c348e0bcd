"""``kvtrail stack`` run as a user runs it: a subprocess that prints the router's URL, serves a completion,
stops on Ctrl-C (SIGINT) with exit code 0 and leaves the request's audit events in the store."""

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

from kvtrail.audit.verify import verify_store
from kvtrail.serving.stack import worker_log_path

pytestmark = pytest.mark.slow

_URL = re.compile(r"router: (http://127\.0\.0\.1:\d+)/v1/completions")
_START_TIMEOUT_S = 120.0


def _read_lines(stream, into: list[str]) -> None:
    for line in stream:
        into.append(line)


def test_stack_answers_a_completion_and_stops_cleanly_on_sigint(tmp_path: Path) -> None:
    db = tmp_path / "x.duckdb"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtrail", "stack", "--db", str(db), "--max-new-tokens", "16"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # the URL line must arrive before the process ends
    out: list[str] = []
    err: list[str] = []
    readers = [
        threading.Thread(target=_read_lines, args=(s, into), daemon=True)
        for s, into in ((proc.stdout, out), (proc.stderr, err))
    ]
    for reader in readers:
        reader.start()
    try:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not (match := _URL.search("".join(out))):
            assert proc.poll() is None, f"stack exited with {proc.returncode}: {''.join(err)[-2000:]}"
            assert time.monotonic() < deadline, f"no router URL after {_START_TIMEOUT_S:.0f} s: {''.join(err)}"
            time.sleep(0.1)
        url = match.group(1)
        r = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": "hello kvtrail", "max_tokens": 8},
            headers={"Authorization": "Bearer key-acme"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"] == {"prompt_tokens": 13, "completion_tokens": 8, "total_tokens": 21}
        request_id = body["id"].removeprefix("cmpl-")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, "".join(err)[-2000:]
    finally:
        if proc.poll() is None:  # only our own child, by its handle
            proc.kill()
            proc.wait(10)
        for reader in readers:
            reader.join(5)
    # The engine's native log lines went to the log beside the store, not to the terminal.
    assert "Local segment descriptor" not in "".join(err)
    assert "Local segment descriptor" in worker_log_path(db).read_text()
    con = duckdb.connect(str(db), read_only=True)
    try:
        rows = con.execute(
            "SELECT node, kind FROM events_v WHERE request_id = ? ORDER BY node, seq", [request_id]
        ).fetchall()
    finally:
        con.close()
    by_node: dict[str, list[str]] = {}
    for node, kind in rows:
        by_node.setdefault(node, []).append(kind)
    assert set(by_node) == {"router-0", "prefill-0", "decode-0"}
    assert by_node["router-0"] == ["request_received", "response_sent"]
    assert {"request_received", "pages_allocated", "kv_written", "transfer_sent", "pages_freed"} <= set(
        by_node["prefill-0"]
    )
    assert {"transfer_reserved", "transfer_received", "kv_read", "pages_freed"} <= set(by_node["decode-0"])
    assert verify_store(db).ok
