"""KV page transfer over loopback TCP with Mooncake: scattered page lists vs one contiguous write.

A spawned decode process registers a pool of ``2 * layers`` buffers (K0..K{L-1}, V0..V{L-1}) of
``pool_pages + 1`` pages of ``item_len`` bytes (default 16 KiB: 16 tokens x 8 KV heads x 64 dims x
bf16); this process holds a prefill pool of the same shape and writes ``pages`` pages per buffer into
it with ``TransferEngineHandle``. Both page lists are fragmented independently (shuffled runs of
about ``mean_run`` pages, as an allocator after churn hands them out), so merged runs are shorter
than either side's.

Rows, interleaved round by round in the same run so machine noise hits them alike:
  scattered   write_pages(prefill pages -> decode pages): merged runs, <= 1024 entries per batch call
  contiguous  write_pages(1..N -> 1..N): one run, so one entry of N * item_len per buffer, one call
  per-page    the scattered lists without merging: one entry per page per buffer (what merging saves)

Every write is checked afterwards (untimed): CRC32 of the source pages == CRC32 of the destination
pages, per buffer. MB/s is 1e6 bytes per second of ``TransferResult.elapsed_s`` (the batch calls).

    .venv/bin/python bench/bench_transfer.py            # 4096 pages x 16 KiB x 2 buffers, 7 rounds
    .venv/bin/python bench/bench_transfer.py --quick    # 1024 pages, 3 rounds
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time
import zlib
from collections.abc import Callable
from typing import TypedDict

import numpy as np

from kvtrail.serving.transfer import (
    EntryPlan,
    PoolBuffer,
    TransferEngineHandle,
    TransferResult,
    merge_runs,
    plan_entries,
)

ROWS = ("scattered", "contiguous", "per-page")
REPLY_S = 120


class RowSummary(TypedDict):
    """One row's figures over its rounds (an entry of ``rows`` in the JSON)."""

    pages: int
    runs: int
    entries: int
    batches: int
    entries_per_batch: float
    bytes: int
    median_ms: float
    median_mb_per_s: float
    min_mb_per_s: float
    max_mb_per_s: float
    ratio_to_contiguous: float


def fragmented(rng, pool_pages: int, count: int, mean_run: float) -> np.ndarray:
    """``count`` distinct pages of 1..pool_pages in shuffled runs of about ``mean_run`` pages."""
    cuts = np.flatnonzero(rng.random(pool_pages - 1) < 1 / mean_run) + 1
    blocks = np.split(np.arange(1, pool_pages + 1, dtype=np.int64), cuts)
    return np.concatenate([blocks[i] for i in rng.permutation(len(blocks))])[:count]


def make_pool(num_buffers: int, pool_pages: int, item_len: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)  # random bytes also fault every page in before timing
    return [rng.integers(0, 256, (pool_pages + 1, item_len), dtype=np.uint8) for _ in range(num_buffers)]


def crcs(pool: list[np.ndarray], pages) -> list[int]:
    return [zlib.crc32(buf[pages]) for buf in pool]


