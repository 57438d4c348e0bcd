"""Sustained ingest into DuckDB of allocator-shaped page lists (kvtrail vs naive layouts).

Batches come from :mod:`kvtrail.sim.synth` (one node's paged allocator after churn: contiguous runs
mixed with scattered pages) and are built before any timing starts. Each method then ingests the
same batches into its own DuckDB file in a temporary directory; the methods take turns batch by
batch (rotating who goes first) so that noise on a shared machine hits them alike:

  kvtrail     AuditStore.append(batch): validation, run encoding into page_runs, all event columns,
              hash-chained batch record, one transaction per batch; checkpoints by CheckpointPolicy
              (default 64 MB of WAL or 10 s, whichever first; --max-wal-mb, --checkpoint-interval-s),
              timed inside append
  kv-wal      the same, but checkpointing only at 256 MB of WAL and never by time (the policy before
              CheckpointPolicy): what the bounded WAL costs is kvtrail vs kv-wal
  naive       one row per page (producer_id, seq, pos, page_id): the lists exploded with numpy and
              inserted via Arrow; nothing else stored, nothing validated
  list        one row per event (producer_id, seq, pages INTEGER[]): the plain list column inserted
              via Arrow, no run encoding; nothing else stored, nothing validated

A page-event is one page id in an event's page list. Rates are over the summed per-batch insert
times; "incl. checkpoint" adds the final CHECKPOINT. Bytes on disk are the file size after it.
"ckpts" counts the checkpoints the store's policy made during the run (their time is part of the
insert time).

    .venv/bin/python bench/bench_ingest.py                      # 150M page-events (~1.5 min)
    .venv/bin/python bench/bench_ingest.py --page-events 2e8
    .venv/bin/python bench/bench_ingest.py --quick              # 4M page-events in 50k-event batches, a few seconds
    .venv/bin/python bench/bench_ingest.py --page-events 3e7 --events-per-batch 20000 --methods kvtrail,kv-wal
                                                                # small commits: what the checkpoint policy costs
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Protocol, TypedDict

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrail.audit.events import Producer
from kvtrail.audit.store import DEFAULT_CHECKPOINT, AuditStore, CheckpointPolicy
from kvtrail.audit.validate import producer_id
from kvtrail.sim.synth import runs_per_event, synth_batches

GOAL_PAGE_EVENTS_PER_S = 50e6
UNBOUNDED_WAL = CheckpointPolicy(max_wal_bytes=256 * 2**20, max_interval_s=math.inf)  # before CheckpointPolicy


class Sink(Protocol):
    """What every ingest method offers: one DuckDB file at ``path``, fed batch by batch."""

    name: str
    path: str

    def append(self, batch: pa.Table, pid: int) -> None: ...

    def checkpoint(self) -> None: ...

    def policy_checkpoints(self) -> tuple[int, float]: ...

    def close(self) -> None: ...


class MethodFigures(TypedDict):
    """One method's results (also its entry under ``methods`` in the JSON)."""

    insert_s: float
    checkpoint_s: float
    page_events_per_s: float
    page_events_per_s_incl_checkpoint: float
    events_per_s: float
    bytes: int
    bytes_per_page_event: float
    policy_checkpoints: int  # made by the store's CheckpointPolicy during the run (0 for the baselines)
    policy_checkpoint_s: float


class KvtrailSink:
    """kvtrail itself: ``AuditStore.append`` (validation, run encoding, hash chain), default checkpoint policy."""

    name = "kvtrail"

    def __init__(self, path: str, policy: CheckpointPolicy = DEFAULT_CHECKPOINT) -> None:
        self.path = path
        self.store = AuditStore(path, checkpoint=policy)

    def policy_checkpoints(self) -> tuple[int, float]:
        return self.store.checkpoints, self.store.checkpoint_s

    def append(self, batch: pa.Table, pid: int) -> None:
        self.store.append(batch)

    def checkpoint(self) -> None:
        self.store.checkpoint()

    def close(self) -> None:
        self.store.close()


