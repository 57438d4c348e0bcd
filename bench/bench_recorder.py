"""Recorder: hot-path cost of one call with the writer thread running, and the sustained zero-drop rate.

Times ``Recorder.pages_allocated(req, pages, "prefill_extend")`` for a 64-page allocation, once with
a numpy int32 array and once with a Python list, each call wrapped in ``time.perf_counter_ns``. The
recorder writes into a DuckDB file in a temporary directory with the default ``RecorderConfig``, so
its writer thread drains and commits while the loop runs (and competes for the GIL, as it would in
a serving process).

Side by side in the same run, interleaved round by round so machine noise hits every row alike:
  timer      the two perf_counter_ns calls around nothing: the timer's own overhead
  floor      appending the same tuple shape to a collections.deque: what the call cannot beat
  floor+copy the floor plus the page copy the recorder makes (ndarray.copy / tuple(list))

The goal is a median of at most 500 ns per call after the timer overhead is subtracted, in every
round (per round: the recorder row's median minus the timer row's median of the same round; the
verdict is on the worst round, bench/rounds.py). The loop calls far faster than any serving process
(and than the writer commits): each recorder row starts once the writer has committed what the rows
before it left (an untimed flush), so its timed calls take the recording path, the writer committing
as they run, and not the drop path of a full buffer. The share of timed calls that found the buffer
full is printed; a round where any did gets no verdict.

Then the sustained rate one producer reaches with zero drops: a producer thread records
allocator-shaped calls (a 64-page ``pages_allocated``, then ``pages_freed`` of the same pages, and
so on) at a set rate into a fresh Recorder writing a real DuckDB store (default RecorderConfig), for
``--sustain-s`` seconds. A rate holds when no event was dropped, the producer reached the rate (within
3 %), and the buffer held less than a quarter of its capacity at the end (a writer that falls behind
would drop in a longer window). The rate doubles from ``--start-rate`` until one does not hold, then
is bisected between the last that held and the first that did not; each round repeats the search.

    .venv/bin/python bench/bench_recorder.py            # ~200k timed calls per row; 5 rounds of the rate search
    .venv/bin/python bench/bench_recorder.py --quick    # well under a minute, no verdicts
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import threading
import time
from collections import deque
from typing import NotRequired, TypedDict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rounds import MIN_ROUNDS, Spread, at_most, check_rounds  # noqa: E402

from kvtrail.audit.events import KIND_CODES, Producer, RequestRef  # noqa: E402
from kvtrail.audit.recorder import Recorder, RecorderConfig  # noqa: E402
from kvtrail.sim.synth import AllocatorSim  # noqa: E402

GOAL_NS = 500
PAGES_PER_CALL = 64
_ALLOC = KIND_CODES["pages_allocated"]


class Summary(TypedDict):
    """One row's per-call timings, in ns."""

    calls: int
    median_ns: float
    mean_ns: float
    p99_ns: float
    p999_ns: float
    max_ns: int
    loop_calls_per_s: float


class RowFigures(Summary):
    """A row's timings net of the timer (an entry of ``rows`` in the JSON); recorder rows add the untimed loop."""

    median_minus_timer_ns: float
    per_page_event_ns: float
    untimed_calls_per_s: NotRequired[float]
    dropped_calls: NotRequired[int]


