"""Planted bugs and the ground truth: what the fleet simulator did on purpose, and what it must yield.

Each :class:`Plant` records one planted bug: its class, the node where the foreign data was read
(``node``) and where the fault began (``source_node``), the request that received foreign data (the
*recipient*), the request whose event carries the fault (``planted``), the pages, and for every
request involved the finding codes the plant must produce. Victims are what the simulator's own
page tracker says: the last writer of each foreign page when the recipient read it (``None`` for a
page never written since the pool was created).

Bug classes (``docs/mission.md`` has the finding codes):

- ``placeholder`` - the incident: a vulnerable prefill node admits a prompt longer than its pool as
  a 1-token placeholder; decode reads every reserved page. Recipient: F1, F2; when served with a
  2xx (its client may disconnect first) F4, and F9 when its time to first token is under half the
  prompt's true prefill time (see ``F9_MARGIN``).
- ``use_after_free`` - decode frees a request's pages at transfer completion while it still waits to
  read them; a partner request gets and writes some. Recipient: F5, F1.
- ``late_write`` - a request is aborted at decode with its last transfer in flight, decode frees at
  once, a partner gets the pages and the old write lands afterwards. Late writer: F7; partner: F1.
- ``double_alloc`` - the allocator hands a page still held by R1 to a partner R2 (F6), which
  writes it before R1 reads it. R1: F1.
- ``cross_tenant_prefix`` - a prefix-cache hit on pages another tenant wrote (cache namespaces
  off). Recipient: F10.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from kvtrail.audit.events import KIND_CODES
from kvtrail.sim.fleet.parts import OK, Request
from kvtrail.timeutil import format_utc

_FREED, _WRITTEN, _ABORTED = (KIND_CODES[k] for k in ("pages_freed", "kv_written", "request_aborted"))
# F9 is expected when the time to first token is under 1/F9_MARGIN of the prompt's true prefill time
# on its node: implausible under any F9 policy whose factor is at most this (queueing on decode can
# make a placeholder response slow enough to look plausible, and then no F9 is expected).
F9_MARGIN = 2.0

# A response is affected when its request has one of these (as kvtrail.forensics.findings says): the
# late writer of an F7 is a source; its reader has the F1.
AFFECTING_CODES = frozenset({"F1", "F5"})


class Plant:
    """One planted bug, filled in as the simulation runs (request serials; names resolved on output)."""

    __slots__ = (
        "cls",
        "node",
        "source_node",
        "time_ns",
        "planted",
        "recipient",
        "pages",
        "victims",
        "read_ns",
        "expected",
        "detail",
        "req",
        "partner",
        "limbo",
        "chunk",
        "ready",
        "cancelled",
    )

    def __init__(self, cls: str, node: str, source_node: str | None, time_ns: int, planted: int):
        self.cls = cls
        self.node = node
        self.source_node = source_node
        self.time_ns = time_ns
        self.planted = planted  # serial of the request whose event carries the fault
        self.recipient: int | None = None  # serial of the request that read foreign data (or got the foreign hit)
        self.pages = np.empty(0, np.int32)
        self.victims: set[int] = set()  # serials of the F1 victims (-1: never written)
        self.read_ns: int | None = None
        self.expected: dict[int, set[str]] = {}
        self.detail: dict = {}  # class-specific facts (e.g. the placeholder's prompt, pool and TTFT)
        # mechanics while the plant is in progress
        self.req: Request | None = None  # the planted request
        self.partner: int | None = None  # serial of the partner request (use_after_free, late_write, double_alloc)
        self.limbo = np.empty(0, np.int32)  # pages freed in the record but kept out of the pool
        # late_write: (token_start, token_end, dst pages) of the write in flight
        self.chunk: tuple[int, int, np.ndarray] | None = None
        self.ready = False  # waiting for a partner reservation
        self.cancelled = False  # never completed (e.g. no partner came): not part of the truth

    def expect(self, serial: int, *codes: str) -> None:
        self.expected.setdefault(serial, set()).update(codes)


class TruthBook:
    """Collects plants and foreign reads; turns them into the ground-truth JSON.

    ``rid_of(serial)`` and ``tenant_of(serial)`` resolve request serials to ids and tenants.
    """

    def __init__(self, rid_of, tenant_of):
        self.rid_of = rid_of
        self.tenant_of = tenant_of
        self.plants: list[Plant] = []
        self.unplanned: list[dict] = []

    def add(self, plant: Plant) -> Plant:
        self.plants.append(plant)
        return plant

    def foreign_read(self, req, node: str, t_ns: int, pages: np.ndarray, writers: np.ndarray) -> None:
        """Request ``req`` read ``pages`` last written by ``writers`` (serials, -1 = never written)."""
        victims = set(np.unique(writers).tolist())
        plant = req.plant
        if plant is None:
            # Not expected from any plant: recorded so that a test (or a reader) sees it.
            self.unplanned.append(
                {
                    "node": node,
                    "request_id": req.rid,
                    "tenant_id": req.tenant,
                    "time": format_utc(t_ns),
                    "time_ns": t_ns,
                    "pages": pages.tolist(),
                    "victim_request_ids": self._ids(victims),
                }
            )
            return
        plant.victims |= victims
        plant.pages = pages
        plant.read_ns = t_ns
        plant.expect(req.serial, "F1")

    def live(self) -> list[Plant]:
        return [p for p in self.plants if not p.cancelled]

    def affected(self) -> set[str]:
        """Request ids that read data they did not own (F1 or F5 expected), planned or not; a late writer
        (F7) is a source, not one of them."""
        out = {self.rid_of(s) for p in self.live() for s, codes in p.expected.items() if codes & AFFECTING_CODES}
        out |= {u["request_id"] for u in self.unplanned}
        return out

    def _ids(self, serials) -> list:
        return [None if s < 0 else self.rid_of(s) for s in sorted(serials, key=lambda s: (s < 0, s))]

    def _tenants(self, serials) -> list:
        return [None if s < 0 else self.tenant_of(s) for s in sorted(serials, key=lambda s: (s < 0, s))]

    def plant_json(self, p: Plant) -> dict:
        recipient = p.recipient
        return {
            "class": p.cls,
            "node": p.node,
            "source_node": p.source_node,
            "time": format_utc(p.time_ns),
            "time_ns": p.time_ns,
            "read_time": format_utc(p.read_ns) if p.read_ns is not None else None,
            "read_ns": p.read_ns,
            "request_id": None if recipient is None else self.rid_of(recipient),
            "tenant_id": None if recipient is None else self.tenant_of(recipient),
            "planted_request_id": self.rid_of(p.planted),
            "victim_request_ids": self._ids(p.victims),
            "victim_tenant_ids": self._tenants(p.victims),
            "pages": [int(x) for x in p.pages],
            "expected_codes": {self.rid_of(s): sorted(c, key=lambda x: int(x[1:])) for s, c in p.expected.items()},
            "detail": p.detail,
        }

    def counts(self) -> dict[str, int]:
        return dict(sorted(Counter(p.cls for p in self.live()).items()))


class PlantHooks:
    """How each bug class bends the simulated lifecycle; ``sim`` is the running FleetSim.

    Faults are armed on a decode node (at ``plants_per_hour`` per class) and fire on the next plain
    request there that reaches the right point; the partner is the next plain request that reserves
    pages on the same node. Pages the record shows as freed but that a plant still needs (for its
    partner, or until its late write lands) are kept out of the allocator ("limbo") so that no third
    request can be caught up in it: every foreign read in the record is a planned one.
    """

    def __init__(self, sim):
        self.sim = sim
        self.book: TruthBook = sim.book

    def _new(self, cls: str, node: str, source: str | None, req) -> Plant:
        plant = self.book.add(Plant(cls, node, source, self.sim.now, req.serial))
        plant.req = req
        req.role = "plant"
        return plant

    def placeholder(self, req) -> None:
        """The incident: recipient of its own stale reservation."""
        plant = self._new("placeholder", req.decode.name, req.prefill.name, req)
        plant.recipient = req.serial
        plant.expect(req.serial, "F2")
        plant.detail = {"prompt_tokens": req.prompt_tokens, "pool_tokens": req.prefill.pool_tokens}
        plant.req = None  # nothing left to do with it (the request points to the plant)
        req.plant = plant

    def responded(self, req, http_status: int, ttft_ns: int | None) -> None:
        """The router answered a placeholder: served (F4), and implausibly fast (F9)? A client that
        disconnected during generation got a 499 instead, which is no finding."""
        plant = req.plant
        if plant is None or plant.cls != "placeholder":
            return
        plant.detail["http_status"] = http_status
        if not 200 <= http_status < 300:
            return
        plant.expect(req.serial, "F4")
        prefill_ns = int(req.prompt_tokens / req.prefill.rate_tokens_per_s * 1e9)
        plant.detail.update(ttft_ns=ttft_ns, true_prefill_ns=prefill_ns)
        if ttft_ns is not None and ttft_ns * F9_MARGIN < prefill_ns:
            plant.expect(req.serial, "F9")

    def cross_tenant_hit(self, node, req, entry) -> None:
        plant = self._new("cross_tenant_prefix", node.name, node.name, req)
        plant.recipient = req.serial
        plant.victims = {entry.writer_serial}
        plant.pages = entry.pages
        plant.read_ns = self.sim.now
        plant.req = None
        plant.expect(req.serial, "F10")

    def transfer_received(self, req) -> bool:
        """use_after_free / double_alloc fire here; True when the request's decode start is deferred."""
        sim, d = self.sim, req.decode
        if req.role is not None or d.pending is not None or not sim.open:
            return False
        cls = next((c for c in d.armed if c in ("use_after_free", "double_alloc")), None)
        if cls is None:
            return False
        d.armed.remove(cls)
        plant = self._new(cls, d.name, d.name, req)
        plant.recipient = req.serial
        req.plant = plant
        if cls == "use_after_free":
            # The transfer receiver frees the pages on completion while the request still waits to
            # decode; they stay in limbo until the partner takes them.
            d.log.add(sim.now, _FREED, req, req.dst, free_reason="finish")
            req.dst_freed = True
            plant.limbo = plant.pages = req.dst
            plant.expect(req.serial, "F5")
        else:
            plant.pages = req.dst[-1:]
        plant.ready = True
        d.pending = plant
        return True

    def last_chunk_sent(self, req, token_start: int, token_end: int, dst: np.ndarray) -> None:
        """late_write fires here: decode aborts the request before this chunk lands."""
        sim, d = self.sim, req.decode
        if req.role is not None or req.fate != OK or d.pending is not None or not sim.open:
            return
        if "late_write" not in d.armed:
            return
        d.armed.remove("late_write")
        plant = self._new("late_write", d.name, req.prefill.name, req)
        plant.chunk = (token_start, token_end, dst)
        plant.pages = dst
        plant.expect(req.serial, "F7")
        d.pending = plant  # not ready until the abort freed the pages
        sim.push(sim.now + sim.hop_ns // 4, self._abort_in_flight, plant)

    def _abort_in_flight(self, plant: Plant) -> None:
        sim, req = self.sim, plant.req
        assert req is not None and plant.chunk is not None, "late_write: aborted once, while its write is in flight"
        d, t = req.decode, sim.now
        req.cancelled = True
        d.log.add(t, _ABORTED, req, stage="transfer", abort_reason="client_disconnected", http_status=499)
        d.log.add(t, _FREED, req, req.dst, free_reason="abort")  # at once: no deferred release
        req.dst_freed = True
        in_flight = plant.chunk[2]
        d.alloc.free(req.dst[~np.isin(req.dst, in_flight)])
        plant.limbo = in_flight
        plant.time_ns = t
        plant.ready = True
        d.release_commitment(req.need_pages - len(in_flight))
        sim.push(t + sim.hop_ns, req.prefill.abort, req)
        req.http_status = 499
        sim.respond_later(req)

    def partner_pages(self, plant: Plant, req, num_pages: int) -> np.ndarray:
        """The partner's reservation: the plant's pages first, then fresh ones from the allocator."""
        d = req.decode
        d.pending = None
        plant.partner = req.serial
        req.role = "partner"
        req.on_first_landing = plant
        if plant.cls == "double_alloc":
            d.alloc.force_alloc(plant.pages)  # the allocator bug: a page R1 still holds goes to R2 as well
            plant.expect(req.serial, "F6")
            return np.concatenate((plant.pages, d.alloc.alloc(num_pages - 1)))
        give, plant.limbo = plant.limbo[:num_pages], plant.limbo[num_pages:]
        if plant.cls == "late_write":
            plant.recipient = req.serial  # the partner reads what the late write leaves on its pages
            req.plant = plant
            d.committed -= len(give)  # now part of the partner's own commitment
        return np.concatenate((give, d.alloc.alloc(num_pages - len(give))))

    def continue_plant(self, plant: Plant) -> None:
        """The partner's KV landed (or no partner will come): the planted read or late write happens now."""
        sim, req = self.sim, plant.req
        assert req is not None, f"{plant.cls}: continued once"
        d = req.decode
        if plant.partner is None and plant.cls == "double_alloc":
            plant.cancelled = True  # nothing was double-allocated
        if plant.cls == "late_write":
            assert plant.chunk is not None, "late_write: planted with its write in flight"
            start, end, dst = plant.chunk
            d.log.add(sim.now, _WRITTEN, req, dst, token_start=start, token_end=end, source="transfer_in")
            d.writer[dst] = req.serial
            rest, plant.limbo = plant.limbo, plant.limbo[:0]
            d.alloc.free(rest)
            d.release_commitment(len(rest))
        else:
            d.start(req)
            if len(plant.limbo):
                d.alloc.free(plant.limbo)
                plant.limbo = plant.limbo[:0]
        plant.req = None  # done: do not keep the request (and its pages) alive with the ground truth