class KvtrailWalSink(KvtrailSink):
    """kvtrail with the WAL left to grow to 256 MB and no time bound: the cost baseline of the policy."""

    name = "kv-wal"

    def __init__(self, path: str, policy: CheckpointPolicy = UNBOUNDED_WAL) -> None:
        super().__init__(path, policy)


class _DuckSink:
    """A baseline: one plain DuckDB table, rows inserted via Arrow, no validation, no chain."""

    name = ""
    table = ""
    ddl = ""

    def __init__(self, path: str) -> None:
        self.path = path
        self.con = duckdb.connect(path)
        self.con.execute(f"CREATE TABLE {self.table} ({self.ddl})")

    def _insert(self, rows: pa.Table) -> None:
        self.con.register("_rows", rows)
        try:
            self.con.execute(f"INSERT INTO {self.table} SELECT * FROM _rows")
        finally:
            self.con.unregister("_rows")

    def checkpoint(self) -> None:
        self.con.execute("CHECKPOINT")

    def policy_checkpoints(self) -> tuple[int, float]:
        return 0, 0.0

    def close(self) -> None:
        self.con.close()


class NaiveSink(_DuckSink):
    """One row per page: the layout a first attempt would use."""

    name = "naive"
    table = "page_rows"
    ddl = "producer_id BIGINT NOT NULL, seq UBIGINT NOT NULL, pos INTEGER NOT NULL, page_id INTEGER NOT NULL"

    def append(self, batch: pa.Table, pid: int) -> None:
        col = batch.column("pages")
        lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False)
        flat = pc.list_flatten(col).to_numpy(zero_copy_only=False)
        starts = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        seq = batch.column("seq").to_numpy()
        pos = np.arange(flat.size, dtype=np.int64) - np.repeat(starts, lengths)
        self._insert(pa.table({"producer_id": pa.array(np.full(flat.size, pid, np.int64)),
                               "seq": pa.array(np.repeat(seq, lengths)),
                               "pos": pa.array(pos.astype(np.int32)), "page_id": pa.array(flat)}))


class ListSink(_DuckSink):
    """One row per event with the page list as a plain INTEGER[] column (no run encoding)."""

    name = "list"
    table = "event_pages"
    ddl = "producer_id BIGINT NOT NULL, seq UBIGINT NOT NULL, pages INTEGER[]"

    def append(self, batch: pa.Table, pid: int) -> None:
        self._insert(pa.table({"producer_id": pa.array(np.full(batch.num_rows, pid, np.int64)),
                               "seq": batch.column("seq"), "pages": batch.column("pages")}))


