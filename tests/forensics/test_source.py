"""The store reader hands the replay the events of a window in engine order, with their page lists,
exactly as the wire form read back (:func:`kvtrail.audit.store.read_events`) has them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pytest

from kvtrail.audit.store import AuditStore, connect_readonly, read_events
from kvtrail.forensics.replay.batch import PRODUCER_NAMES, in_engine_order
from kvtrail.forensics.replay.event import SCALARS
from kvtrail.sim.fleet import FleetConfig, fleet_batches

pytest.importorskip("numba")

from kvtrail.forensics.replay.source import store_batches  # noqa: E402  (needs numba)

# Prefill and decode nodes, transfers (dst_pages), prefix hits (block_hashes): every list the reader fills.
FLEET = FleetConfig(
    seed=4,
    hours=0.004,
    rate_per_s=10,
    prefill_nodes=2,
    decode_nodes=2,
    tenants=4,
    chunk_tokens=4096,
    events_per_batch=500,
)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with AuditStore(tmp_path_factory.mktemp("source") / "s.duckdb") as st:
        for t in fleet_batches(FLEET):
            st.append(t)
        yield st


def _rows(batches) -> list[tuple]:
    """Each row of the batches as (producer identity, producer id, scalars, pages, digests, hashes, dst length)."""
    out = []
    for b in batches:
        scalars = b.scalars.to_pylist()
        for i in range(b.num_rows):
            d, h, nd = b._lists(i)
            out.append(
                (
                    b.idents[b.producer[i]],
                    int(b.pid[i]),
                    tuple(scalars[i].values()),
                    b.pages[b.poff[i] : b.poff[i + 1]].tolist(),
                    None if d is None else d.tolist(),
                    None if h is None else h.tolist(),
                    nd,
                )
            )
    return out


def _wire_rows(con, table: pa.Table) -> list[tuple]:
    ids = {
        tuple(r[1:]): r[0]
        for r in con.execute(f"SELECT producer_id, {', '.join(PRODUCER_NAMES)} FROM producers").fetchall()
    }
    out = []
    for r in in_engine_order(table).to_pylist():
        ident = tuple(r[n] for n in PRODUCER_NAMES)
        out.append(
            (
                ident,
                ids[ident],
                tuple(r[n] for n in SCALARS),
                r["pages"] or [],
                r["page_digests"] or None,
                r["block_hashes"] or None,
                len(r["dst_pages"] or []),
            )
        )
    return out


@pytest.mark.parametrize("page_events_per_slice", [20_000, 200_000, 10**9])
def test_slices_hold_what_read_events_reads(store, page_events_per_slice):
    want = _wire_rows(store.con, read_events(store.con))
    got = []
    slices = 0
    for b in store_batches(store.con, "TRUE", [], page_events_per_slice=page_events_per_slice):
        got += _rows([dataclasses.replace(b, pages=b.pages.copy())])  # the buffer is reused for the next slice
        slices += 1
    assert len({r[1] for r in want}) >= 4 and any(r[6] for r in want) and any(r[5] for r in want)
    assert got == want
    assert (slices > 1) == (page_events_per_slice < 10**9)


def test_a_window_reads_only_its_events(store):
    lo, hi = store.con.execute("SELECT quantile_disc(wall_ns, 0.3), quantile_disc(wall_ns, 0.6) FROM events").fetchone()
    where, params = "wall_ns BETWEEN ? AND ?", [lo, hi]
    want = _wire_rows(store.con, read_events(store.con, where, params))
    got = []
    for b in store_batches(store.con, where, params, page_events_per_slice=20_000):
        got += _rows([dataclasses.replace(b, pages=b.pages.copy())])
    assert want and got == want and np.all(np.diff([r[2][SCALARS.index("wall_ns")] for r in got]) >= 0)


def test_runs_stored_out_of_order_are_read_in_order(tmp_path):
    """The reader takes page_runs in the table's order and checks it: a store whose runs lie in order and
    one whose runs lie shuffled (rewritten by another tool, a parallel insert, a lake's files read in
    another order) read the same, on a read-only connection (which keeps a scan in the table's order)."""
    paths = [tmp_path / "in_order.duckdb", tmp_path / "shuffled.duckdb"]
    for path in paths:
        with AuditStore(path) as st:
            for t in fleet_batches(FLEET):
                st.append(t)
            if path == paths[1]:
                st.con.execute(
                    "CREATE TEMP TABLE shuffled AS SELECT * FROM page_runs ORDER BY hash(producer_id, seq, list, pos)"
                )
                st.con.execute("DELETE FROM page_runs")
                st.con.execute("SET preserve_insertion_order = true")
                st.con.execute("INSERT INTO page_runs SELECT * FROM shuffled")
    got = {}
    for path in paths:
        with connect_readonly(path) as con:
            stored = con.execute("SELECT seq, list, pos FROM page_runs LIMIT 200").fetchall()
            assert (stored == sorted(stored)) == (path == paths[0]), "the runs lie as the test means them to"
            want = _wire_rows(con, read_events(con))
            got[path] = []
            for b in store_batches(con, "TRUE", [], page_events_per_slice=20_000):
                got[path] += _rows([dataclasses.replace(b, pages=b.pages.copy())])
            assert got[path] == want
    assert got[paths[0]] == got[paths[1]]


@pytest.mark.parametrize(
    "where",
    [
        "TRUE",
        "cluster = ? AND node = ? AND wall_ns >= ?",  # a lake task's filter: the producer identity
        "window",  # the engine's window: a correlated subquery naming events_v
    ],
)
def test_the_narrow_union_reads_what_the_whole_view_reads(store, where, monkeypatch):
    """In a store of kind tables the reader queries a union of the columns it reads (planning it costs a
    fraction of the whole view's); read through ``events_v`` itself the slices are the same, row for row."""
    from kvtrail.forensics.replay import source
    from kvtrail.forensics.window import window_filter

    lo, hi, cluster, node = store.con.execute(
        "SELECT quantile_disc(wall_ns, 0.2), quantile_disc(wall_ns, 0.7), any_value(cluster), any_value(node) "
        "FROM events_v WHERE role = 'decode'"
    ).fetchone()
    params: list = []
    if where == "window":
        where, params = window_filter(lo, hi)
    elif where != "TRUE":
        params = [cluster, node, lo]

    def read() -> list[tuple]:
        got = []
        for b in store_batches(store.con, where, params, page_events_per_slice=20_000):
            got += _rows([dataclasses.replace(b, pages=b.pages.copy())])
        return got

    assert source.has_kind_tables(store.con)
    narrow = read()
    monkeypatch.setattr(source, "has_kind_tables", lambda con: False)  # as in a catalog without kind tables
    whole = read()
    assert narrow and narrow == whole
    assert len({r[2][SCALARS.index("kind")] for r in narrow}) >= 4  # page events and the rarer kinds alike


def test_a_snapshot_reads_through_its_own_kind_views(store, tmp_path):
    """A report's snapshot shows the store as of recorded heads through views carrying the tables' names:
    the narrow union reads those views, so a batch committed later stays out of it."""
    from kvtrail.audit.snapshot import open_snapshot

    path = tmp_path / "grown.duckdb"
    with AuditStore(path) as st:
        tables = list(fleet_batches(FLEET))
        for t in tables[: len(tables) // 2]:
            st.append(t)
        rows = st.con.execute("SELECT producer_id, max(batch_no) FROM batches GROUP BY ALL").fetchall()
        for t in tables[len(tables) // 2 :]:
            st.append(t)
    con, _ = open_snapshot(path, [{"producer_id": p, "batch_no": n} for p, n in rows])
    try:
        want = _wire_rows(con, read_events(con))
        got = []
        for b in store_batches(con, "TRUE", [], page_events_per_slice=20_000):
            got += _rows([dataclasses.replace(b, pages=b.pages.copy())])
        with connect_readonly(path) as full:
            everything = full.execute("SELECT count(*) FROM events").fetchone()[0]
    finally:
        con.close()
    assert want and got == want and len(got) < everything
