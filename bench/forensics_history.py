"""The simulated multi-node history bench_forensics.py questions, built once and cached on disk.

Two sources. ``synth`` (default): one :func:`kvtrail.sim.synth.synth_batches` allocator per node
(half of the nodes shaped like PD prefill nodes: long page lists, no decode; half like decode nodes:
mostly one-page growth events), their clocks spread over ``hours``; every ``kv_written`` is followed
by the writer's ``kv_read`` of the same pages (what attention reads), and a ``plant_rate`` share of
the prefill-chunk writes is left out while its read stays: the incident's unwritten reserved pages,
read by a request that gets another request's stale KV (F1, an affected response). ``fleet``: the
fleet simulator (:mod:`kvtrail.sim.fleet`), with its own planted bugs.

The store goes to ``db``; the same batches, as they were appended, to ``db + '.batches.arrow'`` (for
the online part); what was built to ``db + '.json'`` (a rebuild happens when the parameters differ).
"""

from __future__ import annotations

import heapq
import json
import os
import time
from typing import TypedDict

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrail.audit.batch import NULLABLE_BATCH_SCHEMA as NULLABLE_SCHEMA
from kvtrail.audit.events import Producer
from kvtrail.audit.store import AuditStore
from kvtrail.sim.synth import synth_batches

_SHAPES = {"prefill": 0.0, "decode": 0.6}  # decode_fraction per node shape
_READ_ONLY_FIELDS = ("token_start", "token_end", "source")  # kv_read allows none of them


class _ShapeArgs(TypedDict):
    """The synth_batches arguments a node's probe run and its real stream share."""

    num_pages: int
    page_size: int
    seed: int
    decode_fraction: float


def with_reads(t: pa.Table, first_seq: int, rng: np.random.Generator, plant_rate: float) -> tuple[pa.Table, list[str]]:
    """Each kv_written followed by its reader's kv_read; planted: a prefill write left out, its read kept.

    Returns the table (seq renumbered from ``first_seq``) and the request ids of the writes left out
    (each such request reads pages it never wrote: the synth history's ground truth).
    """
    kind = t.column("kind").to_numpy(zero_copy_only=False)
    is_write = kind == "kv_written"
    prev_purpose = np.concatenate([[None], t.column("purpose").to_numpy(zero_copy_only=False)[:-1]])
    # synth writes each allocation right after it: the row before a write names the chunk's purpose
    planted = is_write & (prev_purpose == "prefill_extend") & (rng.random(len(kind)) < plant_rate)
    copies = np.where(is_write & ~planted, 2, 1)
    rows = np.repeat(np.arange(t.num_rows), copies)
    second = np.arange(len(rows)) - np.repeat(np.cumsum(copies) - copies, copies) == 1
    is_read = second | planted[rows]
    out = t.take(pa.array(rows))
    cols = {name: out.column(name) for name in out.column_names}
    cols["kind"] = pc.if_else(pa.array(is_read), "kv_read", out.column("kind"))
    for name in _READ_ONLY_FIELDS:
        cols[name] = pc.if_else(pa.array(is_read), pa.nulls(len(rows), out.column(name).type), out.column(name))
    cols["seq"] = pa.array(np.arange(first_seq, first_seq + len(rows), dtype=np.uint64))
    planted_ids = t.column("request_id").take(pa.array(np.flatnonzero(planted))).to_pylist()
    return pa.table(cols, schema=NULLABLE_SCHEMA), [r for r in planted_ids if r is not None]


def _synth_streams(page_events: int, nodes: int, hours: float, seed: int, num_pages: int, events_per_batch: int):
    """One batch iterator per node, clocks spread over about ``hours``."""
    streams = []
    for k in range(nodes):
        shape = "prefill" if k < nodes // 2 else "decode"
        prod = Producer("bench-fleet", f"{shape}-{k}", shape, "kvtrail-synth", "0", f"{shape}-{k}-i0")
        kw = _ShapeArgs(num_pages=num_pages, page_size=16, seed=seed + k, decode_fraction=_SHAPES[shape])
        # A short run tells how many events a page-event costs in this shape, to spread the clock.
        probe = pa.concat_tables(
            synth_batches(producer=prod, target_page_events=1_000_000, events_per_batch=1 << 20, **kw)
        )
        per_page = probe.num_rows / pc.sum(pc.list_value_length(probe.column("pages"))).as_py()
        writes = pc.sum(pc.equal(probe.column("kind"), "kv_written")).as_py() / probe.num_rows
        target = page_events * 3 // (4 * nodes)  # reads add a quarter: alloc + write + read + free
        gap_ns = max(int(hours * 3600e9 / max(target * per_page * (1 + writes), 1)), 1)
        streams.append(
            synth_batches(
                producer=prod, target_page_events=target, events_per_batch=events_per_batch, mean_gap_ns=gap_ns, **kw
            )
        )
    return streams


