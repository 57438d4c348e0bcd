"""Throughput of the integrity kernels on CPU, side by side with torch and zlib reading the same bytes.

Digest rows: a pool of 3 x 4096 pages (plus the padding page), one bf16 layer, K and V buffers with
8 KiB per page each (16 tokens x 256 values), so one page is 16 KiB across both buffers. A request
of 4096 distinct random page ids (64 MiB) is read by:

  digest            CpuBackend.request_digest: page digests and the request digest, read in place
  adler32 fast      CpuBackend.adler32: SGLang's KV checksum (Adler-32 of every (buffer, page) item)
  zlib.adler32      zlib.adler32 chained over zero-copy memoryview slices of the same 8192 items,
                    in SGLang's order (one thread: zlib is serial); equals the adler32 rows' value
  sum int64 / f32   torch.sum over the same 64 MiB gathered once, before timing, into one contiguous
                    tensor (viewed as int64 / float32): a single streaming pass, the bandwidth
                    reference; the faster of the two is the goal's reference
  gather+sum        torch.sum(buffer.view(pages, -1)[ids]) per buffer: torch's own scattered read,
                    which copies the pages first

Every row runs once per round, rows interleaved, so machine noise hits all alike; GB/s = 1e9 bytes
per second from the median round. Goals: digest >= 50 % of the bandwidth reference, and >= 3x zlib.

Tag rows: PageTags verification (all tags match, the common case) for requests of 1k, 64k and 1M
random pages out of a table of 3x as many, in ns per page, CPU fast path and torch reference.

    .venv/bin/python bench/bench_kernels.py            # 30 rounds
    .venv/bin/python bench/bench_kernels.py --quick    # 5 rounds, a few seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
import zlib
from collections.abc import Callable, Mapping
from typing import TypedDict

import numba
import torch

from kvtrail.kernels.layout import KvLayout
from kvtrail.kernels.registry import get_backend
from kvtrail.kernels.tags import PageTags

REQUEST_PAGES = 4096
POOL_FACTOR = 3
PAGE_SIZE = 16
TAG_SIZES = (1_000, 65_536, 1_000_000)


class DigestRow(TypedDict):
    """One digest row's figures (an entry of ``digest`` in the JSON)."""

    row: str
    median_ms: float
    best_ms: float
    gb_per_s: float
    best_gb_per_s: float


class DigestConfig(TypedDict):
    """The shape the digest rows read."""

    layers: int
    buffers: int
    item_len: int
    page_bytes: int
    request_pages: int
    pool_pages: int
    bytes: int
    rounds: int


class DigestGoals(TypedDict):
    """The digest rows' ratios against the goals (``goals`` in the JSON)."""

    config: DigestConfig
    reference_row: str
    digest_vs_read: float
    digest_vs_zlib: float
    adler_fast_vs_zlib: float
    digest_vs_read_pass: bool
    digest_vs_zlib_pass: bool


class TagRow(TypedDict):
    """One tag-check row's figures (an entry of ``tags`` in the JSON)."""

    pages: int
    row: str
    ns_per_page: float
    us_per_call: float


def _time_rounds(rows: Mapping[str, Callable[..., object]], rounds: int) -> dict[str, list[float]]:
    """Seconds per call of every row, one call per row per round, the row order rotating."""
    names = list(rows)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            rows[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def bench_digest(layers: int, rounds: int, seed: int) -> tuple[list[DigestRow], DigestGoals]:
    g = torch.Generator().manual_seed(seed)
    num_pages = POOL_FACTOR * REQUEST_PAGES
    row_values = 16 * 1024 // 2 // (2 * layers) // PAGE_SIZE  # bf16 values per token row
    shape = ((num_pages + 1) * PAGE_SIZE, row_values)
    k = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(layers)]
    v = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(layers)]
    layout = KvLayout.from_kv(k, v, num_pages)
    ids = torch.randperm(num_pages, generator=g)[:REQUEST_PAGES] + 1
    nbytes = REQUEST_PAGES * layout.page_bytes
    fast = get_backend("cpu")

    gathered = torch.cat([layout.byte_view(b)[ids] for b in range(len(layout.buffers))], 1).contiguous()
    as_i64, as_f32 = gathered.view(torch.int64), gathered.view(torch.float32)
    pages_i64 = [buf.view(num_pages + 1, -1).view(torch.int64) for buf in layout.buffers]
    items = [layout.byte_view(b).numpy().data.cast("B") for b in range(len(layout.buffers))]
    id_list = ids.tolist()

    def zlib_chain() -> int:
        value = 1
        for b, mv in enumerate(items):
            n = layout.item_lens[b]
            for p in id_list:
                value = zlib.adler32(mv[p * n : (p + 1) * n], value)
        return value

    def gather_sum() -> int:
        return sum(int(t[ids].sum()) for t in pages_i64)

    rows: dict[str, Callable[[], object]] = {
        "digest": lambda: fast.request_digest(layout, ids),
        "adler32 fast": lambda: fast.adler32(layout, ids),
        "zlib.adler32": zlib_chain,
        "sum int64": lambda: as_i64.sum(),
        "sum f32": lambda: as_f32.sum(),
        "gather+sum": gather_sum,
    }
    assert fast.adler32(layout, ids) == zlib_chain(), "the Adler-32 rows must compute the same value"
    for fn in rows.values():  # warm-up: numba compile or cache load, page faults, caches
        fn()
    gc.disable()
    try:
        times = _time_rounds(rows, rounds)
    finally:
        gc.enable()
    out: list[DigestRow] = []
    for name, ts in times.items():
        med = statistics.median(ts)
        out.append(
            {
                "row": name,
                "median_ms": med * 1e3,
                "best_ms": min(ts) * 1e3,
                "gb_per_s": nbytes / med / 1e9,
                "best_gb_per_s": nbytes / min(ts) / 1e9,
            }
        )
    by = {r["row"]: r["gb_per_s"] for r in out}
    ref_row = max(("sum int64", "sum f32"), key=lambda row: by[row])
    digest_vs_read = by["digest"] / by[ref_row]
    digest_vs_zlib = by["digest"] / by["zlib.adler32"]
    config: DigestConfig = {
        "layers": layers,
        "buffers": len(layout.buffers),
        "item_len": layout.item_lens[0],
        "page_bytes": layout.page_bytes,
        "request_pages": REQUEST_PAGES,
        "pool_pages": num_pages,
        "bytes": nbytes,
        "rounds": rounds,
    }
    goals: DigestGoals = {
        "config": config,
        "reference_row": ref_row,
        "digest_vs_read": digest_vs_read,
        "digest_vs_zlib": digest_vs_zlib,
        "adler_fast_vs_zlib": by["adler32 fast"] / by["zlib.adler32"],
        "digest_vs_read_pass": digest_vs_read >= 0.5,
        "digest_vs_zlib_pass": digest_vs_zlib >= 3.0,
    }
    return out, goals