def file_bytes(path: str) -> int:
    return sum(os.path.getsize(p) for p in (path, path + ".wal") if os.path.exists(p))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-events", type=float, default=150e6,
                    help="page-events to ingest per method (default 1.5e8, about 1.5 minutes in all)")
    ap.add_argument("--quick", action="store_true", help="4M page-events in 50k-event batches, a few seconds")
    ap.add_argument("--events-per-batch", type=int, default=None,
                    help="events per batch (default 200000, the recorder writer's largest batch; 50000 with --quick)")
    ap.add_argument("--num-pages", type=int, default=200_000, help="pages in the simulated pool (default 200000)")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    ap.add_argument("--reuse", choices=("lowest", "lifo"), default="lowest", help="allocator reuse order")
    ap.add_argument("--decode-fraction", type=float, default=0.6,
                    help="share of requests that decode (1-page growth events); 0 models a PD prefill node")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--methods", default="kvtrail,kv-wal,naive,list",
                    help="comma-separated subset of kvtrail,kv-wal,naive,list (default all)")
    ap.add_argument("--max-wal-mb", type=float, default=DEFAULT_CHECKPOINT.max_wal_bytes / 2**20,
                    help="kvtrail's checkpoint policy: WAL size bound in MiB (default: CheckpointPolicy's, 64)")
    ap.add_argument("--checkpoint-interval-s", type=float, default=DEFAULT_CHECKPOINT.max_interval_s,
                    help="kvtrail's checkpoint policy: time bound in seconds (default: CheckpointPolicy's, 10)")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = ap.parse_args(argv)
    try:
        policy = CheckpointPolicy(max_wal_bytes=int(args.max_wal_mb * 2**20), max_interval_s=args.checkpoint_interval_s)
    except ValueError as exc:
        ap.error(str(exc))
    if args.quick:
        args.page_events = 4e6
    if args.events_per_batch is None:
        args.events_per_batch = 50_000 if args.quick else 200_000
    target = int(args.page_events)
    sinks: dict[str, Callable[[str], Sink]] = {"kvtrail": lambda path: KvtrailSink(path, policy),
                                               "kv-wal": KvtrailWalSink, "naive": NaiveSink, "list": ListSink}
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m not in sinks:
            ap.error(f"--methods: unknown method {m!r}")

    producer = Producer("bench", "node-0", "decode", "kvtrail-synth", "0", f"bench-{args.seed}")
    pid = producer_id(producer)
    t0 = time.perf_counter()
    batches = list(synth_batches(producer=producer, num_pages=args.num_pages, page_size=args.page_size,
                                 seed=args.seed, target_page_events=target, events_per_batch=args.events_per_batch,
                                 reuse=args.reuse, decode_fraction=args.decode_fraction))
    gen_s = time.perf_counter() - t0
    stats = runs_per_event(batches)
    n_events = sum(b.num_rows for b in batches)
    page_events = stats.pages
    print(f"data: {n_events:,} events, {page_events:,} page-events in {len(batches)} batches of "
          f"{args.events_per_batch:,}; pool {args.num_pages:,} pages x {args.page_size} tokens, reuse={args.reuse}, "
          f"decode fraction {args.decode_fraction}; "
          f"generated in {gen_s:.1f} s (untimed)")
    print(f"fragmentation: {stats.mean_runs:.2f} runs per page list, {stats.mean_pages:.1f} pages per list, "
          f"{stats.pages_per_run:.1f} pages per run ({stats.runs:,} runs)")
    print(f"machine: {os.cpu_count()} CPUs, Python {platform.python_version()}, duckdb {duckdb.__version__}, "
          f"pyarrow {pa.__version__}")

    # Warm-up: every method ingests a small separate stream into a throwaway file first.
    warm_producer = Producer("bench", "node-warm", "decode", "kvtrail-synth", "0", "warm")
    warm = list(synth_batches(producer=warm_producer, num_pages=args.num_pages, page_size=args.page_size,
                              seed=args.seed + 1000, target_page_events=min(target, 3_000_000),
                              events_per_batch=args.events_per_batch, reuse=args.reuse,
                              decode_fraction=args.decode_fraction, warmup_page_events=args.num_pages))
    results: dict[str, MethodFigures] = {}
    with tempfile.TemporaryDirectory(prefix="kvtrail-bench-") as tmp:
        for m in methods:
            s = sinks[m](os.path.join(tmp, f"warm-{m}.duckdb"))
            for b in warm:
                s.append(b, producer_id(warm_producer))
            s.checkpoint()
            s.close()
        del warm
        open_sinks = [sinks[m](os.path.join(tmp, f"{m}.duckdb")) for m in methods]
        spent = {m: 0.0 for m in methods}
        gc.collect()
        clock = time.perf_counter
        wall0 = clock()
        for i, b in enumerate(batches):
            k = i % len(open_sinks)
            for s in open_sinks[k:] + open_sinks[:k]:
                t = clock()
                s.append(b, pid)
                spent[s.name] += clock() - t
        wall = clock() - wall0
        for s in open_sinks:
            n_ckpt, ckpt_s = s.policy_checkpoints()
            t = clock()
            s.checkpoint()
            ck = clock() - t
            s.close()
            size = file_bytes(s.path)
            results[s.name] = {
                "insert_s": spent[s.name], "checkpoint_s": ck,
                "page_events_per_s": page_events / spent[s.name],
                "page_events_per_s_incl_checkpoint": page_events / (spent[s.name] + ck),
                "events_per_s": n_events / spent[s.name],
                "bytes": size, "bytes_per_page_event": size / page_events,
                "policy_checkpoints": n_ckpt, "policy_checkpoint_s": ckpt_s,
            }

    print()
    print(f"ingest of the same {len(batches)} batches, methods interleaved batch by batch ({wall:.1f} s wall in all)")
    head = (f"{'method':<8} {'M page-ev/s':>12} {'incl. ckpt':>11} {'k events/s':>11} {'insert s':>9} "
            f"{'ckpts':>6} {'ckpt s':>7} {'MB on disk':>11} {'B/page-ev':>10} {'vs naive':>9}")
    print(head)
    print("-" * len(head))
    naive = results.get("naive")
    for m in methods:
        r = results[m]
        ratio = f"{r['page_events_per_s'] / naive['page_events_per_s']:>8.2f}x" if naive else f"{'':>9}"
        print(f"{m:<8} {r['page_events_per_s'] / 1e6:>12.1f} {r['page_events_per_s_incl_checkpoint'] / 1e6:>11.1f} "
              f"{r['events_per_s'] / 1e3:>11.0f} {r['insert_s']:>9.2f} {r['policy_checkpoints']:>6} "
              f"{r['checkpoint_s']:>7.2f} "
              f"{r['bytes'] / 1e6:>11.1f} {r['bytes_per_page_event']:>10.3f} {ratio}")
    print("(kvtrail validates and stores every event column plus the hash chain; naive and list store page ids "
          "only, unvalidated)")
    verdict = None
    if "kvtrail" in results:
        rate = results["kvtrail"]["page_events_per_s"]
        verdict = rate >= GOAL_PAGE_EVENTS_PER_S
        print()
        print(f"goal >= {GOAL_PAGE_EVENTS_PER_S / 1e6:.0f} M page-events/s sustained (kvtrail): "
              f"{rate / 1e6:.1f} M/s -> {'PASS' if verdict else 'MISS'}")
        if naive:
            size_ratio = results["kvtrail"]["bytes_per_page_event"] / naive["bytes_per_page_event"]
            print(f"kvtrail / naive: {rate / naive['page_events_per_s']:.2f}x throughput, "
                  f"{size_ratio:.3f}x bytes per page-event")
        kv = results["kvtrail"]
        print(f"checkpoint policy ({policy.max_wal_bytes / 2**20:.0f} MB of WAL or {policy.max_interval_s:g} s): "
              f"{kv['policy_checkpoints']} checkpoints during ingest, {kv['policy_checkpoint_s']:.2f} s in all "
              f"({kv['policy_checkpoint_s'] / max(kv['policy_checkpoints'], 1) * 1e3:.0f} ms each, "
              f"{kv['policy_checkpoint_s'] / len(batches) * 1e3:.1f} ms per commit, "
              f"{kv['policy_checkpoint_s'] / kv['insert_s']:.1%} of kvtrail's insert time)")
        if "kv-wal" in results:
            w = results["kv-wal"]
            incl = kv["page_events_per_s_incl_checkpoint"] / w["page_events_per_s_incl_checkpoint"]
            print(f"kvtrail / kv-wal (WAL to 256 MB, no time bound): {rate / w['page_events_per_s']:.2f}x throughput, "
                  f"{incl:.2f}x including the final checkpoint")

    if args.json:
        out = {
            "benchmark": "ingest", "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(),
            "python": platform.python_version(), "duckdb": duckdb.__version__, "pyarrow": pa.__version__,
            "events": n_events, "page_events": page_events, "batches": len(batches),
            "events_per_batch": args.events_per_batch, "num_pages": args.num_pages, "page_size": args.page_size,
            "reuse": args.reuse, "decode_fraction": args.decode_fraction, "seed": args.seed, "generate_s": gen_s,
            "mean_runs_per_list": stats.mean_runs, "mean_pages_per_list": stats.mean_pages,
            "pages_per_run": stats.pages_per_run, "runs": stats.runs, "wall_s": wall,
            "methods": results, "goal_page_events_per_s": GOAL_PAGE_EVENTS_PER_S, "pass": verdict,
            "checkpoint_policy": {"max_wal_bytes": policy.max_wal_bytes, "max_interval_s": policy.max_interval_s},
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
