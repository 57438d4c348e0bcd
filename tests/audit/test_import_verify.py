"""``audit import`` recomputes the chain of what it imports: a tampered export exits 1 naming its first
broken link and imports nothing, unless --no-verify."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest

from kvtrail.audit.batch import from_dicts
from kvtrail.audit.export import export_parquet, import_parquet, verify_export
from kvtrail.audit.store import AuditStore, connect_readonly
from kvtrail.errors import ChainError, StoreError
from tests.conftest import alloc, config, producer, run_cli


@pytest.fixture
def export(tmp_path) -> Path:
    src, out = tmp_path / "src.duckdb", tmp_path / "export"
    with AuditStore(src) as s:
        s.append(from_dicts([config(0), alloc(1, [1, 2, 3])]))
        s.append(from_dicts([alloc(2, [4]), alloc(3, [5, 6])]))
        s.append(from_dicts([alloc(4, [7])]))
    export_parquet(src, out)
    return out


def _rewrite(path: Path, select: str) -> None:
    """Replace a Parquet file by ``select`` over it (``{f}`` is the file), keeping its column types."""
    tmp = path.with_name("tmp.parquet.new")
    with duckdb.connect() as con:
        source = f"read_parquet('{path}', hive_partitioning=false)"  # partition values are not file columns
        con.execute(f"COPY ({select.format(f=source)}) TO '{tmp}' (FORMAT parquet)")
    tmp.replace(path)


def _runs_file(export: Path) -> Path:
    (path,) = export.glob("page_runs/cluster=*/node=*/date=*/hour=*/*.parquet")
    return path


def test_a_clean_export_verifies_and_imports(capsys, export, tmp_path):
    report = verify_export(export)
    assert report.ok and (report.batches_checked, report.events_checked) == (3, 5)
    dst = tmp_path / "dst.duckdb"
    rc, out, err = run_cli(capsys, "audit", "import", "--db", str(dst), str(export))
    assert (rc, err) == (0, []) and out == [f"imported 5 events, 4 page runs, 3 batches into {dst}"]


def test_an_edited_page_run_is_refused_and_nothing_is_imported(capsys, export, tmp_path):
    _rewrite(
        _runs_file(export),
        "SELECT * REPLACE (CASE WHEN seq = 3 THEN CAST(page_start + 1 AS INTEGER) "
        "ELSE page_start END AS page_start) FROM {f}",
    )
    fresh = tmp_path / "fresh.duckdb"
    rc, out, err = run_cli(capsys, "audit", "import", "--db", str(fresh), str(export))
    assert (rc, err) == (1, [])
    assert out[0].startswith("FAILED: the export's chain: first problem: producer ")
    assert out[0].endswith("batch 1: content does not match its digest: rows edited, reordered or replaced")
    assert out[1] == f"nothing imported into {fresh} (--no-verify imports it anyway)"
    assert not fresh.exists()
    with pytest.raises(ChainError, match="batch 1: content does not match its digest"):
        import_parquet(export, fresh)
    assert not fresh.exists()


def test_an_existing_target_keeps_what_it_had(capsys, export, tmp_path):
    batches = export / "batches" / "part-E000001.parquet"
    _rewrite(
        batches, "SELECT * REPLACE (CASE WHEN batch_no = 2 THEN digest ELSE prev_digest END AS prev_digest) FROM {f}"
    )
    target = tmp_path / "target.duckdb"
    other = producer("decode-9", role="decode")
    with AuditStore(target) as s:
        s.append(from_dicts([config(0, other)]))
    before = target.read_bytes()
    rc, out, _ = run_cli(capsys, "audit", "import", "--db", str(target), str(export))
    assert rc == 1 and out[0].endswith("batch 2: broken link: prev_digest does not equal the previous batch's digest")
    assert target.read_bytes() == before


def test_no_verify_imports_a_tampered_export_and_says_so(capsys, export, tmp_path):
    _rewrite(_runs_file(export), "SELECT * REPLACE (CAST(page_start + 1 AS INTEGER) AS page_start) FROM {f}")
    dst = tmp_path / "dst.duckdb"
    rc, out, err = run_cli(capsys, "audit", "import", "--no-verify", "--db", str(dst), str(export))
    assert rc == 0 and out == [f"imported 5 events, 4 page runs, 3 batches into {dst}"]
    assert err == [f"warning: importing {export} without verifying its chain (--no-verify)"]
    assert run_cli(capsys, "audit", "verify", "--db", str(dst))[0] == 1  # the store says what it holds
    other = tmp_path / "other.duckdb"
    assert import_parquet(export, other, verify=False).events == 5
    with connect_readonly(other) as con:
        assert con.execute("SELECT count(*) FROM events").fetchone() == (5,)


def test_an_unreadable_export_is_still_an_exit_2(capsys, export, tmp_path):
    _rewrite(
        export / "batches" / "part-E000001.parquet", "SELECT * REPLACE (CAST(num_runs AS INTEGER) AS num_runs) FROM {f}"
    )
    with pytest.raises(StoreError, match=r"batches: exported columns do not match.*num_runs"):
        verify_export(export)
    rc, out, err = run_cli(capsys, "audit", "import", "--db", str(tmp_path / "d.duckdb"), str(export))
    assert (rc, out, len(err)) == (2, [], 1) and "batches: exported columns do not match" in err[0]
