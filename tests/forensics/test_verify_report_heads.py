"""`kvtrail forensics verify-report` judges the store against the chain heads the report recorded the way
`kvtrail audit verify --expect-heads` does: truncation is *behind*, a rewrite is *forked*."""

from __future__ import annotations

import json
import shutil

import duckdb
import pytest

from kvtrail.cli import main
from tests.conftest import delete_stored
from tests.forensics.incident_fixture import append_request, build

WINDOW = ["--from", "2026-09-09T00:00:00Z", "--to", "2026-09-09T06:00:00Z"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    base = tmp_path_factory.mktemp("heads")
    db = base / "incident.duckdb"
    inc = build(db)
    append_request(db, 300, "globex", 20, inc)  # batches 1 and 2 of every producer: heads at batch 2
    append_request(db, 301, "acme", 20, inc)
    assert main(["forensics", "report", "--db", str(db), *WINDOW, "--out", str(base / "out")]) == 0
    return base, db, inc


@pytest.fixture
def copied(made, tmp_path):
    base, db, inc = made
    shutil.copy(db, tmp_path / "s.duckdb")
    shutil.copytree(base / "out", tmp_path / "out")
    return tmp_path / "s.duckdb", tmp_path / "out", inc


def _head(out, node: str) -> dict:
    (h,) = [h for h in json.loads((out / "report.json").read_text())["chain_heads"] if h["node"] == node]
    return h


def _verify(capsys, out, db) -> tuple[int, list[str]]:
    capsys.readouterr()
    rc = main(["forensics", "verify-report", str(out), "--db", str(db)])
    return rc, capsys.readouterr().out.splitlines()


def test_deleting_the_newest_batches_is_named_as_behind(copied, capsys):
    db, out, inc = copied
    append_request(db, 330, "globex", 20, inc)  # growth past the heads alone is fine ...
    assert _verify(capsys, out, db)[0] == 0
    h = _head(out, "decode-0")
    assert h["batch_no"] == 2
    with duckdb.connect(str(db)) as con:  # ... but then decode-0 is cut back to before its recorded head
        delete_stored(con, "producer_id = ? AND batch_no >= ?", [h["producer_id"], h["batch_no"]])
    rc, lines = _verify(capsys, out, db)
    assert rc == 1
    behind = [x for x in lines if "behind the saved head" in x]
    assert len(behind) == 1
    assert f"chain head of producer {h['producer_id']} (decode-0) batch 2: behind" in behind[0]
    assert "the store ends at batch 1" in behind[0]


def test_a_producer_cut_back_to_nothing_is_behind_and_one_never_stored_is_missing(copied, capsys):
    db, out, _ = copied
    h = _head(out, "router-0")
    with duckdb.connect(str(db)) as con:
        delete_stored(con, "producer_id = ?", [h["producer_id"]])
    doc = json.loads((out / "report.json").read_text())
    doc["chain_heads"].append(dict(h, producer_id=1, node="ghost-0"))
    (out / "report.json").write_text(json.dumps(doc))
    rc, lines = _verify(capsys, out, db)
    assert rc == 1
    assert any(
        f"producer {h['producer_id']} (router-0) batch 2: behind the saved head: the store holds no batch" in x
        for x in lines
    )
    assert any("producer 1 (ghost-0) batch 2: missing: the producer is not in the store" in x for x in lines)


def test_history_replaced_after_the_head_is_named_as_forked(copied, capsys):
    db, out, inc = copied
    h = _head(out, "prefill-0")
    with duckdb.connect(str(db)) as con:
        con.execute(
            "UPDATE batches SET digest = sha256('forged')::BLOB WHERE producer_id = ? AND batch_no = ?",
            [h["producer_id"], h["batch_no"]],
        )
    rc, lines = _verify(capsys, out, db)
    assert rc == 1
    forked = [x for x in lines if "forked from the saved head" in x]
    assert len(forked) == 1
    assert f"chain head of producer {h['producer_id']} (prefill-0) batch {h['batch_no']}: digest differs" in forked[0]


def test_a_manifest_with_malformed_heads_exits_2_naming_the_field(copied, capsys):
    db, out, _ = copied
    doc = json.loads((out / "report.json").read_text())
    doc["chain_heads"][1]["digest"] = "nope"
    (out / "report.json").write_text(json.dumps(doc))
    capsys.readouterr()
    assert main(["forensics", "verify-report", str(out), "--db", str(db)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "report.json: field 'chain_heads[1].digest'" in err[0], err
