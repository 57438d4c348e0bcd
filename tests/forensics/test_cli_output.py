"""The output of `kvtrail forensics findings|affected|exposure|thresholds|exploitation`: file formats keep
every field (lists as arrays, ns as integers), the table reads in a terminal, hostile ids print harmlessly."""

from __future__ import annotations

import json
import re
import types

import polars as pl
import pytest

from kvtrail.answers import tables
from kvtrail.answers.tables import AFFECTED, printable, render_table, shorten
from kvtrail.audit.batch import from_dicts
from kvtrail.audit.store import AuditStore
from kvtrail.cli import main
from kvtrail.outputs import csv_frame
from tests.conftest import alloc, config, event, producer
from tests.forensics.incident_fixture import build

D = producer("decode-0", role="decode")
HOSTILE_TENANT = "\x1b[31m[b]"
HOSTILE_RID = "[bold]req[/bold]-" + "x" * 40 + "\x1b]0;pwned\x07-end"
WINDOW = ["--from", "2026-09-09T00:00:00Z", "--to", "2026-09-09T06:00:00Z"]


def _two_victims_store(path, rid="g", tenant="globex"):
    """acme writes pages 1-2, umbrella 3-4; both free them; ``rid`` reserves 1-5, writes 5 and reads all."""
    req_a, req_u = {"request_id": "a", "tenant_id": "acme"}, {"request_id": "u", "tenant_id": "umbrella"}
    req_g = {"request_id": rid, "tenant_id": tenant, "transfer_id": 7}
    evs = [
        config(0, D),
        alloc(1, [1, 2], rid="a", tenant="acme", prod=D, purpose="decode_reservation"),
        event(2, "kv_written", D, request=req_a, pages=[1, 2], token_start=0, token_end=32, source="transfer_in"),
        event(3, "pages_freed", D, request=req_a, pages=[1, 2], free_reason="finish"),
        alloc(4, [3, 4], rid="u", tenant="umbrella", prod=D, purpose="decode_reservation"),
        event(5, "kv_written", D, request=req_u, pages=[3, 4], token_start=0, token_end=32, source="transfer_in"),
        event(6, "pages_freed", D, request=req_u, pages=[3, 4], free_reason="finish"),
        alloc(7, [1, 2, 3, 4, 5], rid=rid, tenant=tenant, prod=D, purpose="decode_reservation"),
        event(8, "kv_written", D, request=req_g, pages=[5], token_start=0, token_end=1, source="transfer_in"),
        event(9, "kv_read", D, request=req_g, pages=[1, 2, 3, 4, 5]),
        event(
            10, "response_sent", D, request=req_g, http_status=200, prompt_tokens=80, completion_tokens=9, latency_ns=5
        ),
    ]
    with AuditStore(path) as s:
        s.append(from_dicts(evs))
    return str(path)


@pytest.fixture
def db(tmp_path):
    return _two_victims_store(tmp_path / "a.duckdb")


@pytest.fixture(scope="module")
def incident(tmp_path_factory):
    path = tmp_path_factory.mktemp("incident") / "incident.duckdb"
    build(path)
    return str(path)


def _out(capsys, argv) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def test_json_gives_arrays_for_list_columns_and_integer_ns(db, capsys):
    rows = json.loads(_out(capsys, ["forensics", "findings", "--db", db, "--code", "F1", "--format", "json"]))
    assert rows and all(isinstance(r["pages"], list) and isinstance(r["victim_request_ids"], list) for r in rows)
    assert sorted(v for r in rows for v in r["victim_request_ids"]) == ["a", "u"]
    assert all(isinstance(e["producer_id"], int) and isinstance(e["seq"], int) for r in rows for e in r["evidence"])
    assert all(isinstance(r["first_ns"], int) for r in rows)
    (row,) = json.loads(_out(capsys, ["forensics", "affected", "--db", db, "--format", "json"]))
    assert row["codes"] == ["F1"] and row["victim_tenants"] == ["acme", "umbrella"]
    assert row["victim_requests"] == ["a", "u"] and isinstance(row["first_ns"], int)


def test_csv_joins_lists_and_keeps_ns(db, capsys):
    found = pl.read_csv(_out(capsys, ["forensics", "findings", "--db", db, "--code", "F1", "--format", "csv"]).encode())
    assert sorted(found["pages"].to_list()) == ["1,2", "3,4"]
    assert all(":" in ev for ev in found["evidence"]) and found["first_ns"].dtype == pl.Int64
    affected = pl.read_csv(_out(capsys, ["forensics", "affected", "--db", db, "--format", "csv"]).encode())
    row = affected.row(0, named=True)
    assert row["victim_tenants"] == "acme,umbrella" and row["victim_requests"] == "a,u" and row["codes"] == "F1"
    assert affected["first_ns"].dtype == pl.Int64


