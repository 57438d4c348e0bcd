"""Reading a store window straight into :class:`ReplayBatch` slices, for the replay engine's fast path.

The wire form (:func:`kvtrail.audit.store.read_events`) rebuilds every column and list of every event
and sorts them again in the engine; for a forensic question over hours of a fleet that costs more
than the replay itself. This reader asks DuckDB for the events already in engine order, only the
columns the engine reads, in time slices of about ``page_events_per_slice`` page-events (so memory
stays bounded however long the window), and expands each slice's page runs (``page_runs``, read for
all producers in one filtered scan) in a compiled merge on ``seq``, producer by producer. Events of
kinds other than the page kinds, and the few events that carry digest or block-hash lists, are read
in one second query in the same order (none when a slice has none).

All slices are read in one transaction (one snapshot), by default by a helper thread one slice ahead
of the replay (DuckDB and the numba kernel both release the GIL: on 2 idle cores this beats reading
and replaying in turn by ~25 %, for ~5-20 % more CPU; under heavy load the two are even), else in
turn; the connection must not be used by anything else until the slices are consumed.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrail.audit.arrowutil import flat_list, offsets_from_lengths
from kvtrail.audit.batch import BATCH_SCHEMA
from kvtrail.audit.events import KINDS
from kvtrail.audit.layout import EVENTS_SCHEMA, events_v_rows, has_kind_tables
from kvtrail.forensics.progress import advance
from kvtrail.forensics.replay.batch import PAGE_KINDS, PRODUCER_NAMES, ReplayBatch, request_codes
from kvtrail.forensics.replay.event import SCALARS
from kvtrail.forensics.replay.kernels import gather_runs, read_only

# A slice's memory (and the fixed cost of its queries) is about so much per page-event and per event:
# a slice holds about this many page-events, or this many events, or a mix in proportion.
PAGE_EVENTS_PER_SLICE = 24_000_000
EVENTS_PER_SLICE = 250_000
_TYPES = {f.name: f.type for f in BATCH_SCHEMA}
_GRID_POINTS = 4096


def _slice_bounds(
    con,
    where: str,
    params: list,
    page_events_per_slice: int,
    events_per_slice: int = EVENTS_PER_SLICE,
    narrow: bool | None = None,
) -> list[int]:
    """Cut points in wall_ns such that each slice holds about page_events_per_slice page-events, or
    events_per_slice events, or a mix in that proportion.

    Committed batches know their time span, events and page-events; each batch's are taken as spread
    evenly over its span, which is close enough for sizing slices. Only the batches of the producers
    ``where`` selects count, and only their part inside the window's time span (one node's hour of a
    fleet's store is one slice, not as many as the whole fleet's hour would need). ``narrow``: whether the
    store has kind tables, if the caller knows (:func:`_events_v`).
    """
    lo, hi, pids = con.execute(
        f"SELECT min(wall_ns), max(wall_ns), list(DISTINCT producer_id) FROM {_events_v(con, (where,), narrow)} "
        f"WHERE {where}",
        params,
    ).fetchone()
    if lo is None:
        return []
    spans = con.execute(
        "SELECT min_wall_ns, max_wall_ns, num_page_events, num_events FROM batches "
        "WHERE max_wall_ns >= ? AND min_wall_ns <= ? AND pruned_by IS NULL "
        "AND list_contains(?, producer_id)",
        [lo, hi, pids],
    ).fetchnumpy()
    weight = (
        spans["num_page_events"].astype(np.float64) / page_events_per_slice
        + spans["num_events"].astype(np.float64) / events_per_slice
    )  # in slices
    if hi <= lo or float(weight.sum()) < 1.0:
        return [lo, hi + 1]
    grid = np.linspace(lo, hi, _GRID_POINTS)
    start, end = spans["min_wall_ns"].astype(np.float64), spans["max_wall_ns"].astype(np.float64)
    share = np.clip((grid[:, None] - start) / np.maximum(end - start, 1.0), 0.0, 1.0)
    cum = share @ weight  # slices' worth of the batches before each grid point
    total = float(cum[-1] - cum[0])  # inside [lo, hi]
    slices = int(total) + 1
    if slices <= 1:
        return [lo, hi + 1]
    cuts = np.interp(cum[0] + np.arange(1, slices) * total / slices, cum, grid).astype(np.int64)
    return sorted({lo, *cuts.tolist(), hi + 1})


def _events_v(con, cols, narrow: bool | None = None, kinds: list[str] | None = None) -> str:
    """``events_v`` as a FROM item for a query of ``cols`` (names, expressions or filters over them; time,
    kind and producer always included): in a store of kind tables, a union of those columns alone
    (:func:`~kvtrail.audit.layout.events_v_rows`), whose planning costs a fraction of the whole view's; the
    view elsewhere (a lake's Parquet, a format-1 catalog). ``kinds``: only events of these kinds are wanted."""
    if not (has_kind_tables(con) if narrow is None else narrow):
        return "events_v"
    names = [n for n in EVENTS_SCHEMA.names if any(re.search(rf"\b{n}\b", c) for c in cols)]
    return f"{events_v_rows(('wall_ns', 'seq', 'kind', *names), kinds)} events_v"


# The columns a page event can have (validation refuses other fields on page kinds); events of the
# other kinds are read with every column the handlers read, in a second query.
_PAGE_EVENT_COLS = tuple(
    name for name in SCALARS if name in ("seq", "wall_ns", "kind") or any(name in KINDS[k].allowed for k in PAGE_KINDS)
)
_PAGE_KINDS_SQL = "('pages_allocated', 'pages_freed', 'kv_written', 'kv_read')"
_HAS_LISTS = "(page_digests IS NOT NULL OR block_hashes IS NOT NULL)"
_RARE_SQL = f"AND ({_HAS_LISTS} OR kind IS NULL OR kind NOT IN {_PAGE_KINDS_SQL})"
_REST_COLS = tuple(name for name in SCALARS if name not in _PAGE_EVENT_COLS)
# Every ``events`` column :func:`store_batches` reads (a reader of Parquet files may decode these alone).
STORE_BATCH_COLUMNS = ("producer_id", *SCALARS, "page_digests", "block_hashes")


class _SliceReader:
    """Reads the slices of one window inside one transaction (a snapshot) of the caller's connection.

    Not a cursor of its own: a cursor would not see the caller's temporary views (a report's snapshot
    of the store is made of them).
    """

    def __init__(self, con, where: str, params: list):
        self.con = con
        self.where, self.params = where, params
        self.con.begin()
        self.narrow = has_kind_tables(con)
        rows = self.con.execute(
            f"SELECT producer_id, {', '.join(PRODUCER_NAMES)} FROM producers "
            "ORDER BY cluster, node, instance, producer_id"
        ).fetchall()
        self.idents = [tuple(r[1:]) for r in rows]
        pids = np.array([r[0] for r in rows], np.int64)  # store ids are hashes: map them by search
        self.pid_order = np.argsort(pids)
        self.sorted_pids = pids[self.pid_order]
        self.spare: list[np.ndarray] = []  # page buffers of batches the caller is done with

    def close(self) -> None:
        self.con.commit()

    def _events(self, cols, lo: int, hi: int, extra: str = "", kinds: list[str] | None = None) -> pa.Table:
        # Producers rank by (cluster, node, instance) as in the engine's sort; ties keep (producer_id, seq)
        # order, as the sort of read_events' rows does.
        return (
            self.con.sql(
                "WITH pr AS (SELECT producer_id, rank() OVER (ORDER BY cluster, node, instance) AS prank "
                "FROM producers) "
                f"SELECT producer_id, {', '.join(cols)} "
                f"FROM {_events_v(self.con, (*cols, self.where, extra), self.narrow, kinds)} "
                "JOIN pr USING (producer_id) "
                f"WHERE {self.where} AND wall_ns >= ? AND wall_ns < ? {extra} "
                "ORDER BY wall_ns, prank, producer_id, seq",
                params=[*self.params, lo, hi],
            )
            .to_arrow_table()
            .combine_chunks()
        )

    def _some_rows(self, ev: pa.Table, rows: np.ndarray, cols, lo: int, hi: int, extra: str) -> pa.Table:
        """``cols`` of the slice's events matching ``extra`` (``rows`` of ``ev``), in the same order."""
        kinds = pc.unique(ev.column("kind").take(pa.array(rows))).to_pylist()  # the union of those kinds alone
        part = self._events(("seq",) + tuple(cols), lo, hi, extra, None if None in kinds else kinds)
        assert (
            part.num_rows == len(rows)
            and np.array_equal(part.column("producer_id").to_numpy(), ev.column("producer_id").to_numpy()[rows])
            and np.array_equal(part.column("seq").to_numpy(), ev.column("seq").to_numpy()[rows])
        ), "two reads of one snapshot disagree"
        return part

    def read(self, lo: int, hi: int) -> ReplayBatch | None:
        # No list columns in the main read: DuckDB sorts them slowly, and few events carry any.
        ev = self._events(_PAGE_EVENT_COLS + (f"{_HAS_LISTS} AS has_lists",), lo, hi)
        n = ev.num_rows
        if n == 0:
            return None
        pid = ev.column("producer_id").to_numpy().astype(np.int64)
        producer = self.pid_order[np.searchsorted(self.sorted_pids, pid)]
        pages, poff, num_dst = self._pages(_Keys(pid, ev.column("seq").to_numpy().view(np.int64), producer), n)
        # The rare rows (events of the other kinds, events with digest or block-hash lists) in one second
        # query, none when the slice has none: each query costs a bind and a scan of the slice.
        other = ~pc.is_in(ev.column("kind"), value_set=pa.array(PAGE_KINDS)).to_numpy(zero_copy_only=False)
        rare = np.flatnonzero(ev.column("has_lists").to_numpy(zero_copy_only=False) | other)
        part = (
            self._some_rows(ev, rare, ("page_digests", "block_hashes") + _REST_COLS, lo, hi, _RARE_SQL)
            if len(rare)
            else None
        )
        if part is None:
            digests, hashes = read_only(np.zeros(0, np.uint64)), read_only(np.zeros(0, np.int64))
            doff, hoff = np.zeros(n + 1, np.int64), np.zeros(n + 1, np.int64)
        else:
            digests, doff = _scatter_lists(n, rare, part.column("page_digests"), np.uint64)
            hashes, hoff = _scatter_lists(n, rare, part.column("block_hashes"), np.int64)
        rcode, request_ids = request_codes(ev.column("request_id"))
        return ReplayBatch(
            self._scalars(ev, rare, part),
            pid,
            producer,
            self.idents,
            rcode,
            request_ids,
            pages,
            poff,
            digests,
            doff,
            hashes,
            hoff,
            num_dst,
        )

    def _pages(self, keys: "_Keys", n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(flat 'pages' lists, offsets, 'dst_pages' lengths) of the slice's rows, from page_runs.

        One scan for all the slice's producers (:func:`_ordered_runs`); runs attach to events by a merge on seq and
        are concatenated in (list, pos) order, exactly as :func:`~kvtrail.audit.store.read_events` does.
        """
        ranges = keys.ranges()
        runs = _ordered_runs(self.con, ranges)
        run_seg = np.searchsorted(runs["rank"], np.arange(len(ranges) + 1)).astype(np.int64)
        poff = np.zeros(n + 1, np.int64)
        num_dst = np.zeros(n, np.int64)
        args = (
            keys.order,
            keys.seq,
            keys.seg,
            runs["seq"],
            runs["list"],
            runs["page_start"],
            runs["num_pages"],
            run_seg,
        )
        gather_runs(*args, poff, np.zeros(0, np.int32), num_dst)
        np.cumsum(poff, out=poff)
        pages = self._buffer(int(poff[-1]))
        if len(pages):
            gather_runs(*args, poff, pages, num_dst)
        return pages, poff, num_dst

    def _buffer(self, size: int) -> np.ndarray:
        # Fresh memory costs page faults on every touch: reuse the buffers of batches already replayed.
        for k, buf in enumerate(self.spare):
            if len(buf) >= size:
                return self.spare.pop(k)[:size]
        return np.empty(size + size // 4, np.int32)[:size]

    def recycle(self, batch: ReplayBatch) -> None:
        """The caller is done with ``batch``: its page buffer may hold a later slice."""
        self.spare.append(batch.pages if batch.pages.base is None else batch.pages.base)

    @staticmethod
    def _scalars(ev: pa.Table, rare: np.ndarray, part: pa.Table | None) -> pa.Table:
        """Every SCALARS column: the page events' columns from ``ev``, the rest from ``part`` (the rows
        ``rare`` of ``ev``; page events carry none of those fields)."""
        n = ev.num_rows
        at = np.full(n, -1, np.int64)
        at[rare] = np.arange(len(rare))
        take = pa.array(at, mask=at < 0)
        cols = {}
        for name in SCALARS:
            if name in _PAGE_EVENT_COLS:
                cols[name] = ev.column(name).chunk(0)
            elif part is not None:
                cols[name] = part.column(name).chunk(0).take(take)
            else:
                cols[name] = pa.nulls(n, _TYPES[name])
        return pa.table(cols)


def _ordered_runs(con, ranges: list[tuple[int, int, int]]) -> dict[str, np.ndarray]:
    """The page runs of the (producer_id, first seq, last seq) ``ranges``, ordered by (range, seq, list, pos).

    One filtered scan of ``page_runs``, no join and no ORDER BY in DuckDB. Each producer's runs are
    stored in (seq, list, pos) order batch by batch, in stretches (producers' batches interleave, and a
    parallel insert may lay a batch's chunks out of order), so one int64 key per run, checked and if
    need be sorted stably (a merge of those stretches), costs far less than DuckDB's sort of the rows.
    ``rank`` is the range's index.
    """
    cond = " OR ".join(["(producer_id = ?::BIGINT AND seq BETWEEN ?::UBIGINT AND ?::UBIGINT)"] * len(ranges))
    got = con.sql(
        f"SELECT producer_id, seq, list, pos, page_start, num_pages FROM page_runs WHERE {cond}",
        params=[x for r in ranges for x in r],
    ).to_arrow_table()
    cols = {k: got.column(k).to_numpy() for k in ("seq", "list", "page_start", "num_pages")}
    pids = np.array([r[0] for r in ranges], np.int64)
    by_pid = np.argsort(pids)
    rank = by_pid[np.searchsorted(pids[by_pid], got.column("producer_id").to_numpy())]
    order = _run_order(ranges, rank, cols["seq"], cols["list"], got.column("pos").to_numpy())
    if order is not None:
        rank = rank[order]
        cols = {k: v[order] for k, v in cols.items()}
    runs = {k: read_only(v) for k, v in cols.items()}
    runs["rank"] = rank
    runs["seq"] = runs["seq"].view(np.int64)  # as the events' seq: same bits, compared as int64
    return runs


def _run_order(ranges, rank: np.ndarray, seq: np.ndarray, lst: np.ndarray, pos: np.ndarray) -> np.ndarray | None:
    """The order of runs by (rank, seq, list, pos), or None when they are in it already."""
    lo = np.array([r[1] for r in ranges], np.uint64)
    base = np.concatenate([[0], np.cumsum([r[2] - r[1] + 1 for r in ranges], dtype=np.int64)])
    width = int(pos.max(initial=0)) + 1
    if not (
        base[-1] * 2 * width < 1 << 62
        and int(pos.min(initial=0)) >= 0
        and int(lst.max(initial=0)) <= 1
        and int(lst.min(initial=0)) >= 0
    ):
        return np.lexsort((pos, lst, seq, rank))  # no key fits in an int64
    key = (base[rank] + (seq - lo[rank]).astype(np.int64)) * (2 * width) + lst.astype(np.int64) * width + pos
    if np.all(key[1:] > key[:-1]):
        return None
    return np.argsort(key, kind="stable")


class _Keys:
    """The slice's rows sorted by (producer, seq), ``seg`` delimiting producers."""

    def __init__(self, pid: np.ndarray, seq: np.ndarray, producer: np.ndarray):
        order = np.argsort(
            producer.astype(np.int16) if len(producer) and producer.max() < 1 << 15 else producer, kind="stable"
        )  # rows come in time order: seq mostly rises already
        by_seq = seq[order]
        same = producer[order][1:] == producer[order][:-1]
        self.order = order if not np.any(same & (by_seq[1:] < by_seq[:-1])) else np.lexsort((seq, producer))
        self.pid, self.seq = pid[self.order], seq[self.order]
        self.seg = np.flatnonzero(np.diff(producer[self.order], prepend=-1, append=-1))

    def ranges(self) -> list[tuple[int, int, int]]:
        """(producer_id, first seq, last seq) of each producer, in seg order."""
        return [(int(self.pid[a]), int(self.seq[a]), int(self.seq[b - 1])) for a, b in zip(self.seg[:-1], self.seg[1:])]


def _scatter_lists(n: int, rows: np.ndarray, col, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Flat values and offsets for n rows, given the lists of the (increasing) ``rows`` that may have any."""
    values, offsets = flat_list(col, dtype)
    lengths = np.zeros(n, np.int64)
    lengths[rows] = np.diff(offsets)
    return values, offsets_from_lengths(lengths)


def store_batches(
    con,
    where: str,
    params: list,
    page_events_per_slice: int = PAGE_EVENTS_PER_SLICE,
    meanwhile: Callable[[], None] | None = None,
    *,
    events_per_slice: int = EVENTS_PER_SLICE,
    read_ahead: bool = True,
) -> Iterator[ReplayBatch]:
    """The events of ``events_v`` matching ``where`` as ReplayBatches in engine order, slice by slice.

    A batch's page buffer is reused for a later slice once the next batch is asked for: replay each
    batch before asking for the next. ``meanwhile`` runs while the first slice is being read (e.g.
    loading the replay kernels, which would otherwise wait for it). ``read_ahead``: a helper thread
    reads the next slice while the caller replays one; else slices are read in turn.
    """
    con.complete()
    reader = _SliceReader(con, where, params)
    try:
        bounds = _slice_bounds(con, where, params, page_events_per_slice, events_per_slice, reader.narrow)
        if not read_ahead:
            if meanwhile is not None:
                meanwhile()
            for lo, hi in zip(bounds, bounds[1:]):
                if (b := reader.read(lo, hi)) is not None:
                    advance(b.num_rows)
                    yield b
                    reader.recycle(b)
            return
        with ThreadPoolExecutor(1) as pool:
            ahead = None
            for lo, hi in zip(bounds, bounds[1:]):
                nxt = pool.submit(reader.read, lo, hi)
                if ahead is None and meanwhile is not None:
                    meanwhile()
                if ahead is not None and (b := ahead.result()) is not None:
                    advance(b.num_rows)
                    yield b
                    reader.recycle(b)
                ahead = nxt
            if ahead is not None and (b := ahead.result()) is not None:
                advance(b.num_rows)
                yield b
    finally:
        reader.close()
