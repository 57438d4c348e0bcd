"""Forensics at fleet scale: "affected responses in a window" over >= 100 M page-events, several ways.

The history (several nodes, hours; see ``forensics_history.py``) is built once and cached under
``--db``, with its ground truth (the fleet simulator's, or the synth history's planted requests).
Each measured part (``forensics_parts.py``) runs in its own process (so its peak RSS is its own), in
``--rounds`` rounds: every round runs every part once, the first part rotating from round to round,
so the parts alternate and ratios are taken within a round.

  question    kvtrail.forensics.questions.affected_responses(con, Window()): the question as the CLI asks it
  engine      replay_store(con, codes=AFFECTED_CODES): the replay engine's fast path, store reader included
              (a helper thread reads the next slice of the store while one is replayed)
  engine-seq  the same with read_ahead=False: slices read and replayed in turn, one thread
  split       the same in two halves, one after the other: reading the store into batches, then replaying
              batches kept in memory (the 'split' row is the replay alone; the read time is printed below)
  floor       the machine's limit for the same work: the event columns and page_runs read ordered, every
              run expanded to its pages by a compiled loop (see forensics_baselines.py)
  naive-text  one DuckDB query: every page of kv_read and kv_written exploded to a row, each read page
              ASOF-joined to the last write of its (node, page); text keys, as stored (a first try)
  naive-int   the same join after mapping node and request to integers (the competent version)
  window      the same question as last_value(writer) IGNORE NULLS over the union of page rows
  online      the history's wire batches in arrival order, each appended to a fresh AuditStore (ingest)
              and fed to a ReplayEngine (online replay), alternating, timed batch by batch
  pure, sql   (once, not in the rounds) the engine with fast=False over the first --pure-page-events, and
              the SQL engine's F1 over the first --sql-page-events: slow references, their rates count those

Before each part's clock starts, its modules are imported and its compiled code made ready (the floor's
loop compiled, kvtrail's kernels loaded from numba's cache): a process's start-up, printed beside the
part's time, not the question's cost.

Every part runs with numpy's transparent huge pages off (``NUMPY_MADVISE_HUGEPAGE=0``; ``--numpy-hugepages``
keeps numpy's default). numpy advises the kernel to back each array of 4 MB or more with huge pages, and
where the kernel compacts memory on such advice (``/sys/kernel/mm/transparent_hugepage/defrag`` =
``madvise``) an allocation can stall in that compaction: on the development machine the floor's 400 MB page
array cost 0.4 s of system time in some rounds and 1.0-1.15 s in others, so the floor took 0.46-1.43 s from
round to round, the same work, and the verdict on the worst round was set by which rounds stalled. With
the advice off the floor took 0.57-0.67 s in every round. Both sides run the same way.

Rates are page-events of the whole questioned history (entries of events' ``pages`` lists, every kind)
per second of the part's wall time, so ratios between parts are ratios of time. Every part's
"affected" count is set against the ground truth: "same question: no" means it answers another one.

    .venv/bin/python bench/bench_forensics.py                      # 100 M page-events of the fleet simulator
    .venv/bin/python bench/bench_forensics.py --source synth       # 100 M of per-node allocator streams
    .venv/bin/python bench/bench_forensics.py --quick              # 4 M, 2 rounds, about a second per part
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import forensics_history  # noqa: E402
from forensics_parts import peak_rss_bytes, run_part  # noqa: E402
from forensics_report import report  # noqa: E402
from rounds import MIN_ROUNDS, check_rounds, rotated  # noqa: E402

ROUND_PARTS = ("question", "engine", "engine-seq", "split", "floor", "naive-text", "naive-int", "window", "online")
ONCE_PARTS = ("pure", "sql")
PARTS = ROUND_PARTS + ONCE_PARTS


def child(args) -> int:
    with open(args.db + ".json") as f:
        meta = json.load(f)
    out = run_part(args.part, args.db, meta, args)
    out["max_rss_bytes"] = peak_rss_bytes()
    print("RESULT " + json.dumps(out))
    return 0


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--db",
        default=os.path.join(tempfile.gettempdir(), "kvtrail-forensics-bench.duckdb"),
        help="store of the history (built when missing or built with other parameters)",
    )
    ap.add_argument("--page-events", type=float, default=100e6, help="page-events of the history (default 1e8)")
    ap.add_argument("--quick", action="store_true", help="4 M page-events, pure path over 1 M, 2 rounds")
    ap.add_argument(
        "--source",
        choices=("fleet", "synth"),
        default="fleet",
        help="fleet: the fleet simulator (PD nodes, transfers, prefix cache, planted bugs); synth: "
        "per-node allocator streams with reads and planted unwritten pages (many small events)",
    )
    ap.add_argument("--fleet-rate", type=float, default=0.5, help="fleet: request arrivals per second")
    ap.add_argument("--nodes", type=int, default=4, help="synth: nodes (half prefill-shaped, half decode-shaped)")
    ap.add_argument("--hours", type=float, default=2.0, help="synth: simulated span of the history")
    ap.add_argument("--num-pages", type=int, default=100_000, help="pages per node pool (synth)")
    ap.add_argument("--plant-rate", type=float, default=1e-3, help="share of prefill chunks left unwritten (synth)")
    ap.add_argument("--events-per-batch", type=int, default=200_000, help="events per producer batch (synth)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--pure-page-events", type=float, default=5e6, help="history prefix the pure path replays")
    ap.add_argument(
        "--sql-page-events",
        type=float,
        default=10e6,
        help="history prefix the SQL engine questions (0: all; 100 M did not finish in 15 minutes)",
    )
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument(
        "--numpy-hugepages",
        action="store_true",
        help="keep numpy's madvise(MADV_HUGEPAGE) of large arrays in every part (default: off, see above)",
    )
    ap.add_argument("--part-timeout", type=float, default=900, help="seconds before a part is given up")
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"rounds of the alternating parts (default {MIN_ROUNDS}; 2 with --quick); "
        f"a goal's verdict needs >= {MIN_ROUNDS}",
    )
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = ap.parse_args(argv)
    if args.rounds is None:
        args.rounds = 2 if args.quick else MIN_ROUNDS
    try:
        check_rounds(args.rounds)
    except ValueError as exc:
        ap.error(str(exc))
    if args.quick:
        args.page_events, args.pure_page_events, args.sql_page_events = 4e6, 1e6, 0
    args.part_list = [p.strip() for p in args.parts.split(",") if p.strip()]
    for p in args.part_list:
        if p not in PARTS:
            ap.error(f"--parts: unknown part {p!r}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.part:
        return child(args)
    if not args.numpy_hugepages:  # every part is a child process: they all inherit it
        os.environ["NUMPY_MADVISE_HUGEPAGE"] = "0"
    params = {"format": 3, "source": args.source, "page_events": int(args.page_events), "seed": args.seed}
    if args.source == "fleet":
        params.update(fleet_rate=args.fleet_rate)
    else:
        params.update(
            nodes=args.nodes,
            hours=args.hours,
            num_pages=args.num_pages,
            events_per_batch=args.events_per_batch,
            plant_rate=args.plant_rate,
        )
    meta = forensics_history.build(args.db, params)
    print(forensics_history.describe(meta))
    in_rounds = [p for p in ROUND_PARTS if p in args.part_list]
    runs: dict[str, list[dict]] = {p: [] for p in args.part_list}
    failed: dict[str, dict] = {}
    if any(p in args.part_list for p in ("question", "engine", "engine-seq", "split", "online")):
        # Untimed: fills numba's kernel cache (a changed kernel recompiles in the first process) and the
        # page cache, so that round 1 is not the only round that pays for them.
        print("warm-up (untimed): engine")
        run_child("engine", args)
    for r in range(args.rounds):
        order = [p for p in rotated(in_rounds, r) if p not in failed]
        print(f"round {r + 1}/{args.rounds}: {', '.join(order)}")
        for part in order:
            out = run_child(part, args)
            if "error" in out:
                failed[part] = out  # a part that fails once is not run again
            else:
                runs[part].append(out)
    for part in (p for p in ONCE_PARTS if p in args.part_list):
        out = run_child(part, args)
        if "error" in out:
            failed[part] = out
        else:
            runs[part].append(out)
    figures = report(meta, runs, failed, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "benchmark": "forensics",
                    "date": time.strftime("%Y-%m-%d"),
                    "cpus": os.cpu_count(),
                    "rounds": args.rounds,
                    "history": {k: v for k, v in meta.items() if k != "truth_affected_request_ids"},
                    "runs": runs,
                    "failed": failed,
                    **figures,
                },
                f,
                indent=2,
            )
    return 0


def run_child(part: str, args) -> dict:
    """One part in a fresh process; its RESULT line, or an error."""
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--part",
        part,
        "--db",
        args.db,
        "--pure-page-events",
        str(args.pure_page_events),
        "--sql-page-events",
        str(args.sql_page_events),
    ]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.part_timeout)
    except subprocess.TimeoutExpired:
        print(f"  {part}: timed out after {args.part_timeout:.0f} s")
        return {"error": f"timeout after {args.part_timeout:.0f} s"}
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not line:
        error = (proc.stderr.strip().splitlines() or ["failed"])[-1]
        print(f"  {part}: failed: {error}")
        return {"error": error}
    out = json.loads(line[-1][len("RESULT ") :])
    print(
        f"  {part}: {out['wall_s']:.2f} s (process {time.perf_counter() - t0:.1f} s; "
        f"compiled code made ready before the clock in {out.get('kernels_s', 0.0):.2f} s)"
    )
    return out


if __name__ == "__main__":
    sys.exit(main())
