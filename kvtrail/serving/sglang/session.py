"""Session: one SGLang scheduler process's recording state (recorder, resolver, per-request facts).

Created by the plugin when the scheduler has set up its pools (the node configuration hook); until
then, and on every rank but attention-TP rank 0, the hooks return at once. Requests are recorded
with their rid and SGLang's bootstrap room as the transfer id, except SGLang's own fake transfers:
its health checks (``/health``, ``/health_generate``: rid ``HEALTH_CHECK_...``) and warm-up requests on a
PD server carry the fake bootstrap host and room 0, and transfer nothing, so they are recorded with no
transfer id (room 0 is not one transfer shared by every health check).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kvtrail.audit.contract import AuditRecorder
from kvtrail.audit.events import RequestRef
from kvtrail.serving.sglang.resolver import Resolver

# SGLang's disaggregation.utils.FAKE_BOOTSTRAP_HOST: the bootstrap host of its own requests that transfer
# nothing (health checks, warm-up); tests/sglang/test_real_pd.py checks it against SGLang's constant.
FAKE_BOOTSTRAP_HOST = "2.2.2.2"
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"  # SGLang's constants.HEALTH_CHECK_RID_PREFIX


def transfer_id(obj: Any) -> int | None:
    """The transfer id of a request (SGLang's ``Req`` or ``GenerateReqInput``): its bootstrap room, or None
    without one and for SGLang's fake transfers (health checks, warm-up: the fake host, room 0)."""
    room = getattr(obj, "bootstrap_room", None)
    if not isinstance(room, int) or room < 0 or getattr(obj, "bootstrap_host", None) == FAKE_BOOTSTRAP_HOST:
        return None
    return int(room)


@dataclass
class ReqState:
    """What the plugin remembers of one request between hooks (decode reservation, reads)."""

    created_ns: int
    reserved_pages: Any = None  # Snapshot of decode's reserved pages (transfer destination)
    prefix_tokens: int = 0
    reserved_tokens: int = 0
    extended: bool = False  # prefill: its first extend ran (later chunks extend its own prefix)
    has_read: bool = False
    aborted: bool = False
    landed_tokens: int | None = None  # decode: what the commit recorded as landed (the checksum receipt reuses it)
    unverified: bool = False  # decode: the commit could not show what landed (the checksum may prove it later)


@dataclass
class Session:
    """Recording state of one scheduler process."""

    recorder: AuditRecorder
    page_size: int
    role: str
    enforce_length: bool = False
    records_responses: bool = True  # False where the HTTP process records them (modes.responses_in_scheduler)
    resolver: Resolver = field(default_factory=Resolver)
    requests: dict[str, ReqState] = field(default_factory=dict)
    rooms: dict[int, RequestRef] = field(default_factory=dict)  # prefill: bootstrap room -> request (for sends)
    # prefill: bootstrap room -> (SGLang's Adler-32 of the transfer, the tokens it covers)
    digests: dict[int, tuple[int, int | None]] = field(default_factory=dict)
    groups: dict[int, list] = field(default_factory=dict)  # id(allocator) -> frees its open free group postponed
    lock: threading.Lock = field(default_factory=threading.Lock)
    local: threading.local = field(default_factory=threading.local)

    def __post_init__(self) -> None:
        self.resolver.on_failures = self.report_gaps

    def ref(self, req: Any) -> RequestRef:
        tenant = getattr(req, "extra_key", None)  # SGLang's cache namespace; the only per-tenant field it has
        return RequestRef(str(req.rid), transfer_id(req), str(tenant) if tenant else None)

    def state(self, rid: str) -> ReqState:
        with self.lock:
            st = self.requests.get(rid)
            if st is None:
                st = self.requests[rid] = ReqState(time.monotonic_ns())
            return st

    def forget(self, rid: str, room: int | None = None) -> None:
        with self.lock:
            self.requests.pop(rid, None)
            if room is not None:
                self.rooms.pop(room, None)
                self.digests.pop(room, None)

    def later(self, hook: str, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the resolver thread (after the snapshots in args are copied)."""
        self.resolver.submit(hook, fn, *args)

    def report_gaps(self) -> None:
        """Hand the hooks' counted failures to the recorder as recorder_gap events."""
        for hook, n, detail in self.resolver.take_failures():
            self.recorder.events_lost("hook_error", n, 0, f"sglang hook {hook}: {detail}")

    def close(self) -> None:
        self.resolver.drain()
        self.report_gaps()
        self.resolver.stop()
        self.recorder.close()


def instance_id() -> str:
    return f"{os.getpid()}-{time.time_ns()}"
