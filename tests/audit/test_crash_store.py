"""A writer dies before any checkpoint: its store lives in ``<db>.wal``. A copy of the ``.duckdb`` file alone
is refused by every command in one line (exit 2) and never adopted; ``audit backup`` of the crashed
store gives one file that verifies and holds every event."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import duckdb
import pytest

from kvtrail.audit.store import AuditStore, connect_readonly
from kvtrail.audit.verify import verify_store
from kvtrail.cli import main
from kvtrail.errors import StoreError
from tests.conftest import alloc, config

NUM_EVENTS = 80
# Commits two batches with checkpoints out of reach, then dies without closing (no checkpoint at exit).
CHILD = textwrap.dedent("""
    import math, os, sys
    from kvtrail.audit.batch import from_dicts
    from kvtrail.audit.store import AuditStore, CheckpointPolicy
    from tests.conftest import alloc, config
    store = AuditStore(sys.argv[1], checkpoint=CheckpointPolicy(max_wal_bytes=2**30, max_interval_s=math.inf))
    store.append(from_dicts([config(0)] + [alloc(i, [i % 60 + 1]) for i in range(1, 50)]))
    store.append(from_dicts([alloc(i, [i % 60 + 1]) for i in range(50, 80)]))
    os._exit(0)
""")


@pytest.fixture(scope="module")
def crashed_original(tmp_path_factory):
    path = tmp_path_factory.mktemp("crashed") / "store.duckdb"
    subprocess.run([sys.executable, "-c", CHILD, str(path)], check=True, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    return path


@pytest.fixture
def crashed(crashed_original, tmp_path):
    """A fresh copy of the crashed store: its main file and its WAL."""
    for src in (crashed_original, crashed_original.with_name("store.duckdb.wal")):
        shutil.copyfile(src, tmp_path / src.name)
    return tmp_path / "store.duckdb"


@pytest.fixture
def main_file_only(crashed_original, tmp_path):
    """What an operator gets by copying only the .duckdb file off the box."""
    path = tmp_path / "copy" / "store.duckdb"
    path.parent.mkdir()
    shutil.copyfile(crashed_original, path)
    return path


def _run(capsys, *argv: str) -> tuple[int, list[str], list[str]]:
    capsys.readouterr()
    rc = main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out.splitlines(), cap.err.splitlines()


def test_the_crashed_store_keeps_its_data_in_the_wal(crashed_original):
    assert crashed_original.stat().st_size <= 16384
    assert crashed_original.with_name("store.duckdb.wal").stat().st_size > 10_000
    with duckdb.connect(str(crashed_original), read_only=True) as con:  # the WAL is replayed on open
        assert con.execute("SELECT count(*) FROM events").fetchone() == (NUM_EVENTS,)


@pytest.mark.parametrize(
    "argv",
    [
        ["audit", "verify"],
        ["audit", "verify", "--json"],
        ["audit", "stats"],
        ["audit", "head"],
        ["audit", "prune", "--before", "2020-01-01"],
        ["audit", "hold", "list"],
        ["audit", "hold", "release", "1"],
        ["audit", "export", "--out", "OUT"],
        ["audit", "backup", "--to", "OUT"],
        ["forensics", "affected"],
        ["forensics", "findings"],
    ],
)
def test_every_command_refuses_the_wal_less_copy_in_one_line(capsys, main_file_only, tmp_path, argv):
    before = main_file_only.read_bytes()
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv] + ["--db", str(main_file_only)]
    rc, out, err = _run(capsys, *argv)
    assert (rc, out) == (2, [])
    assert len(err) == 1, err
    assert err[0].startswith(f"error: {main_file_only} is an empty DuckDB database, not a kvtrail store")
    assert "store.duckdb.wal next to the original" in err[0] and "kvtrail audit backup" in err[0]
    assert main_file_only.read_bytes() == before and not (tmp_path / "out").exists()


def test_ingest_does_not_adopt_the_copy(capsys, main_file_only, tmp_path):
    events = tmp_path / "e.jsonl"
    events.write_text(json.dumps(config(0)) + "\n" + json.dumps(alloc(1, [3])) + "\n")
    rc, out, err = _run(capsys, "audit", "ingest", "--db", str(main_file_only), str(events))
    assert (rc, out, len(err)) == (2, [], 1)
    assert "is an empty DuckDB database, not a kvtrail store" in err[0]
    with duckdb.connect(str(main_file_only), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM duckdb_tables()").fetchone() == (0,)
    with pytest.raises(StoreError, match="empty DuckDB database"):
        AuditStore(main_file_only)
    # Only when asked: --init-empty makes a new store in it.
    rc, out, err = _run(capsys, "audit", "ingest", "--init-empty", "--db", str(main_file_only), str(events))
    assert (rc, err) == (0, []) and "stored 2 events" in out[0]
    with connect_readonly(main_file_only) as con:
        assert con.execute("SELECT count(*) FROM events").fetchone() == (2,)


def test_a_wal_without_its_database_is_named(capsys, crashed, tmp_path):
    crashed.unlink()
    rc, _, err = _run(capsys, "audit", "stats", "--db", str(crashed))
    assert rc == 2 and err == [
        f"error: --db: store not found: {crashed}, but store.duckdb.wal is there: a WAL "
        "cannot be opened without the database file it belongs to"
    ]
    with pytest.raises(StoreError, match="store.duckdb.wal is there"):
        AuditStore(crashed)  # not a fresh store beside a stranded WAL
    assert not crashed.exists()


def test_backup_of_the_crashed_store_is_one_file_holding_every_event(capsys, crashed, tmp_path):
    wal = crashed.with_name("store.duckdb.wal")
    wal_before = wal.read_bytes()
    to = tmp_path / "off-box" / "evidence.duckdb"
    rc, out, err = _run(capsys, "audit", "backup", "--db", str(crashed), "--to", str(to))
    assert (rc, err) == (0, [])
    assert out[0] == (
        f"backed up {crashed} to {to}: {to.stat().st_size} bytes, 1 producers, 2 batches, {NUM_EVENTS} events"
    )
    assert out[1] == f"OK: the copy verifies (2 batches, {NUM_EVENTS} events, 0 signatures)"
    assert sorted(p.name for p in to.parent.iterdir()) == ["evidence.duckdb"]  # no WAL, no leftovers
    assert wal.read_bytes() == wal_before  # the original is left as it was found
    # The copy alone is the evidence: moved elsewhere without anything beside it, it verifies.
    alone = tmp_path / "elsewhere" / "x.duckdb"
    alone.parent.mkdir()
    shutil.move(to, alone)
    report = verify_store(alone)
    assert report.ok and report.events_checked == NUM_EVENTS
    assert _run(capsys, "audit", "verify", "--db", str(alone))[0] == 0
