"""``kvtrail audit prune | hold | export | import`` end to end on a real store: output, effect, exit codes."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import duckdb
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from kvtrail.audit.batch import to_dicts
from kvtrail.audit.store import connect_readonly, fetch_row, read_events
from kvtrail.cli import main
from tests.conftest import alloc, config

HOUR = 3600 * 10**9


def _ns(day: int) -> int:
    """01:00 UTC on 2026-09-<day>."""
    return int(datetime(2026, 9, day, 1, tzinfo=timezone.utc).timestamp()) * 10**9


def _run(capsys, *argv: str) -> tuple[int, list[str], list[str]]:
    capsys.readouterr()
    rc = main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out.splitlines(), cap.err.splitlines()


def _jsonl(path, events) -> str:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return str(path)


@pytest.fixture
def db(tmp_path, capsys) -> str:
    """One producer, three batches: 2026-09-01 (2 events), 09-05 (1, tenant acme), 09-09 (2)."""
    path = str(tmp_path / "a.duckdb")
    files = [
        _jsonl(tmp_path / "b1.jsonl", [config(0, wall_ns=_ns(1)), alloc(1, [1, 2, 3], rid="r1", wall_ns=_ns(1) + 1)]),
        _jsonl(tmp_path / "b2.jsonl", [alloc(2, [10, 11], rid="r2", tenant="acme", wall_ns=_ns(5))]),
        _jsonl(
            tmp_path / "b3.jsonl",
            [alloc(3, [20], rid="r3", wall_ns=_ns(9)), alloc(4, [21, 30], rid="r3", wall_ns=_ns(9) + 1)],
        ),
    ]
    assert _run(capsys, "audit", "ingest", "--db", path, *files)[0] == 0
    return path


def _scalar(db: str, sql: str):
    con = duckdb.connect(db, read_only=True)
    try:
        return fetch_row(con, sql)[0]
    finally:
        con.close()


def _events(db: str) -> list[dict]:
    con = connect_readonly(db)
    try:
        return to_dicts(read_events(con))
    finally:
        con.close()


def _verify(capsys, db: str) -> dict:
    rc, out, _ = _run(capsys, "audit", "verify", "--db", db, "--json")
    report = json.loads("\n".join(out))
    assert rc == 0 and report["ok"], report["problems"]
    return report


# ---- prune -------------------------------------------------------------------------------------


def test_prune_dry_run_counts_and_changes_nothing(capsys, db):
    rc, out, err = _run(capsys, "audit", "prune", "--db", db, "--before", "2026-09-03", "--dry-run")
    assert (rc, err) == (0, [])
    assert out == [
        "would remove 1 batches, 2 events before 2026-09-03T00:00:00.000000Z; kept 0 batches under legal hold"
    ]
    assert _scalar(db, "SELECT count(*) FROM events") == 5
    assert _scalar(db, "SELECT count(*) FROM prunes") == 0


def test_prune_removes_old_batches_records_itself_and_verifies(capsys, db):
    rc, out, _ = _run(capsys, "audit", "prune", "--db", db, "--before", "2026-09-06T00:00:00Z", "--note", "90d")
    assert rc == 0
    assert out == [
        "removed 2 batches, 3 events before 2026-09-06T00:00:00.000000Z; "
        "kept 0 batches under legal hold (prune record 1)"
    ]
    assert [e["seq"] for e in _events(db)] == [3, 4]
    assert _scalar(db, "SELECT note FROM prunes WHERE prune_id = 1") == "90d"
    report = _verify(capsys, db)
    assert report["batches_pruned"] == 2 and report["coverage"][0]["unexplained"] == 0
    rc, out, _ = _run(capsys, "audit", "prune", "--db", db, "--before", "2026-09-06")
    assert rc == 0 and out[0].startswith("removed 0 batches, 0 events") and "prune record" not in out[0]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--before", "last tuesday"], "error: --before: 'last tuesday' is not an ISO 8601 time"),
        (["--before", "2026-13-01"], "error: --before: '2026-13-01' is not an ISO 8601 time"),
    ],
)
def test_prune_with_a_bad_time_exits_2_with_one_line_naming_the_flag(capsys, db, argv, needle):
    rc, out, err = _run(capsys, "audit", "prune", "--db", db, *argv)
    assert (rc, out) == (2, [])
    assert len(err) == 1 and err[0].startswith(needle)
    assert _scalar(db, "SELECT count(*) FROM events") == 5


def test_prune_without_before_or_store_exits_2(capsys, db, tmp_path):
    rc, _, err = _run(capsys, "audit", "prune", "--db", db)
    assert rc == 2 and any("--before" in line for line in err)
    rc, _, err = _run(capsys, "audit", "prune", "--db", str(tmp_path / "none.duckdb"), "--before", "2026-09-03")
    assert rc == 2 and err == [f"error: --db: store not found: {tmp_path / 'none.duckdb'}"]
    assert not (tmp_path / "none.duckdb").exists()


# ---- hold --------------------------------------------------------------------------------------


def test_a_hold_keeps_its_window_through_a_prune_until_released(capsys, db):
    rc, out, _ = _run(
        capsys, "audit", "hold", "add", "--db", db, "--from", "2026-09-04", "--to", "2026-09-06", "--reason", "case 7"
    )
    assert (rc, out) == (0, ["hold 1 placed"])
    rc, out, _ = _run(capsys, "audit", "hold", "list", "--db", db)
    assert (rc, out) == (
        0,
        ["1\t2026-09-04T00:00:00.000000Z .. 2026-09-06T00:00:00.000000Z\ttenant=*\tnode=*\tactive\tcase 7"],
    )
    rc, out, _ = _run(capsys, "audit", "prune", "--db", db, "--before", "2026-09-08")
    assert (rc, out) == (
        0,
        [
            "removed 1 batches, 2 events before 2026-09-08T00:00:00.000000Z; "
            "kept 1 batches under legal hold (prune record 1)"
        ],
    )
    assert [e["seq"] for e in _events(db)] == [2, 3, 4]

    assert _run(capsys, "audit", "hold", "release", "--db", db, "1")[:2] == (0, ["hold 1 released"])
    rc, out, _ = _run(capsys, "audit", "hold", "list", "--db", db)
    assert rc == 0 and "\treleased 2" in out[0] and "active" not in out[0]
    rc, out, _ = _run(capsys, "audit", "prune", "--db", db, "--before", "2026-09-08")
    assert out == [
        "removed 1 batches, 1 events before 2026-09-08T00:00:00.000000Z; "
        "kept 0 batches under legal hold (prune record 2)"
    ]
    assert _verify(capsys, db)["batches_pruned"] == 2


def test_a_tenant_and_node_hold_is_listed_with_its_scope(capsys, db):
    rc, out, _ = _run(
        capsys,
        "audit",
        "hold",
        "add",
        "--db",
        db,
        "--from",
        "2026-09-01T00:00:00Z",
        "--to",
        "2026-09-30",
        "--tenant",
        "acme",
        "--node",
        "prefill-0",
        "--reason",
        "subpoena",
    )
    assert (rc, out) == (0, ["hold 1 placed"])
    _, out, _ = _run(capsys, "audit", "hold", "list", "--db", db)
    assert out[0].split("\t")[2:] == ["tenant=acme", "node=prefill-0", "active", "subpoena"]
    _, out, _ = _run(capsys, "audit", "prune", "--db", db, "--before", "2026-09-10")
    assert out[0].startswith("removed 2 batches, 4 events") and "kept 1 batches under legal hold" in out[0]
    assert [e["request"]["tenant_id"] for e in _events(db)] == ["acme"]


@pytest.mark.parametrize(
    "argv,line",
    [
        (["release", "7"], "error: hold: no hold with id 7"),
        (["add", "--from", "2026-09-40", "--to", "2026-09-06", "--reason", "x"], "error: --from: '2026-09-40' is not"),
        (["add", "--from", "2026-09-04", "--to", "soon", "--reason", "x"], "error: --to: 'soon' is not"),
        (["add", "--from", "2026-09-06", "--to", "2026-09-04", "--reason", "x"], "error: hold: --from is after --to"),
        (
            ["add", "--from", "2026-09-04", "--to", "2026-09-06", "--reason", "  "],
            "error: hold: --reason must not be empty",
        ),
    ],
)
def test_bad_hold_input_exits_2_with_one_line(capsys, db, argv, line):
    rc, out, err = _run(capsys, "audit", "hold", argv[0], "--db", db, *argv[1:])
    assert (rc, out) == (2, [])
    assert len(err) == 1 and err[0].startswith(line)
    assert _scalar(db, "SELECT count(*) FROM legal_holds") == 0


def test_releasing_twice_or_a_non_number_exits_2(capsys, db):
    _run(capsys, "audit", "hold", "add", "--db", db, "--from", "2026-09-04", "--to", "2026-09-06", "--reason", "r")
    assert _run(capsys, "audit", "hold", "release", "--db", db, "1")[0] == 0
    rc, _, err = _run(capsys, "audit", "hold", "release", "--db", db, "1")
    assert (rc, err) == (2, ["error: hold: hold 1 was already released"])
    rc, _, err = _run(capsys, "audit", "hold", "release", "--db", db, "one")
    assert rc == 2 and any("HOLD_ID" in line and "'one' is not a valid integer" in line for line in err)


# ---- export / import ---------------------------------------------------------------------------


def test_export_writes_readable_partitioned_parquet(capsys, db, tmp_path):
    out_dir = tmp_path / "export"
    rc, out, err = _run(capsys, "audit", "export", "--db", db, "--out", str(out_dir))
    assert (rc, err) == (0, [])
    assert out == [f"exported 5 events, 5 page runs, 3 batches to {out_dir}"]
    manifest = json.loads((out_dir / "manifests" / "manifest-000001.json").read_text())
    rows = {t: sum(f["rows"] for f in manifest["files"].values() if f["table"] == t) for t in ("events", "batches")}
    assert rows == {"events": 5, "batches": 3}
    dates = sorted(p.parent.name for p in (out_dir / "events").glob("cluster=*/node=prefill-0/date=*/hour=*"))
    assert dates == ["date=2026-09-01", "date=2026-09-05", "date=2026-09-09"]
    events = ds.dataset(out_dir / "events", format="parquet", partitioning="hive", exclude_invalid_files=True)
    events = events.to_table()
    assert events.num_rows == 5 and set(events.column("node").to_pylist()) == {"prefill-0"}
    assert sorted(events.column("seq").to_pylist()) == [0, 1, 2, 3, 4]
    assert pq.read_table(out_dir / "batches" / "part-E000001.parquet").num_rows == 3
    # the export is a lake: its verify passes and it has a checkpoint beside each partition
    assert _run(capsys, "lake", "verify", str(out_dir))[0] == 0
    assert len(list((out_dir / "events").glob("*/*/*/*/_checkpoint-E000001.ckpt"))) == 3


def test_import_round_trips_and_the_chain_still_verifies(capsys, db, tmp_path):
    _run(capsys, "audit", "hold", "add", "--db", db, "--from", "2026-09-04", "--to", "2026-09-06", "--reason", "r")
    _run(capsys, "audit", "prune", "--db", db, "--before", "2026-09-08")
    out_dir, copy = tmp_path / "export", str(tmp_path / "copy.duckdb")
    assert _run(capsys, "audit", "export", "--db", db, "--out", str(out_dir))[0] == 0
    rc, out, err = _run(capsys, "audit", "import", "--db", copy, str(out_dir))
    assert (rc, err) == (0, [])
    assert out == [f"imported 3 events, 4 page runs, 3 batches into {copy}"]
    assert _events(copy) == _events(db)
    report = _verify(capsys, copy)
    assert report["batches_pruned"] == 1 and report["events_checked"] == 3
    _, out, _ = _run(capsys, "audit", "hold", "list", "--db", copy)
    assert out[0].startswith("1\t2026-09-04") and out[0].endswith("\tactive\tr")


def test_import_refuses_a_store_that_holds_the_producer_already(capsys, db, tmp_path):
    out_dir = tmp_path / "export"
    _run(capsys, "audit", "export", "--db", db, "--out", str(out_dir))
    rc, out, err = _run(capsys, "audit", "import", "--db", db, str(out_dir))
    assert (rc, out) == (2, [])
    assert len(err) == 1 and err[0].startswith("error: target store already holds producer ")
    assert _scalar(db, "SELECT count(*) FROM events") == 5


def test_bad_export_and_import_arguments_exit_2(capsys, db, tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("")
    rc, _, err = _run(capsys, "audit", "export", "--db", db, "--out", str(full))
    assert (rc, err) == (2, [f"error: export directory {full} exists and is not empty"])
    rc, _, err = _run(capsys, "audit", "export", "--db", str(tmp_path / "none.duckdb"), "--out", str(tmp_path / "o"))
    assert rc == 2 and err == [f"error: --db: store not found: {tmp_path / 'none.duckdb'}"]
    target = tmp_path / "t.duckdb"
    rc, _, err = _run(capsys, "audit", "import", "--db", str(target), str(full))
    assert (rc, err) == (2, [f"error: {full} is not a kvtrail export: manifest.json is missing"])
    assert not target.exists()
    rc, _, err = _run(capsys, "audit", "import", "--db", str(target), str(tmp_path / "nowhere"))
    assert rc == 2 and any("does not exist" in line for line in err)


def test_ingesting_an_implausible_pool_exits_2_naming_pool_pages_and_stores_nothing(capsys, db, tmp_path):
    before = _scalar(db, "SELECT count(*) FROM batches")
    bad = _jsonl(tmp_path / "huge.jsonl", [dict(config(5, wall_ns=_ns(10)), pool_pages=2**25)])
    rc, out, err = _run(capsys, "audit", "ingest", "--db", db, bad)
    assert rc == 2 and len(err) == 1 and "pool_pages" in err[0], err
    assert "Traceback" not in "\n".join(out + err)
    assert _scalar(db, "SELECT count(*) FROM batches") == before
