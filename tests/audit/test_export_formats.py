"""``audit import`` reads every export format: format 1 (``date=/node=``, ``manifest.json``; the fixture in
``tests/audit/data`` was written by that format's code), an ``audit export`` (a whole-store lake export) and a
lake ``lake export`` grew; an ``audit export`` is a lake (``lake verify`` checks it, pruned batches included)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import duckdb
import pytest

from kvtrail.audit.batch import from_dicts
from kvtrail.audit.events import ADDED_FIELDS
from kvtrail.audit.export import TABLE_KEYS, TABLES, export_parquet, import_parquet, verify_export
from kvtrail.audit.lake.catalog import LAKE_TABLES
from kvtrail.audit.lake.export import export_lake
from kvtrail.audit.lake.verify import verify_lake
from kvtrail.audit.retention import add_hold, prune
from kvtrail.audit.store import AuditStore
from kvtrail.audit.verify import verify_store
from kvtrail.errors import ChainError, StoreError
from tests.audit.test_export import DECODE, MIDNIGHT, build_store, traffic
from tests.conftest import run_cli

DATA = Path(__file__).parent / "data"
# The later event fields the export fixture's code did not have (it had ADDED_FIELDS' first three).
LATER_FIELDS = ADDED_FIELDS[3:]
FORMAT1 = DATA / "export-format1"


def digests(db: Path, tables=TABLES) -> dict:
    """Per table its rows and the SHA-256 of its rows in key order, as the fixture's JSON records them."""
    out = {}
    with duckdb.connect(str(db), read_only=True) as con:
        for t in tables:
            where = "key NOT IN ('created_ns', 'store_format')" if t == "meta" else "TRUE"
            # fields added after the fixture was written: null in its rows, not in the rows it recorded
            cols = f"* EXCLUDE ({', '.join(LATER_FIELDS)})" if t == "events" else "*"
            if t == "events":
                nulls = " AND ".join(f"{n} IS NULL" for n in LATER_FIELDS)
                assert con.execute(f"SELECT coalesce(bool_and({nulls}), TRUE) FROM events").fetchone() == (True,)
            rows = con.execute(f"SELECT {cols} FROM {t} WHERE {where} ORDER BY {TABLE_KEYS[t]}").fetchall()
            text = json.dumps([[v.hex() if isinstance(v, bytes) else v for v in r] for r in rows], default=str)
            out[t] = {"rows": len(rows), "sha256": hashlib.sha256(text.encode()).hexdigest()}
    return out


@pytest.fixture
def format1(tmp_path) -> Path:
    dst = tmp_path / "format1"
    shutil.copytree(FORMAT1, dst)
    return dst


def test_a_format1_export_imports_as_it_was_written(format1, tmp_path, capsys):
    want = json.loads((DATA / "export-format1.json").read_text())
    dst = tmp_path / "dst.duckdb"
    rc, out, err = run_cli(capsys, "audit", "import", "--db", str(dst), str(format1))
    assert (rc, err) == (0, [])
    assert out == [f"imported 22 events, 21 page runs, 8 batches into {dst}"]
    assert digests(dst) == want
    report = verify_store(dst)
    assert report.ok and report.batches_pruned == 3, report.first_problem


def test_a_format1_export_goes_on_as_a_lake(format1, tmp_path):
    """Format 1 -> store -> audit export (a lake) -> store: the same rows, and the lake verifies."""
    first, second, lake = tmp_path / "a.duckdb", tmp_path / "b.duckdb", tmp_path / "lake"
    import_parquet(format1, first)
    export_parquet(first, lake)
    r = verify_lake(str(lake))
    assert r.ok, r.problems
    assert r.batches_checked == 8
    import_parquet(lake, second)
    assert digests(second) == digests(first) == json.loads((DATA / "export-format1.json").read_text())


