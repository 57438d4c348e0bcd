"""Serving overhead of auditing on the reference PD stack: CPU time per request, and throughput and TTFT.

One stack (patched mode, the same three processes throughout) runs the same seeded traffic with
auditing switched off (every process swaps its recorder for a NullRecorder) and on (every event
through the recorders into DuckDB), in ``--rounds`` rounds. Each round runs three sides, the first
one rotating from round to round (bench/rounds.py):

  off        auditing off
  on         auditing on
  off-again  auditing off once more: the A/A calibration; its difference from 'off' is the noise

CPU time per request is the process CPU (user + sys, all threads, read from the kernel's
per-process CPU clock) of the stack's processes over a side's traffic plus a settle time
(--settle-s, longer than the recorders' 1 s flush interval, so the 'on' side's writes are committed
inside its own side):

  router     this process: the router's HTTP server and its recorder (hot path and writer thread)
  prefill    the prefill worker process (model, transfer engine, recorder)
  decode     the decode worker process
  store      the store process: the relay that receives every recorder's batches and commits them
             into DuckDB (kvtrail/serving/store_process.py), the role the kvtrail service has in
             production. Measured and printed beside the others; the goal counts the three serving
             processes above, and the totals with the store are printed too.

Beside the process totals, the audit's own work is measured directly, which a shared machine
disturbs far less: each recorder's writer thread counts its CPU (``writer_cpu_ns_total`` in
``Recorder.stats``), and the hot path is the events each process recorded times the cost of one
recorder call, timed in this process at start (a 64-page ``pages_allocated``, writer running).

The traffic client runs in a fourth process of its own (not counted), so the router's process holds
nothing but the stack. Throughput (completion tokens/s) and TTFT come from that client, as before.

The workers' numba kernels (tag checks, digests) run on libgomp's thread pool, whose idle threads
spin-wait by default: that spinning took most of the CPU of the workers on the shared 2-core machine
and tracked wall time, not work, so CPU time per request swung 4x between identical rounds. The
stack's processes inherit this process's environment, and this benchmark sets
OMP_WAIT_POLICY=PASSIVE (idle threads sleep) unless the variable is already set; the output says
which policy ran. ``OMP_WAIT_POLICY=ACTIVE`` reproduces the default.

Overheads are taken within a round (on / off - 1); a goal is PASS only when the worst round clears it.

    .venv/bin/python bench/bench_serving.py [--rounds 6] [--requests 40] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TypedDict

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rounds import Spread, at_most, check_rounds, per_round_ratios, rotated  # noqa: E402

from kvtrail.serving.config import StackConfig  # noqa: E402
from kvtrail.serving.stack import Stack  # noqa: E402
from kvtrail.serving.traffic import TrafficConfig, make_prompt, plan  # noqa: E402

SIDES = ("off", "on", "off-again")
PROCESSES = ("router", "prefill", "decode")  # the serving processes: what the goal counts
STORE = "store"  # the store process, measured beside them
GOAL = 0.01  # at most 1 % more CPU time per request (and 1 % less throughput) with auditing on


class RoundFigures(TypedDict):
    """One side of one round (an entry of ``rounds`` in the JSON)."""

    tokens_per_s: float
    ttft_ms_median: float
    elapsed_s: float
    cpu_s: dict[str, float]  # per process (serving ones and the store), over the traffic and the settle time
    cpu_ms_per_request: float  # the serving processes
    writer_cpu_s: dict[str, float]  # per serving process: its recorder's writer thread
    recorded_events: dict[str, int]  # per serving process: events its recorder numbered


class CpuClocks:
    """Process CPU time (user + sys, every thread) of other processes, in seconds, by pid.

    Uses the kernel's per-process CPU clock (clock_getcpuclockid: ns resolution, threads that ended
    included); where that is refused, /proc/<pid>/stat's utime + stime (clock ticks).
    """

    def __init__(self, pids: dict[str, int]):
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._tick_s = 1 / os.sysconf("SC_CLK_TCK")
        self.pids = pids
        self.clocks: dict[str, int | None] = {name: self._clock_of(pid) for name, pid in pids.items()}

    def _clock_of(self, pid: int) -> int | None:
        if pid == os.getpid():
            return time.CLOCK_PROCESS_CPUTIME_ID
        cid = ctypes.c_int()
        return cid.value if self._libc.clock_getcpuclockid(pid, ctypes.byref(cid)) == 0 else None

    def read(self) -> dict[str, float]:
        out = {}
        for name, clock in self.clocks.items():
            if clock is not None:
                out[name] = time.clock_gettime(clock)
            else:
                with open(f"/proc/{self.pids[name]}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                out[name] = (int(fields[11]) + int(fields[12])) * self._tick_s  # utime, stime
        return out

    @property
    def source(self) -> str:
        return (
            "per-process CPU clocks (ns)"
            if all(c is not None for c in self.clocks.values())
            else "/proc/<pid>/stat (10 ms ticks) for some processes"
        )


async def _traffic(url: str, keys: dict[str, str], traffic: TrafficConfig) -> tuple[float, float, float]:
    requests = plan(traffic, sorted(keys))
    sem = asyncio.Semaphore(traffic.concurrency)
    ttfts: list[float] = []
    tokens = 0
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def one(tenant, n, _overlong):
            nonlocal tokens
            async with sem:
                r = await client.post(
                    "/v1/completions",
                    json={"prompt": make_prompt(tenant, n), "max_tokens": traffic.max_tokens},
                    headers={"Authorization": f"Bearer {keys[tenant]}"},
                )
                assert r.status_code == 200, r.text
                tokens += r.json()["usage"]["completion_tokens"]
                ttfts.append(float(r.headers["x-kvtrail-ttft-ms"]))

        t0 = time.perf_counter()
        await asyncio.gather(*(one(*req) for req in requests))
        elapsed = time.perf_counter() - t0
    return tokens / elapsed, statistics.median(ttfts), elapsed


def client_main(conn: Connection, url: str, keys: dict[str, str], traffic: TrafficConfig) -> None:
    """The traffic client's process: one round of traffic per message, figures sent back."""
    while conn.recv() == "go":
        conn.send(asyncio.run(_traffic(url, keys, traffic)))


