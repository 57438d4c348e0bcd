"""Persisted findings: a re-run over the same window is idempotent; runs are recorded."""

from __future__ import annotations

from kvtrail.audit.batch import from_dicts
from kvtrail.audit.store import AuditStore
from kvtrail.forensics.replay.engine import replay_store
from kvtrail.forensics.results.persist import finding_id, results_digest, save_findings, stored_findings
from kvtrail.forensics.sql.engine import sql_findings
from tests.forensics.test_replay import pd_request, pd_timeline


def test_rerun_is_idempotent_and_both_engines_share_finding_ids(tmp_path):
    tl = pd_timeline()
    pd_request(tl, "r1", 42, [1], list(range(1, 9)), 120, sent_tokens=1, sent_pages=1)
    tl.alloc("d", "r2", [20])
    tl.free("d", "r2", [20], "abort")
    tl.alloc("d", "r3", [20])
    tl.write("d", "r2", [20])
    with AuditStore(tmp_path / "a.duckdb") as store:
        store.append(from_dicts(tl.events))
        found = replay_store(store.con)
        assert {f.code for f in found} == {"F1", "F2", "F7"}
        first = save_findings(store.con, found, from_ns=None, to_ns=None, engine="replay")
        assert (first.run_id, first.num_findings, first.num_new) == (1, len(found), len(found))
        again = save_findings(store.con, replay_store(store.con), from_ns=None, to_ns=None, engine="replay")
        assert (again.run_id, again.num_new, again.results_digest) == (2, 0, first.results_digest)
        via_sql = save_findings(store.con, sql_findings(store.con), from_ns=None, to_ns=None, engine="sql")
        assert via_sql.num_new == 0 and via_sql.results_digest == first.results_digest
        rows = stored_findings(store.con).to_pylist()
        assert len(rows) == len(found)
        assert {r["finding_id"] for r in rows} == {finding_id(f) for f in found}
        assert all((r["first_run_id"], r["last_run_id"]) == (1, 3) for r in rows)
        f7 = next(r for r in rows if r["code"] == "F7")
        assert f7["victim_request_ids"] == ["r3"] and f7["evidence"][0]["seq"] >= 0
        runs = store.con.execute("SELECT engine, num_new FROM forensic_runs ORDER BY run_id").fetchall()
        assert runs == [("replay", len(found)), ("replay", 0), ("sql", 0)]
    assert results_digest([]) != first.results_digest


def test_stored_findings_window(tmp_path):
    tl = pd_timeline()
    pd_request(tl, "r1", 42, [1], list(range(1, 5)), 60, sent_tokens=1, sent_pages=1)
    with AuditStore(tmp_path / "a.duckdb") as store:
        store.append(from_dicts(tl.events))
        found = replay_store(store.con)
        save_findings(store.con, found, from_ns=None, to_ns=None, engine="replay")
        last = max(f.last_ns for f in found)
        assert stored_findings(store.con, from_ns=last + 1).num_rows == 0
        assert stored_findings(store.con, to_ns=last).num_rows == len(found)
