"""`kvtrail forensics findings|affected`: answers from the store, filters, formats, bad input, coverage gaps."""

import json

import polars as pl
import pytest

from kvtrail.audit.batch import from_dicts
from kvtrail.audit.store import AuditStore
from kvtrail.cli import main
from kvtrail.forensics.questions import Window, affected_responses, coverage_gaps, findings
from tests.conftest import T0, alloc, config, event, producer

D = producer("decode-0", role="decode")


def _incident_store(path, gap=False):
    """acme writes pages 1-4 and frees them; globex reserves 1-4, only page 1 is written, it reads all 4."""
    req_a = {"request_id": "a", "tenant_id": "acme"}
    req_g = {"request_id": "g", "tenant_id": "globex", "transfer_id": 7}
    evs = [
        config(0, D),
        alloc(1, [1, 2, 3, 4], rid="a", tenant="acme", prod=D, purpose="decode_reservation"),
        event(2, "kv_written", D, request=req_a, pages=[1, 2, 3, 4], token_start=0, token_end=64, source="transfer_in"),
        event(3, "pages_freed", D, request=req_a, pages=[1, 2, 3, 4], free_reason="finish"),
        alloc(4, [1, 2, 3, 4], rid="g", tenant="globex", prod=D, purpose="decode_reservation"),
        event(5, "kv_written", D, request=req_g, pages=[1], token_start=0, token_end=1, source="transfer_in"),
        event(6, "kv_read", D, request=req_g, pages=[1, 2, 3, 4]),
        event(
            7, "response_sent", D, request=req_g, http_status=200, prompt_tokens=64, completion_tokens=9, latency_ns=5
        ),
    ]
    if gap:
        evs[7]["seq"] = 12  # seq 7..11 never arrived and nothing reported them
    with AuditStore(path) as s:
        s.append(from_dicts(evs))


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "a.duckdb"
    _incident_store(path)
    return str(path)


def test_affected_names_recipient_victim_and_what_the_client_got(db):
    import duckdb

    con = duckdb.connect(db, read_only=True)
    df = affected_responses(con)
    assert isinstance(df, pl.DataFrame) and len(df) == 1
    row = df.row(0, named=True)
    got = (row["request_id"], row["tenant_id"], row["http_status"], row["completion_tokens"])
    assert got == ("g", "globex", 200, 9)
    assert row["victim_tenants"] == ["acme"] and row["victim_requests"] == ["a"] and row["pages_read_foreign"] == 3
    assert len(affected_responses(con, Window(tenant="acme"))) == 1  # acme as victim
    assert len(affected_responses(con, Window(T0 + 10**12, T0 + 2 * 10**12))) == 0  # empty window
    assert "F1" in findings(con)["code"].to_list()
    assert coverage_gaps(con).is_empty()
    con.close()


def test_cli_formats_and_bad_input(db, tmp_path, capsys):
    assert main(["forensics", "affected", "--db", db, "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["request_id"] for r in rows] == ["g"]
    assert main(["forensics", "findings", "--db", db, "--code", "F1", "--format", "csv"]) == 0
    assert capsys.readouterr().out.startswith("code,title,severity")
    out = tmp_path / "f.parquet"
    assert main(["forensics", "findings", "--db", db, "--format", "parquet", "--out", str(out)]) == 0
    assert len(pl.read_parquet(out)) >= 1
    assert main(["forensics", "affected", "--db", db, "--from", "2026-09-10", "--to", "2026-09-09"]) == 2
    assert main(["forensics", "affected", "--db", db, "--node", "nope"]) == 2
    assert main(["forensics", "findings", "--db", db, "--code", "F99"]) == 2
    assert main(["forensics", "affected", "--db", db, "--format", "parquet"]) == 2  # needs --out
    assert "--from: is after --to" in capsys.readouterr().err


def test_a_sequence_gap_is_reported_with_every_answer(tmp_path, capsys):
    path = tmp_path / "gap.duckdb"
    _incident_store(path, gap=True)
    assert main(["forensics", "affected", "--db", str(path)]) == 0
    err = capsys.readouterr().err
    assert "coverage gap: 5 events missing" in err and "decode-0" in err


def test_both_engines_from_the_cli_and_saved_findings_are_idempotent(db, capsys):
    assert main(["forensics", "findings", "--db", str(db), "--format", "json"]) == 0
    replay = json.loads(capsys.readouterr().out)
    assert main(["forensics", "findings", "--db", str(db), "--format", "json", "--engine", "sql"]) == 0
    sql = json.loads(capsys.readouterr().out)
    assert [(r["code"], r["pages"], r["evidence"]) for r in replay] == [
        (r["code"], r["pages"], r["evidence"]) for r in sql
    ]
    assert [r["code"] for r in replay] == ["F8", "F1"]  # the pool is smaller than the context; acme's pages
    for n in (1, 2):
        assert main(["forensics", "findings", "--db", str(db), "--save"]) == 0
        err = capsys.readouterr().err
        assert f"saved run {n}: 2 findings, {2 if n == 1 else 0} new" in err
    import duckdb

    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM findings").fetchall() == [(2,)]
        assert con.execute("SELECT count(*) FROM forensic_runs").fetchall() == [(2,)]


def test_watch_prints_findings_once(db, capsys):
    assert main(["forensics", "watch", "--db", str(db), "--polls", "2", "--interval", "0.05"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == 2  # each finding once, although the store was read twice
    assert " F8 " in lines[0] and " F1 " in lines[1] and "request g (globex) victims a" in lines[1]
    assert "watched 8 events in 2 polls" in captured.err
    assert main(["forensics", "watch", "--db", str(db) + ".missing", "--polls", "1"]) == 2
