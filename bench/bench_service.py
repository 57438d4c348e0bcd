"""Loopback load on the kvtrail service: HTTP ingest beside AuditStore.append of the same batches.

Prepare (once): each of ``--producers`` processes records an allocator-shaped stream (kvtrail.sim's
synthetic allocator, replayed call by call into a ``Recorder``) whose writer hands its batches to a
capturing sink, so the batches are exactly what a recorder's writer sends. Then, in ``--rounds``
rounds, alternating (bench/rounds.py):

  http    a fresh ``kvtrail serve`` subprocess (port 0, its banner read for the URL); the producer
          processes post their batches with ``HttpSink.append`` (what the recorder's writer calls), one
          request after the other as the writer does, all producers at once; ``--queries`` query
          processes ask ``/v1/affected`` and ``/v1/findings`` for a 1-hour window while ingest runs,
          each one pair every ``--query-interval`` seconds (a dashboard's refresh; 0: back to back).
          Timed from the first request to the last commit. Then the service is stopped (SIGTERM) and
          the store is counted: events stored must equal events acknowledged (lost = 0).
  direct  one process appends the same batches, interleaved across producers, to a fresh store with
          ``AuditStore.append``.

Printed: ingest events/s and page-events/s of both (min / median / max over rounds) and their ratio per
round (goal >= 0.8x direct, judged on the worst round), what both sides do per batch and the CPU each
spends per batch (the direct process; the service process, all its threads, to the last acknowledgement
and until the live judge has judged every commit, read from /metrics), the service's CPU per page-event
over direct append's per round (goal <= 1.5x, judge and aggregates included, worst round), the
load average, p50/p99 ingest latency, p50/p99 query latency (the 1-hour window covers the whole
stream, so the service answers from the live judge: docs/service.md), the live judge's lag (commit ->
findings persisted, p50/p99 from /healthz) and lost events.

    .venv/bin/python bench/bench_service.py                 # ~1-2 minutes on 2 cores
    .venv/bin/python bench/bench_service.py --quick         # a few seconds per round, no verdict
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rounds import MIN_ROUNDS, Spread, at_least, check_rounds, per_round_ratios, rotated  # noqa: E402

from kvtrail.audit.batch import read_ipc, write_ipc  # noqa: E402
from kvtrail.audit.events import Producer, RequestRef  # noqa: E402
from kvtrail.audit.recorder import Recorder, RecorderConfig  # noqa: E402
from kvtrail.audit.store import AppendResult, AuditStore, connect_readonly, fetch_row  # noqa: E402
from kvtrail.service.config import ServeConfig  # noqa: E402
from kvtrail.service.tokens import new_token, token_line  # noqa: E402
from kvtrail.sim.synth import synth_batches  # noqa: E402

GOAL_RATIO = 0.8
GOAL_CPU_RATIO = 1.5  # service CPU per page-event, judge and aggregates included, over direct append's
HOUR_NS = 3600 * 10**9
_BANNER = re.compile(r"kvtrail service listening on (http://\S+)")


class CapturingSink:
    """Keeps every batch the recorder's writer commits, as the Arrow IPC bytes HttpSink would send."""

    def __init__(self):
        self.bodies: list[bytes] = []
        self.events = 0

    def append(self, table) -> AppendResult:
        self.bodies.append(write_ipc(table))
        self.events += table.num_rows
        return AppendResult(table.num_rows, 0, 0, ((0, len(self.bodies) - 1),))


def _replay(rec: Recorder, table) -> None:
    """Call the recorder once per synthetic event, as an allocator's serving code would."""
    cols = table.to_pydict()
    for i, kind in enumerate(cols["kind"]):
        pages = cols["pages"][i]
        req = RequestRef(cols["request_id"][i] or "", tenant_id=cols["tenant_id"][i]) if cols["request_id"][i] else None
        if kind == "node_config":
            rec.node_config(
                pool_tokens=cols["pool_tokens"][i],
                pool_pages=cols["pool_pages"][i],
                page_size=cols["page_size"][i],
                context_tokens=cols["context_tokens"][i],
            )
        elif kind == "pages_allocated" and req is not None:
            rec.pages_allocated(req, np.asarray(pages, np.int32), cols["purpose"][i])
        elif kind == "kv_written" and req is not None:
            rec.kv_written(
                req, np.asarray(pages, np.int32), cols["token_start"][i], cols["token_end"][i], cols["source"][i]
            )
        elif kind == "pages_freed":
            rec.pages_freed(req, np.asarray(pages, np.int32), cols["free_reason"][i])