def one_side(stack: Stack, client: Connection, clocks: CpuClocks, settle_s: float, n: int) -> RoundFigures:
    stats0 = stack.audit_stats()
    before = clocks.read()
    client.send("go")
    tokens_per_s, ttft, elapsed = client.recv()
    time.sleep(settle_s)  # the recorders' writers drain once a second: the 'on' side's commits land here
    after = clocks.read()
    stats1 = stack.audit_stats()
    cpu = {p: after[p] - before[p] for p in clocks.pids}

    def delta(p: str, key: str) -> int:
        return stats1[p].get(key, 0) - stats0[p].get(key, 0)

    return {
        "tokens_per_s": tokens_per_s,
        "ttft_ms_median": ttft,
        "elapsed_s": elapsed,
        "cpu_s": cpu,
        "cpu_ms_per_request": sum(cpu[p] for p in PROCESSES) * 1e3 / n,
        "writer_cpu_s": {p: delta(p, "writer_cpu_ns_total") / 1e9 for p in PROCESSES},
        "recorded_events": {p: delta(p, "recorded_events") for p in PROCESSES},
    }


def hot_path_ns_per_call(calls: int = 20_000) -> float:
    """Median ns of one recorder call (64-page ``pages_allocated``, an ndarray) with its writer running."""
    import numpy as np

    from kvtrail.audit.events import Producer, RequestRef
    from kvtrail.audit.recorder import Recorder, RecorderConfig
    from kvtrail.audit.store import AppendResult

    class _Sink:
        def append(self, table):
            return AppendResult(table.num_rows, 0, 0, ())

    rec = Recorder(_Sink(), Producer("bench", "n", "prefill", "bench", "0", "i"), RecorderConfig())
    req, pages, clock = RequestRef("r", 1, "t", "k"), np.arange(64, dtype=np.int32), time.perf_counter_ns
    try:
        samples = []
        for _ in range(calls):
            t0 = clock()
            rec.pages_allocated(req, pages, "prefill_extend")
            samples.append(clock() - t0)
        empty = []
        for _ in range(calls):
            t0 = clock()
            empty.append(clock() - t0)
    finally:
        rec.close()
    return statistics.median(samples) - statistics.median(empty)


