"""Start and stop the reference PD stack: router (this process), prefill and decode worker processes.

A fourth process owns the audit store (:mod:`kvtrail.serving.store_process`): its relay commits the
workers' batches and the router's own into the DuckDB file, so the store's commits cost the serving
processes nothing but sending their batches. The router's HTTP server binds 127.0.0.1 on a port the
OS picks; :attr:`Stack.url` says where it is.

The workers' native stderr (Mooncake's glog lines) goes to :attr:`Stack.worker_log_path`, next to the
store; a worker that fails to start, or exits with an error, is reported with that log's last lines.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import threading
import time
import uuid
from multiprocessing.connection import Client
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING

from kvtrail import __version__
from kvtrail.audit.contract import AuditRecorder
from kvtrail.audit.events import Producer
from kvtrail.audit.recorder import NullRecorder, make_recorder
from kvtrail.audit.relay import RelaySink
from kvtrail.errors import KvtrailError
from kvtrail.serving.config import StackConfig
from kvtrail.serving.link import WorkerLink
from kvtrail.serving.messages import (
    CONTROL_ROOM,
    AuditSet,
    AuditStats,
    ConnectPeer,
    DigestPages,
    GetAuditStats,
    PagesDigest,
    SetAudit,
    Shutdown,
    WorkerFailed,
    WorkerInfo,
    WorkerReady,
)
from kvtrail.serving.store_process import StoreProcess
from kvtrail.signals import stop_signals_ignored

log = logging.getLogger("kvtrail.serving")

if TYPE_CHECKING:
    import uvicorn

    from kvtrail.serving.router import RouterCore

_START_TIMEOUT_S = 90.0
_LOG_TAIL_LINES = 20
_LOG_START_MARK = "==== kvtrail stack start"


def worker_log_path(db_path: str | Path) -> Path:
    """Where a stack writing ``db_path`` sends its workers' native stderr: ``<db>.workers.log`` beside it."""
    db_path = Path(db_path)
    return db_path.with_name(db_path.name + ".workers.log")


