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
Batches are built column by column with numpy and pyarrow: per-event Python work, never per-page.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrail.audit.batch import BATCH_SCHEMA
from kvtrail.audit.events import FREE_REASONS, KIND_CODES, KIND_NAMES, SCHEMA_VERSION, Producer
from kvtrail.audit.pagelist import encode_runs
from kvtrail.serving.allocator import PageAllocator

# 2026-11-29T00:00:00Z: a fixed start so that the stream does not depend on the clock.
DEFAULT_START_WALL_NS = 1_795_910_400_000_000_000
_NULLABLE_SCHEMA = pa.schema([f.with_nullable(True) for f in BATCH_SCHEMA])
_TYPES = {f.name: f.type for f in BATCH_SCHEMA}

_K_CONFIG = KIND_CODES["node_config"]
_K_ALLOC = KIND_CODES["pages_allocated"]
_K_FREE = KIND_CODES["pages_freed"]
_K_WRITE = KIND_CODES["kv_written"]
# Index into the small dictionaries used to build enum columns.
_PURPOSES = ("prefill_extend", "decode_growth")
_P_PREFILL, _P_GROWTH = 0, 1
_R_FINISH, _R_ABORT, _R_RETRACT = (FREE_REASONS.index(r) for r in ("finish", "abort", "retract"))


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

    def __init__(self, draw):
        self._draw = draw
        self._buf: list = []
        self._i = 0

    def __call__(self):
        i = self._i
        if i == len(self._buf):
            self._buf = self._draw(4096).tolist()
            i = 0
        self._i = i + 1
        return self._buf[i]


class _Request:
    __slots__ = ("rid", "tenant", "transfer_id", "prompt", "prefilled", "pages", "num_pages", "budget")

    def __init__(self, rid, tenant, transfer_id, prompt, budget):
        self.rid = rid
        self.tenant = tenant
        self.transfer_id = transfer_id
        self.prompt = prompt
        self.prefilled = 0
        self.pages: list[np.ndarray] = []
        self.num_pages = 0
        self.budget = budget  # decode growth pages left


class _BatchBuilder:
    """Collects events as a few Python lists and turns them into one Arrow batch."""

    def __init__(self, producer: Producer, config: dict | None):
        self.producer = producer
        self.config = config  # node_config values when this batch starts with the config event
        self.kind: list[int] = []
        self.wall: list[int] = []
        self.rid: list = []
        self.tenant: list = []
        self.xfer: list = []
        self.pages: list = []
        self.purpose: list[int] = []
        self.reason: list[int] = []
        self.tstart: list[int] = []
        self.tend: list[int] = []

    def __len__(self) -> int:
        return len(self.kind)

    def table(self, first_seq: int, mono_base: int) -> pa.Table:
        n = len(self.kind)
        kind = np.array(self.kind, dtype=np.int8)
        wall = np.array(self.wall, dtype=np.int64)
        cols: dict[str, pa.Array] = {
            "schema_version": pa.repeat(pa.scalar(SCHEMA_VERSION, pa.int32()), n),
            "seq": pa.array(np.arange(first_seq, first_seq + n, dtype=np.uint64)),
            "wall_ns": pa.array(wall),
            "mono_ns": pa.array(wall - DEFAULT_START_WALL_NS + mono_base),
            "kind": pa.DictionaryArray.from_arrays(pa.array(kind), pa.array(KIND_NAMES)).cast(pa.string()),
            "request_id": pa.array(self.rid, pa.string()),
            "tenant_id": pa.array(self.tenant, pa.string()),
            "transfer_id": pa.array(self.xfer, pa.uint64()),
        }
        for name in ("cluster", "node", "role", "engine", "engine_version", "instance"):
            cols[name] = pa.repeat(pa.scalar(getattr(self.producer, name), pa.string()), n)
        lengths = np.fromiter((0 if p is None else p.size for p in self.pages), dtype=np.int64, count=n)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if offsets[-1] > 2**31 - 1:
            raise ValueError("events_per_batch too large: a batch holds more than 2**31 - 1 pages")
        present = [p for p in self.pages if p is not None]
        flat = np.concatenate(present) if present else np.empty(0, np.int32)
        no_list = np.fromiter((p is None for p in self.pages), dtype=bool, count=n)
        cols["pages"] = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(flat, pa.int32()),
                                                 mask=pa.array(no_list) if no_list.any() else None)
        cols["purpose"] = _enum(self.purpose, _PURPOSES)
        cols["free_reason"] = _enum(self.reason, FREE_REASONS)
        is_write = kind == _K_WRITE
        cols["source"] = _enum(np.where(is_write, 0, -1), ("forward",))
        for name, values in (("token_start", self.tstart), ("token_end", self.tend)):
            v = np.array(values, dtype=np.int64)
            cols[name] = pa.array(v, mask=v < 0)
        if self.config is not None:
            # The node_config event is row 0 of the first batch.
            first = np.zeros(n, dtype=bool)
            first[0] = True
            for name, value in self.config.items():
                type_ = _TYPES[name]
                if pa.types.is_string(type_):
                    cols[name] = pa.array([value] + [None] * (n - 1), type_)
                else:
                    cols[name] = pa.array(np.full(n, value), type_, mask=~first)
        arrays = [cols[f.name] if f.name in cols else pa.nulls(n, f.type) for f in BATCH_SCHEMA]
        return pa.Table.from_arrays(arrays, schema=_NULLABLE_SCHEMA)


