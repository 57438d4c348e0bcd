"""An allocator-shaped synthetic event stream, for tests and benchmarks.

A small, deterministic workload driving one node's paged KV allocator (the serving stack's own
:class:`~kvtrail.serving.allocator.PageAllocator`), shaped like SGLang's in PD serving: free page ids
``1..num_pages`` (0 is the padding page); freed pages are *staged*, and only when an allocation runs
short are they merged back into the free list and sorted, so the lowest page ids are reused first
(``reuse="lowest"``). ``reuse="lifo"`` reuses the most recently freed pages first instead.

Requests arrive with long-context prompts (lognormal lengths, a few hundred to tens of thousands of
tokens), are prefilled in chunks (``pages_allocated`` purpose ``prefill_extend`` plus ``kv_written``
for each chunk), some then grow by decode steps (one page at a time, ``decode_growth``), and are
freed (``pages_freed``: ``finish``, ``abort``, or ``retract`` when the pool runs out). After some
churn the page lists a request gets are fragmented: contiguous runs mixed with scattered pages,
which is what the store's run encoding has to cope with.

Everything is seeded (one :class:`numpy.random.Generator`); the same arguments give the same batches.
:class:`SynthStream` runs the workload, one method per phase of a scheduler step;
:mod:`kvtrail.sim.synth_builder` builds the batches column by column (per-event Python work, never per-page).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrail.audit.arrowutil import flat_list
from kvtrail.audit.events import Producer
from kvtrail.audit.pagelist import encode_runs
from kvtrail.serving.allocator import PageAllocator
from kvtrail.sim.synth_builder import (
    K_ALLOC,
    K_CONFIG,
    K_FREE,
    K_WRITE,
    P_GROWTH,
    P_PREFILL,
    R_ABORT,
    R_FINISH,
    R_RETRACT,
    BatchBuilder,
)

# 2026-11-29T00:00:00Z: a fixed start so that the stream does not depend on the clock.
DEFAULT_START_WALL_NS = 1_795_910_400_000_000_000
# The producer's monotonic clock reads this at DEFAULT_START_WALL_NS, whatever start_wall_ns is (kept so
# that existing streams stay byte-identical).
_MONO_AT_DEFAULT_START_NS = 1_000_000_000_000


class AllocatorSim(PageAllocator):
    """The serving stack's :class:`~kvtrail.serving.allocator.PageAllocator` plus what a simulated
    workload needs: the page size and the seeded generator (``rng``) every draw comes from.

    Reuse orders, ownership checks and ``merges`` are the allocator's own (one implementation).
    """

    def __init__(self, num_pages: int, page_size: int, seed: int = 0, reuse: str = "lowest"):
        if page_size < 1:
            raise ValueError("page_size: must be >= 1")
        super().__init__(num_pages, reuse)
        self.page_size = int(page_size)
        self.rng = np.random.default_rng(seed)


class Draws:
    """Values of one distribution drawn in blocks from the shared generator (per-call cost ~50 ns)."""

    __slots__ = ("_draw", "_buf", "_i")

    def __init__(self, draw: Callable[[int], np.ndarray]):
        self._draw = draw
        self._buf: list = []
        self._i = 0

    def __call__(self) -> Any:
        i = self._i
        if i == len(self._buf):
            self._buf = self._draw(4096).tolist()
            i = 0
        self._i = i + 1
        return self._buf[i]


class _Request:
    __slots__ = ("ident", "prompt", "prefilled", "pages", "num_pages", "budget")

    def __init__(self, rid: str, tenant: str, transfer_id: int, prompt: int, budget: int):
        self.ident = (rid, tenant, transfer_id)  # what every event of the request carries
        self.prompt = prompt
        self.prefilled = 0
        self.pages: list[np.ndarray] = []
        self.num_pages = 0
        self.budget = budget  # decode growth pages left


@dataclass(frozen=True, kw_only=True)
class SynthConfig:
    """Every knob of one synthetic stream (see :func:`synth_batches` for what the workload does)."""

    num_pages: int
    page_size: int
    seed: int
    target_page_events: int  # stop after the batch in which the recorded page lists reach this many pages
    events_per_batch: int
    reuse: str = "lowest"
    tenants: int = 8  # tenant k gets weight 1/(k+1)
    chunk_tokens: int = 8192  # prefill tokens per step
    prompt_median_tokens: int = 3000  # lognormal prompt lengths, clipped to the range below
    prompt_sigma: float = 1.0
    min_prompt_tokens: int = 256
    max_prompt_tokens: int | None = None  # None: an eighth of the pool, at most 65,536
    decode_fraction: float = 0.6  # requests that decode at all (the rest: freed after prefill)
    mean_decode_tokens: float = 400.0
    decode_tokens_per_step: float = 1.0
    abort_prob: float = 0.03
    warmup_page_events: int | None = None  # None: four times the pool
    mean_gap_ns: int = 20_000  # mean time between events (exponential)
    start_wall_ns: int = DEFAULT_START_WALL_NS

    def __post_init__(self) -> None:
        if self.events_per_batch < 1:
            raise ValueError("events_per_batch: must be >= 1")
        if self.target_page_events < 0:
            raise ValueError("target_page_events: must be >= 0")
        if self.tenants < 1:
            raise ValueError("tenants: must be >= 1")
        if self.page_size < 1:
            raise ValueError("page_size: must be >= 1")
        if self.chunk_tokens < self.page_size or self.chunk_tokens % self.page_size:
            raise ValueError("chunk_tokens: must be a positive multiple of page_size")

    @property
    def prompt_range_tokens(self) -> tuple[int, int]:
        """(min, max) prompt length; a request alone always fits the pool."""
        pool_tokens = self.num_pages * self.page_size
        top = self.max_prompt_tokens
        if top is None:
            top = max(self.page_size, min(65_536, pool_tokens // 8))
        top = min(top, pool_tokens)
        return min(self.min_prompt_tokens, top), top


class SynthStream:
    """One producer's synthetic allocator stream; iterating it (once) runs the workload and yields its batches.

    A scheduler step is two phases: :meth:`_prefill_chunk` gives the head of the prefill queue one chunk
    of pages, then :meth:`_decode_crossings` lets the running requests that cross into a new page grow
    or finish. Every random draw comes from one generator in a fixed order, so a seed fixes the stream.
    """

    def __init__(self, producer: Producer, cfg: SynthConfig):
        self.cfg = cfg
        self.alloc = AllocatorSim(cfg.num_pages, cfg.page_size, cfg.seed, cfg.reuse)
        rng = self.rng = self.alloc.rng
        min_prompt, max_prompt = cfg.prompt_range_tokens
        self.u = Draws(rng.random)
        self.gap_ns = Draws(lambda k: rng.exponential(cfg.mean_gap_ns, k).astype(np.int64) + 1)
        self.prompt_draw = Draws(
            lambda k: np.clip(
                rng.lognormal(math.log(cfg.prompt_median_tokens), cfg.prompt_sigma, k), min_prompt, max_prompt
            ).astype(np.int64)
        )
        mean_decode_pages = max(cfg.mean_decode_tokens / cfg.page_size, 1.0)
        self.budget_draw = Draws(
            lambda k: np.where(rng.random(k) < cfg.decode_fraction, rng.geometric(1.0 / mean_decode_pages, k), 0)
        )
        # Each running request decodes decode_tokens_per_step tokens a step, so it crosses into a new page
        # with probability decode_tokens_per_step / page_size: the number of requests touched per step is
        # Poisson with that rate times the number running.
        self.pick_rate = cfg.decode_tokens_per_step / cfg.page_size
        self.xfer_draw = Draws(lambda k: rng.integers(0, 2**63 - 1, k, dtype=np.int64))
        weights = np.cumsum(1.0 / np.arange(1, cfg.tenants + 1))
        self.tenant_cum = (weights / weights[-1]).tolist()
        self.tenant_names = [f"tenant-{k:02d}" for k in range(cfg.tenants)]
        self.rid_prefix = f"{producer.instance}-r"
        config = {
            "pool_tokens": cfg.num_pages * cfg.page_size,
            "pool_pages": cfg.num_pages,
            "page_size": cfg.page_size,
            "context_tokens": max_prompt,
            "max_running_requests": 4096,
            "config_source": "synth",
        }
        self.producer = producer
        self.builder = BatchBuilder(producer, config)
        self.wall_ns = cfg.start_wall_ns
        self.recorded_pages = 0  # entries of the page lists emitted (while recording)
        self.recording = False  # False during the warm-up
        self.running: list[_Request] = []  # decoding (or finished-prefill) requests, random access
        self.prefilling: _Request | None = None
        self.num_requests = 0
        self.started = False

    def __iter__(self) -> Iterator[pa.Table]:
        if self.started:
            raise RuntimeError("a SynthStream runs once; make a new one to replay it")
        self.started = True
        return self._batches()

    def _batches(self) -> Iterator[pa.Table]:
        cfg = self.cfg
        warmup = 4 * cfg.num_pages if cfg.warmup_page_events is None else cfg.warmup_page_events
        allocated = 0
        while allocated < warmup:
            allocated += self._step()
        self.recording = True
        self._emit(K_CONFIG, None, None)
        seq, per_batch = 0, cfg.events_per_batch
        mono_offset_ns = _MONO_AT_DEFAULT_START_NS - DEFAULT_START_WALL_NS
        while True:
            self._step()
            done = self.recorded_pages >= cfg.target_page_events
            # One step emits several events: a full batch is cut at exactly per_batch, the rest carried on.
            while len(self.builder) >= per_batch or (done and len(self.builder)):
                batch = self.builder
                self.builder = (
                    batch.split_off(per_batch) if len(batch) > per_batch else BatchBuilder(self.producer, None)
                )
                table = batch.table(seq, mono_offset_ns)
                seq += table.num_rows
                yield table
            if done:
                return

    # ---- one scheduler step ----------------------------------------------------------------------

    def _step(self) -> int:
        """One scheduler step; returns the pages allocated."""
        got = self._prefill_chunk()
        return got + self._decode_crossings()

    def _prefill_chunk(self) -> int:
        """The head of the prefill queue (a new request if none) gets its next chunk, or is aborted."""
        ps = self.cfg.page_size
        if self.prefilling is None:
            self.prefilling = self._new_request()
        req = self.prefilling
        n_tok = min(self.cfg.chunk_tokens, req.prompt - req.prefilled)
        need = -(-(req.prefilled + n_tok) // ps) - req.num_pages
        pages = self._alloc_or_retract(need, None) if need else np.empty(0, np.int32)
        if pages is None:  # nothing left to retract: the request cannot fit, abort it
            if req.num_pages:
                self._release(req, R_ABORT)
            self.prefilling = None
            return 0
        if need:
            req.pages.append(pages)
            req.num_pages += need
            self._emit(K_ALLOC, req, pages, purpose=P_PREFILL)
            self._emit(K_WRITE, req, pages, tstart=req.prefilled, tend=req.prefilled + n_tok)
        req.prefilled += n_tok
        if req.prefilled >= req.prompt:
            self.running.append(req)
            self.prefilling = None
        return need

    def _decode_crossings(self) -> int:
        """Running requests crossing into a new page: those with budget left grow by one, the rest finish."""
        running, ps, got = self.running, self.cfg.page_size, 0
        for _ in range(int(self.rng.poisson(self.pick_rate * len(running))) if running else 0):
            if not running:
                break
            i = int(self.u() * len(running))
            req = running[i]
            if req.budget <= 0:
                self._take_running(i)
                self._release(req, R_ABORT if self.u() < self.cfg.abort_prob else R_FINISH)
                continue
            page = self._alloc_or_retract(1, req)  # may retract others, which moves req in the list
            if page is None:
                self._release(self._take_running(running.index(req)), R_RETRACT)
                continue
            req.budget -= 1
            req.pages.append(page)
            start = req.num_pages * ps
            req.num_pages += 1
            got += 1
            self._emit(K_ALLOC, req, page, purpose=P_GROWTH)
            self._emit(K_WRITE, req, page, tstart=start, tend=start + ps)
        return got

    # ---- helpers -----------------------------------------------------------------------------------

    def _new_request(self) -> _Request:
        n = self.num_requests
        self.num_requests = n + 1
        names = self.tenant_names
        tenant = names[bisect_right(self.tenant_cum, self.u())] if len(names) > 1 else names[0]
        return _Request(f"{self.rid_prefix}{n:09d}", tenant, self.xfer_draw(), self.prompt_draw(), self.budget_draw())

    def _alloc_or_retract(self, n: int, keep: _Request | None) -> np.ndarray | None:
        """``n`` pages, retracting random running requests (never ``keep``) until they fit; None if they never do."""
        running = self.running
        out = self.alloc.alloc(n)
        while out is None:
            victims = len(running) - (1 if keep is not None and keep in running else 0)
            if victims <= 0:
                return None
            i = int(self.u() * len(running))
            if running[i] is keep:
                continue
            self._release(self._take_running(i), R_RETRACT)
            out = self.alloc.alloc(n)
        return out

    def _release(self, req: _Request, reason: int) -> None:
        pages = np.concatenate(req.pages) if len(req.pages) != 1 else req.pages[0]
        self.alloc.free(pages)
        self._emit(K_FREE, req, pages, reason=reason)
        req.pages = []
        req.num_pages = 0

    def _take_running(self, i: int) -> _Request:
        """Remove running request ``i`` in O(1) (the last one takes its place)."""
        running = self.running
        req = running[i]
        last = running.pop()
        if i < len(running):
            running[i] = last
        return req

    def _emit(
        self,
        kind: int,
        req: _Request | None,
        pages: np.ndarray | None,
        purpose: int = -1,
        reason: int = -1,
        tstart: int = -1,
        tend: int = -1,
    ) -> None:
        # The clock advances during the warm-up too, so the recorded stream starts after it.
        self.wall_ns += self.gap_ns()
        if not self.recording:
            return
        self.builder.add(kind, self.wall_ns, None if req is None else req.ident, pages, purpose, reason, tstart, tend)
        if pages is not None:
            self.recorded_pages += pages.size


def synth_batches(*, producer: Producer, **knobs: Any) -> Iterator[pa.Table]:
    """Yield batches (exactly :data:`BATCH_SCHEMA` columns) of one producer's allocator events.

    ``knobs`` are :class:`SynthConfig`'s fields (``num_pages``, ``page_size``, ``seed``,
    ``target_page_events`` and ``events_per_batch`` are required).

    The first event is ``node_config`` (seq 0); then ``pages_allocated``, ``kv_written`` and
    ``pages_freed`` events with seq 1, 2, ... and strictly increasing ``wall_ns``. Generation stops
    after the batch in which the page lists reach ``target_page_events`` pages in total; every batch
    but the last holds exactly ``events_per_batch`` events.

    The workload, per simulated step: the request at the head of the prefill queue gets one chunk
    (``chunk_tokens``, a multiple of ``page_size``) of pages and writes it; then every running request
    decodes ``decode_tokens_per_step`` tokens, so about ``running * decode_tokens_per_step / page_size``
    of them, picked at random, cross into a new page: a request with decode budget left grows by one
    page (``decode_growth``), one without finishes (``abort`` with probability ``abort_prob``).
    ``decode_fraction`` of requests decode at all, ``mean_decode_tokens`` on average (the rest model
    PD prefill: freed after the transfer). When the pool runs out, random running requests are
    retracted until the allocation fits. Decode pages interleave between requests, so freed lists
    leave single-page holes, and sorted reuse hands those holes to the next prompts.

    Before anything is emitted the simulation churns unrecorded for ``warmup_page_events`` allocated
    pages (default: four times the pool) so that the recorded page lists are fragmented from the start;
    requests still running at the end of the warm-up have their frees recorded without their
    allocations.
    """
    return iter(SynthStream(producer, SynthConfig(**knobs)))


@dataclass(frozen=True)
class RunStats:
    """Fragmentation of page lists: how many contiguous runs they break into."""

    lists: int  # non-empty page lists
    pages: int  # pages in them
    runs: int  # contiguous runs in them

    @property
    def mean_runs(self) -> float:
        """Mean runs per page list (1.0 = every list is one contiguous run)."""
        return self.runs / self.lists if self.lists else 0.0

    @property
    def mean_pages(self) -> float:
        return self.pages / self.lists if self.lists else 0.0

    @property
    def pages_per_run(self) -> float:
        return self.pages / self.runs if self.runs else 0.0


def runs_per_event(
    tables: pa.Table | Iterable[pa.Table], column: str = "pages", *, kind: str | None = None, purpose: str | None = None
) -> RunStats:
    """Count runs in the non-empty page lists of ``column`` over one or more batches.

    ``kind`` / ``purpose`` restrict the count to events of that kind / allocation purpose.
    """
    if isinstance(tables, pa.Table):
        tables = (tables,)
    lists = pages = runs = 0
    for t in tables:
        if kind is not None or purpose is not None:
            mask = pa.array(np.ones(t.num_rows, dtype=bool))
            if kind is not None:
                mask = pc.and_(mask, pc.fill_null(pc.equal(t.column("kind"), kind), False))
            if purpose is not None:
                mask = pc.and_(mask, pc.fill_null(pc.equal(t.column("purpose"), purpose), False))
            t = t.filter(mask)
        col = t.column(column)
        flat, offsets = flat_list(col)
        lengths = np.diff(offsets)
        lists += int(np.count_nonzero(lengths))
        pages += int(flat.size)
        runs += len(encode_runs(flat, offsets)[0])
    return RunStats(lists, pages, runs)