def test_a_format1_export_tampered_or_incomplete_is_refused(format1, tmp_path, capsys):
    (runs,) = format1.glob("page_runs/date=2023-11-15/node=decode-0/*.parquet")
    with duckdb.connect() as con:
        con.execute(
            f"COPY (SELECT * REPLACE (CAST(page_start + 1 AS INTEGER) AS page_start) "
            f"FROM read_parquet('{runs}', hive_partitioning=false)) TO '{runs}.new' (FORMAT parquet)"
        )
    Path(f"{runs}.new").replace(runs)
    assert not verify_export(format1).ok
    fresh = tmp_path / "fresh.duckdb"
    rc, out, _ = run_cli(capsys, "audit", "import", "--db", str(fresh), str(format1))
    assert rc == 1 and out[0].startswith("FAILED: the export's chain: first problem: producer ")
    assert not fresh.exists()

    manifest = json.loads((format1 / "manifest.json").read_text())
    manifest["row_counts"]["events"] += 1
    (format1 / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="events: manifest says 23 rows, the export holds 22"):
        import_parquet(format1, tmp_path / "a.duckdb", verify=False)
    manifest["format_version"] = 99
    (format1 / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="unsupported export format version 99; this kvtrail reads 1"):
        import_parquet(format1, tmp_path / "b.duckdb")
    (format1 / "manifest.json").write_text((FORMAT1 / "manifest.json").read_text())
    (format1 / "batches.parquet").unlink()
    with pytest.raises(StoreError, match="is not a complete export: batches.parquet is missing"):
        import_parquet(format1, tmp_path / "c.duckdb")
    assert not any((tmp_path / f"{n}.duckdb").exists() for n in "abc")


def test_an_audit_export_of_a_pruned_store_is_a_lake_that_verifies(tmp_path):
    src, out = tmp_path / "src.duckdb", tmp_path / "export"
    build_store(src)
    with AuditStore(src) as store:
        add_hold(store, 0, MIDNIGHT, "case 17", node="decode-0")
        prune(store, MIDNIGHT, note="day 1")
    export_parquet(src, out)
    r = verify_lake(str(out))
    assert r.ok, r.problems
    assert r.batches_checked == 8  # the three pruned ones' headers too, explained by the prune record
    files = json.loads((out / "manifests" / "manifest-000001.json").read_text())["files"]
    assert {f["table"] for f in files.values()} == set(TABLES)  # no checkpoints: none asked for
    # an altered prune record is named by the lake's verify and refused by the import
    path = out / "prunes" / "part-E000001.parquet"
    with duckdb.connect() as con:
        con.execute(
            f"COPY (SELECT * REPLACE ('edited' AS note) FROM read_parquet('{path}')) TO '{path}.new' (FORMAT parquet)"
        )
    Path(f"{path}.new").replace(path)
    assert any(p.startswith("altered file: prunes/") for p in verify_lake(str(out)).problems)
    report = verify_export(out)
    assert not report.ok and any("altered file: prunes/part-E000001.parquet" in str(p) for p in report.problems)
    with pytest.raises(ChainError, match="first problem: store: prune record 1 does not match its digest"):
        import_parquet(out, tmp_path / "dst.duckdb")


def test_a_file_changed_without_changing_its_rows_is_refused(tmp_path, capsys):
    """The chain recomputes from the rows; the manifest's SHA-256 also names a file rewritten with the same rows."""
    src, out = tmp_path / "src.duckdb", tmp_path / "export"
    build_store(src)
    export_parquet(src, out)
    path = out / "batches" / "part-E000001.parquet"
    with duckdb.connect() as con:
        con.execute(f"COPY (SELECT * FROM read_parquet('{path}')) TO '{path}.new' (FORMAT parquet, COMPRESSION gzip)")
    Path(f"{path}.new").replace(path)
    rc, out_lines, _ = run_cli(capsys, "audit", "import", "--db", str(tmp_path / "d.duckdb"), str(out))
    assert rc == 1
    assert out_lines[0] == (
        "FAILED: the export's chain: first problem: store: altered file: batches/part-E000001.parquet "
        "(SHA-256 differs from the manifest)"
    )
    assert not (tmp_path / "d.duckdb").exists()


def test_a_lake_that_lake_export_grew_imports_as_its_store(tmp_path):
    src, lake, dst = tmp_path / "src.duckdb", tmp_path / "lake", tmp_path / "dst.duckdb"
    build_store(src)
    export_lake(src, str(lake))
    with AuditStore(src) as store:
        store.append(from_dicts(traffic(DECODE, 9, MIDNIGHT + 3_700 * 10**9, "r9")))
    assert export_lake(src, str(lake)).export_no == 2
    res = import_parquet(lake, dst)
    want = digests(src, LAKE_TABLES)
    assert (res.events, res.batches) == (want["events"]["rows"], want["batches"]["rows"]) and res.batches == 9
    assert digests(dst, LAKE_TABLES) == want
    assert verify_store(dst).ok