def _merged(streams):
    """Batches of all streams in the order of their first event's time (how they would arrive)."""
    heap, nxt = [], {}
    for k, s in enumerate(streams):
        b = next(s, None)
        if b is not None:
            heap.append((b.column("wall_ns")[0].as_py(), k))
            nxt[k] = b
    heapq.heapify(heap)
    while heap:
        _, k = heapq.heappop(heap)
        yield k, nxt[k]
        b = next(streams[k], None)
        if b is not None:
            nxt[k] = b
            heapq.heappush(heap, (b.column("wall_ns")[0].as_py(), k))


def build(db: str, params: dict, log=print) -> dict:
    """Build (or reuse) the history for ``params``; returns its description."""
    meta_path = db + ".json"
    if os.path.exists(meta_path) and os.path.exists(db) and os.path.exists(db + ".batches.arrow"):
        with open(meta_path) as f:
            meta = json.load(f)
        if meta.get("params") == params:
            log(f"history: reusing {db} ({meta['page_events']:,} page-events)")
            return meta
    for path in (db, db + ".wal", db + ".batches.arrow", meta_path):
        if os.path.exists(path):
            os.remove(path)
    t0 = time.perf_counter()
    rng = np.random.default_rng(params["seed"])
    events = page_events = batches = 0
    planted: list[str] = []
    truth: dict = {}
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with (
        AuditStore(db) as store,
        pa.OSFile(db + ".batches.arrow", "wb") as sink,
        pa.ipc.new_stream(sink, NULLABLE_SCHEMA, options=options) as writer,
    ):
        store.con.execute("SET enable_progress_bar = false")
        if params["source"] == "fleet":
            from kvtrail.sim.fleet import FleetConfig, fleet_batches

            source = (
                (0, b)
                for b in fleet_batches(
                    FleetConfig(
                        seed=params["seed"], rate_per_s=params["fleet_rate"], target_page_events=params["page_events"]
                    ),
                    truth=truth,
                )
            )
        else:
            source = _merged(
                _synth_streams(
                    params["page_events"],
                    params["nodes"],
                    params["hours"],
                    params["seed"],
                    params["num_pages"],
                    params["events_per_batch"],
                )
            )
        next_seq: dict[int, int] = {}
        for k, b in source:
            if params["source"] == "synth":
                b, planted_ids = with_reads(b, next_seq.get(k, 0), rng, params["plant_rate"])
                next_seq[k] = next_seq.get(k, 0) + b.num_rows
                planted += planted_ids
            b = b.cast(NULLABLE_SCHEMA)
            store.append(b)
            writer.write_table(b)
            events += b.num_rows
            page_events += pc.sum(pc.list_value_length(b.column("pages"))).as_py() or 0
            batches += 1
            if batches % 50 == 0:
                log(f"  ... {page_events / 1e6:,.0f} M page-events, {time.perf_counter() - t0:.0f} s")
        store.checkpoint()
        span = store.con.execute(
            "SELECT min(wall_ns), max(wall_ns), count(DISTINCT producer_id) FROM events"
        ).fetchone()
        assert span is not None, "an aggregate query returns one row"
    # The ground truth of "which responses are affected": the fleet simulator's own record of its plants
    # and foreign reads, or (synth) the requests whose prefill write was left out.
    truth_ids = truth["affected_request_ids"] if params["source"] == "fleet" else sorted(set(planted))
    meta = {
        "params": params,
        "events": events,
        "page_events": page_events,
        "batches": batches,
        "planted_unwritten_chunks": len(planted),
        "truth_affected_request_ids": truth_ids,
        "producers": span[2],
        "span_hours": (span[1] - span[0]) / 3600e9,
        "build_s": time.perf_counter() - t0,
        "db_bytes": os.path.getsize(db),
    }
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=1)
    log(f"history: built {db} in {meta['build_s']:.0f} s")
    return meta


def describe(meta: dict) -> str:
    p = meta["params"]
    text = (
        f"history ({p['source']}): {meta['events']:,} events, {meta['page_events']:,} page-events, "
        f"{meta['producers']} nodes over {meta['span_hours']:.2f} h, {meta['batches']} batches, "
        f"{meta['db_bytes'] / 1e6:,.0f} MB store; ground truth {len(meta['truth_affected_request_ids'])} "
        "affected responses"
    )
    if p["source"] == "fleet":
        text += f"; fleet simulator, {p['fleet_rate']:g} requests/s"
    if p["source"] == "synth":
        text += (
            f"; pools of {p['num_pages']:,} pages, {meta['planted_unwritten_chunks']} planted unwritten "
            f"prefill chunks (plant rate {p['plant_rate']:g})"
        )
    return text
