"""The SQL engine per (node, hour) partition of a lake agrees with the replay on the lake and with the SQL
engine and the replay on the store the lake came from."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvtrail import forensics as fx
from kvtrail.audit.lake.fs import LakeFS
from kvtrail.audit.lake.manifest import read_manifest
from kvtrail.audit.lake.partition import HOUR_NS
from kvtrail.cli import main
from kvtrail.forensics.lake.plan import plan_tasks
from kvtrail.forensics.lake.questions import ask_lake_findings, lake_findings, open_lake
from kvtrail.forensics.lake.sqltask import PAGE_CODES, run_sql_task, sql_lake_findings
from kvtrail.forensics.lake.task import LakeCoverageError
from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.forensics.results.persist import finding_id
from kvtrail.forensics.sql.engine import sql_findings
from tests.lake.conftest import BOUNDARY_NS
from tests.lake.test_questions import WINDOWS


@pytest.fixture(scope="module")
def lake(fleet_lake):
    with open_lake(fleet_lake) as lk:
        yield lk


@pytest.mark.parametrize("window", WINDOWS)
def test_sql_on_the_lake_equals_the_replay_and_the_store(lake, fleet_con, window):
    got = sql_lake_findings(lake, *window, ForensicsPolicy(), None)
    assert got == lake_findings(lake, fx.Window(*window))
    want = sql_findings(fleet_con, *window)
    assert got == want
    assert [finding_id(f) for f in got] == [finding_id(f) for f in want]


def test_every_planted_class_and_the_checkpoint_prelude(lake):
    found = sql_lake_findings(lake, None, None, ForensicsPolicy(), None)
    assert {"F1", "F2", "F4", "F5", "F6", "F7", "F8", "F10"} <= {f.code for f in found}
    tasks = plan_tasks(lake.fs, lake.manifest, lake.con, None, None, ForensicsPolicy(), PAGE_CODES, need_joins=False)
    second = [t for t in tasks if t.hours[0] == BOUNDARY_NS // HOUR_NS]
    assert second and all(t.checkpoint is not None for t in second)
    with_prelude = {f for t in second for f in run_sql_task(t).found}
    without = {f for t in second for f in run_sql_task(dataclasses.replace(t, checkpoint=None)).found}
    # the second hour's reads of pages written in the first hour are judged from the checkpoint's prelude
    assert with_prelude <= set(found) and with_prelude != without
    assert any(f.code in ("F1", "F10") and f.first_ns < BOUNDARY_NS <= f.last_ns for f in with_prelude)


def test_only_the_asked_codes(lake, fleet_con):
    w = WINDOWS[2]
    for codes in (("F1", "F5"), ("F2", "F4", "F8")):
        assert sql_lake_findings(lake, *w, ForensicsPolicy(), codes) == sql_findings(fleet_con, *w, codes=codes)


def test_ask_findings_with_the_sql_engine(lake, fleet_db):
    w = fx.Window(*WINDOWS[3])
    a, b = ask_lake_findings(lake, w, engine="sql"), fx.ask_findings(fleet_db, w, engine="sql")
    assert len(a.rows) and a.rows.equals(b.rows) and a.warnings == b.warnings


def test_cli_engine_sql_on_the_lake(fleet_lake, fleet_db, capsys):
    cmd = ["forensics", "findings", "--engine", "sql", "--format", "json", "--code", "F1", "--code", "F7"]
    assert main([*cmd, "--db", fleet_db]) == 0
    want = capsys.readouterr().out
    assert main([*cmd, "--lake", fleet_lake]) == 0
    out = capsys.readouterr().out
    assert out == want and json.loads(out)


def test_altered_checkpoint_refuses_the_sql_engine(lake_copy):
    files = read_manifest(LakeFS.open(lake_copy)).files
    ckpt = sorted(p for p, f in files.items() if f.table == "checkpoint" and f.hour == BOUNDARY_NS // HOUR_NS)
    (Path(lake_copy) / ckpt[0]).write_bytes(b"not a checkpoint")
    with open_lake(lake_copy) as lk, pytest.raises(LakeCoverageError, match="does not match the manifest"):
        sql_lake_findings(lk, None, None, ForensicsPolicy(), ("F1",))
