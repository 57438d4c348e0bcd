"""Forensics on a lake equal forensics on the store it came from: findings (same ids), affected, exposure."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvtrail import forensics as fx
from kvtrail.audit.lake.fs import LakeFS
from kvtrail.audit.lake.manifest import read_manifest
from kvtrail.audit.lake.partition import HOUR_NS
from kvtrail.audit.store import read_events
from kvtrail.cli import main
from kvtrail.forensics.lake import checkpoint
from kvtrail.forensics.lake.executor import LocalExecutor, map_largest_first
from kvtrail.forensics.lake.merge import merged_findings
from kvtrail.forensics.lake.plan import plan_tasks
from kvtrail.forensics.lake.questions import (
    ask_lake_affected,
    ask_lake_exploitation,
    ask_lake_exposure,
    ask_lake_findings,
    ask_lake_thresholds,
    lake_findings,
    open_lake,
)
from kvtrail.forensics.lake.task import LakeCoverageError, run_task
from kvtrail.forensics.options import ReportOptions
from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.forensics.replay.engine import ReplayEngine, replay_store
from kvtrail.forensics.replay.pagestate import PAGE_ARRAYS
from kvtrail.forensics.results.persist import finding_id, results_digest
from tests.lake.conftest import BOUNDARY_NS

S = 1_000_000_000
# Whole history; from inside the first hour; across the boundary; inside the second hour only (the replay
# starts at the first hour's node_config: joins-only tasks there); up to the boundary.
WINDOWS = [
    (None, None),
    (BOUNDARY_NS - 9 * S, None),
    (BOUNDARY_NS - 3 * S, BOUNDARY_NS + 4 * S),
    (BOUNDARY_NS + 1 * S, BOUNDARY_NS + 14 * S),
    (None, BOUNDARY_NS + 2 * S),
]


@pytest.fixture(scope="module")
def lake(fleet_lake):
    with open_lake(fleet_lake) as lk:
        yield lk


@pytest.mark.parametrize("window", WINDOWS)
def test_findings_equal_the_store(lake, fleet_con, window):
    want = replay_store(fleet_con, *window)
    got = lake_findings(lake, fx.Window(*window))
    assert got == want
    assert [finding_id(f) for f in got] == [finding_id(f) for f in want]


def test_every_planted_class_and_boundary_crossings(lake, fleet_con):
    found = lake_findings(lake, fx.Window())
    assert {"F1", "F2", "F4", "F5", "F6", "F7", "F8", "F10"} <= {f.code for f in found}
    # the second hour reads pages written in the first: without its checkpoint it is judged otherwise
    tasks = plan_tasks(lake.fs, lake.manifest, lake.con, None, None, ForensicsPolicy(), None, need_joins=True)
    assert all(t.checkpoint is not None for t in tasks)
    blind = [dataclasses.replace(t, checkpoint=None) if t.hours[0] == BOUNDARY_NS // HOUR_NS else t for t in tasks]
    without = merged_findings([run_task(t) for t in blind], ForensicsPolicy(), None, None, need_joins=True)
    assert without != found
    late = [f for f in found if f.code in ("F1", "F5", "F7") and f.last_ns >= BOUNDARY_NS]
    assert late and not set(late) <= set(without)  # the second hour's page findings need the first hour's state
    # transfers reserved before the boundary and received after it
    spanning = fleet_con.execute(
        "SELECT count(*) FROM events r JOIN events c USING (transfer_id, request_id) WHERE r.kind = "
        "'transfer_reserved' AND c.kind = 'transfer_received' AND r.wall_ns < ? AND c.wall_ns >= ?",
        [BOUNDARY_NS, BOUNDARY_NS],
    ).fetchone()[0]
    assert spanning > 0


def test_affected_and_exposure_equal_the_store(lake, fleet_db):
    for window in WINDOWS[2:3]:
        w = fx.Window(*window)
        assert ask_lake_affected(lake, w).rows.equals(fx.ask_affected(fleet_db, w).rows)
        assert ask_lake_exposure(lake, w).rows.equals(fx.ask_exposure(fleet_db, w).rows)
    w = fx.Window(tenant="tenant-001", node="decode-0")
    a, b = ask_lake_findings(lake, w), fx.ask_findings(fleet_db, w)
    assert len(a.rows) and a.rows.equals(b.rows) and a.warnings == b.warnings and a.notes == b.notes


def test_cli_lake_matches_db(fleet_lake, fleet_db, capsys):
    for cmd in (["affected"], ["findings", "--code", "F1", "--code", "F2"]):
        assert main(["forensics", *cmd, "--db", fleet_db, "--format", "json"]) == 0
        want = capsys.readouterr().out
        assert main(["forensics", *cmd, "--lake", fleet_lake, "--format", "json"]) == 0
        assert capsys.readouterr().out == want


def test_checkpoint_round_trip(fleet_con):
    engine = ReplayEngine({}, codes=("F1",), fast=False)
    engine.feed(read_events(fleet_con, "node = 'decode-0' AND wall_ns < ?", [BOUNDARY_NS]))
    key = ("fleet-sim", "decode-0")
    data = checkpoint.capture(engine.state, key, BOUNDARY_NS)
    fresh = ReplayEngine({}, codes=("F1",), fast=False)
    info = checkpoint.restore(data, fresh.state)
    assert info.has_pool and info.boundary_ns == BOUNDARY_NS
    a, b = engine.state.pools[key], fresh.state.pools[key]
    names = lambda s, p, arr: [s.requests[r] if r >= 0 else None for r in arr.tolist()]  # noqa: E731
    for spec in PAGE_ARRAYS:
        if spec.name in ("owner", "alloc_req", "writer"):
            assert names(engine.state, a, getattr(a, spec.name)) == names(fresh.state, b, getattr(b, spec.name))
        elif spec.name not in ("share_head",):
            assert (getattr(a, spec.name) == getattr(b, spec.name)).all(), spec.name
    ids = lambda st, sh: {p: {st.requests[r]: h for r, h in d.items()} for p, d in sh.items()}  # noqa: E731
    assert ids(engine.state, a.shared()) == ids(fresh.state, b.shared())
    assert checkpoint.capture(fresh.state, key, BOUNDARY_NS) == data


def test_missing_partition_refuses(lake_copy):
    files = read_manifest(LakeFS.open(lake_copy)).files
    events = sorted(p for p, f in files.items() if f.table == "events" and f.hour == BOUNDARY_NS // HOUR_NS)
    (Path(lake_copy) / events[0]).unlink()
    with pytest.raises(LakeCoverageError, match="partition file missing: " + events[0]):
        with open_lake(lake_copy) as lk:
            lake_findings(lk, fx.Window())


def test_altered_checkpoint_refuses(lake_copy, capsys):
    files = read_manifest(LakeFS.open(lake_copy)).files
    ckpt = sorted(p for p, f in files.items() if f.table == "checkpoint" and f.hour == BOUNDARY_NS // HOUR_NS)
    (Path(lake_copy) / ckpt[0]).write_bytes(b"not a checkpoint")
    assert main(["forensics", "affected", "--lake", lake_copy]) == 2
    err = capsys.readouterr().err
    assert f"{ckpt[0]} does not match the manifest (altered); no answer" in err


def test_lake_flags_need_a_lake(fleet_db, capsys):
    assert main(["forensics", "affected", "--db", fleet_db, "--workers", "2"]) == 2
    assert "--scheduler/--workers: only with --lake" in capsys.readouterr().err
    assert main(["forensics", "findings", "--lake", "x", "--save"]) == 2
    assert "--lake: not with --save" in capsys.readouterr().err


def test_results_digest_equal(lake, fleet_con):
    w = WINDOWS[3]
    assert results_digest(lake_findings(lake, fx.Window(*w))) == results_digest(replay_store(fleet_con, *w))


def test_thresholds_and_exploitation_equal_the_store(lake, fleet_db):
    w = fx.Window(*WINDOWS[2])
    a, b = ask_lake_thresholds(lake, w), fx.ask_thresholds(fleet_db, w)
    assert a.rows.equals(b.rows) and a.notes == b.notes and a.summary == b.summary
    o = ReportOptions(w.from_ns, w.to_ns)
    a, b = ask_lake_exploitation(lake, o), fx.ask_exploitation(fleet_db, o)
    assert len(a.rows) and a.rows.equals(b.rows) and a.notes == b.notes


def test_tasks_are_handed_out_largest_first_and_answered_in_order():
    handed: list[int] = []

    class Recording(LocalExecutor):
        def map(self, fn, items, label="tasks"):
            handed.extend(items)
            return super().map(fn, items, label)

    costs = [3, 9, 1, 9, 5]
    got = map_largest_first(Recording(), lambda c: c * 10, costs, cost=lambda c: c)
    assert got == [30, 90, 10, 90, 50]
    assert handed == [9, 9, 5, 3, 1]


def test_plan_costs_are_the_tasks_file_bytes(lake):
    tasks = plan_tasks(lake.fs, lake.manifest, lake.con, None, None, ForensicsPolicy(), None, need_joins=True)
    files = lake.manifest.files
    for t in tasks:
        listed = [p for table, entries in t.files if table in ("events", "page_runs") for p, _ in entries]
        assert t.cost == sum(files[p].bytes for p in listed) + files[t.checkpoint[0]].bytes > 0
