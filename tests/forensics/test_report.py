"""`kvtrail forensics report|verify-report` and the other new commands: files, content, verification, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import duckdb
import polars as pl
import pytest
import yaml

from kvtrail.cli import main
from kvtrail.errors import KvtrailError
from kvtrail.report.context import load_context, parse_context
from tests.forensics.incident_fixture import RESEARCHER_KEY, W0, append_request, build

ROOT = Path(__file__).resolve().parents[2]
WINDOW = ["--from", "2026-09-09T00:00:00Z", "--to", "2026-09-09T06:00:00Z"]
FILES = {
    "report.md",
    "report.html",
    "report.pdf",
    "report.json",
    "affected_responses.csv",
    "affected_responses.json",
    "exposed_tenants.csv",
    "exposed_tenants.json",
}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A store, an incident file and one report written from them (tests copy before they modify)."""
    base = tmp_path_factory.mktemp("report")
    db = base / "incident.duckdb"
    inc = build(db)
    ctx = yaml.safe_load((ROOT / "docs" / "incident.example.yaml").read_text())
    ctx["exclusions"]["api_key_ids"][0]["id"] = RESEARCHER_KEY
    ctx["exclusions"]["tenants"] = [{"id": "internal-qa", "reason": "the provider's own tests"}]
    ctx["tenant_names"]["umbrella"] = "Umbrella <Corp> & Co"
    (base / "incident.yaml").write_text(yaml.safe_dump(ctx))
    out = base / "out"
    assert (
        main(
            [
                "forensics",
                "report",
                "--db",
                str(db),
                *WINDOW,
                "--out",
                str(out),
                "--context",
                str(base / "incident.yaml"),
            ]
        )
        == 0
    )
    return base, db, out, inc


def _copy(made, tmp_path):
    base, db, out, inc = made
    shutil.copy(db, tmp_path / "s.duckdb")
    shutil.copytree(out, tmp_path / "out")
    return tmp_path / "s.duckdb", tmp_path / "out", inc


def test_report_files_exist_and_parse(made):
    _, _, out, _ = made
    assert {p.name for p in out.iterdir()} == FILES
    affected = pl.read_csv(out / "affected_responses.csv")
    assert len(affected) == 20 and affected["excluded_by"].null_count() == 13
    assert len(json.loads((out / "affected_responses.json").read_text())) == 20
    exposed = json.loads((out / "exposed_tenants.json").read_text())
    assert [(e["victim_tenant"], e["responses"]) for e in exposed] == [("acme", 13), ("umbrella", 13)]
    assert pl.read_csv(out / "exposed_tenants.csv")["pages"].to_list() == [52, 26]
    pdf = (out / "report.pdf").read_bytes()
    assert pdf.startswith(b"%PDF") and b"fpdf2" in pdf and len(pdf) > 3000
    manifest = json.loads((out / "report.json").read_text())
    assert set(manifest["files"]) == FILES - {"report.json"}
    assert manifest["counts"]["affected_responses"] == 13 and manifest["kvtrail_version"]
    assert {h["node"] for h in manifest["chain_heads"]} == {"router-0", "prefill-0", "decode-0"}
    assert all(len(h["digest"]) == 64 for h in manifest["chain_heads"])
    assert len(manifest["options"]["exclusions"]["tenants"]) == 1