def run(rounds: int, n: int, settle_s: float) -> tuple[dict[str, list[RoundFigures]], dict, str]:
    # Normal traffic (nothing over-long), the patched engine.
    traffic = TrafficConfig(num_requests=n, overlong_share=0.0, seed=7)
    base = StackConfig(
        mode="patched",
        prefill_pool_tokens=16 * 1024,
        decode_pool_tokens=64 * 1024,
        context_tokens=16 * 1024,
        max_new_tokens=48,
    )
    keys = {t: k for k, t in base.api_keys}
    results: dict[str, list[RoundFigures]] = {s: [] for s in SIDES}
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before the workers start: see the module doc
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, Stack(base, Path(tmp) / "audit.duckdb") as stack:
        assert stack.url is not None, "a started stack has a URL"
        mine, theirs = ctx.Pipe()
        client = ctx.Process(target=client_main, args=(theirs, stack.url, keys, traffic), name="bench-client")
        client.start()
        try:
            assert stack.store is not None, "a started stack has a store process"
            pids = {
                "router": os.getpid(),
                **{r: stack.procs[r].pid for r in ("prefill", "decode")},
                STORE: stack.store.pid,
            }
            clocks = CpuClocks({p: pid for p, pid in pids.items() if pid is not None})
            for side in ("off", "on"):  # a warm-up side each, not counted
                stack.set_audit(side == "on")
                one_side(stack, mine, clocks, settle_s, n)
            for r in range(rounds):
                for side in rotated(SIDES, r):
                    stack.set_audit(side == "on")
                    results[side].append(one_side(stack, mine, clocks, settle_s, n))
                print(
                    f"round {r + 1}/{rounds} ({', '.join(rotated(SIDES, r))}): CPU ms/request "
                    + ", ".join(f"{s} {results[s][-1]['cpu_ms_per_request']:.1f}" for s in SIDES),
                    flush=True,
                )
        finally:
            if client.is_alive():
                mine.send("stop")
            client.join(30)
            if client.is_alive():  # only our own child, by its handle
                client.kill()
        stack.set_audit(True)
        assert stack.recorder is not None and stack.store is not None, "a started stack has both"
        stack.recorder.flush(30)
        time.sleep(2.5)  # the workers' writers drain once a second
        row = stack.store.cursor().execute("SELECT count(*), sum(num_pages + num_dst_pages) FROM events").fetchone()
        assert row is not None, "an aggregate query returns one row"
    return results, {"events": row[0], "page_events": int(row[1] or 0)}, clocks.source


def report(results: dict[str, list[RoundFigures]], recorded: dict, source: str, hot_ns: float, args) -> dict:
    rounds, n = len(results["on"]), args.requests
    print(
        f"{rounds} rounds x 3 sides ({', '.join(SIDES)}; first side rotating) x {n} requests, "
        f"concurrency 4, 48 new tokens each; settle {args.settle_s:g} s after each side's traffic"
    )
    print(
        f"machine: {os.cpu_count()} CPUs, shared with other jobs; CPU from {source}; "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}"
    )
    print()
    head = (
        f"{'audit':<10}{'CPU ms/request':>26}{'router':>9}{'prefill':>9}{'decode':>9}{'store':>9}"
        f"{'tokens/s':>24}{'TTFT ms':>9}"
    )
    print(head)
    print(f"{'':<10}{'min / median / max':>26}{'(median CPU ms/request)':>36}{'min / median / max':>24}{'median':>9}")
    print("-" * len(head))
    for s in SIDES:
        x = results[s]
        cpu = Spread.of([r["cpu_ms_per_request"] for r in x])
        per = {p: statistics.median(r["cpu_s"].get(p, 0.0) * 1e3 / n for r in x) for p in (*PROCESSES, STORE)}
        tps = Spread.of([r["tokens_per_s"] for r in x])
        ttft = statistics.median(r["ttft_ms_median"] for r in x)
        print(
            f"{s:<10}{cpu.text(fmt='.1f'):>26}{per['router']:>9.1f}{per['prefill']:>9.1f}{per['decode']:>9.1f}"
            f"{per[STORE]:>9.1f}{tps.text(fmt='.0f'):>24}{ttft:>9.2f}"
        )
    print(
        "(CPU ms/request counts the serving processes: router (this process), prefill and decode; the store "
        "process, which commits every recorder's batches, is shown beside them; the traffic client is not counted)"
    )
    print(f"audited run recorded {recorded['events']:,} events, {recorded['page_events']:,} page-events")
    print()

    def per_round(a: str, b: str, key: Callable[[RoundFigures], float]) -> list[float]:
        return per_round_ratios([key(r) for r in results[a]], [key(r) for r in results[b]])

    def cpu_of(r: RoundFigures) -> float:
        return r["cpu_ms_per_request"]

    def cpu_with_store(r: RoundFigures) -> float:
        return r["cpu_ms_per_request"] + r["cpu_s"].get(STORE, 0.0) * 1e3 / n

    def tput_of(r: RoundFigures) -> float:
        return r["tokens_per_s"]

    cpu_over = [x - 1 for x in per_round("on", "off", cpu_of)]
    cpu_aa = [x - 1 for x in per_round("off-again", "off", cpu_of)]
    all_over = [x - 1 for x in per_round("on", "off", cpu_with_store)]
    all_aa = [x - 1 for x in per_round("off-again", "off", cpu_with_store)]
    tput_over = [1 - x for x in per_round("on", "off", tput_of)]
    tput_aa = [1 - x for x in per_round("off-again", "off", tput_of)]
    v_cpu = at_most("CPU time per request overhead <= 1%", cpu_over, GOAL)
    v_tput = at_most("throughput overhead <= 1%", tput_over, GOAL)
    aa_worst = max(abs(x) for x in cpu_aa)
    print("CPU time per request of the serving processes (router, prefill, decode):")
    print(
        f"  on / off - 1, per round:                       {Spread.of(cpu_over).text(100, '+.2f')} % "
        f"(min / median / max)"
    )
    print(
        f"  A/A calibration, off-again / off - 1:          {Spread.of(cpu_aa).text(100, '+.2f')} % "
        f"(worst |A/A| {aa_worst * 100:.2f} %)"
    )
    print(
        f"  goal <= 1 %: worst round {v_cpu.worst * 100:+.2f} % -> {v_cpu.word} "
        f"(the A/A spread above is the noise such a round carries)"
    )
    print(
        f"with the store process counted too, on / off - 1: {Spread.of(all_over).text(100, '+.2f')} %; "
        f"A/A {Spread.of(all_aa).text(100, '+.2f')} % (reported, not the goal)"
    )
    print(f"throughput, 1 - on / off, per round:             {Spread.of(tput_over).text(100, '+.2f')} %")
    print(f"  A/A calibration, 1 - off-again / off:          {Spread.of(tput_aa).text(100, '+.2f')} %")
    print(f"  goal <= 1 %: worst round {v_tput.worst * 100:+.2f} % -> {v_tput.word}")
    print("per process, CPU ms/request per round, min / median / max (where the cost lands, and each one's noise):")
    for p in (*PROCESSES, STORE):

        def ms(side: str, p: str = p) -> list[float]:
            return [r["cpu_s"].get(p, 0.0) * 1e3 / n for r in results[side]]

        delta = [a - b for a, b in zip(ms("on"), ms("off"))]
        aa = [a - b for a, b in zip(ms("off-again"), ms("off"))]
        print(
            f"  {p:<8} on - off {Spread.of(delta).text(fmt='+.2f'):>24}    A/A off-again - off "
            f"{Spread.of(aa).text(fmt='+.2f'):>24}"
        )
    attributed = audit_work(results, hot_ns, n)
    ttft = statistics.median(per_round("on", "off", lambda r: r["ttft_ms_median"]))
    print(f"TTFT ratio on / off (median of rounds): {ttft:.3f}")
    return {
        "cpu_overhead": cpu_over,
        "cpu_aa": cpu_aa,
        "cpu_overhead_with_store": all_over,
        "cpu_aa_with_store": all_aa,
        "throughput_overhead": tput_over,
        "throughput_aa": tput_aa,
        "audit_work_share": attributed,
        "hot_path_ns_per_call": hot_ns,
        "cpu_verdict": v_cpu.word,
        "throughput_verdict": v_tput.word,
    }


