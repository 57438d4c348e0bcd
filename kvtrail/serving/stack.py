"""Start and stop the reference PD stack: router (this process), prefill and decode worker processes.

This process owns the audit store: a :class:`~kvtrail.audit.relay.RelayServer` commits the workers'
batches (and the router's own) into the DuckDB file. The router's HTTP server binds 127.0.0.1 on a
port the OS picks; :attr:`Stack.url` says where it is.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
import uuid
from multiprocessing.connection import Client
from pathlib import Path

from kvtrail import __version__
from kvtrail.audit.events import Producer
from kvtrail.audit.recorder import Recorder
from kvtrail.audit.relay import RelayServer, RelaySink
from kvtrail.audit.store import AuditStore
from kvtrail.errors import KvtrailError
from kvtrail.serving.config import StackConfig
from kvtrail.serving.link import WorkerLink

_START_TIMEOUT_S = 90.0


class Stack:
    """The running stack. Use as a context manager; ``stop()`` leaves no process behind."""

    def __init__(self, cfg: StackConfig, db_path: str | Path):
        self.cfg = cfg
        self.db_path = Path(db_path)
        self.url: str | None = None
        self.procs: dict[str, mp.Process] = {}
        self.links: dict[str, WorkerLink] = {}
        self._server = None
        self._thread: threading.Thread | None = None

    def start(self) -> "Stack":
        from kvtrail.serving.worker import worker_main

        self.store = AuditStore(self.db_path)
        self.relay = RelayServer(self.store)
        ctx = mp.get_context("spawn")
        ready = {}
        try:
            for role in ("prefill", "decode"):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=worker_main, name=f"kvtrail-{role}",
                                   args=(role, self.cfg, self.relay.address, self.relay.authkey, child), daemon=True)
                proc.start()
                child.close()
                self.procs[role] = proc
                ready[role] = parent
            info = {}
            for role, conn in ready.items():
                if not conn.poll(_START_TIMEOUT_S):
                    raise KvtrailError(f"{role} worker did not start within {_START_TIMEOUT_S:.0f} s")
                try:
                    msg = conn.recv()
                except EOFError:
                    raise KvtrailError(f"{role} worker exited during start (exit code {self.procs[role].exitcode})") from None
                if msg[0] != "ready":
                    raise KvtrailError(f"{role} worker failed to start: {msg[1]}")
                info[role] = msg[1]
            for role in ("prefill", "decode"):
                conn = Client(info[role]["address"], authkey=info[role]["authkey"])
                self.links[role] = WorkerLink(role, conn)
            # Wire prefill to decode: where to write KV, and the channel decode sends page ids on.
            self.links["decode"].send(("peer", 0, info["prefill"]))
            self.links["prefill"].send(("peer", 0, info["decode"]))
            self._start_router()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_router(self) -> None:
        import uvicorn

        from kvtrail.serving.router import RouterCore, create_app

        producer = Producer(self.cfg.cluster, "router-0", "router", "kvtrail-reference", __version__,
                            f"router-{uuid.uuid4().hex[:8]}")
        if self.cfg.audit:
            self.recorder = Recorder(RelaySink(self.relay.address, self.relay.authkey), producer, self.cfg.recorder)
        else:
            from kvtrail.audit.recorder import NullRecorder

            self.recorder = NullRecorder()
        self.core = core = RouterCore(self.cfg, self.links["prefill"], self.links["decode"], self.recorder)
        config = uvicorn.Config(create_app(core), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="kvtrail-router-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise KvtrailError("router HTTP server did not start")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def _control(self, roles: tuple[str, ...], op: str, *fields) -> list[tuple]:
        """Send a control message to workers and wait for each one's reply (room -1: not a request)."""
        import asyncio

        async def ask():
            futs = [self.links[r].expect(op, -1) for r in roles]
            for r in roles:
                self.links[r].send((op, -1, *fields))
            return await asyncio.wait_for(asyncio.gather(*futs), 30)

        return asyncio.run(ask())

    def page_digest(self, role: str, pages) -> str:
        """SHA-256 of the given pages' bytes in a worker's pool (all layers, K then V)."""
        return self._control((role,), "page_digest", [int(p) for p in pages])[0][2]

    def set_audit(self, enabled: bool) -> None:
        """Switch recording on or off in every process of the running stack (acknowledged by each worker)."""
        from kvtrail.audit.recorder import NullRecorder

        self._control(("prefill", "decode"), "audit", enabled)
        self.core.rec = self.recorder if enabled else NullRecorder()

    def stop(self) -> None:
        """Stop the HTTP server, ask the workers to shut down (they flush and unregister), close the store."""
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(10)
            self._server = None
        if getattr(self, "recorder", None) is not None:
            self.recorder.close()
            self.recorder = None
        for role, link in self.links.items():
            try:
                link.send(("shutdown", 0))
            except KvtrailError:
                pass
        for role, proc in self.procs.items():
            proc.join(20)
            if proc.is_alive():  # only our own child, by its handle
                proc.kill()
                proc.join(5)
        for link in self.links.values():
            link.close()
        self.links = {}
        if getattr(self, "relay", None) is not None:
            self.relay.close()
            self.relay = None
        if getattr(self, "store", None) is not None:
            self.store.close()
            self.store = None

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
