"""Long commands say what they are doing on a terminal (counts and rate on stderr) and nothing when stderr
is not one: ``simulate``, ``forensics findings --save``, ``forensics report``, ``lake export``."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvtrail.cli import progress
from tests.conftest import run_cli
from tests.forensics.incident_fixture import build
from tests.sim.test_cli import FLAGS

ROOT = Path(__file__).resolve().parents[1]
COUNT = r"([\d,]+) {unit} in \d+\.\d s \([\d,]+ {unit}/s\)"


def _simulated_events(out: list[str]) -> int:
    m = re.search(r"events ([\d,]+),", "\n".join(out))
    assert m, out
    return int(m.group(1).replace(",", ""))


def test_simulate_counts_on_a_pseudo_terminal_and_is_silent_in_a_pipe(tmp_path):
    cmd = [sys.executable, "-m", "kvtrail", "simulate", *FLAGS]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100"}
    leader, follower = pty.openpty()
    try:
        proc = subprocess.run(
            [*cmd, "--db", str(tmp_path / "tty.duckdb")],
            stdout=subprocess.PIPE,
            stderr=follower,
            text=True,
            env=env,
            timeout=300,
        )
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal's other end is closed: all read
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(leader)
    assert proc.returncode == 0
    on_tty = b"".join(chunks).decode()
    m = re.search("simulate: events stored: " + COUNT.format(unit="events"), on_tty)
    assert m, on_tty[-500:]
    assert int(m.group(1).replace(",", "")) == _simulated_events(proc.stdout.splitlines())
    piped = subprocess.run(
        [*cmd, "--db", str(tmp_path / "pipe.duckdb")], capture_output=True, text=True, env=env, timeout=300
    )
    assert piped.returncode == 0 and "events stored" not in piped.stderr and "events/s" not in piped.stderr
    assert piped.stdout.splitlines()[1:3] == proc.stdout.splitlines()[1:3]  # same run, same counts


@pytest.fixture(scope="module")
def incident(tmp_path_factory) -> Path:
    db = tmp_path_factory.mktemp("progress") / "incident.duckdb"
    build(db)
    return db


def test_findings_save_and_report_say_what_they_do_when_forced_to_a_terminal(incident, capsys, monkeypatch, tmp_path):
    rc, out, err = run_cli(capsys, "forensics", "findings", "--db", str(incident), "--save", "--format", "json")
    assert rc == 0 and not any("replaying" in line or "saving" in line for line in err)  # not a terminal
    monkeypatch.setattr(progress, "on_terminal", lambda: True)
    rc, out, err = run_cli(capsys, "forensics", "findings", "--db", str(incident), "--save", "--format", "json")
    assert rc == 0
    text = "\n".join(err)
    m = re.search("findings: replaying the store: " + COUNT.format(unit="events"), text)
    assert m and int(m.group(1).replace(",", "")) > 0, text
    saved = re.search(r"saved run \d+: (\d+) findings", text)
    assert saved and f"findings: saving {int(saved.group(1)):,} findings into {incident}: done in " in text
    rc, out, err = run_cli(
        capsys,
        "forensics",
        "report",
        "--db",
        str(incident),
        "--out",
        str(tmp_path / "r"),
        "--from",
        "2026-09-09T00:00:00Z",
        "--to",
        "2026-09-09T06:00:00Z",
    )
    text = "\n".join(err)
    assert rc == 0 and re.search("report: answering every question: " + COUNT.format(unit="events"), text), text
    assert f"report: writing the files into {tmp_path / 'r'}: done in " in text


def test_lake_export_counts_the_events_it_reads(incident, capsys, monkeypatch, tmp_path):
    pytest.importorskip("dask")
    monkeypatch.setattr(progress, "on_terminal", lambda: True)
    rc, out, err = run_cli(capsys, "lake", "export", "--db", str(incident), "--to", str(tmp_path / "lake"))
    text = "\n".join(err)
    assert rc == 0, text
    assert re.search(r"producer \d+: \d+ batches", text)  # the export's own steps, above the count
    m = re.search("lake export: events read: " + COUNT.format(unit="events"), text)
    assert m and int(m.group(1).replace(",", "")) > 0, text


def test_a_count_of_nothing_reads_as_the_time_alone(capsys, monkeypatch):
    monkeypatch.setattr(progress, "on_terminal", lambda: True)
    with progress.ticking("findings: asking the service"):
        pass
    err = capsys.readouterr().err
    assert re.search(r"findings: asking the service: done in \d+\.\d s\n", err) and "0 events" not in err
    with progress.ticking("simulate: events stored") as ticker:
        ticker.update(1234)
    assert re.search("simulate: events stored: 1,234 events in ", capsys.readouterr().err)
