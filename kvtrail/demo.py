"""``kvtrail demo``: the main job on the embedded default (a DuckDB file, local processes).

Until the reference serving stack drives it, the demo plays PD-shaped traffic through two real
recorders — a prefill node and a decode node, each with its own paged allocator (lowest page id
reused first, as SGLang does in PD mode) — into one audit store, in the incident's configuration:
the prefill pool holds fewer tokens than the advertised context. It then verifies the chain and
prints what was stored.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from dataclasses import dataclass

import click
import numpy as np
from tqdm import tqdm

from kvtrail import __version__
from kvtrail.audit.events import Producer, RequestRef
from kvtrail.audit.recorder import Recorder
from kvtrail.audit.synth import AllocatorSim
from kvtrail.audit.verify import verify_store
from kvtrail.timeutil import format_utc


@dataclass(frozen=True)
class DemoConfig:
    """The incident's shape, scaled down: context advertised above the prefill pool."""

    page_size: int = 16
    prefill_pool_tokens: int = 681_280
    decode_pool_tokens: int = 2_039_808
    context_tokens: int = 1_048_576
    tenants: tuple[str, ...] = ("acme", "globex", "initech", "umbrella", "hooli")
    median_prompt_tokens: int = 24_000
    max_new_tokens: int = 256


def _producer(node: str, role: str) -> Producer:
    return Producer("demo", node, role, "kvtrail-demo", __version__, f"{node}-{uuid.uuid4().hex[:8]}")


