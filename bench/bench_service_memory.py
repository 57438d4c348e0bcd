"""Does ``kvtrail serve`` plateau? Its RSS over a long producer stream with query clients beside it.

A fresh ``kvtrail serve`` (port 0, its banner read for the URL) takes ``--producers`` recorder processes
(kvtrail.sim's synthetic allocator replayed call by call into a ``Recorder`` whose sink is ``HttpSink``:
what a node's recorder does), each paced at ``--events-per-s``, for ``--duration-s``, while ``--queries``
query processes ask ``/v1/affected`` and ``/v1/findings`` over the whole store back to back (a dashboard
left open, twice). The service's RSS is sampled every ``--sample-s`` from /proc. At the end the service is
stopped (SIGTERM) and the store counted: events stored must equal events acknowledged.

Printed: RSS at start (after the first sample), at the middle and at the end, its peak, its growth over
the second half (MB per minute: ~0 is a plateau), ack latency p50/p99 (each batch's HttpSink.append),
query latency p50/p99, events acknowledged, stored and lost.

    .venv/bin/python bench/bench_service_memory.py                  # 10 minutes (the plateau check)
    .venv/bin/python bench/bench_service_memory.py --duration-s 60  # the 60 s load test
    .venv/bin/python bench/bench_service_memory.py --quick          # 20 s, a smoke run
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

from bench_service import _replay  # noqa: E402

from kvtrail.audit.events import Producer  # noqa: E402
from kvtrail.audit.recorder import Recorder, RecorderConfig  # noqa: E402
from kvtrail.audit.store import AppendResult, connect_readonly, fetch_row  # noqa: E402
from kvtrail.service.tokens import new_token, token_line  # noqa: E402
from kvtrail.sim.synth import synth_batches  # noqa: E402

_BANNER = re.compile(r"kvtrail service listening on (http://\S+)")
_SYNTH_BATCH = 500  # synthetic events replayed between two pacing checks


class TimedSink:
    """HttpSink, timing each append (what a recorder's writer waits for the ack)."""

    def __init__(self, url: str, token: str):
        from kvtrail.audit.httpsink import HttpSink

        self.sink = HttpSink(url, token)
        self.lat: list[float] = []
        self.events = 0

    def append(self, table) -> AppendResult:
        s = time.perf_counter()
        res = self.sink.append(table)
        self.lat.append(time.perf_counter() - s)
        self.events += res.num_events
        return res

    def close(self) -> None:
        self.sink.close()


def _produce(i: int, url: str, token: str, rate: float, duration_s: float, out, go) -> None:
    prod = Producer("bench", f"decode-{i}", "decode", "kvtrail-reference", "0.1", f"mem-{i}")
    sink = TimedSink(url, token)
    rec = Recorder(sink, prod, RecorderConfig(flush_interval_s=0.2))
    target = int(rate * duration_s * 40) + 10_000  # more than the paced stream can use
    go.wait()
    t0 = time.monotonic()
    sent = 0
    for table in synth_batches(
        producer=prod, num_pages=65_536, page_size=16, seed=i, target_page_events=target, events_per_batch=_SYNTH_BATCH
    ):
        if time.monotonic() - t0 >= duration_s:
            break
        _replay(rec, table)
        sent += table.num_rows
        ahead = sent / rate - (time.monotonic() - t0)
        if ahead > 0:
            time.sleep(ahead)
    rec.close()
    dropped = rec.stats()["dropped_events_total"]
    out.put((sink.lat, sink.events, dropped))
    sink.close()


def _query(url: str, token: str, stop, out, go) -> None:
    import httpx

    lat: list[float] = []
    refused = 0
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=300) as c:
        go.wait()
        while not stop.is_set():
            for name in ("affected", "findings"):
                s = time.perf_counter()
                r = c.get(f"/v1/{name}")
                if r.status_code == 429:
                    refused += 1
                    continue
                assert r.status_code == 200, r.text[:300]
                lat.append(time.perf_counter() - s)
    out.put((lat, refused))


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--producers", type=int, default=3)
    ap.add_argument("--queries", type=int, default=2)
    ap.add_argument("--events-per-s", type=float, default=2000.0, help="per producer")
    ap.add_argument("--duration-s", type=float, default=600.0)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--quick", action="store_true", help="20 s, a smoke run")
    ap.add_argument("--memory-limit-mb", type=int, default=None, help="kvtrail serve --memory-limit-mb (its default)")
    ap.add_argument("--judge-horizon-s", type=int, default=None, help="kvtrail serve --judge-horizon-s (its default)")
    ap.add_argument("--series", action="store_true", help="print every RSS sample (seconds, MB)")
    args = ap.parse_args()
    if args.quick:
        args.duration_s, args.sample_s = 20.0, 2.0
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        db = tmp / "mem.duckdb"
        ptoken, otoken = new_token("producer"), new_token("operator")
        (tmp / "tokens.txt").write_text(
            token_line(ptoken[0], "producer", ptoken[2]) + "\n" + token_line(otoken[0], "operator", otoken[2]) + "\n"
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtrail", "serve", "--db", str(db), "--tokens", str(tmp / "tokens.txt")]
            + ([] if args.memory_limit_mb is None else ["--memory-limit-mb", str(args.memory_limit_mb)])
            + ([] if args.judge_horizon_s is None else ["--judge-horizon-s", str(args.judge_horizon_s)]),
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert proc.stdout is not None
        m = _BANNER.match(proc.stdout.readline())
        assert m, "no banner"
        url = m.group(1)
        ctx = mp.get_context("spawn")
        out, qout, stop, go = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
        prods = [
            ctx.Process(target=_produce, args=(i, url, ptoken[1], args.events_per_s, args.duration_s, out, go))
            for i in range(args.producers)
        ]
        queries = [ctx.Process(target=_query, args=(url, otoken[1], stop, qout, go)) for _ in range(args.queries)]
        for p in prods + queries:
            p.start()
        time.sleep(3.0)  # every process up before the clock starts
        samples: list[tuple[float, float]] = [(0.0, _rss_mb(proc.pid))]
        go.set()
        t0 = time.monotonic()
        while any(p.is_alive() for p in prods):
            time.sleep(args.sample_s)
            samples.append((time.monotonic() - t0, _rss_mb(proc.pid)))
        results = [out.get() for _ in prods]
        stop.set()
        qres = [qout.get() for _ in queries]
        for p in prods + queries:
            p.join()
        samples.append((time.monotonic() - t0, _rss_mb(proc.pid)))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(300) == 0
        con = connect_readonly(db)
        stored = fetch_row(con, "SELECT count(*) FROM events")[0]
        con.close()
    acked = sum(r[1] for r in results)
    lat = [x for r in results for x in r[0]]
    qlat = [x for r in qres for x in r[0]]
    t = np.array([s[0] for s in samples])
    rss = np.array([s[1] for s in samples])
    half = t >= t[-1] / 2
    slope = float(np.polyfit(t[half], rss[half], 1)[0] * 60) if half.sum() >= 2 else float("nan")
    mid = rss[np.searchsorted(t, t[-1] / 2)]
    print(
        f"serve RSS over {t[-1]:.0f} s ({args.producers} producers at {args.events_per_s:g} events/s each, "
        f"{args.queries} query clients): start {rss[0]:.0f} MB, middle {mid:.0f} MB, end {rss[-1]:.0f} MB, "
        f"peak {rss.max():.0f} MB; second half {slope:+.1f} MB/min"
    )
    print(f"ack latency p50 {_pct(lat, 50) * 1e3:.1f} ms, p99 {_pct(lat, 99) * 1e3:.1f} ms over {len(lat)} batches")
    print(
        f"query latency p50 {_pct(qlat, 50) * 1e3:.0f} ms, p99 {_pct(qlat, 99) * 1e3:.0f} ms over {len(qlat)} "
        f"queries ({sum(r[1] for r in qres)} answered 429)"
    )
    if args.series:
        print("RSS samples (s: MB): " + ", ".join(f"{a:.0f}: {b:.0f}" for a, b in samples))
    dropped = sum(r[2] for r in results)
    print(f"events acknowledged {acked:,}, stored {stored:,}, lost {acked - stored:,}; recorder drops {dropped:,}")


if __name__ == "__main__":
    main()
