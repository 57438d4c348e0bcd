"""``kvtrail audit migrate`` on stores written by the code of earlier formats (tests/audit/data: format 1,
one wide events table; format 2, request fields in every kind table's rows): refused until migrated, then
every event, the chain heads, verification and the replay's findings are as that code read them, and each
request identity is stored once; a tampered store keeps its problem; a failed conversion leaves the file
unchanged."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
from pathlib import Path

import duckdb
import pytest

from kvtrail.audit.batch import to_jsonl
from kvtrail.audit.events import REQUEST_NAMES
from kvtrail.audit.layout import KIND_TABLES, REQUESTS_TABLE
from kvtrail.audit.migrate import migrate_store
from kvtrail.audit.store import AuditStore, connect_readonly, read_events
from kvtrail.audit.verify import verify_store
from kvtrail.cli import main
from kvtrail.errors import StoreError
from kvtrail.forensics.questions import findings_of
from kvtrail.forensics.results.persist import results_digest
from tests.conftest import alloc, producer

DATA = Path(__file__).parent / "data"
FORMATS = ("1", "2")
EXPECTED = {f: json.loads((DATA / f"store-format{f}.json").read_text()) for f in FORMATS}
_IDENTITIES = (
    f"SELECT count(*) FROM (SELECT DISTINCT {', '.join(REQUEST_NAMES)} FROM events WHERE "
    + " OR ".join(f"{n} IS NOT NULL" for n in REQUEST_NAMES)
    + ")"
)


def _copy(tmp_path, fmt: str) -> Path:
    db = tmp_path / f"old{fmt}.duckdb"
    with gzip.open(DATA / f"store-format{fmt}.duckdb.gz") as src, open(db, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return db


@pytest.fixture(params=FORMATS, ids=[f"format{f}" for f in FORMATS])
def old(request, tmp_path) -> tuple[str, Path]:
    return request.param, _copy(tmp_path, request.param)


def _heads(con) -> dict:
    rows = con.execute(
        "SELECT producer_id, batch_no, digest FROM batches QUALIFY row_number() OVER "
        "(PARTITION BY producer_id ORDER BY batch_no DESC) = 1 ORDER BY 1"
    ).fetchall()
    return {str(p): [int(b), bytes(d).hex()] for p, b, d in rows}


def test_an_older_store_is_refused_with_the_way_out(old, capsys):
    fmt, old = old
    with pytest.raises(StoreError, match=rf"has format {fmt} .*kvtrail audit migrate --db"):
        connect_readonly(old)
    with pytest.raises(StoreError, match="kvtrail audit migrate"):
        AuditStore(old)
    assert main(["audit", "verify", "--db", str(old)]) == 2
    assert "kvtrail audit migrate" in capsys.readouterr().err


def test_migrate_keeps_every_event_the_chain_and_the_findings(old, capsys):
    fmt, old = old
    expected = EXPECTED[fmt]
    with duckdb.connect(str(old), read_only=True) as con:
        identities = con.execute(_IDENTITIES).fetchone()[0]
    assert identities > 20
    assert main(["audit", "migrate", "--db", str(old)]) == 0
    out = capsys.readouterr().out
    assert (
        f"format {fmt} -> 3: {expected['events']} events into {len(KIND_TABLES)} kind tables and "
        f"{identities} request identities"
    ) in out
    assert "verified before and after: OK" in out
    con = connect_readonly(old)
    try:
        events = read_events(con)
        assert events.num_rows == expected["events"]
        assert hashlib.sha256(to_jsonl(events).encode()).hexdigest() == expected["jsonl_sha256"]
        kinds = dict(con.execute("SELECT kind, count(*) FROM events GROUP BY 1").fetchall())
        assert kinds == expected["events_by_kind"]
        assert con.execute("SELECT count(*) FROM page_runs").fetchone()[0] == expected["page_runs"]
        assert _heads(con) == expected["chain_heads"]
        report = verify_store(con)
        assert report.ok and report.batches_checked == sum(b + 1 for b, _ in expected["chain_heads"].values())
        found = findings_of(con)
        assert (len(found), results_digest(found)) == (expected["findings"], expected["findings_digest"])
        tables = {r[0] for r in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
        assert "events" not in tables and {*KIND_TABLES, REQUESTS_TABLE} <= tables
        # Each identity once in the dictionary; no kind table keeps a request field of its own.
        assert con.execute(f"SELECT count(*), count(DISTINCT request_no) FROM {REQUESTS_TABLE}").fetchone() == (
            identities,
            identities,
        )
        stray = con.execute(
            "SELECT table_name, column_name FROM duckdb_columns() WHERE table_name IN "
            "(SELECT unnest(?)) AND column_name IN (SELECT unnest(?))",
            [list(KIND_TABLES), list(REQUEST_NAMES)],
        ).fetchall()
        assert stray == []
    finally:
        con.close()
    # Migrated once: a second run changes nothing, and the store takes new batches that chain on.
    assert main(["audit", "migrate", "--db", str(old)]) == 0
    assert "already format 3, nothing to do" in capsys.readouterr().out
    with AuditStore(old) as store:
        store.append(_one_more())
    assert verify_store(old).ok


def _one_more():
    from kvtrail.audit.batch import from_dicts
    from tests.conftest import config

    prod = producer("prefill-9", instance="after-migrate")
    return from_dicts([config(0, prod), alloc(1, [3, 4], rid="m1", prod=prod)])


def test_a_tampered_store_migrates_with_the_same_problem(old):
    fmt, old = old
    # Format 1 keeps the field in its wide table, format 2 in the kind's table.
    table, where = ("events", "kind = 'pages_allocated' AND ") if fmt == "1" else ("events_pages_allocated", "")
    with duckdb.connect(str(old)) as con:
        con.execute(
            f"UPDATE {table} SET tenant_id = 'mallory' WHERE {where}seq = "
            "(SELECT min(seq) FROM events WHERE kind = 'pages_allocated')"
        )
    res = migrate_store(old)
    assert res.from_format == fmt and res.problems >= 1
    report = verify_store(old)
    assert not report.ok and len(report.problems) == res.problems


def test_a_store_that_cannot_be_converted_is_left_unchanged(tmp_path):
    old = _copy(tmp_path, "1")
    with duckdb.connect(str(old)) as con:  # a kind this kvtrail does not know: no table to move it into
        con.execute("UPDATE events SET kind = 'gpu_telemetry' WHERE kind = 'recorder_closed'")
    before = hashlib.sha256(old.read_bytes()).hexdigest()
    with pytest.raises(StoreError, match="unknown kind 'gpu_telemetry'"):
        migrate_store(old)
    assert hashlib.sha256(old.read_bytes()).hexdigest() == before
    with duckdb.connect(str(old), read_only=True) as con:
        assert con.execute("SELECT value FROM meta WHERE key = 'store_format'").fetchone() == ("1",)


def test_migrate_refuses_what_is_not_a_store(tmp_path):
    with pytest.raises(StoreError, match="store not found"):
        migrate_store(tmp_path / "nothing.duckdb")
    other = tmp_path / "other.duckdb"
    with duckdb.connect(str(other)) as con:
        con.execute("CREATE TABLE t (x INTEGER)")
    with pytest.raises(StoreError, match="not a kvtrail store"):
        migrate_store(other)