def run_demo(db: str, *, seed: int = 0, page_events: int = 40_000_000, cfg: DemoConfig = DemoConfig()) -> None:
    rng = np.random.default_rng(seed)
    ps = cfg.page_size
    p_pages, d_pages = cfg.prefill_pool_tokens // ps, cfg.decode_pool_tokens // ps
    prefill_alloc = AllocatorSim(p_pages, ps, seed)
    decode_alloc = AllocatorSim(d_pages, ps, seed + 1)
    prefill = Recorder(db, _producer("prefill-0", "prefill"))
    decode = Recorder(db, _producer("decode-0", "decode"))
    for rec, pages in ((prefill, p_pages), (decode, d_pages)):
        rec.node_config(pool_tokens=pages * ps, pool_pages=pages, page_size=ps, context_tokens=cfg.context_tokens,
                        max_running_requests=64, checksum_enabled=False, deferred_release=rec is decode,
                        page_tags=False, config_source="demo")
    click.echo(f"kvtrail demo: recording PD traffic into {db} (prefill pool {p_pages * ps:,} tokens < "
               f"advertised context {cfg.context_tokens:,})")
    started = time.perf_counter()
    running: list[tuple[RequestRef, np.ndarray, int, int]] = []  # decode-side: req, pages, seq_len, budget
    recorded = n_requests = n_rejected = 0
    bar = tqdm(total=page_events, unit="page-ev", unit_scale=True, file=sys.stderr, disable=None, desc="record")
    while recorded < page_events:
        n_requests += 1
        tenant = cfg.tenants[int(rng.integers(len(cfg.tenants)))]
        req = RequestRef(f"req-{n_requests:07d}", int(rng.integers(1, 2**63)), tenant, f"key:{tenant[:3]}")
        prompt = int(min(cfg.context_tokens - 1, rng.lognormal(np.log(cfg.median_prompt_tokens), 1.4)))
        need = -(-prompt // ps)
        prefill.request_received(req, prompt, cfg.max_new_tokens)
        decode.request_received(req, prompt, cfg.max_new_tokens)
        while len(running) > 48 or (running and decode_alloc.available < need + 64):
            recorded += _finish(decode, decode_alloc, running.pop(0), rng)
        src = prefill_alloc.alloc(need)
        if src is None:  # a prompt the prefill pool cannot hold: the patched engine rejects it
            n_rejected += 1
            prefill.request_aborted(req, "prefill_queue", "input longer than the KV pool", 400, prompt)
            decode.response_sent(req, 400, prompt, 0, latency_ns=1_000_000, finish_reason="abort")
            continue
        dst = decode_alloc.alloc(need)
        decode.transfer_reserved(req, dst, prompt)
        decode.pages_allocated(req, dst, "decode_reservation")
        prefill.pages_allocated(req, src, "prefill_extend")
        prefill.kv_written(req, src, 0, prompt, "forward")
        prefill.transfer_sent(req, src, dst, prompt, True)
        prefill.pages_freed(req, src, "finish")
        prefill_alloc.free(src)
        decode.transfer_received(req, dst, prompt, "ok")
        decode.kv_written(req, dst, 0, prompt, "transfer_in")
        decode.kv_read(req, dst)
        running.append((req, dst, prompt, int(rng.integers(1, cfg.max_new_tokens))))
        recorded += 6 * need
        bar.update(6 * need)
    while running:
        recorded += _finish(decode, decode_alloc, running.pop(0), rng)
    bar.close()
    ok_p, ok_d = prefill.flush(120), decode.flush(120)
    stats = {"prefill-0": prefill.stats(), "decode-0": decode.stats()}
    prefill.close()
    decode.close()
    elapsed = time.perf_counter() - started
    _summarise(db, stats, n_requests, n_rejected, elapsed, ok_p and ok_d)


def _finish(decode: Recorder, alloc: AllocatorSim, item, rng) -> int:
    """Generate the request's output on decode (growing its page table), respond, free."""
    req, pages, seq_len, budget = item
    grown = []
    for t in range(budget):
        if (seq_len + t) % alloc.page_size == 0:
            new = alloc.alloc(1)
            if new is None:
                break
            decode.pages_allocated(req, new, "decode_growth")
            decode.kv_read(req, new)
            grown.append(new)
    all_pages = np.concatenate([pages, *grown]) if grown else pages
    decode.response_sent(req, 200, seq_len, budget, latency_ns=int(rng.integers(1, 30)) * 10**8,
                         ttft_ns=int(rng.integers(5, 50)) * 10**7, finish_reason="length")
    decode.pages_freed(req, all_pages, "finish")
    alloc.free(all_pages)
    return 2 * len(all_pages) + 2 * len(grown)


def _summarise(db: str, stats: dict, n_requests: int, n_rejected: int, elapsed: float, flushed: bool) -> None:
    from kvtrail.audit.store import connect_readonly

    con = connect_readonly(db)
    rows = con.execute(
        "SELECT node, count(*), sum(num_pages + num_dst_pages), min(wall_ns), max(wall_ns) FROM events_v "
        "GROUP BY node ORDER BY node").fetchall()
    runs = con.execute("SELECT count(*), sum(num_pages) FROM page_runs").fetchone()
    config = con.execute("SELECT node, pool_tokens, context_tokens FROM events_v WHERE kind = 'node_config' "
                         "ORDER BY node").fetchall()
    report = verify_store(con)
    con.close()
    click.echo(f"\n{n_requests:,} requests ({n_rejected:,} rejected: prompt longer than the prefill pool) in "
               f"{elapsed:.1f} s; all recorded events flushed: {'yes' if flushed else 'NO'}")
    click.echo(f"{'node':<12}{'events':>12}{'page-events':>14}{'dropped':>9}  window (UTC)")
    for node, n, pages, t0, t1 in rows:
        click.echo(f"{node:<12}{n:>12,}{int(pages):>14,}{stats[node]['dropped_events_total']:>9}  "
                   f"{format_utc(t0)} .. {format_utc(t1)}")
    click.echo(f"page lists stored as {runs[0]:,} runs for {int(runs[1]):,} page-events "
               f"({int(runs[1]) / max(runs[0], 1):.1f} pages per run); file {os.path.getsize(db) / 2**20:.1f} MiB")
    for node, pool, ctx in config:
        flag = "  <- pool smaller than advertised context (F8 precondition)" if pool < ctx else ""
        click.echo(f"config {node}: KV pool {pool:,} tokens, context {ctx:,} tokens{flag}")
    verdict = "OK" if report.ok else f"FAILED: {report.first_problem}"
    click.echo(f"chain: {report.batches_checked} batches verified: {verdict}")
    click.echo(f"next: kvtrail audit verify --db {db}; kvtrail audit export --db {db} --out export/")