def test_parquet_round_trips_lists(db, tmp_path, capsys):
    out = tmp_path / "f.parquet"
    _out(capsys, ["forensics", "findings", "--db", db, "--format", "parquet", "--out", str(out)])
    df = pl.read_parquet(out)
    assert df.schema["pages"] == pl.List(pl.Int32) and df.schema["first_ns"] == pl.Int64
    assert isinstance(df.schema["evidence"], pl.List)
    _out(capsys, ["forensics", "affected", "--db", db, "--format", "parquet", "--out", str(out), "--force"])
    row = pl.read_parquet(out).row(0, named=True)
    assert row["victim_tenants"] == ["acme", "umbrella"] and row["codes"] == ["F1"]


@pytest.mark.parametrize(
    "command,summary,time_column",
    [
        ("findings", r"\d+ findings: F1 \d+, ", "first_at"),
        ("affected", r"20 affected responses; tenants: 5 recipient, 2 victim", "first_at"),
        ("exposure", r"15 recipient x victim pairs: 5 recipient tenants, 2 victim tenants", None),
        (
            "thresholds",
            r"2 node configurations on 2 nodes, 1 with a pool smaller than the context",
            "effective_from_at",
        ),
        ("exploitation", r"5 accounts: stands out 3, consistent 2", None),
    ],
)
def test_the_table_reads_in_a_terminal(incident, capsys, command, summary, time_column):
    out = _out(capsys, ["forensics", command, "--db", incident, *WINDOW])
    lines = out.splitlines()
    assert re.match(summary, lines[0]), lines[0]
    assert "window 2026-09-09T00:00:00.000000Z to 2026-09-09T06:00:00.000000Z" in out
    assert all(len(line) <= 120 for line in lines), max(lines, key=len)
    assert "shape:" not in out and not any(line.split()[:2] == ["str", "str"] for line in lines)
    assert "_ns" not in out and "┆" not in out
    if time_column:
        assert time_column in out and re.search(r" 2026-09-09T0\d:\d\d:\d\d\.\d{6}Z ", out)
    rule = next(i for i, line in enumerate(lines) if line.startswith("───"))
    assert rule in (2, 3)  # the summary (and the window, when both do not fit one line) above the header
    assert lines[rule - 1].split()[0] in ("code", "request_id", "recipient_tenant", "node", "tenant_id")
    rows = []
    for line in lines[rule + 1 :]:
        if line.startswith("("):  # the footer: notes follow it
            break
        rows.append(line)
    assert len(rows) == len(
        json.loads(_out(capsys, ["forensics", command, "--db", incident, *WINDOW, "--format", "json"]))
    )


def test_dropped_columns_are_counted_and_notes_printed(incident, capsys):
    out = _out(capsys, ["forensics", "thresholds", "--db", incident, *WINDOW])
    assert "(6 more columns in --format csv/json/parquet)" in out
    assert "columns in --format csv/json/parquet)\nEvery affected prompt (20 of 20)" in out
    assert "(7 more columns" in _out(capsys, ["forensics", "exploitation", "--db", incident, *WINDOW])
    assert "more columns" not in _out(capsys, ["forensics", "exposure", "--db", incident, *WINDOW])


def test_a_hostile_id_prints_harmlessly_and_whole_in_files(tmp_path, capsys):
    db = _two_victims_store(tmp_path / "h.duckdb", rid=HOSTILE_RID, tenant=HOSTILE_TENANT)
    for command in ("findings", "affected", "exposure"):
        out = _out(capsys, ["forensics", command, "--db", db])
        assert "\x1b" not in out and "\x07" not in out
        assert "\\x1b[31m[b]" in out  # printed literally, not as colour or markup
        assert all(len(line) <= 120 for line in out.splitlines())
    out = _out(capsys, ["forensics", "affected", "--db", db])
    # the long id shown whole (never cut: a responder copies it); columns left out to fit, and named
    assert printable(HOSTILE_RID) in out and "victim_tenants" in out
    assert "(left out to fit 120 characters: " in out and "first_at" in out.split("(left out")[1]
    (row,) = json.loads(_out(capsys, ["forensics", "affected", "--db", db, "--format", "json"]))
    assert row["request_id"] == HOSTILE_RID and row["tenant_id"] == HOSTILE_TENANT


def test_warnings_and_gaps_go_to_stderr_for_every_format(db, monkeypatch, capsys):
    import kvtrail.answers.ask as ask

    real = ask.ask_affected

    def with_warning(*args, **kw):
        a = real(*args, **kw)
        return types.SimpleNamespace(
            rows=a.rows,
            excluded=a.excluded,
            gaps=a.gaps,
            notes=a.notes,
            warnings=("transfer 7 seen for requests g and h",),
        )

    monkeypatch.setattr(ask, "ask_affected", with_warning)
    for fmt in ("table", "json"):
        assert main(["forensics", "affected", "--db", db, "--format", fmt]) == 0
        captured = capsys.readouterr()
        assert "warning: transfer 7 seen for requests g and h" in captured.err
        assert "transfer 7" not in captured.out