def test_report_content(made):
    _, _, out, _ = made
    md = (out / "report.md").read_text()
    for needle in (
        "Affected responses: 13",
        "Recipient tenants (whose responses read pages they did not own): 3, 3 of them received other customers' data",
        "Victim tenants (whose data another customer read): 2",
        "How counted:",
        "Exposure window: 2026-09-09T00:10",
        "kvtrail itself stores no prompt or output content",
        "| prefill-0 | prefill | i1 |",
        "Reserved vs sent (F2)",
        "Rejected but served (F4)",
        "Every affected prompt (13 of 13) was longer than the prefill pool of its node (128 tokens)",
        "detected: external researcher's report",
        "2026-09-09T14:52:00.000000Z | fixed",
        "2 tenant(s) stand out",
        "repeated probing",
        "Excluded accounts (not counted above)",
        "(a) Nature of the breach",
        "(b) Contact point (DPO): Data Protection Officer, dpo@example.com",
        "Notice to Acme Corp (acme)",
        "Notice to mallory",
        "Please delete them",
        "kvtrail forensics verify-report REPORT_DIR --db incident.duckdb",
    ):
        assert needle in md, needle
    manifest = json.loads((out / "report.json").read_text())
    assert manifest["results_digest"] in md
    html = (out / "report.html").read_text()
    assert "Umbrella &lt;Corp&gt; &amp; Co" in html and "<Corp>" not in html and html.startswith("<!DOCTYPE html>")
    assert "Coverage gap" not in md


def test_verify_report_confirms_an_untouched_report(made, capsys):
    _, db, out, _ = made
    capsys.readouterr()
    assert main(["forensics", "verify-report", str(out), "--db", str(db)]) == 0
    assert capsys.readouterr().out.startswith("confirmed:")


def test_verify_report_fails_after_a_csv_edit(made, tmp_path, capsys):
    db, out, _ = _copy(made, tmp_path)
    (out / "exposed_tenants.csv").write_text((out / "exposed_tenants.csv").read_text().replace("52", "5"))
    assert main(["forensics", "verify-report", str(out), "--db", str(db)]) == 1
    assert "FAILED: file exposed_tenants.csv: modified" in capsys.readouterr().out


def test_verify_report_fails_after_an_event_in_the_window_changes(made, tmp_path, capsys):
    db, out, _ = _copy(made, tmp_path)
    with duckdb.connect(str(db)) as con:  # what the client was told about an affected response, rewritten
        con.execute(
            "UPDATE events_response_sent SET http_status = 400 WHERE request_no IN "
            "(SELECT request_no FROM events_requests WHERE request_id = 'globex-12')"
        )
    assert main(["forensics", "verify-report", str(out), "--db", str(db)]) == 1
    text = capsys.readouterr().out
    assert "FAILED: audit chain:" in text and "FAILED: results digest differs" in text


def test_verify_report_fails_after_an_event_is_slipped_into_a_batch(made, tmp_path, capsys):
    db, out, _ = _copy(made, tmp_path)
    with duckdb.connect(str(db)) as con:  # a copy of a response inserted past the chain, inside the window
        con.execute(
            "INSERT INTO events_kv_read SELECT * REPLACE (seq + 100000 AS seq) FROM events_kv_read "
            "WHERE request_no IN (SELECT request_no FROM events_requests WHERE request_id = 'globex-12')"
        )
    assert main(["forensics", "verify-report", str(out), "--db", str(db)]) == 1
    assert "FAILED: audit chain:" in capsys.readouterr().out


def test_verify_report_fails_after_a_batch_digest_is_tampered(made, tmp_path, capsys):
    db, out, _ = _copy(made, tmp_path)
    with duckdb.connect(str(db)) as con:
        con.execute(
            "UPDATE batches SET digest = sha256('forged')::BLOB "
            "WHERE producer_id = (SELECT producer_id FROM producers WHERE node = 'decode-0')"
        )
    assert main(["forensics", "verify-report", str(out), "--db", str(db)]) == 1
    text = capsys.readouterr().out
    assert "chain head of producer" in text and "(decode-0) batch 0: digest differs" in text


def test_verify_report_on_a_grown_store(made, tmp_path, capsys):
    db, out, inc = _copy(made, tmp_path)
    append_request(db, 300, "globex", 200, inc)  # a late over-long request, committed after the report
    capsys.readouterr()
    assert main(["forensics", "verify-report", str(out), "--db", str(db)]) == 0
    text = capsys.readouterr().out
    assert "note: the store has grown since the report" in text and "fall inside its window" in text
    assert "confirmed:" in text
    assert main(["forensics", "verify-report", str(out), "--db", str(db), "--strict"]) == 1


