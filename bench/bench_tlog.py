"""The transparency log's cost on the commit path: AuditStore.append with and without the Merkle tree.

Batches come from :mod:`kvtrail.sim.synth` (one producer) and are built before any timing. In each round
two fresh stores are open side by side, ``tree`` (kvtrail as shipped: each commit also hashes its leaves
into the frontier, which each store checkpoint caches in meta, kvtrail.audit.tlog) and ``no-tree`` (the
same store with the tree's hashing and caching taken out); they take turns batch by batch, the first
alternating by batch and by round, so noise on a shared machine hits both alike. A method's time is its
summed append() times plus its close (the final checkpoint); the goal (the tree costs at most 5 % of
ingest) is judged on the worst round. On a loaded machine the two stores' difference is mostly noise,
so the tree's own time (its hashing in each commit and its caching at checkpoints, timed around the
calls) is reported beside it as a share of the tree store's time.

    .venv/bin/python bench/bench_tlog.py                                   # 5 rounds, 20k-event batches
    .venv/bin/python bench/bench_tlog.py --events-per-batch 1000 --page-events 2e6   # small commits
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rounds import MIN_ROUNDS, Spread, at_most, per_round_ratios  # noqa: E402

from kvtrail.audit.events import Producer  # noqa: E402
from kvtrail.audit.merkle import Frontier  # noqa: E402
from kvtrail.audit.store import AuditStore  # noqa: E402
from kvtrail.sim.synth import synth_batches  # noqa: E402

GOAL = 0.05


class TimedTree:
    """The store's own TreeWriter, its time added up (stage: each commit's hashing; save: at checkpoints)."""

    def __init__(self, tree) -> None:
        self.tree, self.spent = tree, 0.0

    @property
    def frontier(self):
        return self.tree.frontier

    @frontier.setter
    def frontier(self, value) -> None:
        self.tree.frontier = value

    def stage(self, batches):
        t = time.perf_counter()
        try:
            return self.tree.stage(batches)
        finally:
            self.spent += time.perf_counter() - t

    def save(self, con) -> None:
        t = time.perf_counter()
        try:
            self.tree.save(con)
        finally:
            self.spent += time.perf_counter() - t


class NoTree:
    """Stands in for the store's TreeWriter: no leaf, no frontier, no hashing."""

    def __init__(self) -> None:
        self.frontier = Frontier()

    def stage(self, batches):
        return self.frontier

    def save(self, con) -> None:
        pass


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-events", type=float, default=2e7, help="page-events per method and round")
    ap.add_argument("--events-per-batch", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="2M page-events in 5k-event batches, 2 rounds")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = ap.parse_args(argv)
    if args.quick:
        args.page_events, args.events_per_batch, args.rounds = 2e6, 5_000, 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prod = Producer("bench", "node-0", "decode", "kvtrail-bench", "0", "i0")
    batches = list(
        synth_batches(
            producer=prod,
            num_pages=200_000,
            page_size=16,
            seed=args.seed,
            target_page_events=int(args.page_events),
            events_per_batch=args.events_per_batch,
        )
    )
    events = sum(b.num_rows for b in batches)
    print(f"{len(batches)} batches, {events} events, {args.rounds} rounds")
    times: dict[str, list[float]] = {"tree": [], "no-tree": []}
    shares: list[float] = []
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as d:
            stores = {m: AuditStore(os.path.join(d, f"{m}.duckdb")) for m in times}
            stores["no-tree"].tree = NoTree()  # type: ignore[assignment]
            timed = TimedTree(stores["tree"].tree)
            stores["tree"].tree = timed  # type: ignore[assignment]
            spent = dict.fromkeys(times, 0.0)
            for i, batch in enumerate(batches):
                order = ["tree", "no-tree"] if (i + r) % 2 == 0 else ["no-tree", "tree"]
                for m in order:
                    t = time.perf_counter()
                    stores[m].append(batch)
                    spent[m] += time.perf_counter() - t
            for m in order:
                t = time.perf_counter()
                stores[m].close()
                spent[m] += time.perf_counter() - t
        for m in times:
            times[m].append(spent[m])
        shares.append(timed.spent / spent["tree"])
        print(
            f"round {r + 1}: tree {spent['tree']:.3f} s, no tree {spent['no-tree']:.3f} s; "
            f"the tree's own time inside the commits {timed.spent * 1e3:.1f} ms ({shares[-1]:.2%})"
        )
    for m, ts in times.items():
        print(f"{m:8s} {Spread.of([events / t / 1e6 for t in ts]).text()} M events/s (min / median / max)")
    overhead = [x - 1 for x in per_round_ratios(times["tree"], times["no-tree"])]
    v = at_most(f"the tree costs <= {GOAL:.0%} of ingest", overhead, GOAL)
    print(f"overhead per round: {', '.join(f'{o:+.1%}' for o in overhead)}")
    print(f"{v.goal}: worst round {v.worst:+.1%}: {v.word}")
    own = at_most(f"the tree's own time <= {GOAL:.0%} of the commit's", shares, GOAL)
    print(f"{own.goal}: worst round {own.worst:.2%}: {own.word}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": times, "overhead": overhead, "own_share": shares, "events": events}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