class Stack:
    """The running stack. Use as a context manager; ``stop()`` leaves no process behind."""

    def __init__(self, cfg: StackConfig, db_path: str | Path):
        self.cfg = cfg
        self.db_path = Path(db_path)
        self.worker_log_path = worker_log_path(self.db_path)
        self.url: str | None = None
        self.procs: dict[str, BaseProcess] = {}
        self.links: dict[str, WorkerLink] = {}
        # Reads on the running stack's store go through its process (``store.cursor()``, ``store.query``).
        self.store: StoreProcess | None = None
        self._store_served = False  # the store process started and took commits
        self.recorder: AuditRecorder | None = None
        self.core: RouterCore | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> "Stack":
        from kvtrail.serving.worker import worker_main

        with open(self.worker_log_path, "a", encoding="utf-8") as log:
            log.write(f"{_LOG_START_MARK} {time.strftime('%Y-%m-%dT%H:%M:%S%z')} (router pid {os.getpid()})\n")
        ctx = mp.get_context("spawn")
        ready = {}
        try:
            self.store = store = StoreProcess(self.db_path)  # set first: stop() ends it if start fails
            store.start()
            self._store_served = True  # from here a death of the store process loses events (see _mark_end)
            for role in ("prefill", "decode"):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=worker_main,
                    name=f"kvtrail-{role}",
                    daemon=True,
                    args=(role, self.cfg, store.address, store.authkey, child, str(self.worker_log_path)),
                )
                proc.start()
                child.close()
                self.procs[role] = proc
                ready[role] = parent
            info = {role: self._await_ready(role, conn) for role, conn in ready.items()}
            for role in ("prefill", "decode"):
                conn = Client(info[role].address, authkey=info[role].authkey)
                self.links[role] = WorkerLink(role, conn)
            # Wire prefill to decode: where to write KV, and the channel decode sends page ids on.
            self.links["decode"].send(ConnectPeer(info["prefill"]))
            self.links["prefill"].send(ConnectPeer(info["decode"]))
            self._start_router()
        except BaseException:
            self.stop()
            raise
        return self

    def _await_ready(self, role: str, conn) -> WorkerInfo:
        if not conn.poll(_START_TIMEOUT_S):
            raise KvtrailError(f"{role} worker did not start within {_START_TIMEOUT_S:.0f} s{self._log_tail()}")
        try:
            msg = conn.recv()
        except EOFError:
            raise KvtrailError(
                f"{role} worker exited during start (exit code {self.procs[role].exitcode}){self._log_tail()}"
            ) from None
        if isinstance(msg, WorkerFailed):
            raise KvtrailError(f"{role} worker failed to start: {msg.error}{self._log_tail()}")
        if not isinstance(msg, WorkerReady):
            raise KvtrailError(f"{role} worker sent {type(msg).__name__} instead of WorkerReady at start")
        return msg.info

    def worker_log_tail(self, max_lines: int = _LOG_TAIL_LINES) -> list[str]:
        """The last lines the workers' native stderr wrote since this stack started."""
        try:
            text = self.worker_log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return []
        lines = text.splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith(_LOG_START_MARK)]
        since = lines[starts[-1] + 1 :] if starts else lines
        return since[-max_lines:]

    def wait_for_worker_exit(self, poll_s: float = 0.1) -> None:
        """Block until a worker process or the store process exits (a KeyboardInterrupt from a stop signal ends
        the wait too)."""
        while all(p.is_alive() for p in self.procs.values()) and (self.store is None or self.store.alive()):
            time.sleep(poll_s)

    def failed_workers(self) -> dict[str, int]:
        """Workers, and the store process (as ``store``), that exited with a non-zero code (a kill by signal
        ``n`` reads ``-n``): role -> code."""
        failed = {role: p.exitcode for role, p in self.procs.items() if p.exitcode not in (None, 0)}
        if self.store is not None and self.store.exitcode not in (None, 0):
            failed["store"] = self.store.exitcode
        return failed

    def _log_tail(self) -> str:
        tail = self.worker_log_tail()
        if not tail:
            return ""
        return f"\nlast lines of {self.worker_log_path}:\n" + "\n".join(f"  {line}" for line in tail)

    def _start_router(self) -> None:
        import uvicorn

        from kvtrail.serving.deadlines import deadline_protocol
        from kvtrail.serving.router import RouterCore, create_app

        store = self.store
        assert store is not None and store.address is not None and store.authkey is not None, (
            "the store process starts before the router"
        )
        address, authkey = store.address, store.authkey
        producer = Producer(
            self.cfg.cluster, "router-0", "router", "kvtrail-reference", __version__, f"router-{uuid.uuid4().hex[:8]}"
        )
        self.recorder = make_recorder(self.cfg.audit, lambda: RelaySink(address, authkey), producer, self.cfg.recorder)
        self.core = core = RouterCore(
            self.cfg, self.links["prefill"], self.links["decode"], self.recorder, audit_alive=store.alive
        )
        # On stop uvicorn stops accepting, then waits up to drain_timeout_s for the requests in flight.
        config = uvicorn.Config(
            create_app(core),
            host="127.0.0.1",
            port=0,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=math.ceil(self.cfg.drain_timeout_s),
            http=deadline_protocol(self.cfg.read_timeouts),
        )
        self._server = server = uvicorn.Server(config)
        self._thread = thread = threading.Thread(target=server.run, name="kvtrail-router-http", daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise KvtrailError("router HTTP server did not start")
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def _control(self, roles: tuple[str, ...], request: object, reply: type) -> list:
        """Send a control request (room CONTROL_ROOM) to workers and wait for each one's ``reply``."""
        import asyncio

        async def ask():
            futs = [self.links[r].expect(CONTROL_ROOM, reply) for r in roles]
            for r in roles:
                self.links[r].send(request)
            return await asyncio.wait_for(asyncio.gather(*futs), 30)

        return asyncio.run(ask())

    def page_digest(self, role: str, pages) -> str:
        """SHA-256 of the given pages' bytes in a worker's pool (all layers, K then V)."""
        request = DigestPages(CONTROL_ROOM, tuple(int(p) for p in pages))
        return self._control((role,), request, PagesDigest)[0].sha256_hex

    def audit_stats(self) -> dict[str, dict[str, int]]:
        """Every process's recorder counters (``Recorder.stats``), by role: router, prefill, decode."""
        assert self.recorder is not None, "audit_stats: the stack is not running"
        replies = self._control(("prefill", "decode"), GetAuditStats(CONTROL_ROOM), AuditStats)
        return {"router": self.recorder.stats(), **{r: dict(m.stats) for r, m in zip(("prefill", "decode"), replies)}}

    def set_audit(self, enabled: bool) -> None:
        """Switch recording on or off in every process of the running stack (acknowledged by each worker)."""
        assert self.core is not None, "set_audit: the stack is not running"
        self._control(("prefill", "decode"), SetAudit(CONTROL_ROOM, enabled), AuditSet)
        self.core.rec = self.recorder if enabled else NullRecorder()

    def stop(self) -> None:
        """Stop accepting, drain the requests in flight (up to ``drain_timeout_s``), close the router's
        recorder, ask the workers to shut down (they flush and unregister), stop the store process.

        Stop signals (SIGINT, SIGTERM) are ignored while it runs: a second Ctrl-C must not cut the flush short.
        """
        with stop_signals_ignored():
            self._stop()

    def _stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            if self._thread is not None:
                self._thread.join(self.cfg.drain_timeout_s + 10)
            self._server = None
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None
        for link in self.links.values():
            try:
                link.send(Shutdown())
            except KvtrailError:
                pass
        for proc in self.procs.values():
            proc.join(20)
            if proc.is_alive():  # only our own child, by its handle
                proc.kill()
                proc.join(5)
        for link in self.links.values():
            link.close()
        self.links = {}
        if self.store is not None:  # last: every recorder has flushed through its relay by now
            died = self._store_served and self.store.exitcode not in (None, 0)
            self.store.stop()
            self.store = None
            if died:
                self._mark_end()

    def _mark_end(self) -> None:
        """The store process died and every process of the stack has stopped: open the store once for writing.

        Its ``store_opens`` row is the proven end of what the stack's producers recorded: ``audit verify``
        reports each one's unclean end as ended by this open (whatever was lost was recorded before it).
        """
        from kvtrail.audit.store import AuditStore  # DuckDB, once, only here

        try:
            AuditStore(self.db_path).close()
        except KvtrailError as exc:  # the file is damaged or held: verify still reports the unclean ends
            log.warning("kvtrail stack: could not mark the end of the audit in %s: %s", self.db_path, exc)

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
