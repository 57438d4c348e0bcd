"""The views' counts read from the per-minute aggregates a ``--save`` run keeps, equal to the forensics API's
and the events'; a window the aggregates do not cover says so and is counted from the events."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import duckdb
import pytest

from kvtrail import forensics as fx
from kvtrail.audit.batch import from_dicts
from kvtrail.audit.store import AuditStore
from kvtrail.cli import main
from tests.conftest import event, producer
from tests.dashboards.test_app import as_window, iso, metric, run_app

COVER = re.compile(r"aggregates cover (\d+) of the window's (\d+) whole minutes; (.*)")


def coverage(captions: list[str], prefix: str) -> tuple[int, int, str]:
    for text in captions:
        if text.startswith(prefix) or f"; {prefix}" in text:
            m = COVER.search(text)
            assert m, text
            return int(m[1]), int(m[2]), m[3]
    raise AssertionError(f"no caption {prefix!r}: {captions}")


def count(db: Path, sql: str, params: list) -> int:
    with duckdb.connect(str(db), read_only=True) as con:
        return int(con.execute(sql, params).fetchall()[0][0])


@pytest.mark.parametrize("filters", [{}, {"node": "decode-1"}])
def test_a_saved_store_counts_from_its_aggregates(monkeypatch, persisted, window, filters):
    p = iso(window)
    w = as_window(p, **filters)
    at = run_app(monkeypatch, persisted, "Findings", **p, **filters)
    covered, minutes, rest = coverage([c.value for c in at.caption], "counts:")
    assert covered == minutes > 0 and rest == "the rest read from the events"  # the window's edges are partial
    findings = fx.ask_findings(persisted, w).rows
    assert metric(at, "findings") == str(len(findings))
    for sev in ("critical", "high", "medium"):
        assert metric(at, sev) == str(int((findings["severity"] == sev).sum()))
    at = run_app(monkeypatch, persisted, "Transfers", **p, **filters)
    node = "AND node = ?" if filters else ""
    landed = count(
        persisted,
        f"SELECT count(*) FROM events_v WHERE kind = 'transfer_received' AND wall_ns BETWEEN ? AND ? {node}",
        [w.from_ns, w.to_ns, *filters.values()],
    )
    assert metric(at, "transfers received") == str(landed) != "0"
    assert coverage([c.value for c in at.caption], "transfers received:")[0] == minutes
    at = run_app(monkeypatch, persisted, "Fleet", **p, **filters)
    assert coverage([c.value for c in at.caption], "recorder drops:")[:2] == (minutes, minutes)


def test_a_commit_after_the_saved_run_is_counted_from_the_events(monkeypatch, persisted, window, tmp_path):
    db = tmp_path / "later.duckdb"
    shutil.copy(persisted, db)
    assert window.from_ns is not None and window.to_ns is not None
    middle = (window.from_ns + window.to_ns) // 2
    late = producer("decode-9", "decode")
    with AuditStore(db) as store:  # a node that joins later and reports dropped events mid-window
        store.append(
            from_dicts(
                [
                    event(
                        0,
                        "node_config",
                        late,
                        wall_ns=middle,
                        pool_tokens=1_000_000,
                        pool_pages=62_500,
                        page_size=16,
                        context_tokens=400_000,
                    ),
                    event(1, "recorder_gap", late, wall_ns=middle + 1, dropped_events=7, gap_reason="buffer_full"),
                ]
            )
        )
    p = iso(window)
    drops = count(
        db,
        "SELECT coalesce(sum(dropped_events), 0) FROM events_v WHERE kind = 'recorder_gap' AND wall_ns BETWEEN ? AND ?",
        [window.from_ns, window.to_ns + 999],
    )
    assert drops >= 7
    at = run_app(monkeypatch, db, "Fleet", **p)
    covered, minutes, rest = coverage([c.value for c in at.caption], "recorder drops:")
    assert covered == minutes - 1 and rest == "the rest read from the events"  # the minute the commit changed
    assert metric(at, "recorder dropped events") == str(drops)
    at = run_app(monkeypatch, db, "Findings", **p)
    captions = [c.value for c in at.caption]
    assert any("replay of the window" in c and "counts from the findings rows" in c for c in captions), captions
    assert metric(at, "findings") == str(len(fx.ask_findings(db, as_window(p)).rows))
    assert (
        main(
            ["forensics", "findings", "--db", str(db), "--save", "--out", str(tmp_path / "f.json"), "--format", "json"]
        )
        == 0
    )
    at = run_app(monkeypatch, db, "Fleet", **p)
    assert coverage([c.value for c in at.caption], "recorder drops:")[:2] == (minutes, minutes)
    assert metric(at, "recorder dropped events") == str(drops)
