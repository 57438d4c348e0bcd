"""``kvtrail audit backup``: one checkpointed file, verified, from a closed, signed, tampered or live store."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import duckdb
import pytest

from kvtrail.audit import chain
from kvtrail.audit.backup import backup_store
from kvtrail.audit.batch import from_dicts
from kvtrail.audit.store import AuditStore, connect_readonly
from tests.conftest import alloc, config, run_cli


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "a.duckdb"
    with AuditStore(path) as s:
        s.append(from_dicts([config(0), alloc(1, [1, 2])]))
        s.append(from_dicts([alloc(2, [3])]))
    return path


def test_an_existing_target_is_kept_unless_forced(capsys, db, tmp_path):
    to = tmp_path / "b.duckdb"
    to.write_text("keep me")
    rc, out, err = run_cli(capsys, "audit", "backup", "--db", str(db), "--to", str(to))
    assert (rc, out, err) == (2, [], [f"error: --to: {to} exists; --force replaces it"])
    assert to.read_text() == "keep me"
    (tmp_path / "b.duckdb.wal").write_text("stale")  # would be replayed into the copy if left there
    rc, out, err = run_cli(capsys, "audit", "backup", "--db", str(db), "--to", str(to), "--force")
    assert (rc, err) == (0, []) and out[1] == "OK: the copy verifies (2 batches, 3 events, 0 signatures)"
    assert not (tmp_path / "b.duckdb.wal").exists()
    with connect_readonly(to) as con:
        assert con.execute("SELECT count(*) FROM events").fetchone() == (3,)


def test_the_store_itself_and_a_missing_store_are_refused(capsys, db, tmp_path):
    rc, _, err = run_cli(capsys, "audit", "backup", "--db", str(db), "--to", str(db), "--force")
    assert (rc, err) == (2, [f"error: --to: {db} is the store itself"])
    missing = tmp_path / "none.duckdb"
    rc, _, err = run_cli(capsys, "audit", "backup", "--db", str(missing), "--to", str(tmp_path / "c.duckdb"))
    assert (rc, err) == (2, [f"error: --db: store not found: {missing}"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.duckdb"]


def test_signatures_are_checked_in_the_copy(capsys, tmp_path):
    key, pub = tmp_path / "k.pem", tmp_path / "k.pub"
    chain.generate_keypair(key, pub)
    path = tmp_path / "s.duckdb"
    with AuditStore(path, signer=chain.Signer.from_file(str(key))) as s:
        s.append(from_dicts([config(0), alloc(1, [1])]))
    to = tmp_path / "copy.duckdb"
    rc, out, _ = run_cli(capsys, "audit", "backup", "--db", str(path), "--to", str(to), "--public-key", str(pub))
    assert rc == 0 and out[1] == "OK: the copy verifies (1 batches, 2 events, 1 signatures)"


def test_a_tampered_store_is_copied_as_evidence_and_exits_1(capsys, db, tmp_path):
    with duckdb.connect(str(db)) as con:
        con.execute("UPDATE page_runs SET page_start = 7 WHERE seq = 1")
    to = tmp_path / "evidence.duckdb"
    rc, out, err = run_cli(capsys, "audit", "backup", "--db", str(db), "--to", str(to))
    assert (rc, err) == (1, [])
    assert out[1].startswith("FAILED: the copy's chain: first problem: producer ")
    assert "content does not match its digest" in out[1]
    assert to.is_file()


WRITER = textwrap.dedent("""
    import sys
    from kvtrail.audit.batch import from_dicts
    from kvtrail.audit.store import AuditStore, CheckpointPolicy
    from tests.conftest import alloc, config
    store = AuditStore(sys.argv[1], checkpoint=CheckpointPolicy(max_wal_bytes=20_000, max_interval_s=0.01))
    store.append(from_dicts([config(0, pool_pages=4096)]))
    print("ready", flush=True)
    seq = 1
    while True:
        store.append(from_dicts([alloc(seq + i, list(range(1 + (seq + i) % 4000, 60 + (seq + i) % 4000)))
                                 for i in range(100)]))
        seq += 100
""")


def test_a_store_another_process_is_writing_is_copied_consistently(tmp_path):
    path = tmp_path / "live.duckdb"
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )
    counts = []
    try:
        assert child.stdout.readline() == "ready\n"
        for i in range(6):
            res = backup_store(path, tmp_path / f"b{i}.duckdb")
            assert res.report.ok, str(res.report.first_problem)
            with connect_readonly(res.path) as con:
                n, top = con.execute("SELECT count(*), max(seq) FROM events").fetchone()
            assert n == top + 1 == res.events  # whole batches, a gap-free prefix
            counts.append(n)
    finally:
        child.kill()
        child.wait(10)
    assert counts == sorted(counts) and counts[-1] > counts[0]
