"""``kvtrail serve`` as a process: the banner, a SIGTERM drain with exit 0, a SIGKILL that loses no
acknowledged batch, and a store another process holds."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvtrail.audit.store import AuditStore, connect_readonly
from kvtrail.audit.verify import verify_store
from kvtrail.service.tokens import new_token, token_line
from tests.conftest import alloc, config, producer
from tests.service.conftest import ServiceProcess, arrow_body, auth

pytestmark = pytest.mark.slow


def _token_file(tmp_path: Path) -> tuple[Path, str]:
    token_id, secret, stored = new_token("producer")
    path = tmp_path / "tokens.txt"
    path.write_text(token_line(token_id, "producer", stored) + "\n")
    return path, secret


class Sender(threading.Thread):
    """Sends batches of a few producers until stopped or the service goes away; keeps every acknowledgement."""

    def __init__(self, url: str, token: str, node: str):
        super().__init__(daemon=True)
        self.url, self.token, self.prod = url, token, producer(node=node, role="decode")
        self.acked: list[dict] = []
        self.stop = threading.Event()

    def run(self) -> None:
        seq = 1
        with httpx.Client(base_url=self.url, timeout=30) as c:
            try:
                r = c.post(
                    "/v1/events",
                    content=arrow_body([config(0, prod=self.prod, pool_pages=4096)]),
                    headers=auth(self.token),
                )
                self.acked.append(r.json())
                while not self.stop.is_set():
                    events = [alloc(seq + i, list(range(1 + i, 41 + i)), prod=self.prod) for i in range(50)]
                    r = c.post("/v1/events", content=arrow_body(events), headers=auth(self.token))
                    if r.status_code != 200:
                        return
                    self.acked.append(r.json())
                    seq += 50
            except httpx.TransportError:
                return  # the service stopped or was killed


def _stored_batches(db: Path) -> dict[tuple[int, int], str]:
    con = connect_readonly(db)
    try:
        rows = con.execute("SELECT producer_id, batch_no, digest FROM batches").fetchall()
        return {(p, b): bytes(d).hex() for p, b, d in rows}
    finally:
        con.close()


def _traffic(svc: ServiceProcess, token: str, n: int = 3) -> list[Sender]:
    senders = [Sender(svc.url, token, f"decode-{i}") for i in range(n)]
    for s in senders:
        s.start()
    deadline = time.monotonic() + 60
    while sum(len(s.acked) for s in senders) < 10 * n:
        assert time.monotonic() < deadline and svc.proc.poll() is None, svc.stderr[-2000:]
        time.sleep(0.02)
    return senders


def test_banner_is_the_first_line_and_sigterm_drains_and_exits_0(tmp_path):
    tokens, secret = _token_file(tmp_path)
    db = tmp_path / "svc.duckdb"
    svc = ServiceProcess(db, "--tokens", str(tokens))
    try:
        assert httpx.get(f"{svc.url}/healthz", timeout=10).json()["status"] == "ok"
        senders = _traffic(svc, secret)
        svc.proc.send_signal(signal.SIGTERM)  # while the senders still post
        rc = svc.wait(60)
    finally:
        svc.stop()
    for s in senders:
        s.stop.set()
        s.join(30)
    assert rc == 0, svc.stderr[-3000:]
    stored = _stored_batches(db)
    acked = {(a["producer_id"], a["batch_no"]): a["digest"] for s in senders for a in s.acked}
    assert acked and all(stored.get(k) == d for k, d in acked.items())
    assert verify_store(db).ok
    # closed cleanly: checkpointed, so the main file alone holds everything
    assert not (tmp_path / "svc.duckdb.wal").exists() or (tmp_path / "svc.duckdb.wal").stat().st_size == 0


def test_sigkill_loses_no_acknowledged_batch_and_the_store_reopens_without_repair(tmp_path):
    tokens, secret = _token_file(tmp_path)
    db = tmp_path / "svc.duckdb"
    svc = ServiceProcess(db, "--tokens", str(tokens))
    try:
        senders = _traffic(svc, secret)
        svc.proc.send_signal(signal.SIGKILL)
        assert svc.wait(30) == -signal.SIGKILL
    finally:
        svc.stop()
    for s in senders:
        s.stop.set()
        s.join(30)
    acked = {(a["producer_id"], a["batch_no"]): a["digest"] for s in senders for a in s.acked}
    with AuditStore(db, create=False) as store:  # replays the WAL; nothing to repair
        assert store.upgraded == []
    stored = _stored_batches(db)
    assert acked and all(stored.get(k) == d for k, d in acked.items())
    assert verify_store(db).ok
    # the service comes back on the same store and continues every producer's chain
    svc = ServiceProcess(db, "--tokens", str(tokens))
    try:
        s = senders[0]
        pid = s.acked[0]["producer_id"]
        stored_last = max(b for (p, b) in stored if p == pid)
        beyond = max(a["last_seq"] for a in s.acked) + 10_000  # past any committed but unacknowledged batch
        r = httpx.post(
            f"{svc.url}/v1/events",
            timeout=30,
            headers=auth(secret),
            content=arrow_body([alloc(beyond, [1], prod=s.prod)]),
        )
        assert r.status_code == 200 and r.json()["batch_no"] == stored_last + 1
    finally:
        svc.proc.send_signal(signal.SIGTERM)
        assert svc.wait(60) == 0


def test_a_store_held_by_another_process_is_refused_with_one_line_and_exit_1(tmp_path):
    db = tmp_path / "held.duckdb"
    with AuditStore(db):
        proc = subprocess.run(
            [sys.executable, "-m", "kvtrail", "serve", "--db", str(db)], capture_output=True, text=True, timeout=120
        )
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "in use by another process" in lines[0]


def test_the_judge_interval_reaches_the_judge_and_a_bad_one_is_refused_by_name(tmp_path):
    from click.testing import CliRunner

    from kvtrail.cli import cli
    from kvtrail.service.config import ServeConfig
    from kvtrail.service.state import open_state

    with pytest.raises(ValueError, match="judge_interval_s"):
        ServeConfig(judge_interval_s=-1)
    out = CliRunner().invoke(cli, ["serve", "--db", str(tmp_path / "x.duckdb"), "--judge-interval-s", "-1"])
    assert out.exit_code == 2 and "--judge-interval-s" in out.output
    assert not (tmp_path / "x.duckdb").exists()  # refused before the store was opened
    state = open_state(tmp_path / "s.duckdb", judge_interval_s=2.5)
    try:
        assert state.judge.poll_interval_s == 2.5
    finally:
        state.close()


def test_the_buffer_pool_is_capped_as_configured(tmp_path):
    """DuckDB's memory_limit is set on the service's database (every cursor shares it), by default and as given."""
    from kvtrail.service.config import DEFAULT_MEMORY_LIMIT_MB, ServeConfig
    from kvtrail.service.state import open_state

    assert ServeConfig().memory_limit_mb == DEFAULT_MEMORY_LIMIT_MB
    with pytest.raises(ValueError, match="memory_limit_mb"):
        ServeConfig(memory_limit_mb=1)
    for mb in (DEFAULT_MEMORY_LIMIT_MB, 256):
        state = open_state(tmp_path / f"m{mb}.duckdb", memory_limit_mb=mb)
        try:
            cur = state.cursor()
            (limit,) = cur.execute("SELECT current_setting('memory_limit')").fetchone()
            cur.close()
        finally:
            state.close()
        # DuckDB reports the limit in its own units (MiB/GiB, 1000- or 1024-based by version): compare bytes
        value, unit = limit.split()
        scale = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}[unit]
        assert abs(float(value) * scale - mb * 10**6) <= 0.01 * mb * 10**6, limit


def test_serve_refuses_a_memory_limit_below_the_floor(tmp_path):
    from click.testing import CliRunner

    from kvtrail.cli import cli

    out = CliRunner().invoke(cli, ["serve", "--db", str(tmp_path / "x.duckdb"), "--memory-limit-mb", "1"])
    assert out.exit_code == 2 and "--memory-limit-mb" in out.output
