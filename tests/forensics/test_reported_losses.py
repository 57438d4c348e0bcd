"""Events a recorder reported lost are a coverage gap of every answer and report over their window.

``kvtrail audit verify`` counts them as explained (the producer said so), but nothing can check what they
recorded: an answer that says "no affected responses" over a record missing three quarters of a node's
events must say that too, per producer instance and reason, from the store and from a lake alike.
"""

from __future__ import annotations

import pytest

from kvtrail.audit.events import Producer, RequestRef
from kvtrail.audit.lake.export import export_lake
from kvtrail.audit.recorder import Recorder, RecorderConfig
from kvtrail.audit.store import connect_readonly
from kvtrail.forensics import Window, ask_affected, ask_findings
from kvtrail.forensics.lake.checkpointer import write_checkpoints
from kvtrail.forensics.lake.questions import ask_lake_affected, ask_lake_findings, open_lake
from kvtrail.forensics.options import ReportOptions
from kvtrail.forensics.symptoms import reported_losses
from kvtrail.report.build import build_report
from tests.conftest import stored_events

EXPECTED = (
    "coverage: recorders reported 153 event(s) lost before they were stored (decode-0 (inst-1): 151 buffer full, "
    "2 refused as invalid); what those events recorded cannot be checked, so findings may be missing and counts too low"
)


@pytest.fixture(scope="module")
def lossy(tmp_path_factory):
    """A decode node whose 50-event buffer overflowed (151 dropped), then 2 events refused as invalid."""
    path = tmp_path_factory.mktemp("lossy") / "a.duckdb"
    rec = Recorder(
        path,
        Producer("c1", "decode-0", "decode", "kvtrail-reference", "0.1", "inst-1"),
        RecorderConfig(flush_interval_s=3600, capacity_events=50),
    )
    rec.node_config(pool_tokens=64 * 16, pool_pages=64, page_size=16, context_tokens=4096)
    for i in range(200):
        rec.pages_allocated(RequestRef(f"r{i}", tenant_id="acme"), [1 + i % 60], "decode_growth")
    assert rec.flush(10)
    for page in (70, 71):  # beyond the pool: refused
        rec.pages_allocated(RequestRef("late", tenant_id="acme"), [page], "decode_growth")
    rec.pages_allocated(RequestRef("late", tenant_id="acme"), [5], "decode_growth")
    assert rec.flush(10)
    stats = rec.stats()
    rec.close()
    assert (stats["dropped_events_total"], stats["invalid_events_total"]) == (151, 2)
    return str(path)


def test_reported_losses_per_instance_and_reason(lossy):
    con = connect_readonly(lossy)
    try:
        losses = reported_losses(con)
        walls = [e["wall_ns"] for e in stored_events(lossy)]
        before = reported_losses(con, Window(to_ns=min(walls) - 1))
    finally:
        con.close()
    assert losses.rows() == [("decode-0", "inst-1", "buffer_full", 151, 151), ("decode-0", "inst-1", "invalid", 2, 0)]
    assert before.is_empty()  # no batch of the window holds a gap event


def test_every_answer_says_what_the_recorders_reported_lost(lossy):
    walls = [e["wall_ns"] for e in stored_events(lossy)]
    answer = ask_affected(lossy)
    assert answer.rows.is_empty()  # nothing affected in what was stored ...
    (text,) = [t for t in answer.warnings if t.startswith("coverage: recorders reported")]
    assert text == EXPECTED  # ... and it says what it could not see
    assert text == [t for t in ask_findings(lossy).warnings if t.startswith("coverage: recorders")][0]
    assert not [t for t in ask_affected(lossy, Window(to_ns=min(walls) - 1)).warnings if "recorders" in t]
    with connect_readonly(lossy) as con:
        report = build_report(con, ReportOptions(from_ns=min(walls), to_ns=max(walls)))
    assert text in report.warnings


def test_a_lake_answer_carries_the_same_warning(lossy, tmp_path):
    lake = str(tmp_path / "lake")
    export_lake(lossy, lake, checkpoints=write_checkpoints)
    with open_lake(lake) as lk:
        assert ask_lake_affected(lk).warnings == ask_affected(lossy).warnings
        assert ask_lake_findings(lk).warnings == ask_findings(lossy).warnings
