"""Parquet export/import of an audit store: layout, lossless round trip, and every refusal.

An export is a lake of one whole-store export (cluster=/node=/date=/hour=, ``manifests/manifest-000001.json``);
the exports of format 1 (date=/node=, ``manifest.json``) are read in ``test_export_formats.py``.

``meta`` is compared without ``created_ns``: an import keeps the target's own ``store_format`` and
``created_ns`` (they describe the target file), so only that row may differ from the source.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest

from kvtrail.audit import chain
from kvtrail.audit.batch import from_dicts
from kvtrail.audit.export import TABLE_KEYS, TABLES, export_parquet, import_parquet
from kvtrail.audit.layout import EVENT_COLUMNS
from kvtrail.audit.retention import add_hold, prune, release_hold
from kvtrail.audit.store import (
    EVENTS_SCHEMA,
    RUN_COLUMNS,
    RUNS_SCHEMA,
    AuditStore,
    arrow_query,
    read_events,
)
from kvtrail.audit.storefile import STORE_FORMAT
from kvtrail.audit.verify import verify_store
from kvtrail.errors import StoreError

MIDNIGHT = 1_700_006_400 * 10**9  # 2023-11-15T00:00:00Z
DAY1, DAY2 = "2023-11-14", "2023-11-15"


def producer(node, instance="i1", role="prefill", cluster="c"):
    return {
        "cluster": cluster,
        "node": node,
        "role": role,
        "engine": "ref",
        "engine_version": "0",
        "instance": instance,
    }


def ev(p, seq, wall_ns, kind, **fields):
    return {
        "schema_version": 1,
        "producer": p,
        "seq": seq,
        "wall_ns": wall_ns,
        "mono_ns": seq + 1,
        "kind": kind,
        **fields,
    }


def config(p, seq, wall_ns):
    return ev(
        p,
        seq,
        wall_ns,
        "node_config",
        pool_tokens=1024,
        pool_pages=64,
        page_size=16,
        context_tokens=2048,
        checksum_enabled=True,
        config_source="engine",
    )


def traffic(p, seq, wall_ns, rid):
    """A request's life on one producer: seven events starting at ``seq``, one nanosecond apart."""
    req = {"request_id": rid, "tenant_id": "t1", "transfer_id": 7}
    return [
        ev(p, seq, wall_ns, "request_received", request={**req, "api_key_id": "k"}, prompt_tokens=20),
        ev(p, seq + 1, wall_ns + 1, "pages_allocated", request=req, pages=[3, 4, 5, 9], purpose="prefill_extend"),
        ev(
            p,
            seq + 2,
            wall_ns + 2,
            "pages_allocated",
            request=req,
            pages=[10, 11],
            purpose="prefix_hit",
            block_hashes=[-(2**63), 2**63 - 1],
        ),
        ev(
            p,
            seq + 3,
            wall_ns + 3,
            "kv_written",
            request=req,
            pages=[3, 4],
            token_start=0,
            token_end=20,
            source="forward",
            page_digests=[2**64 - 1, 0],
            digest_algo="kvtrail-page64",
        ),
        ev(
            p,
            seq + 4,
            wall_ns + 4,
            "transfer_sent",
            request=req,
            pages=[3, 4],
            dst_pages=[10, 11],
            num_tokens=20,
            is_last_chunk=True,
            digest=2**64 - 2,
        ),
        ev(p, seq + 5, wall_ns + 5, "pages_freed", request=req, pages=[3, 4, 5, 9, 10, 11], free_reason="finish"),
        ev(
            p,
            seq + 6,
            wall_ns + 6,
            "response_sent",
            request=req,
            http_status=200,
            prompt_tokens=20,
            completion_tokens=5,
            latency_ns=1000,
            finish_reason="stop",
        ),
    ]


PREFILL = producer("prefill-0")
PREFILL_RESTART = producer("prefill-0", instance="i2")
DECODE = producer("decode-0", role="decode")
NUMERIC = producer("123", role="unified")  # a node name that hive type inference would turn into an int