def _enum(codes, choices: tuple[str, ...]) -> pa.Array:
    """A string column from small integer codes (-1 = null)."""
    idx = np.asarray(codes, dtype=np.int8)
    return pa.DictionaryArray.from_arrays(pa.array(idx, mask=idx < 0), pa.array(choices)).cast(pa.string())


def synth_batches(*, producer: Producer, num_pages: int, page_size: int, seed: int, target_page_events: int,
                  events_per_batch: int, reuse: str = "lowest", tenants: int = 8, chunk_tokens: int = 8192,
                  prompt_median_tokens: int = 3000, prompt_sigma: float = 1.0, min_prompt_tokens: int = 256,
                  max_prompt_tokens: int | None = None, decode_fraction: float = 0.6,
                  mean_decode_tokens: float = 400.0, decode_tokens_per_step: float = 1.0, abort_prob: float = 0.03,
                  warmup_page_events: int | None = None, mean_gap_ns: int = 20_000,
                  start_wall_ns: int = DEFAULT_START_WALL_NS) -> Iterator[pa.Table]:
    """Yield batches (exactly :data:`BATCH_SCHEMA` columns) of one producer's allocator events.

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
    if events_per_batch < 1:
        raise ValueError("events_per_batch: must be >= 1")
    if target_page_events < 0:
        raise ValueError("target_page_events: must be >= 0")
    if tenants < 1:
        raise ValueError("tenants: must be >= 1")
    if chunk_tokens < page_size or chunk_tokens % page_size:
        raise ValueError("chunk_tokens: must be a positive multiple of page_size")
    sim = AllocatorSim(num_pages, page_size, seed, reuse)
    rng = sim.rng
    pool_tokens = num_pages * page_size
    if max_prompt_tokens is None:
        max_prompt_tokens = max(page_size, min(65_536, pool_tokens // 8))
    max_prompt_tokens = min(max_prompt_tokens, pool_tokens)  # a request alone always fits the pool
    min_prompt_tokens = min(min_prompt_tokens, max_prompt_tokens)
    if warmup_page_events is None:
        warmup_page_events = 4 * num_pages

    u = Draws(rng.random)
    gap = Draws(lambda k: rng.exponential(mean_gap_ns, k).astype(np.int64) + 1)
    prompt_draw = Draws(lambda k: np.clip(rng.lognormal(math.log(prompt_median_tokens), prompt_sigma, k),
                                           min_prompt_tokens, max_prompt_tokens).astype(np.int64))
    mean_decode_pages = max(mean_decode_tokens / page_size, 1.0)
    budget_draw = Draws(lambda k: np.where(rng.random(k) < decode_fraction,
                                            rng.geometric(1.0 / mean_decode_pages, k), 0))
    # Each running request decodes decode_tokens_per_step tokens a step, so it crosses into a new page
    # with probability decode_tokens_per_step / page_size: the number of requests touched per step is
    # Poisson with that rate times the number running.
    pick_rate = decode_tokens_per_step / page_size
    xfer_draw = Draws(lambda k: rng.integers(0, 2**63 - 1, k, dtype=np.int64))
    # Tenants with skewed traffic: tenant k gets weight 1/(k+1).
    weights = np.cumsum(1.0 / np.arange(1, tenants + 1))
    cum = (weights / weights[-1]).tolist()
    tenant_names = [f"tenant-{k:02d}" for k in range(tenants)]
    rid_prefix = f"{producer.instance}-r"

    config = {"pool_tokens": pool_tokens, "pool_pages": num_pages, "page_size": page_size,
              "context_tokens": max_prompt_tokens, "max_running_requests": 4096, "config_source": "synth"}
    builder = _BatchBuilder(producer, config)
    state = {"seq": 0, "wall": start_wall_ns, "pages": 0, "recording": False}
    mono_base = 1_000_000_000_000
    running: list[_Request] = []  # decoding (or finished-prefill) requests, random access
    next_rid = [0]

    def emit(kind, req, pages, purpose=-1, reason=-1, tstart=-1, tend=-1):
        nonlocal builder
        state["wall"] += gap()
        if not state["recording"]:
            return
        b = builder
        b.kind.append(kind)
        b.wall.append(state["wall"])
        if req is None:
            b.rid.append(None)
            b.tenant.append(None)
            b.xfer.append(None)
        else:
            b.rid.append(req.rid)
            b.tenant.append(req.tenant)
            b.xfer.append(req.transfer_id)
        b.pages.append(pages)
        b.purpose.append(purpose)
        b.reason.append(reason)
        b.tstart.append(tstart)
        b.tend.append(tend)
        if pages is not None:
            state["pages"] += pages.size

    def release(req: _Request, reason: int) -> None:
        pages = np.concatenate(req.pages) if len(req.pages) != 1 else req.pages[0]
        sim.free(pages)
        emit(_K_FREE, req, pages, reason=reason)
        req.pages = []
        req.num_pages = 0

    def take_running(i: int) -> _Request:
        req = running[i]
        last = running.pop()
        if i < len(running):
            running[i] = last
        return req

    def alloc_or_retract(n: int, keep: _Request | None) -> np.ndarray | None:
        out = sim.alloc(n)
        while out is None:
            victims = len(running) - (1 if keep is not None and keep in running else 0)
            if victims <= 0:
                return None
            i = int(u() * len(running))
            if running[i] is keep:
                continue
            release(take_running(i), _R_RETRACT)
            out = sim.alloc(n)
        return out

    def new_request() -> _Request:
        n = next_rid[0]
        next_rid[0] = n + 1
        tenant = tenant_names[bisect_right(cum, u())] if tenants > 1 else tenant_names[0]
        return _Request(f"{rid_prefix}{n:09d}", tenant, xfer_draw(), prompt_draw(), budget_draw())

    prefilling: _Request | None = None
    allocated_in_warmup = 0

    def step() -> int:
        """One scheduler step; returns the pages allocated."""
        nonlocal prefilling
        got = 0
        if prefilling is None:
            prefilling = new_request()
        req = prefilling
        n_tok = min(chunk_tokens, req.prompt - req.prefilled)
        need = -(-(req.prefilled + n_tok) // page_size) - req.num_pages
        pages = alloc_or_retract(need, None) if need else np.empty(0, np.int32)
        if pages is None:  # nothing left to retract: the request cannot fit, abort it
            if req.num_pages:
                release(req, _R_ABORT)
            prefilling = None
        else:
            if need:
                req.pages.append(pages)
                req.num_pages += need
                got += need
                emit(_K_ALLOC, req, pages, purpose=_P_PREFILL)
                emit(_K_WRITE, req, pages, tstart=req.prefilled, tend=req.prefilled + n_tok)
            req.prefilled += n_tok
            if req.prefilled >= req.prompt:
                running.append(req)
                prefilling = None
        for _ in range(int(rng.poisson(pick_rate * len(running))) if running else 0):
            if not running:
                break
            i = int(u() * len(running))
            req = running[i]
            if req.budget > 0:
                page = alloc_or_retract(1, req)  # may retract others, which moves req in the list
                if page is None:
                    release(take_running(running.index(req)), _R_RETRACT)
                    continue
                req.budget -= 1
                req.pages.append(page)
                start = req.num_pages * page_size
                req.num_pages += 1
                got += 1
                emit(_K_ALLOC, req, page, purpose=_P_GROWTH)
                emit(_K_WRITE, req, page, tstart=start, tend=start + page_size)
            else:
                take_running(i)
                release(req, _R_ABORT if u() < abort_prob else _R_FINISH)
        return got

    while allocated_in_warmup < warmup_page_events:
        allocated_in_warmup += step()

    state["recording"] = True
    emit(_K_CONFIG, None, None)
    seq = 0
    while True:
        step()
        done = state["pages"] >= target_page_events
        if len(builder) >= events_per_batch or done:
            while len(builder) >= events_per_batch or (done and len(builder)):
                table = builder.table(seq, mono_base)
                if len(builder) > events_per_batch:
                    head, rest = table.slice(0, events_per_batch), _split_tail(builder, events_per_batch)
                    table = head
                    builder = rest
                else:
                    builder = _BatchBuilder(producer, None)
                seq += table.num_rows
                yield table
            if done:
                return


def _split_tail(b: _BatchBuilder, k: int) -> _BatchBuilder:
    """A builder holding the events of ``b`` from index ``k`` on (carried into the next batch)."""
    rest = _BatchBuilder(b.producer, None)
    for name in ("kind", "wall", "rid", "tenant", "xfer", "pages", "purpose", "reason", "tstart", "tend"):
        setattr(rest, name, getattr(b, name)[k:])
    return rest


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


def runs_per_event(tables: pa.Table | Iterable[pa.Table], column: str = "pages", *,
                   kind: str | None = None, purpose: str | None = None) -> RunStats:
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
        lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False).astype(np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = pc.list_flatten(col).to_numpy(zero_copy_only=False)
        lists += int(np.count_nonzero(lengths))
        pages += int(flat.size)
        runs += len(encode_runs(flat, offsets)[0])
    return RunStats(lists, pages, runs)