def make_allocations(count: int, num_pages: int, seed: int) -> list[np.ndarray]:
    """``count`` 64-page allocations from the allocator simulation after some churn (fragmented)."""
    sim = AllocatorSim(num_pages, 16, seed=seed)
    rng = np.random.default_rng(seed)
    live: list[np.ndarray] = []
    out: list[np.ndarray] = []
    while len(out) < count:
        pages = sim.alloc(PAGES_PER_CALL)
        if pages is None:
            for i in sorted(rng.choice(len(live), size=len(live) // 2, replace=False), reverse=True):
                sim.free(live.pop(i))
            continue
        live.append(pages)
        if sim.merges:  # only record once freed pages are being reused
            out.append(pages)
    return out


def timed_calls(fn, req, inputs: list, n: int) -> tuple[np.ndarray, int]:
    """Call ``fn(req, pages, "prefill_extend")`` n times, timing each; returns (ns per call, loop ns)."""
    clock = time.perf_counter_ns
    m = len(inputs)
    out = [0] * n
    start = clock()
    for i in range(n):
        pages = inputs[i % m]
        t0 = clock()
        fn(req, pages, "prefill_extend")
        t1 = clock()
        out[i] = t1 - t0
    loop = clock() - start
    return np.array(out, dtype=np.int64), loop


def timed_floor(dq: deque, req, inputs: list, n: int, copy: bool) -> tuple[np.ndarray, int]:
    """The same loop appending the recorder's tuple shape to a deque (optionally copying the pages)."""
    clock = time.perf_counter_ns
    append = dq.append
    m = len(inputs)
    out = [0] * n
    start = clock()
    if copy:
        nd = np.ndarray
        for i in range(n):
            pages = inputs[i % m]
            t0 = clock()
            append(
                (
                    _ALLOC,
                    i,
                    t0,
                    req,
                    pages.copy() if type(pages) is nd else tuple(pages),
                    None,
                    ("prefill_extend", None),
                )
            )
            t1 = clock()
            out[i] = t1 - t0
    else:
        for i in range(n):
            pages = inputs[i % m]
            t0 = clock()
            append((_ALLOC, i, t0, req, pages, None, ("prefill_extend", None)))
            t1 = clock()
            out[i] = t1 - t0
    loop = clock() - start
    dq.clear()
    return np.array(out, dtype=np.int64), loop


def timed_nothing(n: int) -> tuple[np.ndarray, int]:
    clock = time.perf_counter_ns
    out = [0] * n
    start = clock()
    for i in range(n):
        t0 = clock()
        t1 = clock()
        out[i] = t1 - t0
    loop = clock() - start
    return np.array(out, dtype=np.int64), loop


def untimed_calls(fn, req, inputs: list, n: int) -> int:
    """The same calls without per-call timers: the loop's calls/s without timer cost."""
    clock = time.perf_counter_ns
    m = len(inputs)
    start = clock()
    for i in range(n):
        fn(req, inputs[i % m], "prefill_extend")
    return clock() - start


def summarise(samples: list[np.ndarray], loop_ns: int, calls: int) -> Summary:
    s = np.concatenate(samples)
    return {
        "calls": int(s.size),
        "median_ns": float(np.median(s)),
        "mean_ns": float(s.mean()),
        "p99_ns": float(np.percentile(s, 99)),
        "p999_ns": float(np.percentile(s, 99.9)),
        "max_ns": int(s.max()),
        "loop_calls_per_s": calls / (loop_ns / 1e9),
    }


class Trial(TypedDict):
    """One paced run of the producer at a set rate (an entry of ``sustained`` rounds in the JSON)."""

    target_calls_per_s: float
    calls_per_s: float
    dropped_events: int
    backlog_events: int
    held: bool


def paced_trial(
    rate: float, duration_s: float, arrays: list[np.ndarray], req, producer: Producer, config: RecorderConfig, tmp: str
) -> Trial:
    """A producer thread calling at ``rate`` calls/s for ``duration_s`` into a fresh Recorder and store."""
    path = os.path.join(tmp, "sustained.duckdb")
    rec = Recorder(path, producer, config)
    rec.node_config(pool_tokens=200_000 * 16, pool_pages=200_000, page_size=16, context_tokens=131_072)
    rec.flush(timeout=60)
    dropped0 = rec.total_dropped
    done: list[float] = []

    def produce() -> None:
        clock, alloc, free, m = time.perf_counter, rec.pages_allocated, rec.pages_freed, len(arrays)
        calls = 0
        start = clock()
        end = start + duration_s
        while (now := clock()) < end:
            due = int((now - start) * rate) - calls
            if due <= 0:
                time.sleep(0.0002)  # ahead of the schedule: leave the GIL to the writer
                continue
            for _ in range(min(due, 256)):  # catch up in bounded bursts, so the clock is read often
                pages = arrays[(calls >> 1) % m]
                if calls & 1:
                    free(req, pages, "finish")
                else:
                    alloc(req, pages, "prefill_extend")
                calls += 1
        done.append(calls / (clock() - start))

    thread = threading.Thread(target=produce, name="bench-producer")
    thread.start()
    thread.join()
    backlog = rec.stats()["buffered_events"]
    dropped = rec.total_dropped - dropped0
    rec.close(timeout=120)
    for p in (path, path + ".wal"):
        if os.path.exists(p):
            os.remove(p)
    achieved = done[0]
    held = dropped == 0 and achieved >= 0.97 * rate and backlog < config.capacity_events // 4
    return {
        "target_calls_per_s": rate,
        "calls_per_s": achieved,
        "dropped_events": dropped,
        "backlog_events": backlog,
        "held": held,
    }


def rate_search(
    start_rate: float,
    bisections: int,
    duration_s: float,
    arrays: list[np.ndarray],
    req,
    producer: Producer,
    config: RecorderConfig,
    tmp: str,
) -> tuple[float, list[Trial]]:
    """The highest rate that held: doubling from ``start_rate``, then bisecting. Returns (calls/s, trials)."""
    trials: list[Trial] = []

    def trial(rate: float) -> bool:
        trials.append(paced_trial(rate, duration_s, arrays, req, producer, config, tmp))
        return trials[-1]["held"]

    good, bad = 0.0, start_rate
    while trial(bad):
        good, bad = bad, bad * 2
    for _ in range(bisections):
        mid = (good + bad) / 2
        if trial(mid):
            good = mid
        else:
            bad = mid
    best = max((t["calls_per_s"] for t in trials if t["held"]), default=0.0)
    return best, trials


def _why_not(t: Trial, config: RecorderConfig) -> str:
    reasons = [
        name
        for name, bad in (
            ("drops", t["dropped_events"] > 0),
            ("short", t["calls_per_s"] < 0.97 * t["target_calls_per_s"]),
            ("backlog", t["backlog_events"] >= config.capacity_events // 4),
        )
        if bad
    ]
    return f" ({'+'.join(reasons)})" if reasons else ""


def report_sustained(best: list[float], trials: list[list[Trial]], duration_s: float, config: RecorderConfig) -> None:
    rounds = len(best)
    print(
        f"sustained rate, one producer thread, zero drops: {rounds} rounds of a rate search, {duration_s:g} s "
        f"per trial, fresh Recorder + DuckDB store per trial (capacity {config.capacity_events:,} events, "
        f"flush every {config.flush_interval_s * 1e3:g} ms)"
    )
    print("  calls alternate pages_allocated / pages_freed of the same 64 pages (64 page-events each)")
    for r, ts in enumerate(trials):
        steps = ", ".join(f"{t['target_calls_per_s'] / 1e3:.0f}k{_why_not(t, config)}" for t in ts)
        print(f"  round {r + 1}: {steps}  -> {best[r] / 1e3:,.0f}k calls/s held")
    print(
        "  (k calls/s tried; a rate that did not hold says why: drops, short = the producer fell > 3 % short "
        "of the rate, backlog = buffer >= capacity/4 at the end)"
    )
    spread = Spread.of(best)
    print(
        f"highest rate held: {spread.text(1e-3, ',.0f')} k calls/s = "
        f"{spread.text(PAGES_PER_CALL * 1e-6, ',.1f')} M page-events/s (min / median / max over rounds"
        f"{'' if rounds >= MIN_ROUNDS else f'; only {rounds} rounds'})"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200_000, help="timed calls per row (default 200000)")
    ap.add_argument("--rounds", type=int, default=10, help="rounds the calls are split into, rows interleaved")
    ap.add_argument("--sustain-s", type=float, default=2.0, help="seconds per trial of the rate search (default 2)")
    ap.add_argument("--sustain-rounds", type=int, default=MIN_ROUNDS, help="rounds of the rate search (default 5)")
    ap.add_argument("--start-rate", type=float, default=50_000, help="first rate tried, calls/s (default 50000)")
    ap.add_argument("--bisections", type=int, default=3, help="bisection steps after the doubling (default 3)")
    ap.add_argument("--quick", action="store_true", help="20000 calls per row in 4 rounds; 2 short rate searches")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = ap.parse_args(argv)
    if args.quick:
        args.calls = 20_000
        args.rounds = 4
        args.sustain_s, args.sustain_rounds, args.bisections = 0.5, 2, 2
    try:
        check_rounds(args.rounds)
        check_rounds(args.sustain_rounds)
    except ValueError as exc:
        ap.error(str(exc))
    if not args.sustain_s > 0 or not args.start_rate > 0:
        ap.error("--sustain-s and --start-rate: must be > 0")
    per_round = max(1, args.calls // args.rounds)
    calls = per_round * args.rounds

    arrays = make_allocations(1024, 200_000, args.seed)
    lists = [a.tolist() for a in arrays]
    assert all(a.dtype == np.int32 and a.size == PAGES_PER_CALL for a in arrays)
    req = RequestRef("bench-req-000001", transfer_id=12345, tenant_id="tenant-00")
    producer = Producer("bench", "node-0", "prefill", "kvtrail-bench", "0", f"bench-{os.getpid()}")
    config = RecorderConfig()

    rows = (
        "recorder ndarray",
        "recorder list",
        "floor ndarray",
        "floor list",
        "floor+copy ndarray",
        "floor+copy list",
        "timer (no-op)",
    )
    samples: dict[str, list[np.ndarray]] = {r: [] for r in rows}
    loops = {r: 0 for r in rows}
    untimed = {"recorder ndarray": 0, "recorder list": 0}
    dropped_in_row = {"recorder ndarray": 0, "recorder list": 0}
    untimed_per_round = max(1, per_round // 2)
    dq: deque = deque()

    with tempfile.TemporaryDirectory(prefix="kvtrail-bench-") as tmp:
        path = os.path.join(tmp, "recorder.duckdb")
        rec = Recorder(path, producer, config)
        rec.node_config(pool_tokens=200_000 * 16, pool_pages=200_000, page_size=16, context_tokens=131_072)
        # Warm-up: code paths, the writer's first commits, the allocator of the deque.
        timed_calls(rec.pages_allocated, req, arrays, 5_000)
        timed_calls(rec.pages_allocated, req, lists, 5_000)
        timed_floor(dq, req, arrays, 5_000, True)
        timed_nothing(5_000)
        if not rec.flush(timeout=120):
            print("warning: warm-up flush timed out", file=sys.stderr)
        stats0 = rec.stats()
        gc.collect()

        t_start = time.perf_counter()
        for round_index in range(args.rounds):
            order = list(rows)
            k = round_index % len(order)
            order = order[k:] + order[:k]  # rotate so no row always runs right after another
            for row in order:
                inputs = lists if row.endswith("list") else arrays
                if row.startswith("recorder"):
                    if not rec.flush(timeout=120):
                        print("warning: a flush before a timed row timed out", file=sys.stderr)
                    d0 = rec.total_dropped
                    s, loop = timed_calls(rec.pages_allocated, req, inputs, per_round)
                    dropped_in_row[row] += rec.total_dropped - d0
                elif row.startswith("floor+copy"):
                    s, loop = timed_floor(dq, req, inputs, per_round, True)
                elif row.startswith("floor"):
                    s, loop = timed_floor(dq, req, inputs, per_round, False)
                else:
                    s, loop = timed_nothing(per_round)
                samples[row].append(s)
                loops[row] += loop
            for row in untimed:
                untimed[row] += untimed_calls(
                    rec.pages_allocated, req, lists if row.endswith("list") else arrays, untimed_per_round
                )
        loop_s = time.perf_counter() - t_start
        before_flush = rec.stats()
        t0 = time.perf_counter()
        flushed = rec.flush(timeout=600)
        drain_s = time.perf_counter() - t0
        stats = rec.stats()
        rec.close()
        size = os.path.getsize(path)
        sustained = [
            rate_search(args.start_rate, args.bisections, args.sustain_s, arrays, req, producer, config, tmp)
            for _ in range(args.sustain_rounds)
        ]

    summaries = {r: summarise(samples[r], loops[r], calls) for r in rows}
    timer = summaries["timer (no-op)"]["median_ns"]
    res: dict[str, RowFigures] = {}
    for r in rows:
        net_ns = summaries[r]["median_ns"] - timer
        res[r] = {**summaries[r], "median_minus_timer_ns": net_ns, "per_page_event_ns": net_ns / PAGES_PER_CALL}
    for r in untimed:
        res[r]["untimed_calls_per_s"] = args.rounds * untimed_per_round / (untimed[r] / 1e9)
        res[r]["dropped_calls"] = dropped_in_row[r]

    recorded = stats["recorded_events"] - stats0["recorded_events"]
    committed = stats["committed_events_total"] - stats0["committed_events_total"]
    print(
        f"kvtrail recorder hot path: pages_allocated, {PAGES_PER_CALL} pages per call, writer running "
        f"(default RecorderConfig), {calls} timed calls per row in {args.rounds} interleaved rounds"
    )
    print(f"machine: {os.cpu_count()} CPUs, Python {platform.python_version()}, numpy {np.__version__}")
    print()
    head = (
        f"{'row':<20} {'median':>8} {'mean':>8} {'p99':>8} {'p99.9':>8} {'med-timer':>10} "
        f"{'ns/page':>8} {'loop calls/s':>13} {'untimed calls/s':>16}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        x = res[r]
        unt = f"{x['untimed_calls_per_s']:>16,.0f}" if "untimed_calls_per_s" in x else f"{'':>16}"
        print(
            f"{r:<20} {x['median_ns']:>8.0f} {x['mean_ns']:>8.0f} {x['p99_ns']:>8.0f} {x['p999_ns']:>8.0f} "
            f"{x['median_minus_timer_ns']:>10.0f} {x['per_page_event_ns']:>8.2f} "
            f"{x['loop_calls_per_s']:>13,.0f}{unt}"
        )
    print("(ns per call; med-timer = median minus the timer's median; ns/page = med-timer / 64)")
    print()
    timer_by_round = [float(np.median(x)) for x in samples["timer (no-op)"]]
    verdicts = {}
    for r in ("recorder ndarray", "recorder list"):
        x = res[r]
        net = [float(np.median(a)) - t for a, t in zip(samples[r], timer_by_round)]
        v = verdicts[r] = at_most(f"<= {GOAL_NS} ns/call", net, GOAL_NS)
        floor = res["floor " + r.split()[1]]["median_minus_timer_ns"]
        word = v.word if x["dropped_calls"] == 0 else f"{v.word[:4]} (timed calls found the buffer full: no verdict)"
        print(
            f"goal <= {GOAL_NS} ns/call (median - timer, per round), {r}: {Spread.of(net).text(fmt='.0f')} ns "
            f"(min / median / max); worst round {v.worst:.0f} ns -> {word}"
            f"  ({x['median_minus_timer_ns'] / max(floor, 1):.1f}x the deque floor; "
            f"{x['dropped_calls'] / x['calls']:.0%} of its timed calls found the buffer full)"
        )
    print()
    print(
        f"events recorded during the run: {recorded:,} (dropped, buffer full: "
        f"{stats['dropped_events_total']:,}; invalid: {stats['invalid_events_total']}; "
        f"writer errors: {stats['writer_errors_total']})"
    )
    print(
        f"buffered when the loop ended: {before_flush['buffered_events']:,} events; "
        f"flush() drained in {drain_s * 1000:.0f} ms (ok={flushed})"
    )
    print(
        f"committed: {committed:,} events, {stats['committed_page_events_total']:,} page-events in total, "
        f"{stats['committed_batches_total']} batches; store file {size / 1e6:.1f} MB; loop phase {loop_s:.1f} s"
    )
    print()
    report_sustained([b for b, _ in sustained], [t for _, t in sustained], args.sustain_s, config)

    if args.json:
        out = {
            "benchmark": "recorder",
            "date": time.strftime("%Y-%m-%d"),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "pages_per_call": PAGES_PER_CALL,
            "calls_per_row": calls,
            "rounds": args.rounds,
            "goal_ns": GOAL_NS,
            "rows": res,
            "verdict": {r: v.word for r, v in verdicts.items()},
            "worst_round_ns": {r: v.worst for r, v in verdicts.items()},
            "sustained_calls_per_s": [b for b, _ in sustained],
            "sustained_trials": [t for _, t in sustained],
            "recorded_events": recorded,
            "dropped_events": stats["dropped_events_total"],
            "invalid_events": stats["invalid_events_total"],
            "writer_errors": stats["writer_errors_total"],
            "buffered_at_loop_end": before_flush["buffered_events"],
            "flush_s": drain_s,
            "flush_ok": flushed,
            "committed_events": committed,
            "committed_batches": stats["committed_batches_total"],
            "store_bytes": size,
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