def peer_main(conn, num_buffers: int, pool_pages: int, item_len: int) -> None:
    """The decode side: registers its pool, then answers CRC requests until told to exit."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # glog's init lines
    handle = TransferEngineHandle()
    pool = make_pool(num_buffers, pool_pages, item_len, seed=99)
    specs = [PoolBuffer.of(b) for b in pool]
    handle.register(specs)
    conn.send((handle.session_id, specs))
    try:
        while conn.poll(REPLY_S):
            cmd, arg = conn.recv()
            if cmd == "crc":
                conn.send(crcs(pool, arg))
            else:
                break
    except EOFError:
        pass
    handle.close()


def per_page_plan(src_bufs, dst_bufs, src_pages, dst_pages) -> EntryPlan:
    """One entry per page per buffer: the scattered lists as if runs were not merged."""
    item = np.array([b.item_len for b in src_bufs], dtype=np.int64)[:, None]
    src = np.array([b.addr for b in src_bufs], dtype=np.int64)[:, None] + src_pages[None, :] * item
    dst = np.array([b.addr for b in dst_bufs], dtype=np.int64)[:, None] + dst_pages[None, :] * item
    lens = np.broadcast_to(item, src.shape)
    return EntryPlan(src.ravel(), dst.ravel(), lens.ravel().copy(), len(src_pages), len(src_pages))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=4096, help="pages written per buffer (default 4096)")
    ap.add_argument("--pool-pages", type=int, default=0, help="pages per pool buffer (default 2 x pages)")
    ap.add_argument("--item-len", type=int, default=16384, help="bytes per page per buffer (default 16384)")
    ap.add_argument("--layers", type=int, default=1, help="layers; each has a K and a V buffer (default 1)")
    ap.add_argument("--mean-run", type=float, default=8.0, help="mean run length of each side's pages (default 8)")
    ap.add_argument("--rounds", type=int, default=7, help="timed writes per row, rows interleaved (default 7)")
    ap.add_argument("--quick", action="store_true", help="1024 pages, 3 rounds: a few seconds")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = ap.parse_args(argv)
    if args.quick:
        args.pages, args.rounds = 1024, 3
    pool_pages = args.pool_pages or 2 * args.pages
    if not 0 < args.pages <= pool_pages or args.layers < 1 or args.rounds < 1 or args.item_len < 1:
        ap.error("need 0 < pages <= pool-pages, layers >= 1, rounds >= 1, item-len >= 1")
    num_buffers = 2 * args.layers

    rng = np.random.default_rng(args.seed)
    src_pages = fragmented(rng, pool_pages, args.pages, args.mean_run)
    dst_pages = fragmented(rng, pool_pages, args.pages, args.mean_run)
    contiguous = np.arange(1, args.pages + 1, dtype=np.int64)
    pool = make_pool(num_buffers, pool_pages, args.item_len, seed=args.seed)
    src_specs = [PoolBuffer.of(b) for b in pool]

    handle = TransferEngineHandle()
    handle.register(src_specs)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=peer_main, args=(child, num_buffers, pool_pages, args.item_len), daemon=True)
    t_spawn = time.perf_counter()
    proc.start()
    child.close()
    try:
        if not conn.poll(REPLY_S):
            raise SystemExit("the decode peer did not start")
        peer, dst_specs = conn.recv()
        spawn_s = time.perf_counter() - t_spawn

        plan_times = []
        for _ in range(6):  # the first call pays numpy's warm-up; report the best of the rest
            t0 = time.perf_counter()
            plan_entries(src_specs, dst_specs, src_pages, dst_pages)
            plan_times.append(time.perf_counter() - t0)
        plan_s = min(plan_times[1:])
        cases: dict[str, Callable[[], TransferResult]] = {
            "scattered": lambda: handle.write_pages(peer, src_specs, dst_specs, src_pages, dst_pages),
            "contiguous": lambda: handle.write_pages(peer, src_specs, dst_specs, contiguous, contiguous),
            "per-page": lambda: handle.write_plan(peer, per_page_plan(src_specs, dst_specs, src_pages, dst_pages)),
        }
        lists = {
            "scattered": (src_pages, dst_pages),
            "contiguous": (contiguous, contiguous),
            "per-page": (src_pages, dst_pages),
        }

        def checked(row: str) -> TransferResult:
            res = cases[row]()
            s, d = lists[row]
            conn.send(("crc", d))
            if not conn.poll(REPLY_S) or conn.recv() != crcs(pool, s):
                raise SystemExit(f"{row}: destination pages differ from the source pages")
            return res

        for row in ROWS:  # warm-up: connections, first-touch costs
            checked(row)
        results: dict[str, list[TransferResult]] = {row: [] for row in ROWS}
        for r in range(args.rounds):
            order = ROWS[r % 3 :] + ROWS[: r % 3]
            for row in order:
                results[row].append(checked(row))
        conn.send(("exit", None))
        proc.join(REPLY_S)
    finally:
        if proc.is_alive():
            proc.kill()  # our own child, by its Process object
            proc.join(REPLY_S)
    handle.close()

    summary: dict[str, RowSummary] = {}
    mbs_by_row = {row: np.array([x.mb_per_s for x in results[row]]) for row in ROWS}
    base = float(np.median(mbs_by_row["contiguous"]))
    for row in ROWS:
        rs = results[row]
        mbs = mbs_by_row[row]
        first = rs[0]
        summary[row] = {
            "pages": first.num_pages,
            "runs": first.num_runs,
            "entries": first.num_entries,
            "batches": first.num_batches,
            "entries_per_batch": first.num_entries / first.num_batches,
            "bytes": first.num_bytes,
            "median_ms": float(np.median([x.elapsed_s for x in rs]) * 1e3),
            "median_mb_per_s": float(np.median(mbs)),
            "min_mb_per_s": float(mbs.min()),
            "max_mb_per_s": float(mbs.max()),
            "ratio_to_contiguous": float(np.median(mbs)) / base,
        }

    mean_src = args.pages / len(merge_runs(src_pages, src_pages))
    mean_dst = args.pages / len(merge_runs(dst_pages, dst_pages))
    print(
        f"kvtrail KV transfer, Mooncake {_mooncake_version()} loopback TCP, {num_buffers} buffers x "
        f"{args.pages} pages x {args.item_len} B = {summary['contiguous']['bytes'] / 2**20:.0f} MiB per write, "
        f"pool {pool_pages} pages; {args.rounds} rounds, rows interleaved"
    )
    print(
        f"machine: {os.cpu_count()} CPUs, Python {platform.python_version()}, numpy {np.__version__}; "
        f"peer spawn to ready {spawn_s:.2f} s; engine init {handle.init_s * 1e3:.2f} ms; "
        f"plan_entries for the scattered lists {plan_s * 1e3:.2f} ms"
    )
    print(
        f"page lists: mean run {mean_src:.1f} pages (prefill), {mean_dst:.1f} (decode), "
        f"{summary['scattered']['pages'] / summary['scattered']['runs']:.1f} merged"
    )
    print()
    head = (
        f"{'row':<11} {'runs':>6} {'entries':>8} {'batches':>8} {'entries/batch':>14} {'median ms':>10} "
        f"{'MB/s median':>12} {'MB/s min-max':>14} {'vs contiguous':>14}"
    )
    print(head)
    print("-" * len(head))
    for row in ROWS:
        x = summary[row]
        print(
            f"{row:<11} {x['runs']:>6} {x['entries']:>8} {x['batches']:>8} {x['entries_per_batch']:>14.0f} "
            f"{x['median_ms']:>10.1f} {x['median_mb_per_s']:>12.0f} "
            f"{x['min_mb_per_s']:>6.0f}-{x['max_mb_per_s']:<7.0f} {x['ratio_to_contiguous']:>14.2f}"
        )
    print("(every write verified: CRC32 of source pages == CRC32 of destination pages, per buffer)")

    if args.json:
        out = {
            "benchmark": "transfer",
            "date": time.strftime("%Y-%m-%d"),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "mooncake": _mooncake_version(),
            "pages": args.pages,
            "pool_pages": pool_pages,
            "item_len": args.item_len,
            "buffers": num_buffers,
            "mean_run": args.mean_run,
            "rounds": args.rounds,
            "spawn_s": spawn_s,
            "engine_init_s": handle.init_s,
            "plan_s": plan_s,
            "rows": summary,
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def _mooncake_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mooncake-transfer-engine-non-cuda")
    except PackageNotFoundError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
