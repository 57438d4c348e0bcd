"""``kvtrail model check|validate`` as a user runs them: exit codes, the JSON shapes, bad input."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli


def test_check_patched_exits_0_and_prints_states_depth_time(capsys):
    rc, out, _ = run_cli(capsys, "model", "check", "--variant", "stack-patched", "--requests", "2", "--pages", "2")
    assert rc == 0
    assert "states explored, depth" in out[1] and out[1].split()[0].isdigit()
    assert all(line.strip().startswith("holds") for line in out[2:7])


def test_check_vulnerable_json_is_exactly_the_documented_object(capsys, tmp_path):
    out_dir = tmp_path / "traces"
    rc, out, err = run_cli(
        capsys,
        "model",
        "check",
        "--variant",
        "vulnerable",
        "--requests",
        "2",
        "--pages",
        "2",
        "--json",
        "--trace-out",
        str(out_dir),
    )
    assert rc == 1
    doc = json.loads("\n".join(out))
    assert list(doc) == ["variant", "bounds", "states", "depth", "seconds", "violations"]
    assert doc["variant"] == "vulnerable" and doc["states"] > 1000
    assert doc["bounds"]["requests"] == 2 and doc["bounds"]["pages"] == 2
    props = [v["property"] for v in doc["violations"]]
    assert "no_foreign_read" in props and "no_free_before_drain" in props
    for v in doc["violations"]:
        assert list(v) == ["property", "trace"]
        assert sum(1 for s in v["trace"] if s.get("counterexample_of") == v["property"]) == 1
        assert {s["node"] for s in v["trace"]} <= {"router-0", "prefill-0", "decode-0"}
    folders = sorted(p.name for p in out_dir.iterdir())
    assert len(folders) == len(doc["violations"])
    assert all(
        sorted(f.name for f in (out_dir / d).iterdir()) == ["decode-0.jsonl", "prefill-0.jsonl", "router-0.jsonl"]
        for d in folders
    )
    assert len([line for line in err if line.startswith("wrote ")]) == 3 * len(folders)


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--variant", "fixed"], "--variant"),
        (["--variant", "patched", "--requests", "0"], "--requests"),
        (["--variant", "patched", "--pages", "1"], "--pages"),
        (["--variant", "patched", "--chunks", "9"], "--chunks"),
        (["--variant", "patched", "--reuse", "random"], "--reuse"),
    ],
)
def test_check_bad_input_exits_2_naming_the_field(capsys, argv, field):
    rc, _, err = run_cli(capsys, "model", "check", *argv)
    assert rc == 2 and field in err[-1]


def test_check_refuses_a_trace_folder_that_is_not_empty(capsys, tmp_path):
    (tmp_path / "x").write_text("")
    rc, _, err = run_cli(capsys, "model", "check", "--variant", "vulnerable", "--trace-out", str(tmp_path))
    assert rc == 2 and "--trace-out" in err[-1]


def _ingested(capsys, tmp_path, case: str):
    from tests.model.test_history import FIXTURES

    db = tmp_path / "s.duckdb"
    files = sorted(str(p) for p in (FIXTURES / "vulnerable" / case).glob("*.jsonl"))
    assert run_cli(capsys, "audit", "ingest", "--db", str(db), *files)[0] == 0
    return db


def test_validate_lists_each_violation_with_its_first_event(capsys, tmp_path):
    db = _ingested(capsys, tmp_path, "04-no_foreign_read")
    rc, out, _ = run_cli(capsys, "model", "validate", "--db", str(db), "--json")
    assert rc == 1
    doc = json.loads("\n".join(out))
    assert list(doc) == ["violations", "coverage"]
    for v in doc["violations"]:
        assert list(v) == ["property", "first_event", "detail"]
        assert list(v["first_event"]) == ["producer", "seq", "node", "request_id"]
    read = next(v for v in doc["violations"] if v["property"] == "no_foreign_read")
    assert read["first_event"]["node"] == "decode-0" and read["first_event"]["request_id"] == "model-r1"
    rc, out, _ = run_cli(capsys, "model", "validate", "--db", str(db))
    assert rc == 1 and any(line.startswith("VIOLATED no_foreign_read:") for line in out)


def test_validate_window_before_the_violations_is_clean(capsys, tmp_path):
    db = _ingested(capsys, tmp_path, "04-no_foreign_read")
    rc, out, _ = run_cli(capsys, "model", "validate", "--db", str(db), "--to", "2026-09-09T13:22:00.000001Z")
    assert rc == 0 and "no violation" in out[-1]


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        ([], "--db or --url"),
        (["--db", "a.duckdb", "--url", "http://127.0.0.1:9"], "--db or --url"),
        (["--db", "missing.duckdb"], "missing.duckdb"),
        (["--db", "x", "--from", "yesterday"], "--from"),
        (["--db", "x", "--from", "2026-09-10", "--to", "2026-09-09"], "--from"),
    ],
)
def test_validate_bad_input_exits_2(capsys, tmp_path, monkeypatch, argv, field):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVTRAIL_URL", raising=False)
    rc, _, err = run_cli(capsys, "model", "validate", *argv)
    assert rc == 2 and field in err[-1], err


def test_check_stopped_at_max_states_is_not_a_proof(capsys):
    rc, out, _ = run_cli(capsys, "model", "check", "--variant", "patched", "--max-states", "50")
    assert rc == 3 and any("not a proof" in line for line in out)
