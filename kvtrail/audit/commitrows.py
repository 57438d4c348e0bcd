"""The rows of one commit besides the kind tables: each producer's part of a batch as stored events,
its page lists run-encoded into ``page_runs`` rows, and its chained digest.

:func:`cut` divides a validated batch by producer on the committing thread (slices, no copies). The
run encoding (:func:`encode`) and the digests (:func:`digests`) need nothing DuckDB holds, so the store
hands a large batch's to a digest thread, which works while DuckDB inserts the event rows (DuckDB,
NumPy, Arrow and SHA-256 release the GIL): the commit waits for the runs only when it inserts them,
and for the digests only at its ``batches`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrail.audit import chain
from kvtrail.audit.arrowutil import flat_list, pick_rows, row_selection
from kvtrail.audit.events import PAGE_LIST_FIELDS
from kvtrail.audit.layout import EVENT_VALUE_FIELDS, EVENTS_SCHEMA
from kvtrail.audit.pagelist import encode_runs
from kvtrail.audit.validate import ValidatedBatch

RUNS_SCHEMA = pa.schema(
    [
        pa.field("producer_id", pa.int64()),
        pa.field("batch_no", pa.int64()),
        pa.field("seq", pa.uint64()),
        pa.field("list", pa.int8()),
        pa.field("pos", pa.int32()),
        pa.field("page_start", pa.int32()),
        pa.field("num_pages", pa.int32()),
    ]
)
RUN_COLUMNS = ", ".join(f.name for f in RUNS_SCHEMA)


@dataclass(frozen=True)
class Part:
    """One producer's rows of a batch: its stored batch number, the digest it chains from, its events."""

    pid: int
    batch_no: int
    prev: bytes
    rows: np.ndarray  # its row indices in the batch
    take: slice | np.ndarray | None  # the same as pick_rows takes them (None: every row)
    events: pa.Table  # EVENTS_SCHEMA


@dataclass(frozen=True)
class Runs:
    """The page_runs rows of every part (in part order) and, per part, its own, with their page-events."""

    table: pa.Table
    parts: tuple[tuple[pa.Table, int], ...]  # (runs, page-events) per part
    num_runs: int
    num_page_events: int


def list_lengths32(col: pa.ChunkedArray | pa.Array) -> pa.Array | pa.ChunkedArray:
    """Each row's list length as int32, a null list as 0 (the stored ``num_pages`` / ``num_dst_pages``)."""
    return pc.fill_null(pc.list_value_length(col), 0).cast(pa.int32())


def cut(vb: ValidatedBatch, seq: np.ndarray, chains: dict[int, tuple[int, bytes]]) -> list[Part]:
    """The batch's parts, one per producer in order of first appearance; ``chains`` maps a producer to
    (last stored batch number, its digest), a new producer starting at the genesis."""
    t = vb.table
    n = t.num_rows
    num_pages = list_lengths32(t.column("pages"))
    num_dst = list_lengths32(t.column("dst_pages"))
    single = len(vb.producer_ids) == 1  # the common batch: no per-producer copies
    parts = []
    for g, pid in enumerate(vb.producer_ids):
        rows = np.arange(n) if single else np.flatnonzero(vb.producer_index == g)
        last_no, prev = chains.get(pid, (-1, chain.GENESIS))
        # A producer's rows in one stretch (batches committed together) are sliced, not copied.
        take = row_selection(rows, n)
        cols = {
            "producer_id": pa.repeat(pa.scalar(pid, pa.int64()), len(rows)),
            "batch_no": pa.repeat(pa.scalar(last_no + 1, pa.int64()), len(rows)),
        }
        sub = pick_rows(t, take)
        for f in EVENT_VALUE_FIELDS:
            cols[f.name] = sub.column(f.name)
        cols["num_pages"] = pick_rows(num_pages, take)
        cols["num_dst_pages"] = pick_rows(num_dst, take)
        parts.append(Part(pid, last_no + 1, prev, rows, take, pa.table(cols, schema=EVENTS_SCHEMA)))
    return parts


def run_arrays(vb: ValidatedBatch) -> tuple[np.ndarray, ...]:
    """Run-encode both page-list columns: (row, list, pos, start, length), ordered by row, list, pos."""
    out = []
    for list_no, name in enumerate(PAGE_LIST_FIELDS):
        flat, offsets = flat_list(vb.table.column(name))
        row, pos, start, length = encode_runs(flat, offsets)
        if len(row):
            out.append((row, np.full(len(row), list_no, np.int8), pos, start, length))
    if not out:
        empty = np.empty(0, np.int32)
        return np.empty(0, np.int64), np.empty(0, np.int8), empty, empty, empty
    if len(out) == 1:  # each list's runs already come in (row, pos) order
        return out[0]
    row, lst, pos, start, length = (np.concatenate(x) for x in zip(*out))
    # Two runs sorted by row, list 0's first: a stable sort by row alone yields (row, list, pos).
    order = np.argsort(row, kind="stable")
    return row[order], lst[order], pos[order], start[order], length[order]


def encode(vb: ValidatedBatch, parts: list[Part], seq: np.ndarray) -> Runs:
    """The batch's page_runs rows, cut by part as :func:`cut` cut its events."""
    run_row, run_list, run_pos, run_start, run_len = run_arrays(vb)
    single = len(parts) == 1
    tables, per_part = [], []
    for g, part in enumerate(parts):
        rsel = None if single else row_selection(np.flatnonzero(vb.producer_index[run_row] == g), len(run_row))

        def pick(x: np.ndarray, rsel=rsel) -> np.ndarray:
            return x if rsel is None else x[rsel]

        mine = pick(run_row)
        nr = len(mine)
        runs = pa.table(
            {
                "producer_id": pa.repeat(pa.scalar(part.pid, pa.int64()), nr),
                "batch_no": pa.repeat(pa.scalar(part.batch_no, pa.int64()), nr),
                "seq": seq[mine],
                "list": pick(run_list),
                "pos": pick(run_pos),
                "page_start": pick(run_start),
                "num_pages": pick(run_len),
            },
            schema=RUNS_SCHEMA,
        )
        tables.append(runs)
        per_part.append((runs, int(pick(run_len).sum(dtype=np.int64))))
    table = tables[0] if single else pa.concat_tables(tables)
    return Runs(table, tuple(per_part), len(run_row), int(run_len.sum(dtype=np.int64)))


def header(part: Part, runs: pa.Table, seq: np.ndarray) -> tuple[int, ...]:
    """The chained header of a part: producer, batch number, first and last seq, events, runs."""
    return (part.pid, part.batch_no, int(seq[part.rows[0]]), int(seq[part.rows[-1]]), len(part.rows), runs.num_rows)


def digests(
    parts: list[Part], runs: Runs, seq: np.ndarray, signer: chain.Signer | None
) -> list[tuple[bytes, bytes | None]]:
    """(digest, signature) of each part, in the chain's order."""
    out = []
    for part, (part_runs, _npe) in zip(parts, runs.parts):
        digest = chain.batch_digest(
            part.prev, header(part, part_runs, seq), part.events, EVENTS_SCHEMA, part_runs, RUNS_SCHEMA
        )
        out.append((digest, signer.sign(digest) if signer else None))
    return out
