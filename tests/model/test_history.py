"""Counterexamples as histories: the checked-in fixtures are what the model writes today, ``kvtrail audit
ingest`` stores them, and both findings engines judge each as the matching finding."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtrail.audit.store import AuditStore
from kvtrail.forensics.questions import findings_of
from kvtrail.model.checker import Checker
from kvtrail.model.history import write_history
from kvtrail.model.validate import validate_store
from kvtrail.model.variants import VARIANTS, Bounds
from tests.conftest import run_cli

FIXTURES = Path(__file__).parent / "fixtures"
BOUNDS = Bounds(2, 2, 2)  # the bounds the fixtures were written with (kvtrail model check ... --trace-out)
# what the findings engines must find in each counterexample's history
EXPECTED = {
    "no_foreign_read": {"F1", "F2", "F4"},
    "no_free_before_drain": {"F7"},
    "transferred_equals_reserved": {"F2", "F1"},
    "aborted_never_sent": {"F4", "F2"},
}
CASES = sorted((v.name, d.name) for v in (FIXTURES).iterdir() for d in v.iterdir())


def test_there_are_fixtures_for_both_vulnerable_variants():
    assert {v for v, _ in CASES} == {"vulnerable", "stack-vulnerable"}
    assert len(CASES) == 10


@pytest.mark.parametrize("variant", ["vulnerable", "stack-vulnerable"])
def test_the_fixtures_are_what_the_model_writes(variant, tmp_path):
    res = Checker(VARIANTS[variant], BOUNDS).run()
    for n, cx in enumerate(res.counterexamples):
        for path in write_history(cx, VARIANTS[variant], BOUNDS, tmp_path, n):
            fixture = FIXTURES / variant / path.parent.name / path.name
            assert path.read_text() == fixture.read_text(), fixture


@pytest.mark.parametrize(("variant", "case"), CASES)
def test_each_history_is_judged_as_its_finding(variant, case, tmp_path, capsys):
    prop = case.split("-", 1)[1]
    db = tmp_path / "s.duckdb"
    files = sorted(str(p) for p in (FIXTURES / variant / case).glob("*.jsonl"))
    assert len(files) == 3  # one file per producer
    rc, _, err = run_cli(capsys, "audit", "ingest", "--db", str(db), *files)
    assert rc == 0, err
    with AuditStore(db) as store:
        codes = {eng: {f.code for f in findings_of(store.con, engine=eng)} for eng in ("replay", "sql")}
        judged = validate_store(store.con)
    assert codes["replay"] == codes["sql"]
    assert EXPECTED[prop] <= codes["replay"], (case, codes)
    assert prop in {v["property"] for v in judged["violations"]}  # the monitors see what the checker found
    if prop == "no_free_before_drain":
        late = [v for v in judged["violations"] if v["property"] == prop]
        assert late[0]["first_event"]["node"] == "decode-0"


def test_the_incident_names_the_other_tenant_as_victim(tmp_path, capsys):
    case = next(c for v, c in CASES if v == "vulnerable" and c.startswith("04-"))
    db = tmp_path / "s.duckdb"
    files = sorted(str(p) for p in (FIXTURES / "vulnerable" / case).glob("*.jsonl"))
    assert run_cli(capsys, "audit", "ingest", "--db", str(db), *files)[0] == 0
    with AuditStore(db) as store:
        f1 = [f for f in findings_of(store.con) if f.code == "F1"]
    assert {f.tenant_id for f in f1} == {"tenant-b"}
    assert "tenant-a" in {t for f in f1 for t in f.victim_tenant_ids}
