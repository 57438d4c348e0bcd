"""The model's costs: the checker's states per second and time to the first counterexample, and
``model validate``'s rate beside ``forensics findings`` (the replay engine) on the same simulated store.

Part 1 (checker): ``patched`` at the command's default bounds (every state explored: states, depth,
states/s) and ``vulnerable`` at the same bounds (seconds to its first counterexample), one run per
round. Part 2 (monitors): a fleet simulation with every planted class, stored through the normal ingest
path (its ingest rate measured), then in ``--rounds`` alternating rounds the monitors over the whole
store (``validate_store``) and the replay's findings (``findings_of``), each reading the store itself.
Rates are page-events (entries of page lists) per second; the goal is validate at least at the rate the
store ingested, judged on the worst round.

    .venv/bin/python bench/bench_model.py                         # defaults, 5 rounds, 10 M page-events
    .venv/bin/python bench/bench_model.py --quick                 # small bounds, 2 rounds, 200 k page-events
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rounds import Spread, at_least, check_rounds, per_round_ratios, rotated  # noqa: E402

from kvtrail.audit.store import AuditStore  # noqa: E402
from kvtrail.forensics.questions import findings_of  # noqa: E402
from kvtrail.model.checker import Checker  # noqa: E402
from kvtrail.model.validate import validate_store  # noqa: E402
from kvtrail.model.variants import VARIANTS, Bounds  # noqa: E402
from kvtrail.sim.fleet.config import FleetConfig  # noqa: E402
from kvtrail.sim.fleet.run import write_fleet  # noqa: E402

# the fleet of tests/sim/test_fleet.py's SMALL (pools that churn within seconds, every planted class armed
# often), run until the page-events wanted
PLANTED = FleetConfig(
    rate_per_s=10,
    prefill_nodes=2,
    decode_nodes=2,
    tenants=6,
    chunk_tokens=4096,
    prefill_pool_tokens=16_384,
    decode_pool_tokens=69_632,
    context_tokens=65_536,
    prefill_rate_min_tokens_per_s=40_000,
    prompt_median_tokens=1024,
    prompt_sigma=1.5,
    completion_median_tokens=48,
    max_new_tokens=1024,
    doc_median_tokens=512,
    plants_per_hour=1500,
)


def checker_part(bounds: Bounds, rounds: int) -> None:
    rates, firsts, states = [], [], 0
    for _ in range(rounds):
        p = Checker(VARIANTS["patched"], bounds).run()
        v = Checker(VARIANTS["vulnerable"], bounds).run(max_states=p.states)  # its space is larger: capped
        assert not p.counterexamples and v.counterexamples
        states, depth = p.states, p.depth
        rates.append(p.states / p.seconds)
        assert v.first_counterexample_s is not None
        firsts.append(v.first_counterexample_s)
        vstates, vseconds = v.states, v.seconds
    b = bounds.as_dict(VARIANTS["patched"])
    print(f"checker, bounds {b}")
    print(
        f"  patched: {states} states, depth {depth}; states/s (min / median / max): {Spread.of(rates).text(fmt='.0f')}"
    )
    print(
        f"  vulnerable (capped at patched's states): {vstates} states in {vseconds:.1f} s; "
        f"first counterexample (s): {Spread.of(firsts).text()}"
    )


def monitors_part(page_events: int, rounds: int) -> None:
    cfg = replace(PLANTED, target_page_events=page_events)
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "fleet.duckdb"
        with AuditStore(db) as store:
            t0 = time.perf_counter()
            summary = write_fleet(cfg, store)
            ingest_s = time.perf_counter() - t0
        ingest_rate = summary.page_events / ingest_s
        print(
            f"store: {summary.events} events, {summary.page_events} page-events, plants {summary.plants}; "
            f"simulated and ingested at {ingest_rate:,.0f} page-events/s"
        )
        times: dict[str, list[float]] = {"validate": [], "findings": []}
        for rnd in range(rounds):
            for method in rotated(list(times), rnd):
                with AuditStore(db) as store:
                    t0 = time.perf_counter()
                    if method == "validate":
                        doc = validate_store(store.con)
                        n = len(doc["violations"])
                    else:
                        n = len(findings_of(store.con))
                    times[method].append(time.perf_counter() - t0)
                print(f"  round {rnd}: {method} {times[method][-1]:.2f} s ({n} violations / findings)")
        for method, ts in times.items():
            rates = [summary.page_events / t for t in ts]
            print(f"  {method}: page-events/s (min / median / max) {Spread.of(rates).text(fmt=',.0f')}")
        ratio = per_round_ratios(times["findings"], times["validate"])
        print(f"  findings time / validate time per round: {Spread.of(ratio).text()}")
        verdict = at_least(
            "validate at the ingest rate", [summary.page_events / t for t in times["validate"]], ingest_rate
        )
        print(f"  goal: {verdict.goal}: worst {verdict.worst:,.0f} vs {ingest_rate:,.0f} page-events/s: {verdict.word}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--page-events", type=int, default=10_000_000)
    ap.add_argument("--quick", action="store_true", help="bounds 3/3/2, 2 rounds, 200 k page-events")
    ap.add_argument("--skip-checker", action="store_true")
    args = ap.parse_args()
    rounds = check_rounds(2 if args.quick else args.rounds)
    bounds = Bounds(3, 3, 2) if args.quick else Bounds(3, 4, 2)
    if not args.skip_checker:
        checker_part(bounds, rounds)
    monitors_part(200_000 if args.quick else args.page_events, rounds)


if __name__ == "__main__":
    main()
