"""``forensics watch --lake``: a lake followed export by export, each new finding printed once."""

from __future__ import annotations

import dataclasses

import duckdb

from kvtrail import forensics as fx
from kvtrail.audit.lake.export import export_lake
from kvtrail.audit.lake.partition import HOUR_NS
from kvtrail.audit.store import AuditStore
from kvtrail.cli import main
from kvtrail.forensics.lake.checkpointer import write_checkpoints
from kvtrail.forensics.lake.questions import lake_findings, open_lake
from kvtrail.forensics.lake.watch import LakeWatch
from kvtrail.forensics.replay.engine import replay_store
from kvtrail.forensics.results.persist import finding_id
from kvtrail.sim.fleet import write_fleet
from tests.lake.conftest import BOUNDARY_NS, FLEET, make_store


def test_new_exports_print_only_new_findings(tmp_path):
    db = make_store(tmp_path / "s.duckdb")
    lake = str(tmp_path / "lake")
    watcher = LakeWatch(lake)
    assert watcher.poll() == [] and watcher.manifest == 0  # no export yet
    export_lake(db, lake, checkpoints=write_checkpoints)
    first = watcher.poll()
    with duckdb.connect(db, read_only=True) as con:
        assert first == replay_store(con)
    runs_first = watcher.tasks_run
    assert watcher.poll() == [] and watcher.tasks_run == runs_first  # no new manifest: nothing re-run
    # more traffic ends the second hour and starts a third; a second export lands
    later = dataclasses.replace(FLEET, seed=2, start_ns=BOUNDARY_NS + HOUR_NS - 5_000_000_000, hours=0.003)
    with AuditStore(db) as store:
        write_fleet(later, store, str(tmp_path / "t2.json"))
    export_lake(db, lake, checkpoints=write_checkpoints)
    second = watcher.poll()
    assert second and watcher.manifest == 2
    assert watcher.tasks_run - runs_first < len(watcher.results)  # the unchanged first hour was not re-run
    ids_first, ids_second = {finding_id(f) for f in first}, {finding_id(f) for f in second}
    assert not ids_first & ids_second  # printed once
    with open_lake(lake) as lk:
        now = {finding_id(f) for f in lake_findings(lk, fx.Window())}
    assert ids_second <= now and now <= ids_first | ids_second
    assert any(f.last_ns >= BOUNDARY_NS + HOUR_NS for f in second)


def test_cli_watch_lake(fleet_lake, fleet_con, capsys):
    assert main(["forensics", "watch", "--lake", fleet_lake, "--polls", "2", "--interval", "0.05"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == len(replay_store(fleet_con)) and len(set(lines)) == len(lines)
    assert "watched manifest 1" in err and "in 2 polls" in err


def test_cli_watch_lake_before_any_export(tmp_path, capsys):
    assert main(["forensics", "watch", "--lake", str(tmp_path / "none"), "--polls", "1"]) == 0
    assert "holds no lake manifest yet" in capsys.readouterr().err
    assert main(["forensics", "watch", "--lake", str(tmp_path), "--url", "http://127.0.0.1:1"]) == 2
    assert main(["forensics", "watch", "--workers", "2"]) == 2
