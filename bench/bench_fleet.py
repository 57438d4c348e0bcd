"""The audit lake at fleet scale: single-store replay vs the lake's per-(node, hour) fan-out on Dask.

A simulated fleet history (:mod:`kvtrail.sim.fleet`, default 4 prefill + 4 decode nodes, ``--hours``
of arrivals at ``--rate`` requests/s) is written to a store and exported to a local lake. Two
questions - "affected in a 1-hour window" and "affected in the whole history" (the replay's F1/F5) -
are answered by the single-store replay (``replay_store``) and by the lake with 1, 2 and 4 Dask
worker processes (4 oversubscribes a 2-core machine); every lake answer is compared with the store's.
Rates are page-events (entries of the events' page lists) per second of wall time; peak memory is
each worker's maximum resident set. Last, the measured per-partition cost is extrapolated on paper
to a two-week incident window of a 500-node fleet on a 32-worker cluster.

    .venv/bin/python bench/bench_fleet.py                  # ~6 M page-events, about two minutes
    .venv/bin/python bench/bench_fleet.py --rate 0.5       # bench_forensics' fleet rate (~32 M/hour)
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
import time

import duckdb

from kvtrail import forensics as fx
from kvtrail.audit.store import AuditStore
from kvtrail.forensics.lake.checkpointer import write_checkpoints
from kvtrail.forensics.lake.questions import lake_findings, open_lake
from kvtrail.forensics.replay.engine import replay_store
from kvtrail.lake.executor import DaskExecutor, LocalExecutor
from kvtrail.lake.export import export_lake
from kvtrail.lake.partition import HOUR_NS
from kvtrail.sim.fleet import FleetConfig, write_fleet
from kvtrail.sim.fleet.config import DEFAULT_START_NS

AFFECTED = ("F1", "F5")
# The fleet: ~120 M page-events per simulated hour of an 8-node deployment.
PAGE_EVENTS_PER_NODE_HOUR = 120_000_000 / 8


def _peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM), in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _page_events(con, from_ns=None, to_ns=None) -> int:
    where, params = "TRUE", []
    if from_ns is not None:
        where, params = "wall_ns >= ? AND wall_ns <= ?", [from_ns, to_ns]
    return int(con.execute(f"SELECT coalesce(sum(num_pages + num_dst_pages), 0) FROM events WHERE {where}",
                           params).fetchone()[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=0.05, help="Requests per second, whole fleet.")
    ap.add_argument("--hours", type=float, default=2.0, help="Simulated hours of arrivals.")
    ap.add_argument("--nodes", type=int, default=4, help="Prefill nodes (and as many decode nodes).")
    ap.add_argument("--workers", type=int, nargs="*", default=[1, 2, 4])
    ap.add_argument("--dir", help="Keep the store and lake here (default: a temporary directory).")
    args = ap.parse_args()
    base = args.dir or tempfile.mkdtemp(prefix="bench-fleet-")
    os.makedirs(base, exist_ok=True)
    db, lake_dir = os.path.join(base, "fleet.duckdb"), os.path.join(base, "lake")
    cfg = FleetConfig(rate_per_s=args.rate, hours=args.hours, prefill_nodes=args.nodes, decode_nodes=args.nodes,
                      start_ns=DEFAULT_START_NS)
    try:
        t = time.perf_counter()
        if not os.path.exists(db):
            with AuditStore(db) as store:
                write_fleet(cfg, store, db + ".truth.json")
        sim_s = time.perf_counter() - t
        t = time.perf_counter()
        if not os.path.exists(lake_dir):
            export_lake(db, lake_dir, checkpoints=write_checkpoints)
        export_s = time.perf_counter() - t
        con = duckdb.connect(db, read_only=True)
        lo, hi = con.execute("SELECT min(wall_ns), max(wall_ns) FROM events").fetchall()[0]
        w1 = (lo + HOUR_NS // 2, lo + HOUR_NS // 2 + HOUR_NS)  # one hour across a partition boundary
        windows = {"1-hour window": w1, "whole history": (None, None)}
        total = _page_events(con)
        print(f"history: {cfg.prefill_nodes}+{cfg.decode_nodes} nodes + router, {(hi - lo) / HOUR_NS:.2f} h, "
              f"{total:,} page-events; simulated+stored in {sim_s:.1f} s, exported to the lake in {export_s:.1f} s")
        with open_lake(lake_dir) as lake:
            parts = len({(f["node"], f["hour"]) for f in lake.manifest.files_of("events").values()})
            print(f"lake: {parts} partitions (node, hour)")
            rows = []
            for name, (f, to) in windows.items():
                pe = total if f is None else _page_events(con, f, to)
                replay_store(con, f, to, codes=AFFECTED)  # untimed: numba's kernel cache, the page cache
                t = time.perf_counter()
                want = replay_store(con, f, to, codes=AFFECTED)
                single = time.perf_counter() - t
                rows.append((name, "single store", single, pe, _peak_rss_mb(), True))
                t = time.perf_counter()
                got = lake_findings(lake, fx.Window(f, to), codes=AFFECTED, executor=LocalExecutor())
                rows.append((name, "lake, in-process", time.perf_counter() - t, pe, _peak_rss_mb(), got == want))
                for n in args.workers:
                    ex = DaskExecutor(workers=n, progress=False)
                    try:
                        lake_findings(lake, fx.Window(f, to), codes=AFFECTED, executor=ex)  # warm the workers
                        t = time.perf_counter()
                        got = lake_findings(lake, fx.Window(f, to), codes=AFFECTED, executor=ex)
                        took = time.perf_counter() - t
                        peak = max(ex.client.run(_peak_rss_mb).values())
                    finally:
                        ex.close()
                    rows.append((name, f"lake, {n} Dask worker{'s' if n > 1 else ''}", took, pe, peak, got == want))
        print(f"{'question':<16} {'engine':<22} {'time s':>8} {'M page-ev/s':>12} {'peak MB/proc':>13} same")
        for name, eng, s, pe, mb, same in rows:
            print(f"{name:<16} {eng:<22} {s:8.2f} {pe / s / 1e6:12.1f} {mb:13.0f} {'yes' if same else 'NO'}")
        whole = [r for r in rows if r[0] == "whole history"]
        one = next(r for r in whole if r[1] == "lake, 1 Dask worker")
        two = next((r for r in whole if r[1] == "lake, 2 Dask workers"), None)
        if two is not None:
            print(f"speed-up 2 workers vs 1 (whole history): {one[2] / two[2]:.2f}x (goal >= 1.7x)")
        per_part_s = one[2] / parts
        per_pe_s = one[2] / total
        pe_part = PAGE_EVENTS_PER_NODE_HOUR
        fleet_parts = 500 * 14 * 24
        est_s = fleet_parts * pe_part * per_pe_s / 32
        print(f"on paper: measured {per_part_s:.2f} s per partition here ({total / parts:,.0f} page-events each, "
              f"{1 / per_pe_s / 1e6:.1f} M page-events/s per worker); a two-week window of a 500-node fleet is "
              f"{fleet_parts:,} partitions of ~{pe_part / 1e6:.0f} M page-events -> {est_s / 3600:.1f} h on 32 "
              f"workers at this per-worker rate (per-worker memory bounded by one partition's node pool)")
        con.close()
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
