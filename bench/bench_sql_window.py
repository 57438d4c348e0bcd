"""The SQL findings engine against the replay engine on a 1-hour window of a fleet history, in rounds.

The history is the fleet simulator's (:mod:`kvtrail.sim.fleet`: PD nodes, transfers, prefix cache,
planted bugs), with arrivals for ``--window-h`` hours of simulated time (default 1) at ``--rate``
requests/s, built once and cached under ``--db``. Both engines answer the same question over the
window [first event, first event + 1 h]: every finding F1-F10 (what ``kvtrail forensics findings``
asks), each producer read from its last ``node_config`` at or before the window's start.

  replay  kvtrail.forensics.replay.engine.replay_store(con, from_ns, to_ns): the fast path, store reader included
  sql     kvtrail.forensics.sql.engine.sql_findings(con, from_ns, to_ns): range joins over page_runs in DuckDB
  sql-lake  the same engine per (node, hour) partition of a lake exported from the store (built once beside
          it), in-process: kvtrail.forensics.lake.sqltask.sql_lake_findings

Each round runs both, the first one rotating (bench/rounds.py), each on a fresh read-only
connection, after one untimed run of the replay (numba's kernel cache, the page cache). Rates are the
window's page-events (entries of events' ``pages`` lists, every kind) per second of wall time; the
ratio sql / replay is taken within a round and the goal (SQL within 10x of the replay) is judged on
the worst round. The two engines' findings are compared.

The SQL engine's time grows faster than the window's events (its page joins): at
bench_forensics.py's fleet rate (0.5 requests/s, ~32 M page-events in an hour) one SQL run takes
minutes, so the default fleet here is smaller (0.1 requests/s); ``--rate 0.5`` runs the full one.

    .venv/bin/python bench/bench_sql_window.py                        # 0.1 requests/s, 5 rounds
    .venv/bin/python bench/bench_sql_window.py --rate 0.5 --rounds 1  # bench_forensics' fleet (minutes)
    .venv/bin/python bench/bench_sql_window.py --quick                # 0.05 requests/s, 2 rounds
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import duckdb

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rounds import MIN_ROUNDS, Spread, at_most, check_rounds, per_round_ratios, rotated  # noqa: E402

from kvtrail.audit.lake.export import export_lake  # noqa: E402
from kvtrail.audit.store import AuditStore, connect_readonly  # noqa: E402
from kvtrail.forensics.lake.checkpointer import write_checkpoints  # noqa: E402
from kvtrail.forensics.lake.questions import open_lake  # noqa: E402
from kvtrail.forensics.lake.sqltask import sql_lake_findings  # noqa: E402
from kvtrail.forensics.policy import ForensicsPolicy  # noqa: E402
from kvtrail.forensics.replay.engine import replay_store  # noqa: E402
from kvtrail.forensics.sql.engine import sql_findings  # noqa: E402
from kvtrail.sim.fleet import FleetConfig  # noqa: E402
from kvtrail.sim.fleet.run import write_fleet  # noqa: E402

ENGINES = ("replay", "sql", "sql-lake")
GOAL_RATIO = 10.0  # the SQL engine's time at most 10x the replay's
_HOUR_NS = 3_600_000_000_000


def build(db: str, params: dict) -> dict:
    """The fleet history for ``params`` in ``db`` (reused when ``db + '.json'`` says it was built so)."""
    meta_path = db + ".json"
    if os.path.exists(meta_path) and os.path.exists(db):
        with open(meta_path) as f:
            meta = json.load(f)
        if meta.get("params") == params:
            print(f"history: reusing {db}")
            return meta
    for path in (db, db + ".wal", meta_path):
        if os.path.exists(path):
            os.remove(path)
    config = FleetConfig(seed=params["seed"], rate_per_s=params["rate_per_s"], hours=params["hours"])
    with AuditStore(db) as store:
        summary = write_fleet(config, store)
        store.checkpoint()
    meta = {
        "params": params,
        "events": summary.events,
        "page_events": summary.page_events,
        "producers": summary.producers,
        "requests": summary.requests,
        "affected": summary.affected,
        "from_ns": summary.from_ns,
        "to_ns": summary.to_ns,
        "build_s": summary.elapsed_s,
    }
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=1)
    print(f"history: built {db} in {summary.elapsed_s:.1f} s")
    return meta


def window_page_events(db: str, from_ns: int, to_ns: int) -> tuple[int, int]:
    """(events, page-events) with wall time in [from_ns, to_ns]."""
    with duckdb.connect(db, read_only=True) as con:
        row = con.execute(
            "SELECT count(*), sum(num_pages) FROM events WHERE wall_ns BETWEEN ? AND ?", [from_ns, to_ns]
        ).fetchone()
    assert row is not None, "an aggregate query returns one row"
    return int(row[0]), int(row[1] or 0)


def lake_of(db: str) -> str:
    """The lake exported from ``db`` (beside it; exported when missing or older than the store)."""
    lake = db + ".lake"
    if not os.path.exists(lake) or os.path.getmtime(lake) < os.path.getmtime(db):
        shutil.rmtree(lake, ignore_errors=True)
        export_lake(db, lake, checkpoints=write_checkpoints)
    return lake


def run_engine(engine: str, db: str, from_ns: int, to_ns: int) -> tuple[float, list]:
    """One engine over the window on a fresh read-only connection: (wall s, findings)."""
    if engine == "sql-lake":
        with open_lake(lake_of(db)) as lake:
            t0 = time.perf_counter()
            found = sql_lake_findings(lake, from_ns, to_ns, ForensicsPolicy(), None)
            return time.perf_counter() - t0, found
    with connect_readonly(db) as con:
        t0 = time.perf_counter()
        if engine == "replay":
            found = replay_store(con, from_ns=from_ns, to_ns=to_ns)
        else:
            found = sql_findings(con, from_ns=from_ns, to_ns=to_ns)
        return time.perf_counter() - t0, found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--db",
        default=os.path.join(tempfile.gettempdir(), "kvtrail-sql-window-bench.duckdb"),
        help="store of the history (built when missing or built with other parameters)",
    )
    ap.add_argument("--rate", type=float, default=0.1, help="fleet request arrivals per second (default 0.1)")
    ap.add_argument("--window-h", type=float, default=1.0, help="simulated hours of arrivals and of the window")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=None, help=f"rounds (default {MIN_ROUNDS}; 2 with --quick)")
    ap.add_argument("--quick", action="store_true", help="0.05 requests/s, 2 rounds, well under a minute")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = ap.parse_args(argv)
    if args.quick:
        args.rate = 0.05
    if args.rounds is None:
        args.rounds = 2 if args.quick else MIN_ROUNDS
    try:
        check_rounds(args.rounds)
    except ValueError as exc:
        ap.error(str(exc))
    if not args.rate > 0 or not args.window_h > 0:
        ap.error("--rate and --window-h: must be > 0")

    params = {"format": 1, "seed": args.seed, "rate_per_s": args.rate, "hours": args.window_h}
    meta = build(args.db, params)
    from_ns = meta["from_ns"]
    to_ns = from_ns + round(args.window_h * _HOUR_NS)
    events, page_events = window_page_events(args.db, from_ns, to_ns)
    print(
        f"history (fleet simulator, {args.rate:g} requests/s; bench_forensics.py's fleet runs 0.5): "
        f"{meta['events']:,} events, {meta['page_events']:,} page-events, {meta['producers']} producers, "
        f"{meta['requests']:,} requests, {meta['affected']} affected responses planted"
    )
    print(f"window: the first {args.window_h:g} h of simulated time: {events:,} events, {page_events:,} page-events")
    print(f"machine: {os.cpu_count()} CPUs, shared with other jobs; DuckDB {duckdb.__version__}")

    # Untimed: numba's kernel cache and the page cache. The SQL engine has no such start-up cost worth
    # a run of its own (at 0.5 requests/s one run takes minutes); its first round gives its findings.
    found: dict[str, list] = {}
    _, found["replay"] = run_engine("replay", args.db, from_ns, to_ns)
    lake_of(args.db)
    walls: dict[str, list[float]] = {e: [] for e in ENGINES}
    for r in range(args.rounds):
        order = rotated(ENGINES, r)
        for engine in order:
            wall, got = run_engine(engine, args.db, from_ns, to_ns)
            assert found.setdefault(engine, got) == got, f"{engine}: findings changed between runs"
            walls[engine].append(wall)
        print(
            f"round {r + 1}/{args.rounds} ({', '.join(order)}): "
            + ", ".join(f"{e} {walls[e][-1]:.2f} s" for e in ENGINES)
        )

    same = found["replay"] == found["sql"] == found["sql-lake"]
    print()
    head = f"{'engine':<8}{'wall s min / median / max':>28}{'M page-ev/s min / median / max':>34}{'findings':>10}"
    print(head)
    print("-" * len(head))
    for e in ENGINES:
        wall_s = Spread.of(walls[e])
        rate = Spread.of([page_events / w for w in walls[e]])
        print(f"{e:<8}{wall_s.text():>28}{rate.text(1e-6, '.2f'):>34}{len(found[e]):>10}")
    codes = sorted({f.code for f in found["replay"]})
    print(
        f"same findings from every engine: {'yes' if same else 'NO'} ({len(found['replay'])} findings: "
        f"{', '.join(codes) or 'none'})"
    )
    all_ratios = {}
    for e in ENGINES[1:]:
        ratios = all_ratios[e] = per_round_ratios(walls[e], walls["replay"])
        v = at_most("SQL within 10x of the replay", ratios, GOAL_RATIO)
        print(
            f"{e} / replay wall time per round: {Spread.of(ratios).text(fmt='.1f')} x (min / median / max); "
            f"goal: within {GOAL_RATIO:g}x on a {args.window_h:g} h window: worst round {v.worst:.1f}x -> {v.word}"
        )
    ratios = all_ratios["sql"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "benchmark": "sql_window",
                    "date": time.strftime("%Y-%m-%d"),
                    "cpus": os.cpu_count(),
                    "params": params,
                    "window": {"from_ns": from_ns, "to_ns": to_ns, "events": events, "page_events": page_events},
                    "wall_s": walls,
                    "ratios": all_ratios,
                    "same_findings": same,
                    "verdict": at_most("sql", ratios, GOAL_RATIO).word,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
