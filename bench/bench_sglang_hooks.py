"""SGLang plugin: what its hooks cost on SGLang's real allocator calls, on CPU.

Runs in the SGLang environment (``bash scripts/sglang-env.sh`` builds it and prints its python, ``$PY`` below):

    $PY bench/bench_sglang_hooks.py            # 5 rounds x 2000 calls per method
    $PY bench/bench_sglang_hooks.py --quick

kvtrail's plugin is loaded by SGLang's own ``load_plugins()``. Two calls, each timed alone:
  alloc  ``disaggregation.decode.alloc_for_decode_prealloc``: decode's reservation of ``--pages`` pages
         (the real ``PagedTokenToKVPoolAllocator.alloc_extend`` on device cpu); hooked AFTER: records
         pages_allocated + transfer_reserved
  free   ``PagedTokenToKVPoolAllocator.free_page_ids`` of those pages (hooked BEFORE: a free inside a free
         group is remembered with its request), which ends in the hooked ``_release_page_ids`` (BEFORE:
         records pages_freed)
Three methods, alternating within each round (bench/rounds.py):
  sglang     the unhooked originals (the registry's ``__wrapped__``)
  hooks-off  the hooked functions with no recording session (a process where kvtrail is not configured)
  recording  the hooked functions recording into a DuckDB store (the resolver and writer threads run)
It prints ns per call and per page (min / median / max over rounds) and the recording overhead, by the wall
clock and by the CPU time of SGLang's thread (the hooks' own work there, apart from waits for the GIL).

``--decode`` measures instead the hook cost per request per decode step: a batch of ``--batch`` requests
(``--prompt`` tokens each, extended through the hooked ``alloc_for_extend``) runs ``--steps`` decode steps
through the hooked ``mem_cache.allocation.alloc_for_decode`` (AFTER: ``kv_read`` of the page table at a
request's first step, ``pages_allocated`` ``decode_growth`` + ``kv_read`` when a step crosses a page), then
the requests are released and the next round starts; only the decode steps are timed, per request per step.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import types
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from rounds import Spread, rotated  # noqa: E402

METHODS = ("sglang", "hooks-off", "recording")


def _world(num_pages: int):
    from tests.sglang.world import Node, publish, req

    publish()
    node = Node("decode", num_pages=num_pages * 4)
    r = req("bench", list(range(num_pages * 4)), 1)
    return node, r


def _time_calls(node, r, num_pages: int, calls: int, plain: bool) -> tuple[float, float, float, float]:
    """Mean ns per alloc call and per free call over ``calls`` alloc/free pairs: wall clock, then the CPU
    time of SGLang's thread alone (what the hooks add there, without the waits for the GIL and the cores
    that the plugin's and every other process's threads cause on a loaded machine)."""
    from sglang.srt.disaggregation import decode as dmod

    from tests.sglang.world import PAGE_SIZE

    prealloc = dmod.alloc_for_decode_prealloc.__wrapped__ if plain else dmod.alloc_for_decode_prealloc
    alloc = node.allocator
    for name in ("free_page_ids", "_release_page_ids"):  # both hooked: the free-group check and the return
        if plain:
            setattr(alloc, name, types.MethodType(getattr(type(alloc), name).__wrapped__, alloc))
        else:
            alloc.__dict__.pop(name, None)
    fill = num_pages * PAGE_SIZE
    t_alloc = t_free = c_alloc = c_free = 0
    clock, cpu = time.perf_counter_ns, time.thread_time_ns
    for _ in range(calls):
        c0, t0 = cpu(), clock()
        loc = prealloc(
            alloc,
            req=r,
            fill_len=fill,
            delta_len=fill,
            prefix_len=0,
            total_prefix_len=0,
            prefix_indices=None,
            uses_swa_tail=False,
            swa_tail_len=0,
            req_to_token_pool=node.pool,
        )
        t1, c1 = clock(), cpu()
        pages = loc[::PAGE_SIZE] // PAGE_SIZE
        c2, t2 = cpu(), clock()
        alloc.free_page_ids(pages)
        t3, c3 = clock(), cpu()
        t_alloc += t1 - t0
        t_free += t3 - t2
        c_alloc += c1 - c0
        c_free += c3 - c2
    return t_alloc / calls, t_free / calls, c_alloc / calls, c_free / calls


def _time_decode(node, batch: int, prompt: int, steps: int, plain: bool, tag: str) -> tuple[float, float]:
    """ns per request per decode step (wall clock, CPU time of SGLang's thread) over ``steps`` steps of a batch."""
    import torch
    from sglang.srt.mem_cache import allocation
    from sglang.srt.mem_cache.common import release_kv_cache

    from tests.sglang.pd import extend
    from tests.sglang.world import req

    decode = allocation.alloc_for_decode.__wrapped__ if plain else allocation.alloc_for_decode
    reqs = [extend(node, req(f"{tag}-{i}", list(range(i, i + prompt)), i + 1)) for i in range(batch)]
    b = node.batch(reqs)
    b.req_pool_indices = b.req_pool_indices_cpu = torch.tensor([r.kv.req_pool_idx for r in reqs])
    lens = torch.tensor([prompt] * batch)
    clock, cpu = time.perf_counter_ns, time.thread_time_ns
    t = c = 0
    for _ in range(steps):
        b.seq_lens, b.seq_lens_cpu = lens.clone(), lens.clone()
        c0, t0 = cpu(), clock()
        decode(b, 1)
        t1, c1 = clock(), cpu()
        t, c = t + t1 - t0, c + c1 - c0
        lens += 1
        for r in reqs:
            r.kv.kv_allocated_len = r.kv.kv_committed_len = int(lens[0])
    for r in reqs:
        r.output_ids = [1] * steps
        release_kv_cache(r, node.tree, checkpoint=False)
    return t / (steps * batch), c / (steps * batch)


def main_decode(a: argparse.Namespace) -> int:
    tmp = tempfile.mkdtemp(prefix="kvtrail-bench-sglang-")
    os.environ.setdefault("KVTRAIL_DB", str(Path(tmp) / "unused.duckdb"))
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from kvtrail.serving.sglang import plugin as mod
    from tests.sglang.world import Node, publish

    assert mod.PLUGIN is not None and not mod.PLUGIN.missing, "the plugin did not load with every hook"
    publish()
    node = Node("null", num_pages=(a.prompt + a.steps) * a.batch // 4 + 64)
    session = mod.PLUGIN.start(node.scheduler, sink=str(Path(tmp) / "bench.duckdb"))
    mod.PLUGIN.session = None
    per: dict[str, list[tuple[float, float]]] = {m: [] for m in METHODS}
    for rnd in range(a.rounds):
        for m in rotated(METHODS, rnd):
            mod.PLUGIN.session = session if m == "recording" else None
            per[m].append(_time_decode(node, a.batch, a.prompt, a.steps, m == "sglang", f"{m}-{rnd}"))
            mod.PLUGIN.session = None
            if session is not None:
                session.resolver.drain()
    assert session is not None
    lost = session.resolver.failures
    session.close()
    print(
        f"SGLang plugin hooks per request per decode step (alloc_for_decode, device cpu, page size 4): batch "
        f"{a.batch}, prompt {a.prompt}, {a.steps} steps x {a.rounds} rounds; ns min / median / max over rounds"
    )
    for title, i in (("wall clock", 0), ("CPU time of SGLang's thread", 1)):
        print(f"{title}:")
        for m in METHODS:
            print(f"  {m:<11} {Spread.of([x[i] for x in per[m]]).text(fmt='.0f'):>28} ns/request/step")
        extra = [rec[i] - base[i] for rec, base in zip(per["recording"], per["sglang"])]
        worst = max(extra)
        print(f"  recording overhead: {Spread.of(extra).text(fmt='.0f')} ns/request/step (worst round {worst:.0f})")
    print(f"hook failures: {dict(lost)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--pages", type=int, default=16, help="pages per allocation (page size 4)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--decode", action="store_true", help="the hook cost per request per decode step")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64)
    a = ap.parse_args(argv)
    if a.quick:
        a.rounds, a.calls, a.steps = 2, 300, 16
    warnings.filterwarnings("ignore")
    if a.decode:
        return main_decode(a)
    tmp = tempfile.mkdtemp(prefix="kvtrail-bench-sglang-")
    os.environ.setdefault("KVTRAIL_DB", str(Path(tmp) / "unused.duckdb"))
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from kvtrail.serving.sglang import plugin as mod

    assert mod.PLUGIN is not None and not mod.PLUGIN.missing, "the plugin did not load with every hook"
    node, r = _world(a.pages)
    session = mod.PLUGIN.start(node.scheduler, sink=str(Path(tmp) / "bench.duckdb"))
    mod.PLUGIN.session = None
    per: dict[str, list[tuple[float, float, float, float]]] = {m: [] for m in METHODS}
    for rnd in range(a.rounds):
        for m in rotated(METHODS, rnd):
            mod.PLUGIN.session = session if m == "recording" else None
            per[m].append(_time_calls(node, r, a.pages, a.calls, plain=m == "sglang"))
            mod.PLUGIN.session = None
            if session is not None:
                session.resolver.drain()
    assert session is not None
    lost = session.resolver.failures
    session.close()
    print(
        f"SGLang plugin hooks on the real allocator (device cpu), {a.pages} pages of 4 tokens per call, "
        f"{a.calls} calls x {a.rounds} rounds; ns min / median / max over rounds"
    )
    for title, off in (("wall clock", 0), ("CPU time of SGLang's thread", 2)):
        print(f"{title}:")
        print(f"{'method':<11} {'alloc ns/call':>24} {'alloc ns/page':>22} {'free ns/call':>24} {'free ns/page':>22}")
        for m in METHODS:
            al, fr = Spread.of([x[off] for x in per[m]]), Spread.of([x[off + 1] for x in per[m]])
            print(
                f"{m:<11} {al.text(fmt='.0f'):>24} {al.text(1 / a.pages, '.0f'):>22} "
                f"{fr.text(fmt='.0f'):>24} {fr.text(1 / a.pages, '.0f'):>22}"
            )
        for op, i in (("alloc", off), ("free", off + 1)):
            extra = [rec[i] - base[i] for rec, base in zip(per["recording"], per["sglang"])]
            print(
                f"recording overhead on {op} ({title}): {Spread.of(extra).text(fmt='.0f')} ns/call "
                f"({Spread.of([e / a.pages for e in extra]).text(fmt='.0f')} ns/page)"
            )
    print(f"hook failures: {dict(lost)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