def build_store(path: Path, *, signer=None) -> None:
    """Several producers on three nodes, events on both sides of a UTC midnight, several batches each."""
    day1 = MIDNIGHT - 3_600 * 10**9
    with AuditStore(path, signer=signer) as store:
        store.append(
            from_dicts(
                [
                    config(PREFILL, 0, day1),
                    *traffic(PREFILL, 1, day1, "r1"),
                    config(DECODE, 0, day1),
                    config(NUMERIC, 0, day1),
                ]
            )
        )
        # The request straddles midnight: seq 8..10 on day 1 (the last at MIDNIGHT - 1), 11..14 on day 2.
        late = traffic(PREFILL, 8, MIDNIGHT - 3, "r2")
        store.append(from_dicts(late[:3]))
        gap = ev(DECODE, 8, MIDNIGHT + 20, "recorder_gap", dropped_events=3, gap_reason="buffer_full")
        store.append(from_dicts([*late[3:], *traffic(DECODE, 1, MIDNIGHT + 10, "r3"), gap]))
        store.append(
            from_dicts(
                [
                    config(PREFILL_RESTART, 0, MIDNIGHT + 30),
                    *traffic(PREFILL_RESTART, 1, MIDNIGHT + 40, "r4"),
                    ev(
                        NUMERIC,
                        1,
                        MIDNIGHT + 50,
                        "request_aborted",
                        request={"request_id": "r5"},
                        stage="router",
                        abort_reason="busy",
                        http_status=503,
                    ),
                ]
            )
        )


MANIFEST = Path("manifests") / "manifest-000001.json"


def manifest_of(out: Path) -> dict:
    return json.loads((out / MANIFEST).read_text())