def _prepare(i: int, page_events: int, out: str) -> None:
    prod = Producer("bench", f"decode-{i}", "decode", "kvtrail-reference", "0.1", f"boot-{i}")
    sink = CapturingSink()
    rec = Recorder(sink, prod, RecorderConfig(flush_interval_s=0.05))
    for table in synth_batches(
        producer=prod, num_pages=65_536, page_size=16, seed=i, target_page_events=page_events, events_per_batch=20_000
    ):
        _replay(rec, table)
        rec.flush()  # the buffer never drops: every event of the stream is in some batch
    rec.close()
    assert rec.stats()["dropped_events_total"] == 0, rec.stats()
    d = Path(out) / f"p{i}"
    d.mkdir()
    for k, body in enumerate(sink.bodies):
        (d / f"{k:06d}.arrow").write_bytes(body)


def _bodies(root: Path) -> list[list[bytes]]:
    return [[f.read_bytes() for f in sorted(p.iterdir())] for p in sorted(root.glob("p*"))]


def prepared(root: Path, producers: int, page_events: int, prepare=_prepare) -> list[list[bytes]]:
    """Each producer's recorder batches as Arrow IPC bodies: ``prepare`` run for each in its own process,
    writing under ``root``."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=prepare, args=(i, page_events, str(root))) for i in range(producers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    return _bodies(root)


def arrival_order(bodies: list[list[bytes]]) -> list[bytes]:
    """The producers' batches as they arrive together: one of each in turn, then the rest of the longer ones."""
    return [b for group in zip(*bodies) for b in group] + [b for p in bodies for b in p[min(map(len, bodies)) :]]


def _send(url: str, token: str, bodies: list[bytes], out, ready, go) -> None:
    from kvtrail.audit.httpsink import HttpSink

    sink = HttpSink(url, token)
    tables = [read_ipc(b) for b in bodies]
    lat, events, pages = [], 0, 0
    ready.put(1)  # loaded: every producer starts sending at the same moment, not as its process came up
    go.wait()
    t0 = time.perf_counter()
    for t in tables:
        s = time.perf_counter()
        res = sink.append(t)
        lat.append(time.perf_counter() - s)
        events += res.num_events
        pages += res.num_page_events
    out.put((t0, time.perf_counter(), lat, events, pages))
    sink.close()


def _query(url: str, token: str, window: tuple[str, str], interval_s: float, stop, out, ready, go) -> None:
    import httpx

    lat: dict[str, list[float]] = {"affected": [], "findings": []}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=120) as c:
        ready.put(1)
        go.wait()
        while not stop.is_set():
            start = time.perf_counter()
            for name in lat:
                s = time.perf_counter()
                r = c.get(f"/v1/{name}", params={"from": window[0], "to": window[1]})
                assert r.status_code == 200, r.text[:300]
                lat[name].append(time.perf_counter() - s)
            stop.wait(max(0.0, interval_s - (time.perf_counter() - start)))  # paced: one pair per interval
    out.put(lat)


