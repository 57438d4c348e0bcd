"""The store keeps every event exactly: fields, page lists (order included), producers."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtrail.audit.batch import from_dicts, to_dicts
from kvtrail.audit.store import AuditStore, read_events
from tests.conftest import alloc, config, event, producer


def _all_kinds(seq0=1, prod=None):
    req = {"request_id": "r9", "transfer_id": 2**63 + 5, "tenant_id": "acme", "api_key_id": "k:3f2a"}
    evs = [
        event(
            0,
            "request_received",
            prod,
            request={"request_id": "r9", "tenant_id": "acme"},
            prompt_tokens=700,
            max_new_tokens=32,
        ),
        event(0, "pages_allocated", prod, request=req, pages=[5, 6, 7, 60, 2], purpose="prefill_extend"),
        event(
            0,
            "pages_allocated",
            prod,
            request=req,
            pages=[9, 10],
            purpose="prefix_hit",
            block_hashes=[-(2**63), 2**63 - 1],
        ),
        event(
            0,
            "kv_written",
            prod,
            request=req,
            pages=[5, 6],
            token_start=0,
            token_end=32,
            source="forward",
            page_digests=[0, 2**64 - 1],
            digest_algo="kvtrail-page64",
        ),
        event(0, "kv_read", prod, request=req, pages=[7, 5, 6]),
        event(0, "transfer_reserved", prod, request=req, pages=[11, 12, 13], num_tokens=40),
        event(
            0,
            "transfer_sent",
            prod,
            request=req,
            pages=[5],
            dst_pages=[11],
            num_tokens=1,
            is_last_chunk=True,
            digest=12345,
            digest_algo="adler32",
        ),
        event(0, "transfer_received", prod, request=req, pages=[11, 12, 13], num_tokens=1, status="mismatch"),
        event(
            0,
            "request_aborted",
            prod,
            request=req,
            stage="prefill_queue",
            abort_reason="input too long",
            http_status=400,
            prompt_tokens=900000,
        ),
        event(
            0,
            "response_sent",
            prod,
            request=req,
            http_status=200,
            prompt_tokens=900000,
            completion_tokens=17,
            latency_ns=5_000_000,
            ttft_ns=1_000_000,
            finish_reason="stop",
        ),
        event(0, "pages_freed", prod, pages=[60], free_reason="eviction"),
        event(0, "pages_freed", prod, request=req, pages=[], free_reason="abort"),
        event(0, "recorder_gap", prod, dropped_events=3, dropped_pages=190, gap_reason="buffer_full", detail="full"),
    ]
    for i, e in enumerate(evs):
        e["seq"] = seq0 + i
    return evs


def test_every_kind_round_trips_exactly(store):
    evs = [
        config(
            0,
            checksum_enabled=True,
            canary_enabled=False,
            deferred_release=True,
            page_tags=False,
            config_source="server_info",
            max_running_requests=48,
        )
    ] + _all_kinds()
    store.append(from_dicts(evs))
    assert to_dicts(read_events(store.con)) == evs


def test_multi_producer_batch_gets_one_chained_batch_per_producer(store):
    a, b = producer("prefill-0"), producer("decode-0", role="decode")
    evs = [config(0, a), config(0, b), alloc(1, [3, 4], prod=a), alloc(1, [3], prod=b), alloc(2, [9], prod=a)]
    res = store.append(from_dicts(evs))
    assert len(res.batches) == 2 and res.num_events == 5 and res.num_page_events == 4
    back = to_dicts(read_events(store.con, "node = ?", ["prefill-0"]))
    assert [e["seq"] for e in back] == [0, 1, 2]
    assert back[1]["pages"] == [3, 4]


def test_state_survives_reopen(tmp_path):
    path = tmp_path / "a.duckdb"
    with AuditStore(path) as s:
        s.append(from_dicts([config(0, pool_pages=10), alloc(1, [10])]))
    with AuditStore(path) as s:
        s.append(from_dicts([alloc(2, [9])]))  # pool size and last seq known after reopen
        assert s.con.execute("SELECT max(batch_no) FROM batches").fetchone()[0] == 1
        import pytest

        from kvtrail.errors import ValidationError

        with pytest.raises(ValidationError, match="going backwards"):
            s.append(from_dicts([alloc(2, [9])]))
        with pytest.raises(ValidationError, match="pool has 10"):
            s.append(from_dicts([alloc(3, [11])]))


def test_runs_are_what_is_stored(store):
    store.append(from_dicts([config(0), alloc(1, list(range(1, 65))), alloc(2, [5, 3, 4, 9, 10])]))
    runs = store.con.execute("SELECT seq, pos, page_start, num_pages FROM page_runs ORDER BY seq, pos").fetchall()
    assert runs == [(1, 0, 1, 64), (2, 0, 5, 1), (2, 1, 3, 2), (2, 3, 9, 2)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.integers(1, 500), min_size=0, max_size=50), min_size=1, max_size=20), st.integers(0, 2**32))
def test_random_page_lists_round_trip(tmp_path_factory, lists, seed):
    rng = np.random.default_rng(seed)
    path = tmp_path_factory.mktemp("s") / "a.duckdb"
    evs = [config(0, pool_pages=500)]
    for i, pages in enumerate(lists):
        if rng.random() < 0.5:
            evs.append(alloc(i + 1, pages, rid=f"r{i}"))
        else:
            evs.append(
                event(
                    i + 1,
                    "transfer_sent",
                    request={"request_id": f"r{i}", "transfer_id": i},
                    pages=pages,
                    dst_pages=[p + 1 for p in pages],
                    num_tokens=len(pages),
                    is_last_chunk=bool(i % 2),
                )
            )
    with AuditStore(path) as s:
        s.append(from_dicts(evs))
        assert to_dicts(read_events(s.con)) == evs


def test_a_foreign_duckdb_file_is_refused_unchanged(tmp_path):
    import duckdb
    import pytest

    from kvtrail.errors import StoreError

    path = tmp_path / "other.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE sales (id INTEGER)")
    con.close()
    with pytest.raises(StoreError, match="not a kvtrail store"):
        AuditStore(path)
    con = duckdb.connect(str(path))
    assert [r[0] for r in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()] == ["sales"]
    con.close()


def test_read_events_after_an_open_result_on_the_same_connection(store):
    store.append(from_dicts([config(0), alloc(1, [1, 2])]))
    store.con.execute("SELECT count(*) FROM events").fetchone()  # leaves a result open (DuckDB 2)
    assert len(to_dicts(read_events(store.con))) == 2


def test_events_v_rows_holds_the_views_rows_for_the_columns_asked(tmp_path):
    """The narrow union the store reader queries: events_v's rows (of the kinds asked, if any) with the
    producer identity and the columns asked; a column events does not hold is refused by name."""
    from kvtrail.audit.layout import events_v_rows
    from kvtrail.sim.fleet import FleetConfig, fleet_batches

    cfg = FleetConfig(seed=2, hours=0.002, rate_per_s=10, prefill_nodes=1, decode_nodes=1, events_per_batch=400)
    with AuditStore(tmp_path / "s.duckdb") as store:
        for t in fleet_batches(cfg):
            store.append(t)
        cols = "node, producer_id, seq, kind, request_id, tenant_id, num_pages, block_hashes"
        key = "ORDER BY producer_id, seq"
        want = store.con.execute(f"SELECT {cols} FROM events_v {key}").fetchall()
        narrow = events_v_rows(("seq", "kind", "request_id", "tenant_id", "num_pages", "block_hashes"))
        got = store.con.execute(f"SELECT {cols} FROM {narrow} v {key}").fetchall()
        assert len(want) > 100 and got == want
        sent = store.con.execute(
            f"SELECT DISTINCT kind FROM {events_v_rows(('kind',), ['transfer_sent', 'node_config'])} v"
        ).fetchall()
        assert sorted(sent) == [("node_config",), ("transfer_sent",)]
        with pytest.raises(ValueError, match="not a column of events: pages_of"):
            events_v_rows(("seq", "pages_of"))
