"""Sustained ingest into DuckDB of allocator-shaped page lists: kvtrail, baselines and the machine's limit.

Batches come from :mod:`kvtrail.sim.synth` (one node's paged allocator after churn: contiguous runs
mixed with scattered pages) and are built before any timing starts. The methods (``ingest_sinks.py``)
run in ``--rounds`` rounds; in each round every method ingests all batches into a fresh DuckDB file,
the methods taking turns batch by batch with the first one rotating (by round and by batch), so
noise on a shared machine hits them alike:

  kvtrail       AuditStore.append(batch): validation, run encoding into page_runs, all event columns,
                hash-chained batch record, one transaction per batch; checkpoints by CheckpointPolicy
                (default 64 MB of WAL or 10 s; --max-wal-mb, --checkpoint-interval-s), timed inside append
  kvtrail-free  the bound on any faster kvtrail (ingest_free.py; not in the default set): the same store
                writing the same rows, with its own computation (validation, request numbering, run
                encoding, SHA-256 chain) done for it before the rounds; every round's store is verified
  recorder      the recorder's path: the same events as the recorder's buffered tuples (built untimed), turned
                into a batch by its writer's build_batch and committed by AuditStore.append, timed together
  kv-wal        the same, checkpointing only at 256 MB of WAL and never by time (the policy before
                CheckpointPolicy): what the bounded WAL costs is kvtrail vs kv-wal (not in the default set)
  naive         one row per page (producer_id, seq, pos, page_id) exploded with numpy, inserted via Arrow
  list          one row per event (producer_id, seq, pages INTEGER[]), the list-per-event store a
                competent user would try first; neither baseline validates or stores anything but page ids
  limit-kinds   the machine's limit for kvtrail's work: DuckDB appending the rows kvtrail's store wrote
                (already encoded and split by kind, as Arrow, no Python per event) into today's tables (one
                per event kind, store format 2) and page_runs
  limit-wide    the same rows into store format 1's single 48-column events table (the layout before)
  limit-narrow  the same information appended into the narrowest tables that hold it (10-column events,
                a requests table, page_runs)

A page-event is one page id in an event's page list. A round's rate is its page-events over the summed
per-batch insert times plus the round's final CHECKPOINT ("insert only" leaves that out); ratios are
taken within a round, and the goal is judged on the worst round.

    .venv/bin/python bench/bench_ingest.py                      # 150M page-events, 5 rounds
    .venv/bin/python bench/bench_ingest.py --decode-fraction 0  # a PD prefill node's shape
    .venv/bin/python bench/bench_ingest.py --quick              # 4M page-events in 50k-event batches, 2 rounds
    .venv/bin/python bench/bench_ingest.py --page-events 3e7 --methods kvtrail,kvtrail-free,limit-kinds
                                                                # how close kvtrail could come to limit-kinds
    .venv/bin/python bench/bench_ingest.py --page-events 3e7 --events-per-batch 20000 --methods kvtrail,kv-wal
                                                                # small commits: what the checkpoint policy costs
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import duckdb  # noqa: E402
import pyarrow as pa  # noqa: E402
from ingest_free import KvtrailFreeSink, Precomputed  # noqa: E402
from ingest_report import GOAL_DECODE_PAGE_EVENTS_PER_S, GOAL_PREFILL_PAGE_EVENTS_PER_S, report  # noqa: E402
from ingest_sinks import (  # noqa: E402
    Encoded,
    KvtrailSink,
    KvtrailWalSink,
    LimitKindsSink,
    LimitNarrowSink,
    LimitWideSink,
    ListSink,
    NaiveSink,
    RecorderSink,
    Sink,
    recorder_items,
)
from rounds import MIN_ROUNDS, check_rounds, rotated  # noqa: E402

from kvtrail.audit.events import Producer  # noqa: E402
from kvtrail.audit.store import DEFAULT_CHECKPOINT, CheckpointPolicy  # noqa: E402
from kvtrail.audit.validate import producer_id  # noqa: E402
from kvtrail.sim.synth import runs_per_event, synth_batches  # noqa: E402

METHODS = (
    "kvtrail",
    "kvtrail-free",
    "recorder",
    "kv-wal",
    "naive",
    "list",
    "limit-kinds",
    "limit-wide",
    "limit-narrow",
)
DEFAULT_METHODS = "kvtrail,recorder,naive,list,limit-kinds,limit-wide,limit-narrow"
LIMITS = ("limit-kinds", "limit-wide", "limit-narrow")


def file_bytes(path: str) -> int:
    return sum(os.path.getsize(p) for p in (path, path + ".wal") if os.path.exists(p))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-events", type=float, default=150e6, help="page-events to ingest per method and round")
    ap.add_argument("--quick", action="store_true", help="4M page-events in 50k-event batches, 2 rounds")
    ap.add_argument(
        "--events-per-batch",
        type=int,
        default=None,
        help="events per batch (default 200000, the recorder writer's largest batch; 50000 with --quick)",
    )
    ap.add_argument("--num-pages", type=int, default=200_000, help="pages in the simulated pool (default 200000)")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    ap.add_argument("--reuse", choices=("lowest", "lifo"), default="lowest", help="allocator reuse order")
    ap.add_argument(
        "--decode-fraction",
        type=float,
        default=0.6,
        help="share of requests that decode (1-page growth events); 0 models a PD prefill node",
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--methods",
        default=DEFAULT_METHODS,
        help=f"comma-separated subset of {','.join(METHODS)} (default {DEFAULT_METHODS})",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"rounds (default {MIN_ROUNDS}; 2 with --quick); a verdict needs >= {MIN_ROUNDS}",
    )
    ap.add_argument(
        "--max-wal-mb",
        type=float,
        default=DEFAULT_CHECKPOINT.max_wal_bytes / 2**20,
        help="kvtrail's checkpoint policy: WAL size bound in MiB (default: CheckpointPolicy's, 64)",
    )
    ap.add_argument(
        "--checkpoint-interval-s",
        type=float,
        default=DEFAULT_CHECKPOINT.max_interval_s,
        help="kvtrail's checkpoint policy: time bound in seconds (default: CheckpointPolicy's, 10)",
    )
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = ap.parse_args(argv)
    try:
        args.policy = CheckpointPolicy(
            max_wal_bytes=int(args.max_wal_mb * 2**20), max_interval_s=args.checkpoint_interval_s
        )
        args.rounds = check_rounds(args.rounds if args.rounds is not None else 2 if args.quick else MIN_ROUNDS)
    except ValueError as exc:
        ap.error(str(exc))
    if args.quick:
        args.page_events = 4e6
    if args.events_per_batch is None:
        args.events_per_batch = 50_000 if args.quick else 200_000
    args.method_list = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in args.method_list:
        if m not in METHODS:
            ap.error(f"--methods: unknown method {m!r}")
    return args


def _synth(args, producer: Producer, seed: int, target: int, **extra) -> list[pa.Table]:
    return list(
        synth_batches(
            producer=producer,
            num_pages=args.num_pages,
            page_size=args.page_size,
            seed=seed,
            target_page_events=target,
            events_per_batch=args.events_per_batch,
            reuse=args.reuse,
            decode_fraction=args.decode_fraction,
            **extra,
        )
    )


def _one_round(
    factories: dict[str, Callable[[str], Sink]],
    order: list[str],
    batches: list[pa.Table],
    pid: int,
    folder: str,
    r: int,
    page_events: int,
    n_events: int,
) -> dict[str, dict]:
    """Every method ingests every batch into a fresh file, taking turns batch by batch."""
    sinks = {m: factories[m](os.path.join(folder, f"r{r}-{m}.duckdb")) for m in order}
    spent = dict.fromkeys(order, 0.0)
    gc.collect()
    clock = time.perf_counter
    for i, b in enumerate(batches):
        for m in rotated(order, i):
            t = clock()
            sinks[m].append(i, b, pid)
            spent[m] += clock() - t
    out = {}
    for m in order:
        s = sinks[m]
        n_ckpt, ckpt_s = s.policy_checkpoints()
        t = clock()
        s.checkpoint()
        ck = clock() - t
        s.close()
        size = file_bytes(s.path)
        for p in (s.path, s.path + ".wal"):
            if os.path.exists(p):
                os.remove(p)
        out[m] = {
            "insert_s": spent[m],
            "checkpoint_s": ck,
            "page_events_per_s": page_events / spent[m],
            "page_events_per_s_incl_checkpoint": page_events / (spent[m] + ck),
            "events_per_s": n_events / spent[m],
            "bytes": size,
            "bytes_per_page_event": size / page_events,
            "policy_checkpoints": n_ckpt,
            "policy_checkpoint_s": ckpt_s,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    methods = args.method_list
    target = int(args.page_events)
    producer = Producer("bench", "node-0", "decode", "kvtrail-synth", "0", f"bench-{args.seed}")
    pid = producer_id(producer)
    t0 = time.perf_counter()
    batches = _synth(args, producer, args.seed, target)
    gen_s = time.perf_counter() - t0
    stats = runs_per_event(batches)
    n_events = sum(b.num_rows for b in batches)
    print(
        f"data: {n_events:,} events, {stats.pages:,} page-events in {len(batches)} batches of "
        f"{args.events_per_batch:,}; pool {args.num_pages:,} pages x {args.page_size} tokens, reuse={args.reuse}, "
        f"decode fraction {args.decode_fraction}; generated in {gen_s:.1f} s (untimed)"
    )
    print(
        f"fragmentation: {stats.mean_runs:.2f} runs per page list, {stats.mean_pages:.1f} pages per list, "
        f"{stats.pages_per_run:.1f} pages per run ({stats.runs:,} runs)"
    )
    print(
        f"machine: {os.cpu_count()} CPUs, Python {platform.python_version()}, duckdb {duckdb.__version__}, "
        f"pyarrow {pa.__version__}"
    )
    rounds: list[dict[str, dict]] = []
    with tempfile.TemporaryDirectory(prefix="kvtrail-bench-") as tmp:
        encoded = None
        if any(m in LIMITS for m in methods):
            # The limits append what kvtrail's store writes: one untimed kvtrail ingest, read back per batch.
            enc_path = os.path.join(tmp, "encode.duckdb")
            with KvtrailSink(enc_path).store as store:
                for b in batches:
                    store.append(b)
                store.checkpoint()
            encoded = Encoded(enc_path, len(batches))
            os.remove(enc_path)
            if encoded.left_out:
                print(
                    f"limit-narrow leaves out event columns {', '.join(encoded.left_out)} (the node_config row's "
                    "payload)"
                )
        enc = encoded
        # kvtrail-free: every batch's own computation made once, untimed, by a real store (ingest_free.py).
        pre = Precomputed(os.path.join(tmp, "free.duckdb"), batches, args.policy) if "kvtrail-free" in methods else None
        # The recorder's tuples, built untimed (what its hot path leaves in the buffer).
        items = [recorder_items(b) for b in batches] if "recorder" in methods else []
        factories: dict[str, Callable[[str], Sink]] = {
            "kvtrail": lambda path: KvtrailSink(path, args.policy),
            "kv-wal": KvtrailWalSink,
            "naive": NaiveSink,
            "list": ListSink,
            "recorder": lambda path: RecorderSink(path, items, producer, args.policy),
        }
        if pre is not None:
            factories["kvtrail-free"] = lambda path: KvtrailFreeSink(path, pre, args.policy)
        if enc is not None:
            factories.update(
                {
                    "limit-kinds": lambda path: LimitKindsSink(path, enc),
                    "limit-wide": lambda path: LimitWideSink(path, enc),
                    "limit-narrow": lambda path: LimitNarrowSink(path, enc),
                }
            )
        # Warm-up: every method ingests a short separate stream (the limits: the first batch) into a throwaway file.
        warm_producer = Producer("bench", "node-warm", "decode", "kvtrail-synth", "0", "warm")
        warm = _synth(args, warm_producer, args.seed + 1000, min(target, 3_000_000), warmup_page_events=args.num_pages)
        for m in methods:
            s = factories[m](os.path.join(tmp, f"warm-{m}.duckdb"))
            for i, b in enumerate(batches[:1] if m in LIMITS or m in ("recorder", "kvtrail-free") else warm):
                s.append(i, b, producer_id(warm_producer))
            s.checkpoint()
            s.close()
        del warm
        wall0 = time.perf_counter()
        for r in range(args.rounds):
            rounds.append(_one_round(factories, rotated(methods, r), batches, pid, tmp, r, stats.pages, n_events))
            print(
                f"round {r + 1}/{args.rounds}: "
                + ", ".join(f"{m} {rounds[-1][m]['page_events_per_s_incl_checkpoint'] / 1e6:.1f}" for m in methods)
                + " M page-ev/s"
            )
        wall = time.perf_counter() - wall0
    print()
    print(
        f"ingest of the same {len(batches)} batches in {args.rounds} rounds, methods interleaved batch by batch "
        f"({wall:.1f} s wall in all)"
    )
    goal = GOAL_PREFILL_PAGE_EVENTS_PER_S if args.decode_fraction == 0 else GOAL_DECODE_PAGE_EVENTS_PER_S
    figures = report(methods, rounds, len(batches), args.policy, goal)
    if args.json:
        out = {
            "benchmark": "ingest",
            "date": time.strftime("%Y-%m-%d"),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "duckdb": duckdb.__version__,
            "pyarrow": pa.__version__,
            "events": n_events,
            "page_events": stats.pages,
            "batches": len(batches),
            "rounds": args.rounds,
            "events_per_batch": args.events_per_batch,
            "num_pages": args.num_pages,
            "page_size": args.page_size,
            "reuse": args.reuse,
            "decode_fraction": args.decode_fraction,
            "seed": args.seed,
            "generate_s": gen_s,
            "mean_runs_per_list": stats.mean_runs,
            "mean_pages_per_list": stats.mean_pages,
            "pages_per_run": stats.pages_per_run,
            "runs": stats.runs,
            "wall_s": wall,
            "per_round": rounds,
            **figures,
            "checkpoint_policy": {
                "max_wal_bytes": args.policy.max_wal_bytes,
                "max_interval_s": args.policy.max_interval_s,
            },
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
