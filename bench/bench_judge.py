"""The live judge's work per committed batch, alone, beside direct append of the same batches.

``kvtrail serve`` judges every commit on one thread (kvtrail/service/judge.py): it sorts the commit into
engine order once, feeds it to the warm forensic replay and to the model's monitors, and now and then
derives the findings and adds the poll's commits to the minute aggregates. Goal 2 of the performance
issue counts that thread in the service's CPU (bench/bench_service.py), where two busy cores make every
part dearer; this measures the same steps with nothing else running. The batches are bench_service.py's
(each of ``--producers`` recorders' stream, interleaved as they would arrive), committed one by one with
``AuditStore.append`` into one store; then, in ``--rounds`` rounds, alternating:

  judge   a fresh ``OnlineReplay`` and ``LiveMonitors`` over every committed table, in commit order, as
          a poll hands them over; every ``--poll-commits`` commits the replay's findings are derived
          (``poll``), every ``--aggregate-polls`` polls the commits are added to the minute
          aggregates. The judging thread's CPU (``time.thread_time``), per part: sort, replay,
          findings, monitors, aggregates (DuckDB's own threads for the aggregates' insert are not in it).
  direct  ``AuditStore.append`` of the same batches into a fresh store: the process's CPU.

Printed: each part's and the judge's CPU per batch (min / median / max over the rounds), direct append's,
and judge / direct per round. No goal: the figure says how much of goal 2's 1.5x the judge alone takes.

    .venv/bin/python bench/bench_judge.py            # ~1 minute on 2 cores
    .venv/bin/python bench/bench_judge.py --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_service import arrival_order, prepared  # noqa: E402
from rounds import MIN_ROUNDS, Spread, check_rounds, per_round_ratios, rotated  # noqa: E402

from kvtrail.audit.batch import read_ipc  # noqa: E402
from kvtrail.audit.store import AuditStore  # noqa: E402
from kvtrail.forensics import OnlineReplay  # noqa: E402
from kvtrail.forensics.results import aggregates  # noqa: E402
from kvtrail.model.live import LiveMonitors  # noqa: E402
from kvtrail.service.judge import _judged_rows  # noqa: E402

PARTS = ("sort", "replay", "findings", "monitors", "aggregates")
AGGREGATE_TABLES = ("minute_events", "minute_findings", "minute_coverage")


def run_judge(store: AuditStore, commits: list, poll_commits: int, aggregate_polls: int) -> dict[str, float]:
    """Thread CPU seconds per part for judging every commit once, as the service's judge thread does."""
    con = store.con
    aggregates.ensure_tables(con)
    for table in AGGREGATE_TABLES:  # each round adds every commit afresh (a covered minute is not added twice)
        con.execute(f"DELETE FROM {table}")
    replay, model = OnlineReplay(), LiveMonitors()
    spent = dict.fromkeys(PARTS, 0.0)
    pending = []
    clock = time.thread_time
    for i, (table, batches) in enumerate(commits):
        t0 = clock()
        judged = _judged_rows(table)
        t1 = clock()
        assert replay.feed_committed(con, judged, batches, ordered=True), "a commit out of order"
        t2 = clock()
        assert model.feed_committed(judged, batches, ordered=True), "a commit out of order"
        t3 = clock()
        spent["sort"] += t1 - t0
        spent["replay"] += t2 - t1
        spent["monitors"] += t3 - t2
        pending.append((table, batches))
        last = i == len(commits) - 1
        if (i + 1) % poll_commits == 0 or last:
            t4 = clock()
            replay.poll(con, read_store=False)
            spent["findings"] += clock() - t4
        if (i + 1) % (poll_commits * aggregate_polls) == 0 or last:
            t5 = clock()
            aggregates.add_batches(con, pending)  # one transaction for what several polls fed
            spent["aggregates"] += clock() - t5
            pending = []
    return spent


def run_direct(tables: list, path: Path) -> float:
    """Process CPU seconds for appending every batch to a fresh store (its close not counted)."""
    c0 = time.process_time()
    with AuditStore(path) as store:
        for t in tables:
            store.append(t)
        cpu = time.process_time() - c0
    return cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--producers", type=int, default=3)
    ap.add_argument("--page-events", type=int, default=6_000_000, help="per producer")
    ap.add_argument("--poll-commits", type=int, default=6, help="commits per poll (the service: 4-8)")
    ap.add_argument(
        "--aggregate-polls", type=int, default=4, help="polls per addition to the aggregates (the service: 2 s)"
    )
    ap.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    ap.add_argument("--quick", action="store_true", help="small streams, 2 rounds")
    args = ap.parse_args(argv)
    if args.quick:
        args.page_events, args.rounds = 200_000, 2
    check_rounds(args.rounds)
    for name in ("poll_commits", "aggregate_polls"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be at least 1")
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        root = tmp / "batches"
        root.mkdir()
        tables = [read_ipc(b) for b in arrival_order(prepared(root, args.producers, args.page_events))]
        store = AuditStore(tmp / "judged.duckdb")
        commits = []
        for t in tables:
            res = store.append(t)
            commits.append((res.table, dict(res.batches)))
        n = len(commits)
        print(f"{n} recorder batches of {args.producers} producers, {sum(t.num_rows for t in tables):,} events")
        # untimed: loads the compiled kernels, as the service does at start
        run_judge(store, commits, args.poll_commits, args.aggregate_polls)
        judge: list[dict[str, float]] = []
        direct: list[float] = []
        for r in range(args.rounds):
            for method in rotated(["judge", "direct"], r):
                if method == "judge":
                    judge.append(run_judge(store, commits, args.poll_commits, args.aggregate_polls))
                    line = ", ".join(f"{k} {1000 * v / n:.2f}" for k, v in judge[-1].items())
                    print(f"  round {r} judge   {1000 * sum(judge[-1].values()) / n:6.2f} ms per batch ({line})")
                else:
                    direct.append(run_direct(tables, tmp / f"direct{r}.duckdb"))
                    print(f"  round {r} direct  {1000 * direct[-1] / n:6.2f} ms per batch")
        store.close()
    total = [sum(j.values()) for j in judge]
    print("CPU per batch, ms (min / median / max over the rounds):")
    for part in PARTS:
        print(f"  judge: {part:<10} {Spread.of([j[part] / n for j in judge]).text(1000)}")
    print(f"  judge, in all      {Spread.of([t / n for t in total]).text(1000)}  (the judging thread, alone)")
    print(f"  direct append      {Spread.of([d / n for d in direct]).text(1000)}  (its process)")
    ratios = per_round_ratios(total, direct)
    print("judge alone / direct append, per round: " + ", ".join(f"{x:.2f}" for x in ratios))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
