"""A simulated decode node: reservations, KV landing, generation with page growth, and a page tracker.

Admission reserves the prompt's pages as soon as the router hands a request over, but only while
the pages promised to admitted requests (prompt plus whole generation) fit the pool; otherwise the
request waits, so generation never runs out of pages. After the last chunk lands, decode reads the
request's whole page table, then generates one token per step, allocating, writing and reading a
fresh page every ``page_size`` tokens.

The node keeps the simulator's own page tracker: the last writer of every page (request serial, -1 =
never written since the pool was created). Every page-table read is checked against it, which is how
the ground truth knows whose data a stale page held. It is deliberately independent of the
forensics engines.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from kvtrail.audit.events import KIND_CODES
from kvtrail.serving.allocator import PageAllocator
from kvtrail.sim.fleet.log import ProducerLog
from kvtrail.sim.fleet.parts import OK, Request

_ALLOC, _FREED, _WRITTEN, _READ, _RESERVED, _RECEIVED, _ABORTED = (
    KIND_CODES[k]
    for k in (
        "pages_allocated",
        "pages_freed",
        "kv_written",
        "kv_read",
        "transfer_reserved",
        "transfer_received",
        "request_aborted",
    )
)


class DecodeNode:
    """One decode node of a running :class:`~kvtrail.sim.fleet.loop.FleetSim`."""

    def __init__(self, sim, name: str, log: ProducerLog, *, pool_tokens: int):
        self.sim = sim
        self.name = name
        self.log = log
        self.page_size = sim.cfg.page_size
        self.pool_pages = pool_tokens // self.page_size
        self.pool_tokens = self.pool_pages * self.page_size
        self.alloc = PageAllocator(self.pool_pages, "lowest")
        self.writer = np.full(self.pool_pages + 1, -1, np.int32)  # last writer's request serial
        # Pages promised to admitted requests plus pages a plant keeps out of the pool.
        self.committed = 0
        self.waiting: deque[Request] = deque()  # requests waiting for room to reserve
        self.armed: list[str] = []  # bug classes waiting for a suitable request on this node
        self.pending = None  # the plant waiting for its partner's reservation

    def config_fields(self) -> dict:
        """The node's ``node_config`` payload (deferred release is off where late writes are planted)."""
        return {
            "pool_tokens": self.pool_tokens,
            "pool_pages": self.pool_pages,
            "page_size": self.page_size,
            "context_tokens": self.sim.cfg.context_tokens,
            "max_running_requests": 4096,
            "checksum_enabled": True,
            "deferred_release": "late_write" not in self.sim.cfg.bugs,
            "canary_enabled": False,
            "page_tags": False,
            "config_source": "server_info",
        }

    # ---- reservation -------------------------------------------------------------------------------

    def reserve(self, req: Request) -> None:
        if self.waiting or self.committed + req.need_pages > self.pool_pages:
            self.waiting.append(req)  # admitted in arrival order as earlier requests release pages
            return
        self._admit(req)

    def _admit(self, req: Request) -> None:
        sim, t = self.sim, self.sim.now
        n = -(-req.prompt_tokens // self.page_size)
        self.committed += req.need_pages
        plant = self.pending
        if plant is not None and plant.ready and req.fate == OK and req.role is None:
            pages = sim.hooks.partner_pages(plant, req, n)
        else:
            pages = self.alloc.alloc(n)
            assert pages is not None, "admission keeps committed pages within the pool"
        req.dst = pages
        self.log.add(t, _RESERVED, req, pages, num_tokens=req.prompt_tokens)
        self.log.add(t, _ALLOC, req, pages, purpose="decode_reservation")
        sim.push(t + sim.hop_ns, req.prefill.receive, req)

    def release_commitment(self, num_pages: int) -> None:
        self.committed -= num_pages
        while self.waiting and self.committed + self.waiting[0].need_pages <= self.pool_pages:
            self._admit(self.waiting.popleft())

    def drop(self, req: Request) -> None:
        """Prefill rejected the request (patched behaviour): release the reservation; the client gets 400."""
        t = self.sim.now
        self.log.add(t, _ABORTED, req, stage="transfer", abort_reason="prefill_rejected", http_status=400)
        self.log.add(t, _FREED, req, req.dst, free_reason="abort")
        self.alloc.free(req.dst)
        self.release_commitment(req.need_pages)
        req.http_status = 400
        self.sim.respond_later(req)

    # ---- transfer in -------------------------------------------------------------------------------

    def land(self, arg) -> None:
        req, dst, start, end, last = arg
        if req.cancelled:
            return  # decode aborted the request: this write never lands (the planted late write aside)
        sim, t = self.sim, self.sim.now
        self.log.add(t, _WRITTEN, req, dst, token_start=start, token_end=end, source="transfer_in")
        self.writer[dst] = req.serial
        if req.on_first_landing is not None:
            plant, req.on_first_landing = req.on_first_landing, None
            sim.push(t + 2000, sim.hooks.continue_plant, plant)
        if not last:
            return
        landed = req.dst[: -(-req.target_tokens // self.page_size)]
        if req.sent_digest is not None:
            self.log.add(
                t,
                _RECEIVED,
                req,
                landed,
                num_tokens=req.target_tokens,
                status="ok",
                digest=req.sent_digest,
                digest_algo="adler32",
            )
        else:
            self.log.add(t, _RECEIVED, req, landed, num_tokens=req.target_tokens, status="ok")
        sim.push(t + sim.hop_ns, req.prefill.ack, req)
        if not sim.hooks.transfer_received(req):
            sim.push(t + sim.hop_ns, self.start, req)

    # ---- generation --------------------------------------------------------------------------------

    def start(self, req: Request) -> None:
        """Read the request's page table (the whole reservation) and start generating."""
        sim, t = self.sim, self.sim.now
        self.log.add(t, _READ, req, req.dst)
        writers = self.writer[req.dst]
        foreign = writers != req.serial
        if foreign.any():
            sim.book.foreign_read(req, self.name, t, req.dst[foreign], writers[foreign])
        req.t_start_ns = t
        req.t_first_token_ns = t + sim.step_ns
        req.end_token = req.abort_at_token or req.completion_tokens
        req.next_growth = len(req.dst) * self.page_size - req.prompt_tokens + 1  # first token on a new page
        self._next_tick(req)

    def _next_tick(self, req: Request) -> None:
        sim = self.sim
        if req.next_growth <= req.end_token:
            sim.push(req.t_start_ns + req.next_growth * sim.step_ns, self._grow, req)
        else:
            sim.push(req.t_start_ns + req.end_token * sim.step_ns, self._finish, req)

    def _grow(self, req: Request) -> None:
        t, log = self.sim.now, self.log
        page = self.alloc.alloc(1)
        assert page is not None, "admission commits the pages of the whole generation"
        pos = req.prompt_tokens + req.next_growth - 1
        log.add(t, _ALLOC, req, page, purpose="decode_growth")
        log.add(t, _WRITTEN, req, page, token_start=pos, token_end=pos + 1, source="forward")
        log.add(t, _READ, req, page)
        self.writer[page] = req.serial
        req.growth.append(page)
        req.next_growth += self.page_size
        self._next_tick(req)

    def _finish(self, req: Request) -> None:
        t = self.sim.now
        parts = req.growth if req.dst_freed else [req.dst, *req.growth]
        aborted = req.abort_at_token > 0
        if aborted:
            self.log.add(t, _ABORTED, req, stage="decode", abort_reason="client_disconnected", http_status=499)
        if parts:
            pages = parts[0] if len(parts) == 1 else np.concatenate(parts)
            self.log.add(t, _FREED, req, pages, free_reason="abort" if aborted else "finish")
            self.alloc.free(pages)
        self.release_commitment(req.need_pages)
        req.http_status = 499 if aborted else 200
        self.sim.respond_later(req)