def audit_work(results: dict[str, list[RoundFigures]], hot_ns: float, n: int) -> list[float]:
    """Print the audit's own work in the serving processes, measured directly; return its share per round."""
    print(
        f"audit work in the serving processes on the 'on' side, measured directly (per request; hot path = "
        f"recorded events x {hot_ns:.0f} ns, one recorder call timed at start):"
    )
    shares = []
    for p in PROCESSES:
        writer = [r["writer_cpu_s"][p] * 1e3 / n for r in results["on"]]
        events = [r["recorded_events"][p] / n for r in results["on"]]
        hot_ms = statistics.median(events) * hot_ns / 1e6
        print(
            f"  {p:<8} writer thread {Spread.of(writer).text(fmt='.3f')} ms, "
            f"{Spread.of(events).text(fmt='.1f')} events -> hot path ~{hot_ms:.3f} ms"
        )
    for on in results["on"]:
        work_ms = sum(on["writer_cpu_s"][p] * 1e3 + on["recorded_events"][p] * hot_ns / 1e6 for p in PROCESSES) / n
        # Against the rest of the same side's CPU: both halves saw the same load on the machine.
        shares.append(work_ms / (on["cpu_ms_per_request"] - work_ms))
    print(
        f"  audit work / the rest of the same side's serving CPU, per round: {Spread.of(shares).text(100, '.2f')} % "
        f"(min / median / max; worst round {max(shares) * 100:.2f} % against the 1 % goal: a direct measurement "
        f"of the writer threads plus an estimate of the hot path, not the verdict above)"
    )
    return shares


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6, help="rounds; each runs all three sides (default 6)")
    ap.add_argument("--requests", type=int, default=40, help="requests per side and round (default 40)")
    ap.add_argument("--settle-s", type=float, default=1.5, help="wait after each side's traffic, counted in its CPU")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 12 requests (no verdict)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.requests = 2, 12
    try:
        check_rounds(args.rounds)
    except ValueError as exc:
        ap.error(str(exc))
    hot_ns = hot_path_ns_per_call()
    results, recorded, source = run(args.rounds, args.requests, args.settle_s)
    figures = report(results, recorded, source, hot_ns, args)
    if args.json:
        args.json.write_text(json.dumps({"rounds": results, "recorded": recorded, **figures}, indent=2))


if __name__ == "__main__":
    main()
