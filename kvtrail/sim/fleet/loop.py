"""The fleet simulator: a discrete-event simulation of a PD deployment that emits its audit record.

One heap of timed actions drives every node. A request arrives at the router (Poisson), decode
reserves pages for its prompt, prefill computes it in chunks (FIFO chunked prefill at the node's
rate, prefix-cache hits skipped) and sends each chunk, decode receives, reads its page table and
generates (one page of growth every ``page_size`` tokens), and the router answers. Page ids come
from each node's own allocator, so concurrent requests interleave and pools fragment as they churn.

The planted bugs (:mod:`kvtrail.sim.fleet.plants`) hook into this lifecycle at three points: the
last chunk sent (late_write), the transfer received (use_after_free, double_alloc) and the next
reservation on the same decode node (the partner request). The placeholder bug happens by itself
when a prompt longer than a vulnerable prefill node's pool lands there; cross-tenant prefix hits
when cache namespaces are off.

Everything is seeded: the same :class:`~kvtrail.sim.fleet.config.FleetConfig` gives the same batches.
"""

from __future__ import annotations

import heapq
import itertools
import math
from array import array
from bisect import bisect_right
from collections import Counter
from typing import Iterator

import numpy as np
import pyarrow as pa

from kvtrail.audit.events import KIND_CODES, Producer
from kvtrail.sim.fleet.config import FleetConfig, config_json
from kvtrail.sim.fleet.decode import DecodeNode
from kvtrail.sim.fleet.log import ProducerLog
from kvtrail.sim.fleet.parts import PLACEHOLDER, PREFILL_REJECT, ROUTER_REJECT, Request
from kvtrail.sim.fleet.plants import PlantHooks, TruthBook
from kvtrail.sim.fleet.prefill import PrefillNode
from kvtrail.sim.synth import Draws
from kvtrail.timeutil import format_utc

