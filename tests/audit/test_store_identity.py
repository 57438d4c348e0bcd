"""Only a complete kvtrail store is opened as one: anything else is refused in one line naming the path,
unchanged; a new store is made only where no file is. Each writable open is recorded in store_opens."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import duckdb
import pytest

from kvtrail import __version__
from kvtrail.audit.batch import from_dicts
from kvtrail.audit.store import AuditStore, connect_readonly, schema_ddl
from kvtrail.audit.storefile import ADDED_TABLES, STORE_FORMAT, STORE_TABLES
from kvtrail.cli import main
from kvtrail.errors import StoreError
from tests.conftest import alloc, config


def _tables(path) -> list[str]:
    with duckdb.connect(str(path), read_only=True) as con:
        return sorted(r[0] for r in con.execute("SELECT table_name FROM duckdb_tables()").fetchall())


def _stats_error(capsys, path) -> str:
    capsys.readouterr()
    assert main(["audit", "stats", "--db", str(path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    return err[0]


def test_the_schema_makes_every_table_the_identity_check_requires(tmp_path):
    with duckdb.connect() as con:
        for stmt in schema_ddl():
            con.execute(stmt)
        made = {r[0] for r in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
    assert made == {*STORE_TABLES, *ADDED_TABLES, "store_opens"}  # a new store has the added kinds' tables too


def test_a_foreign_database_is_refused_by_readers_too(tmp_path, capsys):
    path = tmp_path / "sales.duckdb"
    with duckdb.connect(str(path)) as con:
        con.execute("CREATE TABLE sales (id INTEGER)")
    with pytest.raises(StoreError, match=r"sales.duckdb is a DuckDB database but not a kvtrail store \(it holds sales"):
        connect_readonly(path)
    assert "not a kvtrail store" in _stats_error(capsys, path)
    assert _tables(path) == ["sales"]


def test_an_incomplete_store_names_the_missing_tables(tmp_path, capsys):
    path = tmp_path / "a.duckdb"
    AuditStore(path).close()
    with duckdb.connect(str(path)) as con:
        con.execute("DROP TABLE legal_holds")
        con.execute("DROP TABLE prune_batches")
    line = _stats_error(capsys, path)
    assert line.startswith(f"error: store {path} is incomplete: table(s) prune_batches, legal_holds missing;")
    with pytest.raises(StoreError, match="incomplete"):
        AuditStore(path)  # a writer does not silently complete it either
    assert "legal_holds" not in _tables(path)


def test_another_format_and_a_non_duckdb_file_are_refused(tmp_path, capsys):
    path = tmp_path / "a.duckdb"
    AuditStore(path).close()
    with duckdb.connect(str(path)) as con:
        con.execute("UPDATE meta SET value = '9' WHERE key = 'store_format'")
    assert _stats_error(capsys, path) == f"error: store {path} has format 9; this kvtrail reads format {STORE_FORMAT}"
    junk = tmp_path / "junk.duckdb"
    junk.write_text("not a database\n" * 500)
    assert _stats_error(capsys, junk) == f"error: {junk} is not a DuckDB database file"
    with pytest.raises(StoreError, match="is not a DuckDB database file"):
        AuditStore(junk)
    assert junk.read_text() == "not a database\n" * 500


def test_create_false_does_not_make_a_store(tmp_path):
    with pytest.raises(StoreError, match="store not found"):
        AuditStore(tmp_path / "none.duckdb", create=False)
    assert list(tmp_path.iterdir()) == []


def test_a_store_held_by_another_process_is_named_with_its_pid(tmp_path, capsys):
    path = tmp_path / "a.duckdb"
    holder = textwrap.dedent("""
        import sys, time
        from kvtrail.audit.store import AuditStore
        s = AuditStore(sys.argv[1])
        print("open", flush=True)
        sys.stdin.readline()
        s.close()
    """)
    child = subprocess.Popen(
        [sys.executable, "-c", holder, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )
    try:
        assert child.stdout.readline() == "open\n"
        line = _stats_error(capsys, path)
        assert line.startswith(f"error: store {path} is in use by another process (pid {child.pid}):")
        with pytest.raises(StoreError, match=f"pid {child.pid}"):
            AuditStore(path)
    finally:
        child.communicate("\n", timeout=30)
    assert child.returncode == 0


def test_every_writable_open_is_recorded(tmp_path):
    path = tmp_path / "a.duckdb"
    with AuditStore(path) as s:
        assert s.open_no == 0
        s.append(from_dicts([config(0), alloc(1, [1])]))
    connect_readonly(path).close()  # a reader is not an owner: no row
    with AuditStore(path) as s:
        assert s.open_no == 1
    with duckdb.connect(str(path), read_only=True) as con:
        rows = con.execute("SELECT open_no, opened_ns, kvtrail_version FROM store_opens ORDER BY open_no").fetchall()
        cols = con.execute(
            "SELECT column_name, data_type FROM duckdb_columns() WHERE table_name = 'store_opens' ORDER BY column_index"
        ).fetchall()
    assert [r[0] for r in rows] == [0, 1] and rows[0][1] < rows[1][1]
    assert {r[2] for r in rows} == {__version__}
    assert cols == [("open_no", "BIGINT"), ("opened_ns", "BIGINT"), ("kvtrail_version", "VARCHAR")]


def test_a_store_from_before_store_opens_gets_it_on_its_next_writable_open(tmp_path):
    path = tmp_path / "old.duckdb"
    with AuditStore(path) as s:
        s.append(from_dicts([config(0), alloc(1, [1])]))
    with duckdb.connect(str(path)) as con:
        con.execute("DROP TABLE store_opens")
    with connect_readonly(path) as con:  # still a store for readers
        assert con.execute("SELECT count(*) FROM events").fetchone() == (2,)
    with AuditStore(path) as s:
        assert s.open_no == 0
        s.append(from_dicts([alloc(2, [2])]))
    assert "store_opens" in _tables(path)


@pytest.mark.parametrize(
    "command", [["audit", "stats"], ["audit", "verify"], ["forensics", "findings"], ["token", "list"]]
)
def test_a_json_file_as_db_is_named_and_refused_unchanged(tmp_path, capsys, command):
    """DuckDB would open a .json file as an in-memory view of its data (and say only 'Cannot launch
    in-memory database in read-only mode!'); a reader and a writer both name the file instead."""
    path = tmp_path / "ground_truth.json"
    path.write_text('{"affected": ["r1", "r2"]}\n')
    capsys.readouterr()
    assert main([*command, "--db", str(path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: {path} is not a DuckDB database file (JSON text): not a kvtrail store"]
    with pytest.raises(StoreError, match="not a kvtrail store"):
        AuditStore(path)
    assert path.read_text() == '{"affected": ["r1", "r2"]}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ground_truth.json"]
