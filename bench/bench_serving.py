"""Serving throughput and TTFT of the reference PD stack with auditing off vs on, same traffic, same run.

One stack (patched mode, the same three processes throughout) alternates rounds with auditing
switched off (every process swaps its recorder for a NullRecorder) and on (every event through the
recorders into DuckDB); the order alternates each round and every round sends the same seeded
traffic, so machine noise hits both sides alike.

    .venv/bin/python bench/bench_serving.py [--rounds 8] [--requests 40] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import TypedDict

import httpx

from kvtrail.serving.config import StackConfig
from kvtrail.serving.stack import Stack
from kvtrail.serving.traffic import TrafficConfig, make_prompt, plan


class RoundFigures(TypedDict):
    """One round of traffic against the stack (an entry of ``rounds`` in the JSON)."""

    tokens_per_s: float
    ttft_ms_median: float
    elapsed_s: float


async def _round(url: str, keys: dict[str, str], traffic: TrafficConfig) -> RoundFigures:
    requests = plan(traffic, sorted(keys))
    sem = asyncio.Semaphore(traffic.concurrency)
    ttfts: list[float] = []
    tokens = 0
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def one(tenant, n, _overlong):
            nonlocal tokens
            async with sem:
                r = await client.post("/v1/completions", json={"prompt": make_prompt(tenant, n),
                                                               "max_tokens": traffic.max_tokens},
                                      headers={"Authorization": f"Bearer {keys[tenant]}"})
                assert r.status_code == 200, r.text
                tokens += r.json()["usage"]["completion_tokens"]
                ttfts.append(float(r.headers["x-kvtrail-ttft-ms"]))
        t0 = time.perf_counter()
        await asyncio.gather(*(one(*req) for req in requests))
        elapsed = time.perf_counter() - t0
    return {"tokens_per_s": tokens / elapsed, "ttft_ms_median": statistics.median(ttfts), "elapsed_s": elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8, help="rounds per side (default 8)")
    ap.add_argument("--requests", type=int, default=40, help="requests per round (default 40)")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 12 requests")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--aa", action="store_true", help="A/A calibration: auditing on for both sides (measures noise)")
    args = ap.parse_args()
    rounds, n = (2, 12) if args.quick else (args.rounds, args.requests)
    # Normal traffic (nothing over-long), the patched engine.
    traffic = TrafficConfig(num_requests=n, overlong_share=0.0, seed=7)
    base = StackConfig(mode="patched", prefill_pool_tokens=16 * 1024, decode_pool_tokens=64 * 1024,
                       context_tokens=16 * 1024, max_new_tokens=48)
    keys = {t: k for k, t in base.api_keys}
    results: dict[str, list[RoundFigures]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp, Stack(base, Path(tmp) / "audit.duckdb") as stack:
        url = stack.url
        assert url is not None, "a started stack has a URL"
        for side in ("off", "on"):  # warm-up round each, not counted
            stack.set_audit(side == "on")
            asyncio.run(_round(url, keys, traffic))
        for r in range(rounds):
            for side in (("off", "on") if r % 2 == 0 else ("on", "off")):
                stack.set_audit(side == "on" or args.aa)
                results[side].append(asyncio.run(_round(url, keys, traffic)))
        stack.set_audit(True)
        assert stack.recorder is not None and stack.store is not None, "a started stack has both"
        stack.recorder.flush(30)
        time.sleep(2.5)  # the workers' writers drain once a second
        events = stack.store.cursor().execute("SELECT count(*), sum(num_pages + num_dst_pages) FROM events").fetchone()
        assert events is not None, "an aggregate query returns one row"
    tps = {s: statistics.median(x["tokens_per_s"] for x in results[s]) for s in results}
    ttft = {s: statistics.median(x["ttft_ms_median"] for x in results[s]) for s in results}
    # Per-round pairs: the ratio of each on-round to the off-round beside it, then the median.
    ratios = sorted(a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(results["on"], results["off"]))
    overhead = 1 - statistics.median(ratios)
    print(f"{rounds} rounds x {n} requests per side, concurrency {traffic.concurrency}, 48 new tokens each")
    print(f"{'audit':<6}{'tokens/s (median)':>20}{'TTFT ms (median)':>18}")
    for s in ("off", "on"):
        print(f"{s:<6}{tps[s]:>20.1f}{ttft[s]:>18.2f}")
    print(f"audited run recorded {events[0]:,} events, {int(events[1] or 0):,} page-events")
    if args.aa:
        print("A/A calibration (auditing on for both sides): the 'overhead' below is noise")
    print(f"paired on/off throughput ratios: min {ratios[0]:.3f}, median {statistics.median(ratios):.3f}, "
          f"max {ratios[-1]:.3f}")
    print(f"throughput overhead of auditing (median of paired rounds): {overhead * 100:+.2f}%  "
          f"-> goal <= 1%: {'PASS' if overhead <= 0.01 else 'MISS'}")
    print(f"TTFT ratio on/off: {ttft['on'] / ttft['off']:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"rounds": results, "tokens_per_s": tps, "ttft_ms": ttft,
                                         "overhead": overhead, "events": events[0]}, indent=2))


if __name__ == "__main__":
    main()