VULNERABLE_VERSION, PATCHED_VERSION = "0.5.19", "0.5.23"
_CONFIG, _RECV, _ABORTED, _RESPONSE = (
    KIND_CODES[k] for k in ("node_config", "request_received", "request_aborted", "response_sent")
)
_MASK64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """SplitMix64's finaliser: a bijection on 64-bit integers (distinct inputs give distinct ids)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _cumulative_zipf(n: int) -> list[float]:
    w = np.cumsum(1.0 / np.arange(1, n + 1))
    return (w / w[-1]).tolist()


class FleetSim:
    """One simulation run: :meth:`batches` yields the record, then :meth:`truth` says what was planted."""

    def __init__(self, cfg: FleetConfig):
        self.cfg = cfg
        rng = self.rng = np.random.default_rng(cfg.seed)
        self.ps = cfg.page_size
        self.hop_ns = max(1000, int(cfg.hop_us * 1000))  # plant ordering needs a hop of at least 1 us
        self.step_ns = int(cfg.decode_step_ms * 1e6)
        self.xfer_ns_per_page = cfg.transfer_us_per_page * 1000
        self.base = mix64(cfg.seed ^ mix64(cfg.start_ns))
        self.heap: list = []
        self._tick = itertools.count()
        self.now = cfg.start_ns
        self.open = True  # arrivals continue
        self.num_batches = 0
        self.num_requests = 0
        self.responses: Counter = Counter()
        self.tenant_of = array("i")
        self.logs: list[ProducerLog] = []

        def log(node: str, role: str, version: str) -> ProducerLog:
            lg = ProducerLog(
                Producer(cfg.cluster, node, role, "sglang", version, cfg.instance),
                start_wall_ns=cfg.start_ns,
                mono_base_ns=int(rng.integers(10**12, 10**14)),
            )
            self.logs.append(lg)
            return lg

        self.router = log("router-0", "router", PATCHED_VERSION)
        rates = rng.uniform(cfg.prefill_rate_min_tokens_per_s, cfg.prefill_rate_max_tokens_per_s, cfg.prefill_nodes)
        self.prefills = [
            PrefillNode(
                self,
                f"prefill-{i}",
                log(
                    f"prefill-{i}",
                    "prefill",
                    VULNERABLE_VERSION if i < cfg.vulnerable_prefill_nodes else PATCHED_VERSION,
                ),
                pool_tokens=cfg.prefill_pool_tokens,
                rate_tokens_per_s=float(rates[i]),
                vulnerable=i < cfg.vulnerable_prefill_nodes,
            )
            for i in range(cfg.prefill_nodes)
        ]
        self.decodes = [
            DecodeNode(
                self, f"decode-{i}", log(f"decode-{i}", "decode", PATCHED_VERSION), pool_tokens=cfg.decode_pool_tokens
            )
            for i in range(cfg.decode_nodes)
        ]
        self._init_traffic()
        self.book = TruthBook(self.rid_of, lambda s: self.tenant_names[self.tenant_of[s]])
        self.hooks = PlantHooks(self)

    def _init_traffic(self) -> None:
        cfg, rng = self.cfg, self.rng
        self.u = Draws(rng.random)
        self.gap_ns = Draws(lambda k: rng.exponential(1e9 / cfg.rate_per_s, k).astype(np.int64) + 1)
        self.prompt_draw = Draws(
            lambda k: np.maximum(
                rng.lognormal(math.log(cfg.prompt_median_tokens), cfg.prompt_sigma, k), cfg.min_prompt_tokens
            ).astype(np.int64)
        )
        self.completion_draw = Draws(
            lambda k: np.maximum(
                rng.lognormal(math.log(cfg.completion_median_tokens), cfg.completion_sigma, k), 1
            ).astype(np.int64)
        )
        # Clients ask for a few typical generation budgets, at most the configured one.
        budgets = [m for m in (256, 1024, 4096, 16384, 65536) if m < cfg.max_new_tokens]
        self.max_new_choices = budgets + [cfg.max_new_tokens]
        self.tenant_names = [f"tenant-{k:03d}" for k in range(cfg.tenants)]
        self.tenant_cum = _cumulative_zipf(cfg.tenants)
        # Two API keys per tenant, as hashed ids (from their own hash domain, bit 62).
        self.api_keys = [
            [f"k:{self.hash_key((1 << 62) | (k * 2 + j)) & 0xFFFFFFFF:08x}" for j in range(2)]
            for k in range(cfg.tenants)
        ]
        # Documents prompts may start with: a few every tenant uses, then each tenant's own.
        num_docs = cfg.public_docs + cfg.tenants * cfg.docs_per_tenant
        doc_tokens = rng.lognormal(math.log(cfg.doc_median_tokens), 0.8, num_docs).astype(np.int64)
        self.doc_tokens = np.maximum(doc_tokens // self.ps, 1) * self.ps
        self.num_docs = num_docs
        self.public_cum = _cumulative_zipf(cfg.public_docs)
        self.private_cum = _cumulative_zipf(cfg.docs_per_tenant)

    # ---- plumbing ----------------------------------------------------------------------------------

    def rid_of(self, serial: int) -> str:
        """Request id of a request serial (hex, unique per run)."""
        return f"{mix64(self.base ^ serial):016x}"

    def hash_key(self, key: int) -> int:
        """A 64-bit value derived from ``key`` and the run (transfer ids, digests, block hashes)."""
        return mix64((~self.base & _MASK64) ^ key)

    def push(self, t_ns: int, fn, arg) -> None:
        """Run ``fn(arg)`` at simulated time ``t_ns``."""
        heapq.heappush(self.heap, (t_ns, next(self._tick), fn, arg))

    def page_events(self) -> int:
        """Entries of 'pages' lists emitted so far, all producers."""
        return sum(lg.num_page_events for lg in self.logs)

    def batches(self) -> Iterator[pa.Table]:
        """Run the simulation, yielding each producer's batch as it fills (and the rest at the end)."""
        cfg, t = self.cfg, self.cfg.start_ns
        for node in self.prefills + self.decodes:
            node.log.add(t, _CONFIG, None, **node.config_fields())
        self.push(t + self.gap_ns(), self._arrive, None)
        for cls in ("use_after_free", "late_write", "double_alloc"):
            if cls in cfg.bugs and cfg.plants_per_hour > 0:
                self.push(t + self._arm_gap(), self._arm, cls)
        actions = 0
        heap = self.heap
        while True:
            while heap:
                t, _, fn, arg = heapq.heappop(heap)
                self.now = t
                fn(arg)
                actions += 1
                if actions & 255 == 0:
                    yield from self._flush(full_only=True)
            if not self._drain():
                break
        yield from self._flush(full_only=False)

    def _flush(self, full_only: bool) -> Iterator[pa.Table]:
        cfg = self.cfg
        for lg in self.logs:
            if not full_only or len(lg) >= cfg.events_per_batch or lg.pending_pages >= cfg.max_pages_per_batch:
                table = lg.flush()
                if table is not None:
                    self.num_batches += 1
                    yield table

    def _drain(self) -> bool:
        """Everything else is done: finish plants still waiting for a partner that will never come."""
        progressed = False
        for d in self.decodes:
            plant = d.pending
            if plant is not None and plant.ready and plant.partner is None:
                d.pending = None
                self.push(self.now + 1000, self.hooks.continue_plant, plant)
                progressed = True
        return progressed

    # ---- arrivals and the router -------------------------------------------------------------------

    def _arrive(self, _) -> None:
        cfg = self.cfg
        if (self.page_events() >= cfg.target_page_events) if cfg.target_page_events else self.now >= cfg.end_ns:
            self.open = False
            return
        self.push(self.now + self.gap_ns(), self._arrive, None)
        req = self._new_request()
        t, P = self.now, req.prompt_tokens
        self.router.add(t, _RECV, req, prompt_tokens=P, max_new_tokens=req.max_new_tokens)
        if req.fate == ROUTER_REJECT:
            self.router.add(
                t,
                _ABORTED,
                req,
                stage="router",
                abort_reason="context_length_exceeded",
                http_status=400,
                prompt_tokens=P,
            )
            req.http_status = 400
            self._respond(req)
            return
        self.push(t + self.hop_ns, req.decode.reserve, req)

    def _new_request(self) -> Request:
        cfg, u = self.cfg, self.u
        serial = self.num_requests
        self.num_requests += 1
        tenant = bisect_right(self.tenant_cum, u()) if cfg.tenants > 1 else 0
        self.tenant_of.append(tenant)
        P = self.prompt_draw()
        max_new = self.max_new_choices[int(u() * len(self.max_new_choices))]
        C = min(self.completion_draw(), max_new)
        abort = int(1 + u() * (C - 1)) if u() < cfg.client_abort_prob and C > 1 else 0
        req = Request(
            serial,
            self.rid_of(serial),
            self.tenant_names[tenant],
            tenant,
            self.api_keys[tenant][int(u() * 2)],
            self.hash_key(serial),
            self.now,
            P,
            max_new,
            C,
            abort,
        )
        req.need_pages = -(-(P + C) // self.ps)
        if u() < cfg.prefix_share_prob:
            uid = (
                bisect_right(self.public_cum, u())
                if u() < cfg.public_doc_prob
                else cfg.public_docs + tenant * cfg.docs_per_tenant + bisect_right(self.private_cum, u())
            )
            doc = int(self.doc_tokens[uid])
            if doc < P:
                req.doc_key = ((tenant + 1) if cfg.cache_namespaces else 0) * self.num_docs + uid
                req.doc_tokens = doc
        if P > cfg.context_tokens:
            req.fate = ROUTER_REJECT
            return req
        # Cache-aware routing: a document's requests go to one prefill node (where its pages may be cached).
        nodes = self.prefills
        req.prefill = (
            nodes[self.hash_key(req.doc_key) % len(nodes)] if req.doc_key is not None else nodes[int(u() * len(nodes))]
        )
        if P > req.prefill.pool_tokens:
            vulnerable = req.prefill.vulnerable and "placeholder" in cfg.bugs
            req.fate = PLACEHOLDER if vulnerable else PREFILL_REJECT
            req.doc_key, req.doc_tokens = None, 0
        req.decode = min(self.decodes, key=lambda d: d.committed)
        return req

    def _respond(self, req: Request) -> None:
        t, status = self.now, req.http_status
        fields = {}
        if req.t_first_token_ns:
            fields["ttft_ns"] = req.t_first_token_ns + self.hop_ns - req.t_arrival_ns
        if status == 200:
            completion = req.completion_tokens
            finish = "length" if completion == req.max_new_tokens else "stop"
        else:
            completion = req.end_token if req.t_first_token_ns else 0
            finish = "abort" if status == 499 else "error"
        self.router.add(
            t,
            _RESPONSE,
            req,
            http_status=status,
            prompt_tokens=req.prompt_tokens,
            completion_tokens=completion,
            latency_ns=t - req.t_arrival_ns,
            finish_reason=finish,
            **fields,
        )
        self.responses[status] += 1
        self.hooks.responded(req, status, fields.get("ttft_ns"))

    def respond_later(self, req: Request) -> None:
        """The router answers one hop from now."""
        self.push(self.now + self.hop_ns, self._respond, req)

    # ---- planted bugs and the ground truth ------------------------------------------------------------

    def _arm_gap(self) -> int:
        return int(self.rng.exponential(3600e9 / self.cfg.plants_per_hour)) + 1

    def _arm(self, cls: str) -> None:
        if not self.open:
            return
        self.decodes[int(self.u() * len(self.decodes))].armed.append(cls)
        self.push(self.now + self._arm_gap(), self._arm, cls)

    def truth(self) -> dict:
        """The ground truth of the finished run (JSON-ready): config, window, nodes, plants, affected, summary."""
        cfg, book = self.cfg, self.book
        to_ns = max(lg.last_wall_ns for lg in self.logs)
        nodes = []
        for node in self.prefills + self.decodes:
            p = node.log.producer
            nodes.append(
                {
                    "node": node.name,
                    "role": p.role,
                    "engine_version": p.engine_version,
                    "pool_tokens": node.pool_tokens,
                    "pool_pages": node.pool_pages,
                    "context_tokens": cfg.context_tokens,
                    "prefill_rate_tokens_per_s": getattr(node, "rate_tokens_per_s", None),
                    "expected_codes": ["F8"] if node.pool_tokens < cfg.context_tokens else [],
                }
            )
        plants = [book.plant_json(p) for p in book.live()]
        affected = sorted(book.affected())
        return {
            "format": "kvtrail-fleet-truth/1",
            "seed": cfg.seed,
            "config": config_json(cfg),
            "window": {
                "from": format_utc(cfg.start_ns),
                "to": format_utc(to_ns),
                "from_ns": cfg.start_ns,
                "to_ns": to_ns,
            },
            "producers": [
                {
                    "node": lg.producer.node,
                    "role": lg.producer.role,
                    "instance": lg.producer.instance,
                    "events": lg.num_events,
                    "page_events": lg.num_page_events,
                }
                for lg in self.logs
            ],
            "nodes": nodes,
            "plants": plants,
            "unplanned_foreign_reads": book.unplanned,
            "affected_request_ids": affected,
            "summary": {
                "producers": len(self.logs),
                "events": sum(lg.num_events for lg in self.logs),
                "page_events": self.page_events(),
                "requests": self.num_requests,
                "responses": {str(k): v for k, v in sorted(self.responses.items())},
                "plants": book.counts(),
                "affected": len(affected),
                "batches": self.num_batches,
            },
        }
