"""kvtrail lake export / verify: the layout, incremental exports, many stores, tampering named, signatures."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest

from kvtrail.audit.chain import generate_keypair
from kvtrail.audit.lake.export import export_lake
from kvtrail.audit.lake.fs import LakeFS
from kvtrail.audit.lake.manifest import FileEntry, read_manifest
from kvtrail.audit.lake.partition import HOUR_NS
from kvtrail.audit.lake.verify import verify_lake
from kvtrail.audit.store import AuditStore
from kvtrail.cli import main
from kvtrail.forensics.lake.checkpointer import write_checkpoints
from kvtrail.forensics.lake.questions import lake_findings, open_lake
from kvtrail.forensics.replay.engine import replay_store
from kvtrail.forensics.window import Window
from kvtrail.sim.fleet import write_fleet
from tests.lake.conftest import BOUNDARY_NS, FLEET, make_store, second_cluster


def _files(lake: str, table: str) -> dict[str, FileEntry]:
    return read_manifest(LakeFS.open(lake)).files_of(table)


def test_layout_rows_and_checkpoints(fleet_lake, fleet_con):
    events = _files(fleet_lake, "events")
    assert all("/cluster=fleet-sim/node=" in p and "/date=2026-09-01/hour=0" in p for p in events)
    boundary_hour = BOUNDARY_NS // HOUR_NS
    assert {f.hour for f in events.values()} == {boundary_hour - 1, boundary_hour}  # around the boundary
    assert sum(f.rows for f in events.values()) == fleet_con.execute("SELECT count(*) FROM events").fetchone()[0]
    runs = sum(f.rows for f in _files(fleet_lake, "page_runs").values())
    assert runs == fleet_con.execute("SELECT count(*) FROM page_runs").fetchone()[0]
    # one checkpoint beside each partition, its digest in the manifest
    ckpts = _files(fleet_lake, "checkpoint")
    parts = {(f.node, f.hour) for f in events.values()}
    assert {(f.node, f.hour) for f in ckpts.values()} == parts
    assert all(Path(p).parent.as_posix() in {Path(e).parent.as_posix() for e in events} for p in ckpts)
    f = next(iter(events))
    table = pq.read_table(str(Path(fleet_lake) / f))
    assert table.column_names == [r[0] for r in fleet_con.execute("DESCRIBE events").fetchall()]
    doc = read_manifest(LakeFS.open(fleet_lake)).doc
    heads = dict(fleet_con.execute("SELECT producer_id::VARCHAR, max(batch_no) FROM batches GROUP BY 1").fetchall())
    assert {k: v["batch_no"] for k, v in doc.chain_heads.items()} == heads


def test_verify_ok_and_cli(fleet_lake, capsys):
    r = verify_lake(fleet_lake)
    assert r.ok, r.problems
    assert r.batches_checked > 0
    assert main(["lake", "verify", fleet_lake]) == 0
    assert "ok: manifest 1" in capsys.readouterr().out


def _some(lake: str, table: str) -> Path:
    return Path(lake) / sorted(_files(lake, table))[0]


@pytest.mark.parametrize("damage", ["edit", "delete", "extra", "checkpoint"])
def test_tampering_is_named(lake_copy, damage, capsys):
    if damage == "edit":
        path = _some(lake_copy, "events")
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        want = "altered file: " + path.relative_to(lake_copy).as_posix()
    elif damage == "delete":
        path = _some(lake_copy, "page_runs")
        path.unlink()
        want = "missing file: " + path.relative_to(lake_copy).as_posix()
    elif damage == "extra":
        path = _some(lake_copy, "events").with_name("part-extra.parquet")
        path.write_bytes(b"PAR1")
        want = "extra file: " + path.relative_to(lake_copy).as_posix()
    else:
        path = _some(lake_copy, "checkpoint")
        path.write_bytes(path.read_bytes() + b"x")
        want = "altered file: " + path.relative_to(lake_copy).as_posix()
    assert main(["lake", "verify", lake_copy]) == 1
    assert want in capsys.readouterr().err


def test_incremental_export_adds_only_new_batches(tmp_path):
    db = make_store(tmp_path / "s.duckdb")
    lake = str(tmp_path / "lake")
    first = export_lake(db, lake, checkpoints=write_checkpoints)
    assert export_lake(db, lake, checkpoints=write_checkpoints).files == 0  # nothing new: no new manifest
    # the later run ends the second hour and starts a third: its checkpoint resumes from the second's
    later = dataclasses.replace(FLEET, seed=2, start_ns=BOUNDARY_NS + HOUR_NS - 5_000_000_000, hours=0.003)
    with AuditStore(db) as store:
        write_fleet(later, store, str(tmp_path / "t2.json"))
    second = export_lake(db, lake, checkpoints=write_checkpoints)
    assert second.export_no == first.export_no + 1
    with duckdb.connect(db, read_only=True) as con:
        total = con.execute("SELECT count(*) FROM batches").fetchone()[0]
    assert first.batches + second.batches == total
    m = read_manifest(LakeFS.open(lake))
    assert {f.export_no for f in m.files_of("events").values()} == {1, 2}
    assert {f.hour for f in m.files_of("checkpoint").values() if f.export_no == 2} == {BOUNDARY_NS // HOUR_NS + 1}
    assert verify_lake(lake).ok
    # the second export's checkpoints continue the first's state: answers still equal the store's
    with duckdb.connect(db, read_only=True) as con, open_lake(lake) as lk:
        assert lake_findings(lk, Window()) == replay_store(con)


def test_many_stores_one_lake(tmp_path, fleet_db):
    west = make_store(tmp_path / "west.duckdb", second_cluster())
    lake = str(tmp_path / "lake")
    export_lake(fleet_db, lake, checkpoints=write_checkpoints)
    export_lake(west, lake, checkpoints=write_checkpoints)
    m = read_manifest(LakeFS.open(lake))
    assert {p["cluster"] for p in m.doc.producers.values()} == {"fleet-sim", "fleet-west"}
    r = verify_lake(lake)
    assert r.ok, r.problems


def test_signed_manifest(tmp_path, fleet_db, capsys):
    key, pub = tmp_path / "k.pem", tmp_path / "k.pub"
    generate_keypair(key, pub)
    lake = str(tmp_path / "lake")
    assert main(["lake", "export", "--db", fleet_db, "--to", lake, "--signing-key", str(key)]) == 0
    assert main(["lake", "verify", lake, "--public-key", str(pub)]) == 0
    path = Path(lake) / "manifests" / "manifest-000001.json"
    doc = json.loads(path.read_text())
    doc["chain_heads"] = {}
    path.write_text(json.dumps(doc))
    capsys.readouterr()
    assert main(["lake", "verify", lake, "--public-key", str(pub)]) == 1
    assert "signature does not verify" in capsys.readouterr().err


def test_unsigned_manifest_fails_with_a_key(tmp_path, fleet_lake, capsys):
    key, pub = tmp_path / "k.pem", tmp_path / "k.pub"
    generate_keypair(key, pub)
    assert main(["lake", "verify", fleet_lake, "--public-key", str(pub)]) == 1
    assert "not signed" in capsys.readouterr().err


def test_since_exports_later_batches_and_still_verifies(tmp_path):
    db = make_store(tmp_path / "s.duckdb", dataclasses.replace(FLEET, events_per_batch=400))
    lake = str(tmp_path / "lake")
    assert main(["lake", "export", "--db", db, "--to", lake, "--since", "2026-09-01T01:00:05Z"]) == 0
    m = read_manifest(LakeFS.open(lake))
    assert m.doc.anchors and all(a["batch_no"] > 0 for a in m.doc.anchors.values())
    with duckdb.connect(db, read_only=True) as con:
        total = con.execute("SELECT count(*) FROM batches").fetchone()[0]
    assert 0 < sum(f.rows for f in m.files_of("batches").values()) < total
    r = verify_lake(lake)
    assert r.ok, r.problems


def test_each_manifest_carries_the_store_log_it_covers(tmp_path):
    """Every export records the store's tree size and root; a later export's tree extends the earlier one."""
    import base64

    from kvtrail.audit.merkle import verify_consistency
    from kvtrail.audit.store import connect_readonly
    from kvtrail.audit.tlog import LogView

    db = make_store(tmp_path / "s.duckdb")
    lake = str(tmp_path / "lake")
    export_lake(db, lake, checkpoints=write_checkpoints)
    first = read_manifest(LakeFS.open(lake)).tree
    later = dataclasses.replace(FLEET, seed=2, start_ns=BOUNDARY_NS + HOUR_NS - 5_000_000_000, hours=0.003)
    with AuditStore(db) as store:
        write_fleet(later, store, str(tmp_path / "t2.json"))
    export_lake(db, lake, checkpoints=write_checkpoints)
    second = read_manifest(LakeFS.open(lake)).tree
    con = connect_readonly(db)
    view = LogView(con)
    con.close()
    assert first is not None and second is not None and first[0] == second[0] == view.origin
    assert second[1] == view.size > first[1] and second[2] == base64.b64encode(view.tree.root()).decode()
    old_root = base64.b64decode(first[2])
    assert old_root == view.tree.root(first[1])
    assert verify_consistency(
        first[1], second[1], old_root, view.tree.root(), view.tree.consistency_proof(first[1], second[1])
    )
    assert verify_lake(lake).ok