def test_empty_windows_say_so(made, tmp_path, capsys):
    _, db, _, _ = made
    out = tmp_path / "empty"
    assert (
        main(["forensics", "report", "--db", str(db), "--from", "2026-09-20", "--to", "2026-09-21", "--out", str(out)])
        == 0
    )
    md = (out / "report.md").read_text()
    assert "holds no events in this window" in md and "Affected responses: 0" in md
    assert json.loads((out / "report.json").read_text())["counts"]["victim_tenants"] == 0
    quiet = tmp_path / "quiet"  # events, but only two short requests: nothing affected
    assert (
        main(
            [
                "forensics",
                "report",
                "--db",
                str(db),
                "--from",
                "2026-09-09T04:36:00Z",
                "--to",
                "2026-09-09T04:39:00Z",
                "--out",
                str(quiet),
                "--exclude-tenant",
                "initech=test",
            ]
        )
        == 0
    )
    assert "No affected responses were found in this window" in (quiet / "report.md").read_text()
    assert main(["forensics", "verify-report", str(quiet), "--db", str(db)]) == 0


def test_coverage_gap_is_in_the_report_and_on_stderr(tmp_path, capsys):
    db = tmp_path / "gap.duckdb"
    build(db, gap=True)
    assert main(["forensics", "report", "--db", str(db), *WINDOW, "--out", str(tmp_path / "r")]) == 0
    assert "warning: coverage gap: 5 events missing" in capsys.readouterr().err
    assert "> **Warning:** Coverage gap: 5 audit events are missing" in (tmp_path / "r" / "report.md").read_text()
    assert main(["forensics", "exposure", "--db", str(db), *WINDOW]) == 0
    assert "coverage gap" in capsys.readouterr().err


