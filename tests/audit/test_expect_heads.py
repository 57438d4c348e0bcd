"""`kvtrail audit head --json` and `kvtrail audit verify --expect-heads`: truncation and rewrites that the
chain alone cannot show are caught against heads saved outside the store."""

from __future__ import annotations

import json

import duckdb
import pytest

from kvtrail.audit.heads import compare_heads
from kvtrail.audit.store import connect_readonly, fetch_row
from kvtrail.cli import main
from tests.conftest import alloc, config, delete_stored, producer

P, D = producer("prefill-0"), producer("decode-0", role="decode")


def _run(capsys, *argv: str) -> tuple[int, list[str], list[str]]:
    capsys.readouterr()
    rc = main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out.splitlines(), cap.err.splitlines()


def _ingest(capsys, db: str, path, events) -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    assert _run(capsys, "audit", "ingest", "--db", db, str(path))[0] == 0


def _pid(db: str, node: str) -> int:
    with duckdb.connect(db, read_only=True) as con:
        return fetch_row(con, "SELECT producer_id FROM producers WHERE node = ?", [node])[0]


@pytest.fixture
def saved(tmp_path, capsys):
    """A store with 3 batches per producer, its heads saved to heads.json, then 2 more batches each."""
    db = str(tmp_path / "a.duckdb")
    _ingest(capsys, db, tmp_path / "b0.jsonl", [config(0, P), config(0, D)])
    for b in range(1, 5):
        if b == 3:
            rc, out, _ = _run(capsys, "audit", "head", "--db", db, "--json")
            assert rc == 0
            (tmp_path / "heads.json").write_text("\n".join(out))
        _ingest(
            capsys,
            db,
            tmp_path / f"b{b}.jsonl",
            [alloc(b, [b], rid=f"p{b}", prod=P), alloc(b, [b], rid=f"d{b}", prod=D)],
        )
    return db, str(tmp_path / "heads.json")


def test_head_json_lists_every_producer_with_its_latest_batch(saved):
    _, heads = saved
    doc = json.loads(open(heads).read())
    assert sorted(h["node"] for h in doc["heads"]) == ["decode-0", "prefill-0"]
    for h in doc["heads"]:
        assert (h["batch_no"], h["last_seq"], len(h["digest"])) == (2, 2, 64)
        assert set(h) == {"producer_id", "node", "instance", "batch_no", "last_seq", "digest"}


def test_a_store_that_grew_past_the_saved_heads_verifies(saved, capsys):
    db, heads = saved
    rc, out, _ = _run(capsys, "audit", "verify", "--db", db, "--expect-heads", heads)
    assert rc == 0, out
    assert "OK: the store still holds all 2 saved chain heads" in out


def test_deleting_a_producers_newest_batches_is_named_as_behind(saved, capsys):
    db, heads = saved
    a = _pid(db, "prefill-0")
    with duckdb.connect(db) as con:  # batches 2..4 of prefill-0 gone: the shorter chain itself is intact
        delete_stored(con, "producer_id = ? AND batch_no >= 2", [a])
    assert _run(capsys, "audit", "verify", "--db", db)[0] == 0  # what the chain alone can tell
    rc, out, _ = _run(capsys, "audit", "verify", "--db", db, "--expect-heads", heads)
    assert rc == 1
    failed = [line for line in out if line.startswith("FAILED")]
    assert len(failed) == 1 and f"producer {a} (prefill-0)" in failed[0] and "behind the saved head" in failed[0]
    assert "the store ends at batch 1, seq 1, the saved head is batch 2, seq 2" in failed[0]
    rc, out, _ = _run(capsys, "audit", "verify", "--db", db, "--expect-heads", heads, "--json")
    report = json.loads("\n".join(out))
    assert rc == 1 and not report["ok"] and report["heads_checked"] == 2
    assert [p for p in report["problems"] if "behind" in p and "prefill-0" in p]


def test_a_rewritten_digest_at_the_saved_head_is_named_as_forked(saved, capsys):
    db, heads = saved
    d = _pid(db, "decode-0")
    with duckdb.connect(db) as con:  # a whole rewrite: every digest replaced (the links are then broken too)
        con.execute(
            "UPDATE batches SET digest = sha256('forged' || batch_no::VARCHAR)::BLOB WHERE producer_id = ?", [d]
        )
    rc, out, _ = _run(capsys, "audit", "verify", "--db", db, "--expect-heads", heads)
    assert rc == 1
    (line,) = [x for x in out if x.startswith("FAILED: saved chain head")]
    assert f"producer {d} (decode-0) batch 2: digest differs" in line and "forked" in line


