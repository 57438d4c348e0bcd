"""What one live-judge poll costs as the judged history grows, beside replaying that history afresh.

The service's judge keeps one replay warm and asks it for every finding after each poll
(``ReplayEngine.findings``: the per-node findings it holds, plus the cross-node ones F2, F3, F4, F9
and F11, which join events of several nodes). This feeds a fleet simulator's batches, in arrival order,
to one engine; at ``--checkpoints`` points of the history it times, in ``--rounds`` alternating rounds:

  poll     ``findings()`` on the warm engine with nothing new fed: what every poll pays whatever it
           was handed (it should not grow with the history)
  replay   a fresh engine fed the whole history so far, then ``findings()``: what a judge without
           state would pay per poll (the reference)

Printed per checkpoint: events judged, transfers and 2xx responses held for the cross-node joins,
both times (min / median / max over the rounds) and poll / replay per round. No goal is set: the
figures say how a poll's cost grows with the history.

    .venv/bin/python bench/bench_judge_poll.py                  # 3 h of a 0.5 requests/s fleet
    .venv/bin/python bench/bench_judge_poll.py --quick          # a few seconds
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rounds import Spread, check_rounds, per_round_ratios, rotated  # noqa: E402

from kvtrail.forensics.replay.engine import ReplayEngine  # noqa: E402
from kvtrail.sim.fleet.config import FleetConfig  # noqa: E402
from kvtrail.sim.fleet.run import fleet_batches  # noqa: E402


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def fresh(tables) -> None:
    engine = ReplayEngine()
    for t in tables:
        engine.feed(t)
    engine.findings()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=3.0, help="simulated span of the fleet's history")
    ap.add_argument("--rate", type=float, default=0.5, help="request arrivals per second, whole fleet")
    ap.add_argument("--checkpoints", type=int, default=4, help="points of the history timed")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="0.2 h, 2 checkpoints, 2 rounds")
    args = ap.parse_args()
    if args.quick:
        args.hours, args.checkpoints, args.rounds = 0.2, 2, 2
    check_rounds(args.rounds)
    tables = list(fleet_batches(FleetConfig(hours=args.hours, rate_per_s=args.rate, seed=1)))
    print(
        f"history: {len(tables)} batches, {sum(t.num_rows for t in tables):,} events, {args.hours:g} h of a "
        f"{args.rate:g} requests/s fleet (the fleet simulator's defaults otherwise)"
    )
    engine = ReplayEngine()
    fed = 0
    engine.findings()  # load the compiled kernels before anything is timed
    for k in range(1, args.checkpoints + 1):
        upto = round(len(tables) * k / args.checkpoints)
        for t in tables[fed:upto]:
            engine.feed(t)
        fed = upto
        events = sum(t.num_rows for t in tables[:fed])
        times: dict[str, list[float]] = {"poll": [], "replay": []}
        for r in range(args.rounds):
            for method in rotated(["poll", "replay"], r):
                times[method].append(
                    timed(engine.findings if method == "poll" else lambda upto=fed: fresh(tables[:upto]))
                )
        joins = engine.state.joins
        ratios = per_round_ratios(times["poll"], times["replay"])
        print(
            f"checkpoint {k}/{args.checkpoints}: {events:,} events judged, {len(joins.transfers):,} "
            f"transfers, {len(joins.responses):,} 2xx responses, {len(engine.findings()):,} findings"
        )
        print(
            f"  poll {Spread.of(times['poll']).text(1e3, '.1f')} ms   "
            f"replay {Spread.of(times['replay']).text(1, '.2f')} s  (min / median / max)   "
            f"poll / replay per round {', '.join(f'{x:.3f}' for x in ratios)}"
        )


if __name__ == "__main__":
    main()