def test_analysis_commands(made, tmp_path, capsys):
    _, db, _, _ = made
    capsys.readouterr()
    assert (
        main(
            [
                "forensics",
                "exposure",
                "--db",
                str(db),
                *WINDOW,
                "--format",
                "json",
                "--exclude-tenant",
                "internal-qa=tests",
                "--exclude-tenant",
                "initech",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    rows = json.loads(captured.out)
    assert {(r["recipient_tenant"], r["victim_tenant"]) for r in rows} >= {("mallory", "acme"), ("hooli", "umbrella")}
    assert not any(r["recipient_tenant"] in ("initech", "internal-qa") for r in rows)
    assert "excluded: 7 affected responses of 2 account(s)" in captured.err
    excl = tmp_path / "excl.yaml"
    excl.write_text(
        yaml.safe_dump(
            {
                "tenants": [{"id": "internal-qa", "reason": "tests"}],
                "api_key_ids": [{"id": RESEARCHER_KEY, "reason": "researcher"}],
            }
        )
    )
    args = ["forensics", "affected", "--db", str(db), *WINDOW, "--format", "csv", "--exclude-file", str(excl)]
    assert main(args) == 0
    assert len(pl.read_csv(capsys.readouterr().out.encode())) == 13
    assert main(["forensics", "thresholds", "--db", str(db), *WINDOW]) == 0
    assert "Every affected prompt (20 of 20)" in capsys.readouterr().out
    out = tmp_path / "x.parquet"
    assert (
        main(
            [
                "forensics",
                "exploitation",
                "--db",
                str(db),
                *WINDOW,
                "--exclude-file",
                str(excl),
                "--format",
                "parquet",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    df = pl.read_parquet(out)
    assert dict(zip(df["tenant_id"], df["verdict"]))["mallory"] == "stands out"
    capsys.readouterr()
    assert (
        main(
            [
                "forensics",
                "findings",
                "--db",
                str(db),
                *WINDOW,
                "--code",
                "F4",
                "--format",
                "json",
                "--exclude-tenant",
                "mallory",
            ]
        )
        == 0
    )
    assert not [r for r in json.loads(capsys.readouterr().out) if r["tenant_id"] == "mallory"]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (
            ["forensics", "report", "--db", "DB", "--from", "2026-09-10", "--to", "2026-09-09", "--out", "OUT"],
            "--from: is after --to",
        ),
        (
            ["forensics", "report", "--db", "DB", *WINDOW, "--out", "OUT", "--exclude-tenant", "nobody"],
            "unknown tenant 'nobody'",
        ),
        (["forensics", "report", "--db", "missing.duckdb", *WINDOW, "--out", "OUT"], "--db: store not found"),
        (
            ["forensics", "report", "--db", "DB", *WINDOW, "--out", "OUT", "--context", "BAD"],
            "incident.yaml: field 'detected_at': not an ISO 8601 UTC time",
        ),
        (["forensics", "exposure", "--db", "DB", *WINDOW, "--node", "decode-9"], "--node: unknown node"),
        (["forensics", "exploitation", "--db", "DB", "--to", "2026-09-09"], "--from: required"),
        (["forensics", "verify-report", "nowhere", "--db", "DB"], "report directory not found"),
        (["forensics", "verify-report", "OUT0", "--db", "missing.duckdb"], "--db: store not found"),
        (["forensics", "verify-report", ".", "--db", "DB"], "no report.json in"),
        (["forensics", "verify-report", "OUT0", "--db", "BAD"], "is not a DuckDB database file"),
    ],
)
def test_bad_input_exits_2(made, tmp_path, monkeypatch, capsys, argv, needle):
    _, db, out, _ = made
    (tmp_path / "incident.yaml").write_text("organisation: X\ncontact: {email: a@b.c}\ndetected_at: 9 Sep\n")
    monkeypatch.chdir(tmp_path)
    subst = {"DB": str(db), "OUT": str(tmp_path / "o"), "OUT0": str(out), "BAD": str(tmp_path / "incident.yaml")}
    assert main([subst.get(a, a) for a in argv]) == 2
    assert needle in capsys.readouterr().err


def test_incident_file_validation(tmp_path):
    ctx = load_context(ROOT / "docs" / "incident.example.yaml")
    assert ctx.organisation and ctx.dpo.email == "dpo@example.com" and ctx.detected_at < ctx.fixed_at
    assert ctx.display_name("acme") == "Acme Corp (acme)" and ctx.display_name("x") == "x"
    ok = {"organisation": "O", "contact": {"email": "a@b.c"}}
    for bad, needle in [
        ({**ok, "detected_at": "2026-09-09 13:22"}, "field 'detected_at': not an ISO 8601 UTC time"),
        ({**ok, "detectd_at": "2026-09-09T13:22:00Z"}, "field 'detectd_at': unknown field"),
        ({"contact": {"email": "a@b.c"}}, "field 'organisation': required"),
        ({**ok, "contact": {"email": "nobody"}}, "field 'contact.email'"),
        ({**ok, "exclusions": {"tenants": [{"id": "t"}]}}, "field 'exclusions.tenants[0].reason': required"),
        ({**ok, "exclusions": {"users": []}}, "field 'exclusions.users': unknown field"),
        ({**ok, "timeline": [{"at": "2026-09-09T13:22:00Z"}]}, "field 'timeline[0]'"),
        ({**ok, "measures_taken": {"a": 1}}, "field 'measures_taken': must be a list"),
    ]:
        with pytest.raises(KvtrailError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            parse_context(bad)
    assert parse_context({**ok, "fixed_at": "2026-09-09T16:52:00+02:00"}).fixed_at == W0 + (14 * 60 + 52) * 60 * 10**9
    (tmp_path / "broken.yaml").write_text("organisation: [\n")
    with pytest.raises(KvtrailError, match="broken.yaml: not valid YAML"):
        load_context(tmp_path / "broken.yaml")
