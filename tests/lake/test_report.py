"""`forensics report --lake` equals the report on the store the lake came from, records the lake manifest,
and `verify-report --lake` re-checks it: a changed lake fails naming what changed, a grown one still verifies."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from kvtrail.audit.lake.export import export_lake
from kvtrail.audit.lake.fs import LakeFS
from kvtrail.audit.lake.manifest import read_manifest
from kvtrail.audit.lake.partition import HOUR_NS
from kvtrail.cli import main
from kvtrail.forensics.lake.checkpointer import write_checkpoints
from kvtrail.timeutil import format_utc
from tests.lake.conftest import BOUNDARY_NS, make_store, second_cluster

S = 1_000_000_000
WINDOW = ["--from", format_utc(BOUNDARY_NS - 9 * S), "--to", format_utc(BOUNDARY_NS + 14 * S)]


@pytest.fixture(scope="module")
def reports(tmp_path_factory, fleet_db, fleet_lake):
    base = tmp_path_factory.mktemp("reports")
    assert main(["forensics", "report", "--db", fleet_db, *WINDOW, "--out", str(base / "store")]) == 0
    assert main(["forensics", "report", "--lake", fleet_lake, *WINDOW, "--out", str(base / "lake")]) == 0
    return base / "store", base / "lake"


@pytest.fixture
def copied(tmp_path, reports, lake_copy):
    shutil.copytree(reports[1], tmp_path / "out")
    return tmp_path / "out", lake_copy


def _doc(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def _verify(capsys, out, lake) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["forensics", "verify-report", str(out), "--lake", str(lake)])
    return rc, capsys.readouterr().out


def test_lake_report_equals_the_store_report(reports, fleet_lake):
    store, lake = (_doc(d) for d in reports)
    assert store["counts"]["affected_responses"] > 0 and store["counts"]["findings"] > 0
    assert lake["results_digest"] == store["results_digest"]
    assert lake["counts"] == store["counts"] and lake["chain_heads"] == store["chain_heads"]
    for name in ("affected_responses.csv", "exposed_tenants.json"):
        assert (reports[1] / name).read_bytes() == (reports[0] / name).read_bytes()
    assert "lake" not in store
    m = read_manifest(LakeFS.open(fleet_lake))
    assert lake["lake"] == {
        "url": fleet_lake,
        "manifest": m.number,
        "chain_heads": m.doc.chain_heads,
        "manifest_sha256": hashlib.sha256(m.raw).hexdigest(),
    }
    assert f"verify-report REPORT_DIR --lake {fleet_lake}" in (reports[1] / "report.md").read_text()


def test_verify_report_on_the_lake(reports, fleet_lake, capsys):
    rc, out = _verify(capsys, reports[1], fleet_lake)
    assert rc == 0, out
    assert f"matches the lake {fleet_lake} (lake manifest, results digest" in out


def _partition(lake: str, table: str) -> str:
    files = read_manifest(LakeFS.open(lake)).files
    return sorted(p for p, f in files.items() if f.table == table and f.hour == BOUNDARY_NS // HOUR_NS)[0]


def test_altered_partition_is_named(copied, capsys):
    out, lake = copied
    part = _partition(lake, "events")
    (Path(lake) / part).write_bytes(b"PAR1 not the exported rows PAR1")
    rc, text = _verify(capsys, out, lake)
    assert rc == 1
    assert f"FAILED: lake: altered file: {part}" in text
    assert "results could not be recomputed" in text  # the question refuses: never an answer from less


def test_missing_partition_is_named(copied, capsys):
    out, lake = copied
    part = _partition(lake, "page_runs")
    (Path(lake) / part).unlink()
    rc, text = _verify(capsys, out, lake)
    assert rc == 1
    assert f"FAILED: lake: missing file: {part}" in text
    assert f"partition file missing: {part}" in text


def test_altered_or_missing_manifest_is_named(copied, capsys):
    out, lake = copied
    manifest = Path(lake) / "manifests" / "manifest-000001.json"
    manifest.write_text(manifest.read_text().replace('"export_no": 1', '"export_no": 1 '))
    rc, text = _verify(capsys, out, lake)
    assert rc == 1 and "lake manifest manifests/manifest-000001.json: altered" in text
    manifest.unlink()
    rc, text = _verify(capsys, out, lake)
    assert rc == 1 and "lake manifest manifests/manifest-000001.json: missing" in text


def test_a_lake_that_grew_still_verifies(copied, tmp_path, capsys):
    out, lake = copied
    export_lake(make_store(tmp_path / "west.duckdb", second_cluster()), lake, checkpoints=write_checkpoints)
    rc, text = _verify(capsys, out, lake)
    assert rc == 0, text
    assert "new exports since the report (manifest 2 now); results were re-computed from manifest 1" in text


def test_a_store_report_is_not_verified_against_a_lake(reports, fleet_lake, capsys):
    assert main(["forensics", "verify-report", str(reports[0]), "--lake", fleet_lake]) == 2
    assert "records no lake manifest" in capsys.readouterr().err


def test_report_flags(tmp_path, fleet_lake, fleet_db, capsys):
    inside = str(Path(fleet_lake) / "out")
    assert main(["forensics", "report", "--lake", fleet_lake, *WINDOW, "--out", inside]) == 2
    assert "inside the lake" in capsys.readouterr().err and not Path(inside).exists()
    assert main(["forensics", "report", "--db", fleet_db, *WINDOW, "--out", str(tmp_path / "o"), "--workers", "2"]) == 2
    assert "only with --lake" in capsys.readouterr().err
    assert main(["forensics", "verify-report", str(tmp_path), "--db", fleet_db, "--scheduler", "tcp://x:1"]) == 2