def test_history_replaced_after_a_truncation_is_named_as_forked(saved, tmp_path, capsys):
    db, heads = saved
    a = _pid(db, "prefill-0")
    with duckdb.connect(db) as con:
        delete_stored(con, "producer_id = ? AND batch_no >= 2", [a])
    # New batches appended through the store itself: a valid chain of the same length, other content.
    _ingest(capsys, db, tmp_path / "forged.jsonl", [alloc(2, [9], rid="x", prod=P)])
    _ingest(capsys, db, tmp_path / "forged2.jsonl", [alloc(3, [9], rid="y", prod=P)])
    assert _run(capsys, "audit", "verify", "--db", db)[0] == 0
    rc, out, _ = _run(capsys, "audit", "verify", "--db", db, "--expect-heads", heads)
    assert rc == 1
    (line,) = [x for x in out if x.startswith("FAILED")]
    assert f"producer {a} (prefill-0) batch 2: digest differs" in line and "forked from the saved head" in line


def test_a_producer_missing_from_the_store_is_named(saved, capsys):
    db, heads = saved
    doc = json.loads(open(heads).read())
    doc["heads"].append(dict(doc["heads"][0], producer_id=12345, node="gone-0"))
    open(heads, "w").write(json.dumps(doc))
    rc, out, _ = _run(capsys, "audit", "verify", "--db", db, "--expect-heads", heads)
    assert rc == 1
    assert any("producer 12345 (gone-0)" in x and "missing" in x for x in out if x.startswith("FAILED"))


def test_producers_the_file_does_not_mention_are_fine(saved, tmp_path, capsys):
    db, heads = saved
    _ingest(capsys, db, tmp_path / "new.jsonl", [config(0, producer("decode-1", role="decode"))])
    doc = json.loads(open(heads).read())
    doc["heads"] = [h for h in doc["heads"] if h["node"] == "prefill-0"]
    open(heads, "w").write(json.dumps(doc))
    rc, out, _ = _run(capsys, "audit", "verify", "--db", db, "--expect-heads", heads)
    assert rc == 0 and "OK: the store still holds all 1 saved chain heads" in out


def test_compare_heads_judges_each_producer_on_its_own(saved):
    db, heads = saved
    saved_heads = json.loads(open(heads).read())["heads"]
    a = _pid(db, "prefill-0")
    with duckdb.connect(db) as con:
        delete_stored(con, "producer_id = ? AND batch_no >= 1", [a])
    con = connect_readonly(db)
    try:
        problems = compare_heads(con, saved_heads)
        assert compare_heads(con, []) == []
    finally:
        con.close()
    assert [(p.producer_id, p.node, p.batch_no) for p in problems] == [(a, "prefill-0", 2)]
    assert "behind the saved head" in problems[0].what


@pytest.mark.parametrize(
    "content,needle",
    [
        ("not json {", "not valid JSON"),
        ("[]", "field 'heads': missing"),
        ('{"heads": {}}', "field 'heads': must be a list"),
        ('{"heads": [7]}', "field 'heads[0]': must be an object"),
        ('{"heads": [{"producer_id": 1, "batch_no": 0, "last_seq": 0}]}', "field 'heads[0].digest': missing"),
        (
            '{"heads": [{"producer_id": 1, "batch_no": "0", "last_seq": 0, "digest": "' + "a" * 64 + '"}]}',
            "field 'heads[0].batch_no': must be int",
        ),
        (
            '{"heads": [{"producer_id": 1, "batch_no": -1, "last_seq": 0, "digest": "' + "a" * 64 + '"}]}',
            "field 'heads[0].batch_no': must be >= 0",
        ),
        (
            '{"heads": [{"producer_id": 1, "batch_no": 0, "last_seq": 0, "digest": "abc"}]}',
            "field 'heads[0].digest': must be a SHA-256 digest",
        ),
    ],
)
def test_a_bad_heads_file_exits_2_naming_the_file_and_the_field(saved, tmp_path, capsys, content, needle):
    db, _ = saved
    bad = tmp_path / "bad-heads.json"
    bad.write_text(content)
    rc, out, err = _run(capsys, "audit", "verify", "--db", db, "--expect-heads", str(bad))
    assert (rc, out) == (2, [])
    assert len(err) == 1 and err[0].startswith(f"error: {bad}: ") and needle in err[0], err


def test_a_missing_heads_file_exits_2(saved, tmp_path, capsys):
    db, _ = saved
    rc, _, err = _run(capsys, "audit", "verify", "--db", db, "--expect-heads", str(tmp_path / "none.json"))
    assert rc == 2 and len(err) == 1 and "none.json: cannot read" in err[0]


def test_head_text_output_is_unchanged_in_shape(saved, capsys):
    db, _ = saved
    rc, out, _ = _run(capsys, "audit", "head", "--db", db)
    assert rc == 0 and [line.split("\t")[0] for line in out] == ["decode-0", "prefill-0"]
    assert all(line.split("\t")[2:4] == ["batch 4", "seq 4"] and len(line.split("\t")[4]) == 64 for line in out)
