"""Dashboard views' data queries on a simulated fleet store, cold and warm (goal: <= 2 s cold, <= 200 ms warm).

    .venv/bin/python bench/bench_dashboard.py [--page-events 100000000] [--rounds 5] [--db bench/out/dash.duckdb]
    .venv/bin/python bench/bench_dashboard.py --quick     # 4 M page-events, 2 rounds (no verdict): a smoke run

Builds the store once with ``kvtrail simulate --target-page-events N`` (kept as ``*.nosave.duckdb`` and
reused when it exists), then a copy whose findings and per-minute aggregates a ``kvtrail forensics
findings --save`` run kept, as the live judge would (also reused). Per view it times exactly what the
view asks its source for, on the store's whole window: *cold* on a fresh source (nothing memoised; the
OS file cache is warm and the modules are loaded, as on a running dashboard: one untimed pass first) and
*warm* on the same source again (a page reload, a filter toggled back). Both stores are measured in the
same rounds: the saved one (the goal) and the one no run was saved on (every view that needs findings
replays the window). Rounds alternate the views and the stores (``rounds.py``); min / median / max per
figure, verdicts on the worst round.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import duckdb

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rounds import MIN_ROUNDS, Spread, check_rounds, rotated  # noqa: E402

from kvtrail import forensics as fx  # noqa: E402
from kvtrail.answers.store import StoreSource  # noqa: E402
from kvtrail.answers.tally import findings_tally  # noqa: E402
from kvtrail.cli import main as kvtrail  # noqa: E402
from kvtrail.forensics.results import aggregates

COLD_GOAL_S, WARM_GOAL_S = 2.0, 0.2


def build(db: Path, page_events: int) -> Path:
    """The saved store at ``db`` and the unsaved one beside it (returned), each built once."""
    raw = db.with_name(db.stem + ".nosave.duckdb")
    if raw.exists():
        print(f"reusing {raw}")
    else:
        db.parent.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        assert (
            kvtrail(
                ["simulate", "--db", str(raw), "--seed", "7", "--target-page-events", str(page_events), "--hours", "24"]
            )
            == 0
        )
        print(f"simulated in {time.perf_counter() - t:.1f} s")
    if db.exists():
        print(f"reusing {db}")
        return raw
    shutil.copy(raw, db)
    t = time.perf_counter()
    assert (
        kvtrail(
            [
                "forensics",
                "findings",
                "--db",
                str(db),
                "--save",
                "--format",
                "json",
                "--out",
                str(db.with_suffix(".findings.json")),
                "--force",
            ]
        )
        == 0
    )
    print(f"findings and aggregates saved (one replay of the whole store) in {time.perf_counter() - t:.1f} s")
    return raw


def recompute_s(db: Path) -> float:
    """What the aggregates alone cost ``--save``: every minute of the store rebuilt (idempotent)."""
    con = duckdb.connect(str(db))
    try:
        return timed(lambda: aggregates.recompute(con, None, None))
    finally:
        con.close()


def views(src: StoreSource, w: fx.Window) -> dict[str, Callable[[], object]]:
    """What each view asks its source for (see kvtrail/dashboards/*_view.py)."""

    def fleet() -> object:
        return src.bounds(), src.events_in(w), src.choices(), src.fleet(w), src.counts(w)

    def findings() -> object:
        found = src.findings(w)
        return findings_tally(src, w, found), src.found(w)[1]

    def affected() -> object:
        rows = src.affected(w)
        return src.request(rows["request_id"][0], w) if len(rows) else rows

    return {
        "Fleet": fleet,
        "Findings": findings,
        "Affected responses": affected,
        "Exposure": lambda: (src.exposure(w), src.thresholds(w), src.exploitation(w)),
        "Transfers": lambda: (src.transfers(w), src.counts(w)),
    }


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", type=Path, default=None, help="the store (default bench/out/dash.duckdb)")
    ap.add_argument("--page-events", type=int, default=None, help="page-events of the history (default 1e8)")
    ap.add_argument("--rounds", type=int, default=None, help=f"rounds (default {MIN_ROUNDS}; 2 with --quick)")
    ap.add_argument("--quick", action="store_true", help="4 M page-events, 2 rounds, its own store")
    a = ap.parse_args()
    a.db = a.db or Path("bench/out/dash-quick.duckdb" if a.quick else "bench/out/dash.duckdb")
    a.page_events = a.page_events or (4_000_000 if a.quick else 100_000_000)
    a.rounds = a.rounds or (2 if a.quick else MIN_ROUNDS)
    rounds = check_rounds(a.rounds)
    raw = build(a.db, a.page_events)
    print(f"aggregates of the whole store recomputed in {recompute_s(a.db):.2f} s")
    probe = StoreSource(a.db)
    bounds = probe.bounds()
    assert bounds is not None, "the simulated store holds no events"
    w = fx.Window(bounds[0], bounds[1])
    with fx.open_store(a.db) as con:
        page_events = con.execute("SELECT sum(num_page_events) FROM batches").fetchall()[0][0]
    print(
        f"store {a.db}: {page_events:,} page-events; window {(bounds[1] - bounds[0]) / 3.6e12:.2f} h; "
        f"findings from: {probe.found(w)[1]}; {probe.counts(w).describe()}"
    )
    print(f"store {raw}: findings from: {StoreSource(raw).found(w)[1]}; {StoreSource(raw).counts(w).describe()}")
    names = list(views(probe, w))
    for fn in views(StoreSource(a.db), w).values():  # one-off costs of a fresh process (imports, e.g. pandas,
        fn()  # which a running Streamlit app has loaded), not timed
    stores = {"saved": a.db, "no saved run": raw}
    cold = {(s, n): [] for s in stores for n in names}  # type: dict[tuple[str, str], list[float]]
    warm = {(s, n): [] for s in stores for n in names}  # type: dict[tuple[str, str], list[float]]
    for r in range(rounds):
        for store in rotated(list(stores), r):
            for name in rotated(names, r):
                src = StoreSource(stores[store])
                fn = views(src, w)[name]
                cold[(store, name)].append(timed(fn))
                warm[(store, name)].append(min(timed(fn) for _ in range(3)))
        print(f"round {r + 1}/{rounds} done", flush=True)
    verdict_ok = rounds >= MIN_ROUNDS
    for store in stores:
        print(f"\n{store}: {'view':<20} {'cold s (min/med/max)':>24} {'warm ms (min/med/max)':>26}  verdict")
        for n in names:
            c, h = Spread.of(cold[(store, n)]), Spread.of(warm[(store, n)])
            ok = c.max <= COLD_GOAL_S and h.max <= WARM_GOAL_S
            word = ("PASS" if ok else "MISS") if verdict_ok else "no verdict"
            print(
                f"{store}: {n:<20} {c.text():>24} {h.text(1000, '.1f'):>26}  {word} "
                f"(goal <= {COLD_GOAL_S:g} s cold, <= {WARM_GOAL_S * 1000:.0f} ms warm, worst round)"
            )


if __name__ == "__main__":
    main()
