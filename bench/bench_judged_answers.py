"""What a question answered from the live judge costs the service, beside the CLI's answer by replay.

A dashboard's "last hour" asks ``/v1/affected`` and ``/v1/findings`` for a window covering everything
judged, and every poll of the judge makes a new judged state, so under ingest each pair of questions is
computed afresh about once per poll (docs/service.md). This stores ``--hours`` of the fleet simulator's
history (transfers, aborts, responses: every symptom query has rows to read), opens it as a service
(``open_state``: the judge reads it once), and times in ``--rounds`` alternating rounds:

  judged    the pair through the service's routes (in-process ASGI client: auth, the judged snapshot,
            the window's context, the answers, the access log), the answer cache cleared first, so
            each round pays what a fresh poll's first asker pays
  replayed  the same pair as the CLI asks them of the store (``ask_affected``, ``ask_findings``: a
            replay of the window each): the reference, what answering without the judge costs

Printed: both times (min / median / max) and judged / replayed per round. No goal is set.

    .venv/bin/python bench/bench_judged_answers.py              # 1 h of a 0.5 requests/s fleet
    .venv/bin/python bench/bench_judged_answers.py --quick      # a few seconds
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rounds import Spread, check_rounds, per_round_ratios, rotated  # noqa: E402

from kvtrail.audit.store import AuditStore  # noqa: E402
from kvtrail.forensics import Window, ask_affected, ask_findings  # noqa: E402
from kvtrail.service import tokens  # noqa: E402
from kvtrail.service.app import create_app  # noqa: E402
from kvtrail.service.state import open_state  # noqa: E402
from kvtrail.sim.fleet.config import FleetConfig  # noqa: E402
from kvtrail.sim.fleet.run import fleet_batches  # noqa: E402
from kvtrail.timeutil import format_utc  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=1.0, help="simulated span of the fleet's history")
    ap.add_argument("--rate", type=float, default=0.5, help="request arrivals per second, whole fleet")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="0.1 h, 2 rounds")
    args = ap.parse_args()
    if args.quick:
        args.hours, args.rounds = 0.1, 2
    check_rounds(args.rounds)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fastapi.testclient import TestClient
    tmp = Path(tempfile.mkdtemp(prefix="kvtrail-bench-answers-"))
    db = tmp / "fleet.duckdb"
    with AuditStore(db) as store:
        events = 0
        for t in fleet_batches(FleetConfig(hours=args.hours, rate_per_s=args.rate, seed=1)):
            store.append(t)
            events += t.num_rows
        first, last = store.con.execute("SELECT min(min_wall_ns), max(max_wall_ns) FROM batches").fetchone()
    print(f"history: {events:,} events, {args.hours:g} h of a {args.rate:g} requests/s fleet")
    state = open_state(db)
    try:
        assert state.judge.wait_idle(600), "the judge did not catch up"
        with state.write_lock:
            _, secret = tokens.add_token(state.store.con, "operator")
        client = TestClient(create_app(state))
        headers = {"Authorization": f"Bearer {secret}"}
        params = {"from": format_utc(first - 10**9), "to": format_utc(last + 10**9)}
        window = Window(first - 10**9, last + 10**9)

        def judged() -> None:
            state.answers._done.clear()  # a fresh judged state: nothing computed on it yet
            for path in ("/v1/affected", "/v1/findings"):
                r = client.get(path, params=params, headers=headers)
                assert r.status_code == 200, r.text

        def replayed() -> None:
            cur = state.cursor()
            try:
                ask_affected(cur, window)
                ask_findings(cur, window)
            finally:
                cur.close()

        judged()  # warm: the first snapshot, the routes' imports
        times: dict[str, list[float]] = {"judged": [], "replayed": []}
        methods = {"judged": judged, "replayed": replayed}
        for r in range(args.rounds):
            for name in rotated(list(methods), r):
                t0 = time.perf_counter()
                methods[name]()
                times[name].append(time.perf_counter() - t0)
        ratios = per_round_ratios(times["judged"], times["replayed"])
        print(f"judged pair   {Spread.of(times['judged']).text(1e3, '.1f')} ms  (min / median / max)")
        print(f"replayed pair {Spread.of(times['replayed']).text(1e3, '.1f')} ms")
        print(f"judged / replayed per round: {', '.join(f'{x:.3f}' for x in ratios)}")
    finally:
        state.close()


if __name__ == "__main__":
    main()