def expected_partitions(path: Path) -> tuple[set, set]:
    """(date, node) of every event, and of every event with a page list, computed in Python."""
    with duckdb.connect(str(path), read_only=True) as con:
        rows = read_events(con).select(["wall_ns", "node", "pages", "dst_pages"]).to_pylist()
    day = lambda ns: datetime.fromtimestamp(ns // 10**9, timezone.utc).date().isoformat()  # noqa: E731
    events = {(day(r["wall_ns"]), r["node"]) for r in rows}
    runs = {(day(r["wall_ns"]), r["node"]) for r in rows if r["pages"] or r["dst_pages"]}
    return events, runs


@pytest.fixture
def signer(tmp_path):
    chain.generate_keypair(tmp_path / "key.pem", tmp_path / "key.pub")
    return chain.Signer.from_file(tmp_path / "key.pem")


def scalar(con, sql):
    return con.execute(sql).fetchall()[0][0]  # fetchall: DuckDB 2 keeps a half-read result open on the connection


def table(con, name, where="TRUE"):
    return arrow_query(con, f"SELECT * FROM {name} WHERE {where} ORDER BY {TABLE_KEYS[name]}")


def assert_chain_recomputes(con):
    """Recompute every batch digest from the stored rows and follow each producer's links."""
    rows = con.execute(
        "SELECT producer_id, batch_no, first_seq, last_seq, num_events, num_runs, prev_digest, digest "
        "FROM batches ORDER BY producer_id, batch_no"
    ).fetchall()
    assert rows
    last = {}
    for pid, no, first, last_seq, n_ev, n_runs, prev, digest in rows:
        assert bytes(prev) == last.get(pid, chain.GENESIS)
        evs = arrow_query(
            con, f"SELECT {EVENT_COLUMNS} FROM events WHERE producer_id = ? AND batch_no = ? ORDER BY seq", [pid, no]
        )
        runs = arrow_query(
            con,
            f"SELECT {RUN_COLUMNS} FROM page_runs WHERE producer_id = ? AND batch_no = ? ORDER BY seq, list, pos",
            [pid, no],
        )
        header = (pid, no, int(first), int(last_seq), n_ev, n_runs)
        assert chain.batch_digest(bytes(prev), header, evs, EVENTS_SCHEMA, runs, RUNS_SCHEMA) == bytes(digest)
        last[pid] = bytes(digest)


def test_round_trip_is_lossless(tmp_path, signer):
    src, out, dst = tmp_path / "src.duckdb", tmp_path / "export", tmp_path / "dst.duckdb"
    build_store(src, signer=signer)
    partitions = dict(zip(("events", "page_runs"), expected_partitions(src)))
    assert partitions["events"] == {(d, n) for d in (DAY1, DAY2) for n in ("prefill-0", "decode-0", "123")}
    assert partitions["page_runs"] == {(DAY1, "prefill-0"), (DAY2, "prefill-0"), (DAY2, "decode-0")}
    steps = []
    res = export_parquet(src, out, progress=steps.append)

    assert {s for s in steps if not s.startswith("producer ")} == set(TABLES) - {"events", "page_runs"} | {"manifest"}
    for name in ("events", "page_runs"):
        found = {
            (p.parent.parent.name.removeprefix("date="), p.parent.parent.parent.name.removeprefix("node="))
            for p in (out / name).glob("cluster=c/node=*/date=*/hour=*/*.parquet")
            if pq.read_metadata(p).num_rows  # a partition's page-runs file is there even when it holds none
        }
        assert found == partitions[name], name
    manifest = manifest_of(out)
    listed = {t: sum(f["rows"] for f in manifest["files"].values() if f["table"] == t) for t in TABLES}
    for name in ("producers", "batches", "meta"):  # the other tables are empty: no file
        assert (out / name / "part-E000001.parquet").is_file()
    with duckdb.connect(str(src), read_only=True) as con:
        counts = {t: scalar(con, f"SELECT count(*) FROM {t}") for t in TABLES}
        heads = con.execute(
            "SELECT producer_id, max(batch_no), arg_max(digest, batch_no) FROM batches GROUP BY producer_id"
        ).fetchall()
        assert scalar(con, "SELECT count(*) FROM batches WHERE signature IS NULL") == 0
    assert listed == counts
    assert manifest["chain_heads"] == {str(p): {"batch_no": n, "digest": bytes(d).hex()} for p, n, d in heads}
    assert manifest["format_version"] == 2 and manifest["exported_at"].endswith("+00:00")
    assert manifest["store_format"] == STORE_FORMAT
    assert (res.events, res.page_runs, res.batches, res.producers) == (
        counts["events"],
        counts["page_runs"],
        counts["batches"],
        counts["producers"],
    )
    assert res.files == sum(1 for p in out.rglob("*") if p.is_file())

    imp = import_parquet(out, dst)
    assert (imp.events, imp.page_runs, imp.batches, imp.producers) == (
        res.events,
        res.page_runs,
        res.batches,
        res.producers,
    )
    with duckdb.connect(str(src), read_only=True) as a, duckdb.connect(str(dst), read_only=True) as b:
        for name in TABLES:
            where = "key <> 'created_ns'" if name == "meta" else "TRUE"
            ta, tb = table(a, name, where), table(b, name, where)
            assert ta.schema == tb.schema, name
            assert ta.equals(tb), name
        assert scalar(b, "SELECT count(*) FROM meta WHERE key = 'created_ns'") == 1
        assert table(b, "producers").column("node").to_pylist().count("123") == 1
        assert read_events(a).equals(read_events(b))
        assert_chain_recomputes(a)
        assert_chain_recomputes(b)
    assert verify_store(src).ok
    report = verify_store(dst)
    assert report.ok, report.first_problem
    with AuditStore(dst, create=False) as store:  # the imported store takes further batches on the chain
        store.append(from_dicts([traffic(DECODE, 9, MIDNIGHT + 100, "r6")[0]]))
    with duckdb.connect(str(dst), read_only=True) as con:
        assert_chain_recomputes(con)


def test_round_trip_after_prune_and_holds(tmp_path):
    src, out, dst = tmp_path / "src.duckdb", tmp_path / "export", tmp_path / "dst.duckdb"
    build_store(src)
    with AuditStore(src) as store:
        add_hold(store, 0, MIDNIGHT, "case 17", node="decode-0")
        release_hold(store, add_hold(store, 0, MIDNIGHT, "case 18", tenant_id="t1"))
        result = prune(store, MIDNIGHT, note="day 1")
    assert result.num_batches == 3 and result.num_held_batches == 1
    export_parquet(src, out)
    import_parquet(out, dst)
    with duckdb.connect(str(src), read_only=True) as a, duckdb.connect(str(dst), read_only=True) as b:
        assert scalar(b, "SELECT count(*) FROM batches WHERE pruned_by IS NOT NULL") == 3
        for name in TABLES:
            where = "key <> 'created_ns'" if name == "meta" else "TRUE"
            assert table(a, name, where).equals(table(b, name, where)), name
    assert verify_store(src).ok
    report = verify_store(dst)
    assert report.ok, report.first_problem
    assert report.batches_pruned == 3


def test_retention_records_of_two_stores_are_not_merged(tmp_path):
    a, b, dst = tmp_path / "a.duckdb", tmp_path / "b.duckdb", tmp_path / "dst.duckdb"
    build_store(a)
    with AuditStore(a) as store:
        add_hold(store, 0, MIDNIGHT, "case 17")
    other = producer("prefill-1", cluster="c2")
    with AuditStore(b) as store:
        store.append(from_dicts([config(other, 0, MIDNIGHT)]))
        add_hold(store, 0, MIDNIGHT, "case 18")
    export_parquet(a, tmp_path / "ea")
    export_parquet(b, tmp_path / "eb")
    import_parquet(tmp_path / "ea", dst)
    with pytest.raises(StoreError, match="already has legal_holds rows"):
        import_parquet(tmp_path / "eb", dst)


def test_empty_store_round_trip(tmp_path):
    src, out, dst = tmp_path / "src.duckdb", tmp_path / "export", tmp_path / "dst.duckdb"
    AuditStore(src).close()
    res = export_parquet(src, out)
    assert (res.events, res.page_runs, res.batches, res.producers) == (0, 0, 0, 0)
    imp = import_parquet(out, dst)
    assert (imp.events, imp.page_runs, imp.batches, imp.producers) == (0, 0, 0, 0)
    with duckdb.connect(str(dst), read_only=True) as con:
        assert scalar(con, "SELECT value FROM meta WHERE key = 'store_format'") == STORE_FORMAT


def test_import_refuses_a_column_of_another_type(tmp_path):
    src, out = tmp_path / "src.duckdb", tmp_path / "export"
    build_store(src)
    export_parquet(src, out)
    path = out / "batches" / "part-E000001.parquet"
    with duckdb.connect() as con:
        con.execute(
            f"COPY (SELECT * REPLACE (CAST(num_runs AS INTEGER) AS num_runs) FROM read_parquet('{path}')) "
            f"TO '{tmp_path / 'b.parquet'}' (FORMAT parquet)"
        )
    (tmp_path / "b.parquet").replace(path)
    with pytest.raises(StoreError, match=r"batches: exported columns do not match.*num_runs"):
        import_parquet(out, tmp_path / "dst.duckdb")
    assert not (tmp_path / "dst.duckdb").exists()


def test_two_exports_merge_into_one_store(tmp_path):
    a, b, dst = tmp_path / "a.duckdb", tmp_path / "b.duckdb", tmp_path / "dst.duckdb"
    build_store(a)
    other = producer("prefill-1", cluster="c2")
    with AuditStore(b) as store:
        store.append(from_dicts([config(other, 0, MIDNIGHT), *traffic(other, 1, MIDNIGHT + 5, "x")]))
    export_parquet(a, tmp_path / "ea")
    export_parquet(b, tmp_path / "eb")
    import_parquet(tmp_path / "ea", dst)
    import_parquet(tmp_path / "eb", dst)
    with duckdb.connect(str(dst), read_only=True) as con:
        for src in (a, b):
            with duckdb.connect(str(src), read_only=True) as s:
                pids = [r[0] for r in s.execute("SELECT producer_id FROM producers").fetchall()]
                where = f"producer_id IN ({', '.join(map(str, pids))})"
                for name in ("producers", "events", "page_runs", "batches"):
                    assert table(s, name).equals(table(con, name, where)), name
        assert_chain_recomputes(con)


def test_export_refuses_non_empty_out_dir_and_missing_store(tmp_path):
    src = tmp_path / "src.duckdb"
    build_store(src)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(StoreError, match="not empty"):
        export_parquet(src, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    with pytest.raises(StoreError, match="not empty"):
        export_parquet(src, out / "keep.txt")
    with pytest.raises(StoreError, match="store not found"):
        export_parquet(tmp_path / "missing.duckdb", tmp_path / "out2")
    assert not (tmp_path / "missing.duckdb").exists() and not (tmp_path / "out2").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    export_parquet(src, empty)  # an existing empty directory is fine
    assert (empty / MANIFEST).is_file()


def test_export_refuses_unsafe_node_name(tmp_path):
    src = tmp_path / "src.duckdb"
    bad = producer("rack 1/gpu0")
    with AuditStore(src) as store:
        store.append(from_dicts([config(PREFILL, 0, MIDNIGHT), config(bad, 0, MIDNIGHT)]))
    with pytest.raises(StoreError, match=r"'rack 1/gpu0'"):
        export_parquet(src, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.duckdb"]  # no partial output left behind


def test_import_refuses_tampered_count_and_rolls_back(tmp_path):
    src, out = tmp_path / "src.duckdb", tmp_path / "export"
    build_store(src)
    export_parquet(src, out)
    manifest = manifest_of(out)
    runs = next(f for f in manifest["files"].values() if f["table"] == "page_runs" and f["rows"])
    runs["rows"] += 1
    (out / MANIFEST).write_text(json.dumps(manifest))

    fresh = tmp_path / "fresh.duckdb"
    with pytest.raises(StoreError, match="page_runs"):
        import_parquet(out, fresh)
    assert not fresh.exists()  # the store this import created is removed again

    # An existing store keeps exactly what it had: producers, batches and events inserted before the
    # failing table are rolled back.
    target = tmp_path / "target.duckdb"
    other = producer("decode-9", role="decode")
    with AuditStore(target) as store:
        store.append(from_dicts([config(other, 0, MIDNIGHT)]))
    with duckdb.connect(str(target), read_only=True) as con:
        before = {t: table(con, t) for t in TABLES}
    with pytest.raises(StoreError, match="page_runs: manifest says"):
        import_parquet(out, target)
    with duckdb.connect(str(target), read_only=True) as con:
        assert all(table(con, t).equals(before[t]) for t in TABLES)


def test_import_refuses_tampered_chain_head(tmp_path):
    src, out = tmp_path / "src.duckdb", tmp_path / "export"
    build_store(src)
    export_parquet(src, out)
    manifest = manifest_of(out)
    pid = sorted(manifest["chain_heads"])[0]
    manifest["chain_heads"][pid]["digest"] = "00" * 32
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match=f"chain head of producer {pid}"):
        import_parquet(out, tmp_path / "dst.duckdb")


def test_import_refuses_duplicate_producers(tmp_path):
    src, out, dst = tmp_path / "src.duckdb", tmp_path / "export", tmp_path / "dst.duckdb"
    build_store(src)
    export_parquet(src, out)
    import_parquet(out, dst)
    with duckdb.connect(str(dst), read_only=True) as con:
        before = {t: table(con, t) for t in TABLES}
    with pytest.raises(StoreError, match=r"already holds producer \d+ \(node [\w-]+, instance i\d\)"):
        import_parquet(out, dst)
    with duckdb.connect(str(dst), read_only=True) as con:
        assert all(table(con, t).equals(before[t]) for t in TABLES)


def test_import_refuses_missing_or_unsupported_manifest(tmp_path):
    src, out = tmp_path / "src.duckdb", tmp_path / "export"
    build_store(src)
    export_parquet(src, out)
    manifest_path = out / MANIFEST
    text = manifest_path.read_text()
    manifest_path.write_text(text.replace('"format_version": 2', '"format_version": 99'))
    with pytest.raises(StoreError, match="not a kvtrail-lake manifest of format_version 1 or 2"):
        import_parquet(out, tmp_path / "a.duckdb")
    manifest_path.unlink()
    with pytest.raises(StoreError, match="manifests/ holds no manifest"):
        import_parquet(out, tmp_path / "b.duckdb")
    manifest_path.parent.rmdir()
    with pytest.raises(StoreError, match="manifest.json is missing"):
        import_parquet(out, tmp_path / "c.duckdb")
    assert not any((tmp_path / f"{n}.duckdb").exists() for n in "abc")
