"""Lakes of manifest format 1 (``tests/lake/data``, written by that format's code) still verify, answer,
import and grow; a whole-store export (``kvtrail audit export``) answers like its store."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from kvtrail import forensics as fx
from kvtrail.audit.batch import from_dicts
from kvtrail.audit.export import export_parquet, import_parquet
from kvtrail.audit.lake.catalog import LAKE_TABLES
from kvtrail.audit.lake.export import export_lake
from kvtrail.audit.lake.fs import LakeFS
from kvtrail.audit.lake.manifest import FORMAT_VERSION, manifest_name, read_manifest
from kvtrail.audit.lake.verify import verify_lake
from kvtrail.audit.store import AuditStore, connect_readonly
from kvtrail.cli import main
from kvtrail.forensics.lake.checkpointer import write_checkpoints
from kvtrail.forensics.lake.questions import lake_findings, open_lake
from kvtrail.forensics.replay.engine import replay_store
from tests.audit.test_export import DECODE, MIDNIGHT, build_store, traffic
from tests.audit.test_export_formats import digests
from tests.lake.conftest import BOUNDARY_NS

DATA = Path(__file__).parent / "data"
RECORD = json.loads((DATA / "lake-format1.json").read_text())


@pytest.fixture
def old_lake(tmp_path) -> str:
    dst = tmp_path / "lake"
    shutil.copytree(DATA / "lake-format1", dst)
    return str(dst)


def _store_found(db: Path) -> list:
    with connect_readonly(db) as con:
        return sorted([f.code, f.node, f.request_id, f.first_ns] for f in replay_store(con))


def _found(lake: str) -> list:
    with open_lake(lake) as lk:
        return sorted([f.code, f.node, f.request_id, f.first_ns] for f in lake_findings(lk, fx.Window()))


def test_a_format1_lake_verifies_and_answers_as_it_did(old_lake, capsys):
    r = verify_lake(old_lake)
    assert r.ok, r.problems
    assert (r.manifest, r.files_checked, r.batches_checked) == (2, RECORD["files_checked"], RECORD["batches_checked"])
    assert main(["lake", "verify", old_lake]) == 0
    assert _found(old_lake) == RECORD["findings"]
    # its manifests are read as written: format 1, and an edit is still named
    assert json.loads(Path(old_lake, manifest_name(2)).read_text())["format_version"] == 1
    some = sorted(read_manifest(LakeFS.open(old_lake)).files_of("page_runs"))[0]
    Path(old_lake, some).write_bytes(Path(old_lake, some).read_bytes() + b"x")
    assert f"altered file: {some} (SHA-256 differs from the manifest)" in verify_lake(old_lake).problems


def test_a_format1_lake_imports_as_its_store_and_the_store_answers_the_same(old_lake, tmp_path):
    dst = tmp_path / "dst.duckdb"
    import_parquet(old_lake, dst)
    assert digests(dst, LAKE_TABLES) == RECORD["tables"]
    assert _store_found(dst) == _found(old_lake) == RECORD["findings"]


def test_a_format1_lake_grows_by_a_format2_export(old_lake, tmp_path):
    """The store the fixture came from, rebuilt (its digests do not depend on when it was written), goes on."""
    src = tmp_path / "src.duckdb"
    build_store(src)
    with AuditStore(src) as store:
        store.append(from_dicts(traffic(DECODE, 9, MIDNIGHT + 3_700 * 10**9, "r9")))
    assert export_lake(src, old_lake, checkpoints=write_checkpoints).files == 0  # the lake holds every batch
    with AuditStore(src) as store:
        store.append(from_dicts(traffic(DECODE, 16, MIDNIGHT + 3_800 * 10**9, "r10")))
    assert export_lake(src, old_lake, checkpoints=write_checkpoints).export_no == 3
    raw2 = Path(old_lake, manifest_name(2)).read_bytes()
    doc3 = json.loads(Path(old_lake, manifest_name(3)).read_text())
    assert doc3["format_version"] == FORMAT_VERSION == 2
    assert doc3["prev_manifest_sha256"] == hashlib.sha256(raw2).hexdigest()
    r = verify_lake(old_lake)
    assert r.ok and r.batches_checked == RECORD["batches_checked"] + 1, r.problems
    assert _found(old_lake) == _store_found(src)


@pytest.mark.parametrize("window", [(None, None), (BOUNDARY_NS - 3_000_000_000, BOUNDARY_NS + 4_000_000_000)])
def test_a_whole_store_export_answers_like_its_store(fleet_db, fleet_con, tmp_path_factory, window):
    out = tmp_path_factory.getbasetemp() / "whole-store-export"
    if not out.exists():
        export_parquet(fleet_db, out, checkpoints=write_checkpoints)
    assert verify_lake(str(out)).ok
    with open_lake(str(out)) as lk:
        assert lake_findings(lk, fx.Window(*window)) == replay_store(fleet_con, *window)