def test_table_to_a_file_and_empty_answers(db, tmp_path, capsys):
    out = tmp_path / "t.txt"
    assert "wrote 1 rows" in _out(capsys, ["forensics", "affected", "--db", db, "--out", str(out)])
    assert out.read_text().startswith("1 affected response; tenants: 1 recipient, 2 victim, whole store")
    empty = _out(
        capsys, ["forensics", "affected", "--db", db, "--from", "2026-09-09T13:00:00Z", "--to", "2026-09-09T13:10:00Z"]
    )
    assert empty == "no affected responses in this window\n"


def test_formatting_helpers():
    assert shorten("abcdefghij", 5, middle=True) == "ab…ij" and shorten("abcdefghij", 5) == "abcd…"
    assert shorten("abc", 5, middle=True) == "abc"
    assert printable("a\x1b[1mb\nc\u202ed") == "a\\x1b[1mb\\x0ac\\u202ed" and printable(None) == ""
    lists = pl.DataFrame(
        {
            "request_id": ["r"],
            "tenant_id": ["t"],
            "codes": [["F1", "F5"]],
            "victim_tenants": [["b", "a"]],
            "victim_requests": [["x", "y", "z"]],
            "first_ns": [0],
        }
    )
    text = render_table(lists, AFFECTED)
    assert "1970-01-01T00:00:00.000000Z" in text and "a,b" in text and "F1" not in text
    assert text.splitlines()[3].split()[-2] == "3"  # three victim requests, counted
    assert all(len(line) <= 60 for line in render_table(lists, AFFECTED, width_chars=60).splitlines())
    ev = pl.DataFrame(
        {
            "evidence": [[{"producer_id": 1, "seq": 2}, {"producer_id": 3, "seq": 4}], []],
            "pages": [[1, 2], None],
            "victim_tenant_ids": [["a", None], []],
        }
    )
    flat = csv_frame(ev)
    assert flat["evidence"].to_list() == ["1:2;3:4", ""] and flat["pages"].to_list() == ["1,2", None]
    assert flat["victim_tenant_ids"].to_list() == ["a,", ""]
    assert tables.window_scope(None, None, "acme") == "whole store, tenant acme"


WIDE = pl.DataFrame(
    {
        "request_id": ["a282094c90274d82", "5e0c1a9b77d3f601"],
        "tenant_id": ["acme", "initech"],
        "http_status": [200, 200],
        "prompt_tokens": [13080, 131072],
        "completion_tokens": [48, 4096],
        "pages_read_foreign": [817, 8192],
        "victim_tenants": [["globex", "initech"], ["acme"]],
        "victim_requests": [["x", "y", "z"], ["w"]],
        "first_ns": [1_788_912_420_000_009_000] * 2,
    }
)


@pytest.mark.parametrize("width", [120, 100, 80, 60])
def test_ids_and_numbers_are_never_cut_and_left_out_columns_are_named(width):
    """Rule changed with the 'never cut' fix: a 16-character id at 120 columns showed as 'a282094…0274d82'
    and, at 100, 13080 as '130…'; now a table too wide leaves out whole columns and says which."""
    text = render_table(WIDE, AFFECTED, width_chars=width)
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines), max(lines, key=len)
    header = lines[1].split()
    rows = [line.split() for line in lines[3:5]]
    for row, rid in zip(rows, WIDE["request_id"]):
        assert row[0] == rid
    numbers = {
        "status": "http_status",
        "prompt": "prompt_tokens",
        "completion": "completion_tokens",
        "pages": "pages_read_foreign",
    }
    for head, name in numbers.items():
        if head in header:
            i = header.index(head)
            assert [r[i] for r in rows] == [str(v) for v in WIDE[name]], head
    shown = set(header)
    every = {c.header for c in AFFECTED.columns}
    left_out = every - shown
    if left_out:
        note = next(line for line in text.replace("\n(", "\n\0(").split("\0") if line.startswith("(left out"))
        assert all(h in note for h in left_out) and f"fit {width} characters" in note
    else:
        assert "left out" not in text


def test_the_view_chooses_what_gives_way_first():
    wide = render_table(WIDE, AFFECTED, width_chars=120)
    assert "first_at" in wide.splitlines()[1] and "victim_reqs" not in wide.splitlines()[1]
    assert "(left out to fit 120 characters: victim_reqs;" in wide
    text = render_table(WIDE, AFFECTED, width_chars=100)
    assert "first_at" not in text.splitlines()[1] and "victim_tenants" in text.splitlines()[1]
    assert "(left out to fit 100 characters: victim_reqs, first_at;" in text


def test_a_joined_list_is_cut_between_ids_never_inside_one():
    from kvtrail.answers.tables import shorten_items

    assert shorten_items("acme,initech,(never written)", 40) == "acme,initech,(never written)"
    assert shorten_items("acme,initech,(never written)", 20) == "acme,initech +1"
    assert shorten_items("acme,initech,(never written)", 10) == "acme +2"
    assert shorten_items("a-very-long-tenant-id,b", 8) == "2 items"
    text = render_table(
        WIDE.with_columns(pl.Series("victim_tenants", [["globex", "initech", "umbrella-corp"]] * 2)),
        AFFECTED,
        width_chars=100,
    )
    row = text.splitlines()[3]
    assert "globex,initech +1" in row or "globex,initech,umbrella-corp" in row, row