def bench_tags(rounds: int, seed: int, sizes: tuple[int, ...] = TAG_SIZES) -> list[TagRow]:
    g = torch.Generator().manual_seed(seed)
    fast, ref = get_backend("cpu"), get_backend("cpu", "reference")
    out: list[TagRow] = []
    for n in sizes:
        tags = PageTags(POOL_FACTOR * n)
        tags.allocate(torch.arange(1, POOL_FACTOR * n + 1))  # every page has been handed out once
        ids = torch.randperm(POOL_FACTOR * n, generator=g)[:n] + 1
        held = tags.allocate(ids)
        # bind this size's inputs now: the timed calls run after the loop variables move on
        rows = {
            "fast": lambda tags=tags, ids=ids, held=held: fast.verify_tags(tags.table, ids, held),
            "reference": lambda tags=tags, ids=ids, held=held: ref.verify_tags(tags.table, ids, held),
        }
        for fn in rows.values():
            assert fn().numel() == 0
        calls = max(1, min(200, 2_000_000 // n))  # batch small requests so one timing spans ~ms
        batched = {k: (lambda fn=fn, calls=calls: [fn() for _ in range(calls)]) for k, fn in rows.items()}
        times = _time_rounds(batched, rounds)
        for name, ts in times.items():
            out.append(
                {
                    "pages": n,
                    "row": name,
                    "ns_per_page": statistics.median(ts) / calls / n * 1e9,
                    "us_per_call": statistics.median(ts) / calls * 1e6,
                }
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30, help="interleaved rounds (default 30)")
    ap.add_argument("--quick", action="store_true", help="5 rounds, a few seconds")
    ap.add_argument("--layers", type=int, default=1, help="layers the 16 KiB page is split across (default 1)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = ap.parse_args(argv)
    if args.layers not in (1, 2, 4, 8, 16, 32, 64, 128):
        ap.error("--layers: must split 16 KiB into whole bf16 token rows (a power of two, 1 to 128)")
    rounds = 5 if args.quick else args.rounds

    digest_rows, goals = bench_digest(args.layers, rounds, args.seed)
    tag_rows = bench_tags(rounds, args.seed)

    c = goals["config"]
    print(
        f"{c['request_pages']} pages x {c['page_bytes'] // 1024} KiB ({c['buffers']} buffers x "
        f"{c['item_len']} B) from a pool of {c['pool_pages']}; {rounds} rounds; "
        f"torch threads {torch.get_num_threads()}, numba threads {numba.get_num_threads()}"
    )
    print(f"{'row':<14} {'median ms':>10} {'GB/s':>8} {'best GB/s':>10}")
    for r in digest_rows:
        print(f"{r['row']:<14} {r['median_ms']:>10.2f} {r['gb_per_s']:>8.2f} {r['best_gb_per_s']:>10.2f}")
    ok = {True: "PASS", False: "MISS"}
    print(
        f"goal digest >= 50% of single-pass read ({goals['reference_row']}): "
        f"{goals['digest_vs_read']:.0%} {ok[goals['digest_vs_read_pass']]}"
    )
    print(f"goal digest >= 3x zlib.adler32: {goals['digest_vs_zlib']:.1f}x {ok[goals['digest_vs_zlib_pass']]}")
    print(f"adler32 fast vs zlib.adler32: {goals['adler_fast_vs_zlib']:.1f}x")
    print()
    print(f"{'tag check':<10} {'pages':>9} {'ns/page':>9} {'us/call':>10}")
    for t in tag_rows:
        print(f"{t['row']:<10} {t['pages']:>9,} {t['ns_per_page']:>9.2f} {t['us_per_call']:>10.1f}")

    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "date": time.strftime("%Y-%m-%d"),
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                    "numba": numba.__version__,
                    "torch_threads": torch.get_num_threads(),
                    "numba_threads": numba.get_num_threads(),
                    "digest": digest_rows,
                    "goals": goals,
                    "tags": tag_rows,
                },
                fh,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