def _iso(ns: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ns // 10**9)) + "Z"


def _window(bodies: list[list[bytes]]) -> tuple[str, str]:
    first = min(int(read_ipc(b[0]).column("wall_ns")[0].as_py()) for b in bodies)
    return _iso(first), _iso(first + HOUR_NS)


def run_http(
    bodies: list[list[bytes]],
    queries: int,
    tmp: Path,
    round_no: int,
    interval_s: float,
    judge_interval_s: float,
    serve_args: tuple[str, ...] = (),
) -> dict:
    db = tmp / f"http{round_no}.duckdb"
    ptoken = new_token("producer")
    otoken = new_token("operator")
    tokens = tmp / f"tokens{round_no}.txt"
    tokens.write_text(
        token_line(ptoken[0], "producer", ptoken[2]) + "\n" + token_line(otoken[0], "operator", otoken[2]) + "\n"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvtrail",
            "serve",
            "--db",
            str(db),
            "--tokens",
            str(tokens),
            "--judge-interval-s",
            str(judge_interval_s),
            *serve_args,
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    m = _BANNER.match(proc.stdout.readline())
    assert m, "no banner"
    url = m.group(1)
    ctx = mp.get_context("spawn")
    out, qout, stop, ready, go = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Queue(), ctx.Event()
    qprocs = [
        ctx.Process(target=_query, args=(url, otoken[1], _window(bodies), interval_s, stop, qout, ready, go))
        for _ in range(queries)
    ]
    sprocs = [ctx.Process(target=_send, args=(url, ptoken[1], b, out, ready, go)) for b in bodies]
    for p in qprocs + sprocs:
        p.start()
    for _ in qprocs + sprocs:  # every process started and loaded before the clock starts
        ready.get()
    judge0 = _judge_cpu_s(url)
    cpu0, load0 = _cpu_s(proc.pid), os.getloadavg()[0]
    go.set()
    results = [out.get() for _ in sprocs]
    service_cpu = _cpu_s(proc.pid) - cpu0  # the service process over the ingest (all its threads)
    stop.set()
    qlat = [qout.get() for _ in qprocs]
    for p in qprocs + sprocs:
        p.join()
    import httpx

    caught_up_s = _judge_caught_up(url, otoken[1])
    judged_cpu = _cpu_s(proc.pid) - cpu0  # ... and until the live judge has judged every commit
    health = httpx.get(f"{url}/healthz", timeout=30).json()
    judge_cpu = health["judge_cpu_s"] - judge0  # the judge thread's share of judged_cpu
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 0
    con = connect_readonly(db)
    stored = fetch_row(con, "SELECT count(*) FROM events")[0]
    con.close()
    wall = max(r[1] for r in results) - min(r[0] for r in results)
    events = sum(r[3] for r in results)
    return {
        "wall_s": wall,
        "events": events,
        "page_events": sum(r[4] for r in results),
        "lat": [x for r in results for x in r[2]],
        "lost": events - stored,
        "q": {k: [x for d in qlat for x in d[k]] for k in ("affected", "findings")},
        "lag_p50_s": health.get("judge_lag_p50_s"),
        "lag_p99_s": health.get("judge_lag_p99_s"),
        "cpu_s": service_cpu,
        "judged_cpu_s": judged_cpu,
        "judge_cpu_s": judge_cpu,
        "caught_up_s": caught_up_s,
        "batches": sum(map(len, bodies)),
        "load": load0,
        "transactions": health.get("commit_transactions"),
        "checkpoints": health.get("checkpoints"),
        "checkpoint_s": health.get("checkpoint_s"),
    }


def run_direct(bodies: list[list[bytes]], tmp: Path, round_no: int) -> dict:
    tables = [read_ipc(b) for b in arrival_order(bodies)]
    events = pages = 0
    load0 = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    with AuditStore(tmp / f"direct{round_no}.duckdb") as store:
        for t in tables:
            res = store.append(t)
            events += res.num_events
            pages += res.num_page_events
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        checkpoints, checkpoint_s = store.checkpoints, store.checkpoint_s
    return {
        "wall_s": wall,
        "events": events,
        "page_events": pages,
        "cpu_s": cpu,
        "batches": len(tables),
        "load": load0,
        "checkpoints": checkpoints,
        "checkpoint_s": checkpoint_s,
    }


_JUDGE_LAG = re.compile(r"^kvtrail_judge_lag_seconds\{[^}]*\} (\S+)$", re.M)


def _judge_caught_up(url: str, token: str, timeout_s: float = 300.0) -> float:
    """Seconds until the live judge has no committed batch left to judge (every producer's
    ``kvtrail_judge_lag_seconds`` is 0), polled every 0.25 s after the last acknowledgement."""
    import httpx

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=30).text
        lags = [float(x) for x in _JUDGE_LAG.findall(text)]
        if lags and max(lags) == 0.0:
            return time.perf_counter() - t0
        time.sleep(0.25)
    raise AssertionError(f"the live judge did not catch up within {timeout_s:g} s")


def _judge_cpu_s(url: str) -> float:
    """CPU seconds the service's live judge thread has spent in its polls so far (``/healthz``)."""
    import httpx

    return float(httpx.get(f"{url}/healthz", timeout=30).json()["judge_cpu_s"])


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--producers", type=int, default=3)
    ap.add_argument("--queries", type=int, default=2)
    ap.add_argument("--page-events", type=int, default=6_000_000, help="per producer")
    ap.add_argument(
        "--query-interval",
        type=float,
        default=1.0,
        help="seconds from the start of one query pair (affected, findings) of a client to the next: "
        "a dashboard's refresh; 0 asks back to back",
    )
    ap.add_argument(
        "--judge-interval-s",
        type=float,
        default=ServeConfig().judge_interval_s,
        help="the service's least time between two live-judge polls (kvtrail serve --judge-interval-s)",
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="small streams, 2 rounds, no verdict")
    args = ap.parse_args()
    if args.quick:
        args.page_events, args.rounds = 200_000, 2
    check_rounds(args.rounds)
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        root = tmp / "batches"
        root.mkdir()
        t = time.perf_counter()
        bodies = prepared(root, args.producers, args.page_events)
        print(
            f"prepared {sum(map(len, bodies))} recorder batches of {args.producers} producers "
            f"in {time.perf_counter() - t:.1f} s"
        )
        runs: dict[str, list[dict]] = {"http": [], "direct": []}
        for r in range(args.rounds):
            for method in rotated(["http", "direct"], r):
                res = (
                    run_http(bodies, args.queries, tmp, r, args.query_interval, args.judge_interval_s)
                    if method == "http"
                    else run_direct(bodies, tmp, r)
                )
                runs[method].append(res)
                print(
                    f"  round {r} {method:6s} {res['events'] / res['wall_s']:>10,.0f} events/s "
                    f"{res['page_events'] / res['wall_s']:>12,.0f} page-events/s"
                )
    report(runs, args)


def report(runs: dict[str, list[dict]], args) -> None:
    http, direct = runs["http"], runs["direct"]
    for name, rs in (("http", http), ("direct", direct)):
        ev = Spread.of([r["events"] / r["wall_s"] for r in rs])
        pe = Spread.of([r["page_events"] / r["wall_s"] for r in rs])
        print(f"{name:6s} events/s {ev.text(1, ',.0f')}   page-events/s {pe.text(1, ',.0f')}  (min / median / max)")
    ratios = per_round_ratios(
        [r["page_events"] / r["wall_s"] for r in http], [r["page_events"] / r["wall_s"] for r in direct]
    )
    verdict = at_least(f"http >= {GOAL_RATIO}x direct append", ratios, GOAL_RATIO)
    print(
        f"http / direct page-events/s per round: {', '.join(f'{x:.2f}' for x in ratios)}  "
        f"-> {verdict.goal}: {verdict.word} (worst {verdict.worst:.2f})"
    )
    print(
        "same batches on both sides (the recorder's, as Arrow IPC), each one durable commit (AuditStore.append, "
        "the default checkpoint policy); the service also decodes and checks each request, runs the live "
        "judge and writes the access log"
    )
    cpu = {name: [r["cpu_s"] / r["batches"] * 1e3 for r in rs] for name, rs in (("http", http), ("direct", direct))}
    judged = [r["judged_cpu_s"] / r["batches"] * 1e3 for r in http]
    print(
        f"CPU per batch: direct {Spread.of(cpu['direct']).text(1, '.1f')} ms (one process), service "
        f"{Spread.of(cpu['http']).text(1, '.1f')} ms to the last acknowledgement, "
        f"{Spread.of(judged).text(1, '.1f')} ms until the live judge had judged every commit "
        f"({Spread.of([r['caught_up_s'] for r in http]).text(2, '.2f')} s after the last acknowledgement) "
        f"(its process, all threads; min / median / max); "
        f"load average at the start of the rounds {min(r['load'] for r in http + direct):.1f} to "
        f"{max(r['load'] for r in http + direct):.1f} on {os.cpu_count()} cores"
    )
    # CPU per page-event, service (judge and aggregates included) over direct append, round by round
    cpu_ratios = [
        (h["judged_cpu_s"] / h["page_events"]) / (d["cpu_s"] / d["page_events"]) for h, d in zip(http, direct)
    ]
    worst = max(cpu_ratios)
    word = "no verdict" if len(cpu_ratios) < MIN_ROUNDS else ("PASS" if worst <= GOAL_CPU_RATIO else "MISS")
    print(
        f"service CPU per page-event / direct append's, per round (judge included): "
        f"{', '.join(f'{x:.2f}' for x in cpu_ratios)}  -> goal <= {GOAL_CPU_RATIO}x with "
        f"{args.queries} query clients: {word} (worst {worst:.2f})"
    )
    # the same, split: the live judge's thread (its own CPU clock) and everything else the service did
    # (HTTP, decoding and checking requests, the commit path with DuckDB's and the digest threads)
    judge = [h["judge_cpu_s"] / h["batches"] * 1e3 for h in http]
    rest = [(h["judged_cpu_s"] - h["judge_cpu_s"]) / h["batches"] * 1e3 for h in http]
    print(
        f"service CPU per batch split: live judge thread {Spread.of(judge).text(1, '.1f')} ms, the rest "
        f"{Spread.of(rest).text(1, '.1f')} ms; per round, judge / direct append "
        + ", ".join(f"{j / d:.2f}" for j, d in zip(judge, cpu["direct"]))
        + ", the rest / direct append "
        + ", ".join(f"{r / d:.2f}" for r, d in zip(rest, cpu["direct"]))
    )
    if all(r.get("transactions") is not None for r in http):
        print(
            "service commits per round (batches in transactions; checkpoints, their seconds): "
            + ", ".join(
                f"{r['batches']} in {r['transactions']}; {r['checkpoints']}, {r['checkpoint_s']:.2f} s" for r in http
            )
        )
        print(
            "direct append checkpoints per round (their seconds): "
            + ", ".join(f"{r['checkpoints']}, {r['checkpoint_s']:.2f} s" for r in direct)
        )
    lat = [x for r in http for x in r["lat"]]
    print(
        f"ingest latency per batch: p50 {_pct(lat, 50) * 1e3:.1f} ms, p99 {_pct(lat, 99) * 1e3:.1f} ms "
        f"({len(lat)} requests, {args.producers} producers)"
    )
    for q in ("affected", "findings"):
        ql = [x for r in http for x in r["q"][q]]
        print(
            f"query {q:9s} (1-hour window, during ingest): p50 {_pct(ql, 50) * 1e3:.1f} ms, "
            f"p99 {_pct(ql, 99) * 1e3:.1f} ms ({len(ql)} queries, {args.queries} clients, "
            + (
                f"each asking affected and findings once every {args.query_interval:g} s)"
                if args.query_interval
                else "each asking back to back)"
            )
        )
    lags = [(r["lag_p50_s"], r["lag_p99_s"]) for r in http if r["lag_p99_s"] is not None]
    if lags:
        print(
            f"live judge lag (commit -> findings persisted): p50 {max(a for a, _ in lags) * 1e3:.0f} ms, "
            f"p99 {max(b for _, b in lags) * 1e3:.0f} ms (worst round; the judge polls at most every "
            f"{args.judge_interval_s:g} s)"
        )
    lost = sum(r["lost"] for r in http)
    print(f"lost events (acknowledged - stored): {lost}")
    assert lost == 0


if __name__ == "__main__":
    main()
