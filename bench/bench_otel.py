"""The OpenTelemetry export's cost: service ingest with and without ``kvtrail serve --otlp-endpoint``, side by side.

Prepare (once): each of ``--producers`` processes records an allocator-shaped stream as bench/bench_service.py
does, plus one ``response_sent`` (2xx) per request that frees its pages, so the judge has responses to export
as spans. Then, in ``--rounds`` rounds, alternating (bench/rounds.py), bench_service's ``http`` run (a fresh
``kvtrail serve``, the producers posting their batches with ``HttpSink`` all at once, no query clients):

  plain   ``kvtrail serve``
  otlp    ``kvtrail serve --otlp-endpoint`` to an OTLP/HTTP receiver in this process (127.0.0.1, port 0) that
          decodes every request's protobuf (tests/alerts/otlp.py), as a collector would

Printed: ingest events/s of both (min / median / max), their ratio per round (goal: otlp >= 0.9x plain,
judged on the worst round), the service's CPU per batch, the live judge's lag, and per otlp round the
responses sent, spans received and records the export dropped (from its ``/metrics`` counters, read by the
receiver's count after the service's clean stop).

    .venv/bin/python bench/bench_otel.py              # a few minutes on 2 cores
    .venv/bin/python bench/bench_otel.py --quick      # seconds per round, no verdict
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_service import CapturingSink, _replay, prepared, run_http  # noqa: E402
from rounds import Spread, at_least, check_rounds, per_round_ratios, rotated  # noqa: E402

from kvtrail.audit.batch import read_ipc  # noqa: E402
from kvtrail.audit.events import Producer, RequestRef  # noqa: E402
from kvtrail.audit.recorder import Recorder, RecorderConfig  # noqa: E402
from kvtrail.service.config import ServeConfig  # noqa: E402
from kvtrail.sim.synth import synth_batches  # noqa: E402
from tests.alerts.otlp import otlp_receiver  # noqa: E402

GOAL_RATIO = 0.9


def _prepare(i: int, page_events: int, out: str) -> None:
    prod = Producer("bench", f"decode-{i}", "decode", "kvtrail-reference", "0.1", f"boot-{i}")
    sink = CapturingSink()
    rec = Recorder(sink, prod, RecorderConfig(flush_interval_s=0.05))
    for table in synth_batches(
        producer=prod, num_pages=65_536, page_size=16, seed=i, target_page_events=page_events, events_per_batch=20_000
    ):
        _replay(rec, table)
        cols = table.select(["kind", "request_id", "tenant_id", "free_reason"]).to_pydict()
        done = {
            (rid, tenant)
            for kind, rid, tenant, why in zip(cols["kind"], cols["request_id"], cols["tenant_id"], cols["free_reason"])
            if kind == "pages_freed" and rid
        }
        for rid, tenant in sorted(done):
            rec.response_sent(RequestRef(rid, tenant_id=tenant), 200, 512, 64, 250_000_000, ttft_ns=40_000_000)
        rec.flush()
    rec.close()
    assert rec.stats()["dropped_events_total"] == 0, rec.stats()
    d = Path(out) / f"p{i}"
    d.mkdir()
    for k, body in enumerate(sink.bodies):
        (d / f"{k:06d}.arrow").write_bytes(body)


def _responses(bodies: list[list[bytes]]) -> int:
    return sum(
        int(np.sum(read_ipc(b).column("kind").to_numpy(zero_copy_only=False) == "response_sent"))
        for p in bodies
        for b in p
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--producers", type=int, default=3)
    ap.add_argument("--page-events", type=int, default=1_500_000, help="per producer")
    ap.add_argument("--judge-interval-s", type=float, default=ServeConfig().judge_interval_s)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="small streams, 2 rounds, no verdict")
    args = ap.parse_args()
    if args.quick:
        args.page_events, args.rounds = 150_000, 2
    check_rounds(args.rounds)
    env_path = os.environ.get("PYTHONPATH", "")
    root_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root_dir, env_path) if p)  # the service runs this tree
    with tempfile.TemporaryDirectory() as tmpdir, otlp_receiver() as (url, received):
        tmp = Path(tmpdir)
        root = tmp / "batches"
        root.mkdir()
        t = time.perf_counter()
        bodies = prepared(root, args.producers, args.page_events, _prepare)
        responses = _responses(bodies)
        print(
            f"prepared {sum(map(len, bodies))} recorder batches of {args.producers} producers "
            f"({responses} responses) in {time.perf_counter() - t:.1f} s"
        )
        runs: dict[str, list[dict]] = {"plain": [], "otlp": []}
        for r in range(args.rounds):
            for method in rotated(["plain", "otlp"], r):
                before = len(received.spans)
                extra = ("--otlp-endpoint", url) if method == "otlp" else ()
                res = run_http(bodies, 0, tmp, r if method == "plain" else 100 + r, 0.0, args.judge_interval_s, extra)
                res["spans"] = len(received.spans) - before
                runs[method].append(res)
                print(
                    f"  round {r} {method:5s} {res['events'] / res['wall_s']:>10,.0f} events/s"
                    + (f"  spans received {res['spans']} of {responses}" if method == "otlp" else "")
                )
    report(runs, args, responses)


def report(runs: dict[str, list[dict]], args, responses: int) -> None:
    for name, rs in runs.items():
        ev = Spread.of([r["events"] / r["wall_s"] for r in rs])
        cpu = Spread.of([r["cpu_s"] / r["batches"] * 1e3 for r in rs])
        print(
            f"{name:5s} events/s {ev.text(1, ',.0f')}  service CPU per batch {cpu.text(1, '.1f')} ms "
            "(min / median / max)"
        )
    ratios = per_round_ratios(
        [r["events"] / r["wall_s"] for r in runs["otlp"]], [r["events"] / r["wall_s"] for r in runs["plain"]]
    )
    verdict = at_least(f"otlp >= {GOAL_RATIO}x plain", ratios, GOAL_RATIO)
    print(
        f"otlp / plain events/s per round: {', '.join(f'{x:.2f}' for x in ratios)}  "
        f"-> {verdict.goal}: {verdict.word} (worst {verdict.worst:.2f})"
    )
    for name, rs in runs.items():
        lags = [r["lag_p99_s"] for r in rs if r["lag_p99_s"] is not None]
        if lags:
            print(f"{name:5s} live judge lag p99 (worst round): {max(lags) * 1e3:.0f} ms")
    print(
        f"spans received per otlp round: {', '.join(str(r['spans']) for r in runs['otlp'])} of {responses} responses "
        f"(the rest dropped and counted: queue full or receiver failed); lost events "
        f"{sum(r['lost'] for rs in runs.values() for r in rs)}"
    )
    cpu_s = {name: Spread.of([r["cpu_s"] for r in rs]).median for name, rs in runs.items()}
    wall = Spread.of([r["wall_s"] for r in runs["plain"]]).median
    print(
        f"the stream's responses: {responses / wall:,.0f}/s at plain's median ingest rate; the export's CPU in the "
        f"service: {(cpu_s['otlp'] - cpu_s['plain']) / responses * 1e6:,.0f} us per span (median CPU difference of "
        "the service process over the ingest / responses)"
    )
    load = [r["load"] for rs in runs.values() for r in rs]
    print(f"load average at the start of the rounds {min(load):.1f} to {max(load):.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
