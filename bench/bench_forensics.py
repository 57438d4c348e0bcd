"""Forensics at fleet scale: "affected responses in a window" over >= 100 M page-events, several ways.

The history (several nodes, hours; see ``forensics_history.py``) is built once and cached under
``--db``. Each measured part (``forensics_parts.py``) then runs in its own process (so its peak RSS
is its own), one after another, on the same store:

  question   kvtrail.forensics.questions.affected_responses(con, Window()): the question as the CLI asks it
  engine     replay_store(con, codes=AFFECTED_CODES): the replay engine's fast path, store reader included
  split      the same in two halves, one after the other: reading the store into batches, then replaying
             batches kept in memory (the 'split' row is the replay alone; the read time is printed below)
  pure       the same engine with fast=False (every event through the Python handlers), over the first
             --pure-page-events of the history only (it is ~100x slower): its rate counts those
  sql        kvtrail.forensics.sql.engine.sql_findings(con, codes=("F1",)): the SQL engine's F1, over the first
             --sql-page-events of the history (its range joins grow faster than linearly)
  naive      one DuckDB query: every page of kv_read and kv_written exploded to a row (page_runs x
             generate_series), each read page ASOF-joined to the last write of its (node, page) at or
             before it; reads whose writer is another request (or nobody) counted
  online     the history's wire batches in arrival order, each appended to a fresh AuditStore (ingest)
             and fed to a ReplayEngine (online replay), alternating, timed batch by batch

Rates are page-events of the whole questioned history (entries of events' ``pages`` lists, every kind)
per second of the part's wall time, so ratios between parts are ratios of time.

    .venv/bin/python bench/bench_forensics.py                      # 100 M page-events of the fleet simulator
    .venv/bin/python bench/bench_forensics.py --source synth       # 100 M of per-node allocator streams
    .venv/bin/python bench/bench_forensics.py --quick              # 4 M, about a second per part
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import forensics_history  # noqa: E402
from forensics_parts import peak_rss_bytes, run_part  # noqa: E402

GOAL_PAGE_EVENTS_PER_S = 50e6
GOAL_VS_NAIVE = 10.0
GOAL_RSS_BYTES = 4 << 30
PARTS = ("question", "engine", "split", "pure", "sql", "naive", "online")
REPEATED = ("question", "engine", "split", "naive", "online")  # run --repeat times, the median reported


def child(args) -> int:
    with open(args.db + ".json") as f:
        meta = json.load(f)
    out = run_part(args.part, args.db, meta, args)
    out["max_rss_bytes"] = peak_rss_bytes()
    print("RESULT " + json.dumps(out))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", default=os.path.join(tempfile.gettempdir(), "kvtrail-forensics-bench.duckdb"),
                    help="store of the history (built when missing or built with other parameters)")
    ap.add_argument("--page-events", type=float, default=100e6, help="page-events of the history (default 1e8)")
    ap.add_argument("--quick", action="store_true", help="4 M page-events, pure path over 1 M")
    ap.add_argument("--source", choices=("fleet", "synth"), default="fleet",
                    help="fleet: the fleet simulator (PD nodes, transfers, prefix cache, planted bugs); synth: "
                         "per-node allocator streams with reads and planted unwritten pages (many small events)")
    ap.add_argument("--fleet-rate", type=float, default=0.5, help="fleet: request arrivals per second")
    ap.add_argument("--nodes", type=int, default=4, help="synth: nodes (half prefill-shaped, half decode-shaped)")
    ap.add_argument("--hours", type=float, default=2.0, help="synth: simulated span of the history")
    ap.add_argument("--num-pages", type=int, default=100_000, help="pages per node pool (synth)")
    ap.add_argument("--plant-rate", type=float, default=1e-3, help="share of prefill chunks left unwritten (synth)")
    ap.add_argument("--events-per-batch", type=int, default=200_000, help="events per producer batch (synth)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--pure-page-events", type=float, default=5e6, help="history prefix the pure path replays")
    ap.add_argument("--sql-page-events", type=float, default=10e6,
                    help="history prefix the SQL engine questions (0: all; 100 M did not finish in 15 minutes)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--part-timeout", type=float, default=900, help="seconds before a part is given up")
    ap.add_argument("--repeat", type=int, default=3, help=f"runs of each of {', '.join(REPEATED)} (median reported)")
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = ap.parse_args(argv)
    if args.quick:
        args.page_events, args.pure_page_events, args.sql_page_events = 4e6, 1e6, 0
    if args.part:
        return child(args)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    for p in parts:
        if p not in PARTS:
            ap.error(f"--parts: unknown part {p!r}")
    params = {"format": 2, "source": args.source, "page_events": int(args.page_events), "seed": args.seed}
    if args.source == "fleet":
        params.update(fleet_rate=args.fleet_rate)
    else:
        params.update(nodes=args.nodes, hours=args.hours, num_pages=args.num_pages,
                      events_per_batch=args.events_per_batch, plant_rate=args.plant_rate)
    meta = forensics_history.build(args.db, params)
    import duckdb
    import numba

    print(forensics_history.describe(meta))
    print(f"machine: {os.cpu_count()} CPUs, Python {platform.python_version()}, duckdb {duckdb.__version__}, "
          f"numba {numba.__version__}")
    results = {}
    for part in parts:
        runs = []
        for _ in range(args.repeat if part in REPEATED else 1):
            r = run_child(part, args)
            if "error" in r:
                runs = [r]
                break
            runs.append(r)
        results[part] = runs[0] if "error" in runs[0] else median_run(runs)
    report(meta, results, args)
    return 0


def run_child(part: str, args) -> dict:
    """One part in a fresh process; its RESULT line, or an error."""
    cmd = [sys.executable, os.path.abspath(__file__), "--part", part, "--db", args.db,
           "--pure-page-events", str(args.pure_page_events), "--sql-page-events", str(args.sql_page_events)]
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
    out = json.loads(line[-1][len("RESULT "):])
    print(f"  {part}: {out['wall_s']:.2f} s (process {time.perf_counter() - t0:.1f} s)")
    return out


def median_run(runs: list[dict]) -> dict:
    """The run with the median wall time, with the range of all runs."""
    ranked = sorted(runs, key=lambda r: r["wall_s"])
    out = dict(ranked[len(ranked) // 2])
    out["runs_wall_s"] = [r["wall_s"] for r in runs]
    return out


def report(meta: dict, results: dict, args) -> None:
    total = meta["page_events"]
    naive = results.get("naive", {}).get("wall_s")
    print()
    head = (f"{'part':<10} {'wall s':>8} {'M page-ev/s':>12} {'vs naive':>9} {'peak RSS MB':>12} "
            f"{'F1 pages':>10} {'affected':>9}")
    print(head)
    print("-" * len(head))
    for part, r in results.items():
        if "error" in r:
            print(f"{part:<10} {r['error']}")
            continue
        n = r.get("page_events", total)
        rate = n / r["wall_s"]
        r["page_events_per_s"] = rate
        # The pure path replays a prefix: compare its time per page-event with the naive query's.
        ratio = f"{rate / (total / naive):>8.1f}x" if naive else f"{'':>9}"
        print(f"{part:<10} {r['wall_s']:>8.2f} {rate / 1e6:>12.1f} {ratio} {r['max_rss_bytes'] / 1e6:>12.0f} "
              f"{r.get('f1_pages', '-'):>10} {r.get('affected', '-'):>9}")
    spread = "; ".join(f"{p} {min(r['runs_wall_s']):.2f}-{max(r['runs_wall_s']):.2f} s" for p, r in results.items()
                       if len(r.get("runs_wall_s", ())) > 1)
    if spread:
        print(f"(median of {args.repeat} runs in fresh processes; range: {spread})")
    print("(M page-ev/s: page-events of the questioned history per second of wall time; 'pure', 'sql' and "
          "'online' count the page-events they replayed, and find what is in that prefix. affected: responses\n"
          " with F1/F5/F7 (sql: F1 only; naive: readers of a page whose last write was another request's or "
          "nobody's, prefix-cache hits and fresh growth pages included))")
    sp = results.get("split")
    if sp and "error" not in sp:
        print(f"split: reading the store into batches {sp['read_s']:.2f} s ({total / sp['read_s'] / 1e6:.1f} M "
              f"page-ev/s), replaying them from memory {sp['wall_s']:.2f} s ({total / sp['wall_s'] / 1e6:.1f} M "
              f"page-ev/s); 'engine' overlaps the two on the machine's cores")
    on = results.get("online")
    if on and "error" not in on:
        ingest = on["page_events"] / on["ingest_s"]
        replay = on["page_events"] / on["replay_s"]
        print(f"online: ingest {ingest / 1e6:.1f} M page-ev/s ({on['ingest_s']:.1f} s), online replay "
              f"{replay / 1e6:.1f} M page-ev/s ({on['replay_s']:.1f} s): replay / ingest {replay / ingest:.1f}x "
              f"-> {'keeps up' if replay >= ingest else 'FALLS BEHIND'}")
    print()
    for part in ("engine", "question"):
        r = results.get(part)
        if not r or "error" in r:
            continue
        checks = [("rate", r["page_events_per_s"] >= GOAL_PAGE_EVENTS_PER_S,
                   f">= {GOAL_PAGE_EVENTS_PER_S / 1e6:.0f} M page-ev/s: {r['page_events_per_s'] / 1e6:.1f}"),
                  ("memory", r["max_rss_bytes"] <= GOAL_RSS_BYTES, f"<= 4 GB: {r['max_rss_bytes'] / 1e9:.2f} GB")]
        if naive:
            checks.append(("vs naive", r["wall_s"] * GOAL_VS_NAIVE <= naive,
                           f">= {GOAL_VS_NAIVE:.0f}x naive: {naive / r['wall_s']:.1f}x"))
        print(f"goals ({part}): " + "; ".join(f"{text} -> {'PASS' if ok else 'MISS'}" for _, ok, text in checks))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "forensics", "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(),
                       "history": meta, "parts": results}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
