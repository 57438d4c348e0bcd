"""What the prefill and decode loops share: the control channels, message dispatch and the control ops.

A worker talks to the router over one control connection and to its PD peer over another (decode
connects to prefill). Its loop is single-threaded like a scheduler: it waits for messages with a
short timeout and, between messages, advances its running requests one step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection, Listener, wait
from typing import TYPE_CHECKING, Any, ClassVar

from kvtrail.audit.contract import AuditRecorder
from kvtrail.audit.recorder import NullRecorder
from kvtrail.serving.messages import (
    AuditSet,
    AuditStats,
    DigestPages,
    GetAuditStats,
    PagesDigest,
    SetAudit,
    Shutdown,
    unexpected,
)

if TYPE_CHECKING:  # torch-backed types: the annotations only
    from kvtrail.serving.allocator import PageAllocator
    from kvtrail.serving.config import StackConfig
    from kvtrail.serving.integrity import PoolIntegrity
    from kvtrail.serving.kvpool import KVPool
    from kvtrail.serving.model import CopyModel
    from kvtrail.serving.transfer import TransferEngineHandle

_IDLE_WAIT_S = 0.05

Handler = Callable[[Any, Any], None]  # (worker, message) -> None


class WorkerBase:
    """Shared plumbing of the prefill and decode loops.

    A subclass lists its messages in ``HANDLERS`` (message type -> handler function, the base's
    entries included) and implements ``step``, ``has_work`` and ``on_peer_lost``.
    """

    role = "worker"

    def __init__(
        self,
        cfg: StackConfig,
        pool: KVPool,
        model: CopyModel,
        engine: TransferEngineHandle,
        recorder: AuditRecorder,
        allocator: PageAllocator,
        integrity: PoolIntegrity,
    ):
        self.cfg = cfg
        self.pool = pool
        self.model = model
        self.engine = engine
        self.rec: AuditRecorder = recorder
        self._recorder = recorder  # what SetAudit(enabled=True) switches back to
        self.alloc = allocator
        self.integrity = integrity
        self.router: Connection | None = None
        self.listener: Listener | None = None
        self.peer: Connection | None = None
        self._running = True

    def send_router(self, msg: object) -> None:
        assert self.router is not None, f"{self.role}: no router connection yet"
        self.router.send(msg)

    def send_peer(self, msg: object) -> None:
        assert self.peer is not None, f"{self.role}: no peer connection"
        self.peer.send(msg)

    def has_work(self) -> bool:
        return False

    def step(self) -> None:
        """Advance running requests (decode) or due timers (prefill)."""

    def on_peer_lost(self) -> None:
        """The PD peer went away; subclasses fail what depended on it."""

    def dispatch(self, msg: object) -> None:
        """Run the handler for ``msg``'s type; :class:`~kvtrail.serving.messages.ProtocolError` if none."""
        handler = self.HANDLERS.get(type(msg))
        if handler is None:
            raise unexpected(f"{self.role} worker", msg)
        handler(self, msg)

    def run(self, router: Connection, listener: Listener) -> None:
        self.router = router
        self.listener = listener
        while self._running:
            conns = [c for c in (self.router, self.peer) if c is not None]
            ready = wait(conns, timeout=0 if self.has_work() else _IDLE_WAIT_S)
            for conn in ready:
                assert isinstance(conn, Connection)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    if conn is self.router:
                        return  # the router is gone: nothing left to serve
                    self.peer = None
                    self.on_peer_lost()
                    continue
                self.dispatch(msg)
            self.step()

    def on_shutdown(self, _msg: Shutdown) -> None:
        self._running = False

    def on_set_audit(self, msg: SetAudit) -> None:
        """Switch recording on or off at run time (the off side of overhead benchmarks; a kill switch)."""
        self.rec = self._recorder if msg.enabled else NullRecorder()
        self.send_router(AuditSet(msg.room, msg.enabled))

    def on_get_audit_stats(self, msg: GetAuditStats) -> None:
        """The recorder's counters, also while recording is switched off (the benchmark reads them per side)."""
        self.send_router(AuditStats(msg.room, tuple(sorted(self._recorder.stats().items()))))

    def on_digest_pages(self, msg: DigestPages) -> None:
        """Inspection for tests and operators: SHA-256 of the pool bytes of the pages (every buffer)."""
        digest = hashlib.sha256(self.pool.page_bytes(msg.pages)).hexdigest()
        self.send_router(PagesDigest(msg.room, digest))

    HANDLERS: ClassVar[Mapping[type, Handler]] = {
        Shutdown: on_shutdown,
        SetAudit: on_set_audit,
        GetAuditStats: on_get_audit_stats,
        DigestPages: on_digest_pages,
    }
