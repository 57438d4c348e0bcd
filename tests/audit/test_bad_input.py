"""`kvtrail audit ingest` on bad files: exit 2 with one line naming the file, the event (index, line,
kind) and the field by its schema name; nothing stored. Valid but suspicious input is accepted whole."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from kvtrail.audit.batch import BATCH_SCHEMA, from_dicts, parse_jsonl, write_ipc
from kvtrail.audit.store import connect_readonly, fetch_row, read_events
from kvtrail.cli import main
from kvtrail.errors import ValidationError
from tests.conftest import alloc, config, event, producer


def _ingest(capsys, db, *files) -> tuple[int, list[str], list[str]]:
    capsys.readouterr()
    rc = main(["audit", "ingest", "--db", str(db), *map(str, files)])
    cap = capsys.readouterr()
    return rc, cap.out.splitlines(), cap.err.splitlines()


def _lines(*events) -> bytes:
    return "".join(json.dumps(e) + "\n" for e in events).encode()


def _stored(db) -> int:
    if not db.exists():
        return 0
    con = connect_readonly(str(db))
    try:
        return fetch_row(con, "SELECT count(*) FROM events")[0]
    finally:
        con.close()


# ---- undecodable bytes --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data,line",
    [
        (b"\xff\n", 1),
        (_lines(config(0), alloc(1, [1])) + b"\n" + b'{"kind": "\xc3\x28"}\n', 4),  # blank line 3 still counts
    ],
)
def test_invalid_utf8_exits_2_naming_the_file_and_line(capsys, tmp_path, data, line):
    (tmp_path / "bad.jsonl").write_bytes(data)
    rc, out, err = _ingest(capsys, tmp_path / "a.duckdb", tmp_path / "bad.jsonl")
    assert (rc, out) == (2, [])
    assert len(err) == 1 and "bad.jsonl" in err[0] and f"line {line} is not valid UTF-8" in err[0], err
    assert _stored(tmp_path / "a.duckdb") == 0


def test_a_unicode_line_separator_inside_a_string_does_not_split_the_line():
    e = alloc(1, [1], rid="a\u2028b")
    table = parse_jsonl(json.dumps(e, ensure_ascii=False).encode())
    assert table.num_rows == 1 and table.column("request_id")[0].as_py() == "a\u2028b"


# ---- explicit nulls -----------------------------------------------------------------------------


def _null_tenant():
    e = alloc(1, [1])
    e["request"]["tenant_id"] = None
    return e


def _null_request_field():
    return event(
        1,
        "transfer_received",
        request={"request_id": "r", "transfer_id": 1, "api_key_id": None},
        pages=[1],
        num_tokens=16,
        status="ok",
    )


NULLS = [
    # (event builder, field the error names, kind it names)
    (_null_tenant, "tenant_id", "pages_allocated"),
    (_null_request_field, "api_key_id", "transfer_received"),
    (lambda: dict(alloc(1, [1]), block_hashes=None), "block_hashes", "pages_allocated"),
    (
        lambda: event(
            1,
            "transfer_received",
            request={"request_id": "r", "transfer_id": 1},
            pages=[1],
            num_tokens=16,
            status="ok",
            digest=None,
        ),
        "digest",
        "transfer_received",
    ),
    (lambda: dict(alloc(1, [1]), request=None), "request", "pages_allocated"),
    (lambda: alloc(1, [1], prod=dict(producer(), engine_version=None)), "engine_version", "pages_allocated"),
]


@pytest.mark.parametrize("build,field,kind", NULLS, ids=[n[1] for n in NULLS])
def test_an_explicit_null_is_rejected_naming_field_and_kind(capsys, tmp_path, build, field, kind):
    (tmp_path / "n.jsonl").write_bytes(_lines(config(0), build()))
    rc, out, err = _ingest(capsys, tmp_path / "a.duckdb", tmp_path / "n.jsonl")
    assert (rc, out) == (2, [])
    assert len(err) == 1
    assert f"n.jsonl: event 1 ({kind}): field '{field}': must be left out" in err[0], err
    assert "at line 2" in err[0]
    assert _stored(tmp_path / "a.duckdb") == 0


def test_the_same_event_without_the_null_field_is_accepted(capsys, tmp_path):
    e = _null_tenant()
    del e["request"]["tenant_id"]
    (tmp_path / "ok.jsonl").write_bytes(_lines(config(0), e))
    assert _ingest(capsys, tmp_path / "a.duckdb", tmp_path / "ok.jsonl")[0] == 0
    assert _stored(tmp_path / "a.duckdb") == 2


# ---- files without events -----------------------------------------------------------------------


def _empty_ipc() -> bytes:
    return write_ipc(BATCH_SCHEMA.empty_table())


@pytest.mark.parametrize(
    "name,data",
    [
        ("empty.jsonl", b""),
        ("blank.jsonl", b"\n   \n\t\n"),
        ("empty.arrow", b""),
        ("no-rows.arrow", None),  # a valid stream with a schema and no rows
    ],
    ids=["empty jsonl", "blank lines", "zero-byte arrow", "arrow without rows"],
)
def test_a_file_without_events_exits_2(capsys, tmp_path, name, data):
    (tmp_path / name).write_bytes(_empty_ipc() if data is None else data)
    rc, out, err = _ingest(capsys, tmp_path / "a.duckdb", tmp_path / name)
    assert (rc, out) == (2, [])
    assert err == [f"error: no events in {tmp_path / name}"]


def test_an_empty_file_among_good_ones_stores_nothing(capsys, tmp_path):
    (tmp_path / "good.jsonl").write_bytes(_lines(config(0)))
    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert _ingest(capsys, tmp_path / "a.duckdb", tmp_path / "good.jsonl", tmp_path / "empty.jsonl")[0] == 2
    assert _stored(tmp_path / "a.duckdb") == 0


# ---- every error names the field (schema name) and the kind --------------------------------------

BAD = [
    # (bad event after a node_config, field, kind)
    (dict(alloc(1, [1]), request={"request_id": "r", "tenant": "x"}), "tenant", "pages_allocated"),
    (dict(alloc(1, [1]), tenant_id="acme"), "tenant_id", "pages_allocated"),  # outside 'request'
    (dict(alloc(1, [1]), node="n"), "node", "pages_allocated"),  # outside 'producer'
    ({k: v for k, v in alloc(1, [1]).items() if k != "producer"}, "producer", "pages_allocated"),
    (dict(alloc(1, [1]), request="r1"), "request", "pages_allocated"),
    (dict(alloc(1, [1]), pages=[1, "2"]), "pages", "pages_allocated"),
    (dict(alloc(1, [1]), seq=2**64), "seq", "pages_allocated"),
    (dict(alloc(1, [1]), schema_version=9), "schema_version", "pages_allocated"),
    ({k: v for k, v in alloc(1, [1]).items() if k != "wall_ns"}, "wall_ns", "pages_allocated"),
    (alloc(1, [1], prod=producer(role="cache")), "role", "pages_allocated"),
    (alloc(1, [1], prod=producer(instance="")), "instance", "pages_allocated"),
    (alloc(1, [1], purpose="because"), "purpose", "pages_allocated"),
    (alloc(1, [1], purpose="prefix_hit"), "block_hashes", "pages_allocated"),
    (alloc(1, [99]), "pages", "pages_allocated"),
    (event(1, "pages_freed", pages=[1]), "free_reason", "pages_freed"),
    (event(1, "kv_read", request={"request_id": "r"}, pages=[1], purpose="decode_growth"), "purpose", "kv_read"),
    (
        event(
            1,
            "transfer_received",
            request={"request_id": "r", "transfer_id": 1},
            pages=[1],
            num_tokens=16,
            status="lost",
        ),
        "status",
        "transfer_received",
    ),
    (
        event(
            1,
            "transfer_sent",
            request={"request_id": "r", "transfer_id": 1},
            pages=[1, 2],
            dst_pages=[3],
            num_tokens=16,
            is_last_chunk=True,
        ),
        "dst_pages",
        "transfer_sent",
    ),
    (
        event(1, "kv_written", request={"request_id": "r"}, pages=[1], token_start=5, token_end=2, source="forward"),
        "token_end",
        "kv_written",
    ),
    (
        event(1, "request_aborted", request={"request_id": "r"}, stage="router", abort_reason="x", http_status=42),
        "http_status",
        "request_aborted",
    ),
    (event(1, "pages_stolen"), "kind", "pages_stolen"),
    (dict(config(1), seq=0), "seq", "node_config"),
]


@pytest.mark.parametrize("bad,field,kind", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_every_ingest_error_names_the_schema_field_the_kind_and_the_line(capsys, tmp_path, bad, field, kind):
    (tmp_path / "b.jsonl").write_bytes(_lines(config(0), bad))
    rc, out, err = _ingest(capsys, tmp_path / "a.duckdb", tmp_path / "b.jsonl")
    assert (rc, out) == (2, [])
    assert len(err) == 1
    assert f"b.jsonl: event 1 ({kind}): field '{field}': " in err[0], err
    assert "request." not in err[0].split("field ")[1].split(":")[0]  # a schema name, not a path
    assert "; at line 2" in err[0], err


def _ipc_error(table: pa.Table, store) -> ValidationError:
    store.append(from_dicts([config(0)]))
    with pytest.raises(ValidationError) as exc:
        store.append(table)
    return exc.value


def test_arrow_column_errors_name_the_first_event_and_its_kind(store):
    good = from_dicts([config(1), alloc(2, [1])])
    t = good.append_column("prompt", pa.array([None, "secret"]))
    err = _ipc_error(t, store)
    assert (err.field, err.event, err.kind) == ("prompt", 1, "pages_allocated")


def test_arrow_wrong_type_names_the_first_event_that_does_not_convert(store):
    good = from_dicts([config(1), alloc(2, [1])])
    t = good.set_column(good.schema.get_field_index("seq"), "seq", pa.array(["1", "two"]))
    err = _ipc_error(t, store)
    assert (err.field, err.event, err.kind) == ("seq", 1, "pages_allocated") and "wrong type" in err.reason


# ---- valid but suspicious: accepted whole -------------------------------------------------------


def test_a_page_listed_twice_in_one_allocation_is_accepted_and_stored_whole(capsys, tmp_path):
    db = tmp_path / "a.duckdb"
    (tmp_path / "dup.jsonl").write_bytes(_lines(config(0), alloc(1, [5, 6, 5]), alloc(2, [7, 7], rid="r2")))
    rc, out, err = _ingest(capsys, db, tmp_path / "dup.jsonl")
    assert (rc, err) == (0, [])
    assert "stored 3 events, 5 page-events" in out[0]
    con = connect_readonly(str(db))
    try:
        events = read_events(con).to_pylist()
    finally:
        con.close()
    assert [e["pages"] for e in events if e["kind"] == "pages_allocated"] == [[5, 6, 5], [7, 7]]
    assert main(["audit", "verify", "--db", str(db)]) == 0
