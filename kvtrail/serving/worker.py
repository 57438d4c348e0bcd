"""Worker process entry: build the pool, model, transfer engine and recorder, then run the role's loop.

A worker talks to the router over one control connection and to its PD peer over another (decode
connects to prefill). Its loop is single-threaded like a scheduler: it waits for messages with a
short timeout and, between messages, advances its running requests one step.
"""

from __future__ import annotations

import os
import secrets
import uuid
from multiprocessing.connection import Client, Connection, Listener, wait

from kvtrail import __version__

_IDLE_WAIT_S = 0.05


class WorkerBase:
    """Shared plumbing of the prefill and decode loops; subclasses implement ``on_<op>`` and ``step``."""

    role = "worker"

    def __init__(self, cfg, pool, model, engine, recorder, allocator):
        self.cfg = cfg
        self.pool = pool
        self.model = model
        self.engine = engine
        self.rec = recorder
        self.alloc = allocator
        self.router: Connection | None = None
        self.peer: Connection | None = None
        self.peer_info: dict | None = None
        self._running = True

    def send_router(self, msg: tuple) -> None:
        self.router.send(msg)

    def send_peer(self, msg: tuple) -> None:
        self.peer.send(msg)

    def has_work(self) -> bool:
        return False

    def step(self) -> None:
        """Advance running requests (decode) or due timers (prefill)."""

    def run(self, router: Connection, listener: Listener) -> None:
        self.router = router
        self.listener = listener
        while self._running:
            conns = [c for c in (self.router, self.peer) if c is not None]
            ready = wait(conns, timeout=0 if self.has_work() else _IDLE_WAIT_S)
            for conn in ready:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    if conn is self.router:
                        return  # the router is gone: nothing left to serve
                    self.peer = None
                    self.on_peer_lost()
                    continue
                handler = getattr(self, f"on_{msg[0]}", None)
                assert handler is not None, f"{self.role}: no handler for message {msg[0]!r}"
                handler(*msg[1:])
            self.step()

    def on_shutdown(self, _room) -> None:
        self._running = False

    def on_audit(self, room: int, enabled: bool) -> None:
        """Switch recording on or off at run time (the off side of overhead benchmarks; a kill switch)."""
        from kvtrail.audit.recorder import NullRecorder

        if not hasattr(self, "_recorder"):
            self._recorder = self.rec
        self.rec = self._recorder if enabled else NullRecorder()
        self.send_router(("audit", room, enabled))

    def on_page_digest(self, room: int, pages) -> None:
        """Inspection for tests and operators: SHA-256 of the pool bytes of ``pages`` (every buffer)."""
        import hashlib

        self.send_router(("page_digest", room, hashlib.sha256(self.pool.page_bytes(pages)).hexdigest()))

    def on_peer_lost(self) -> None:
        """The PD peer went away; subclasses fail what depended on it."""

    def connect_peer(self, info: dict) -> None:
        self.peer_info = info
        if self.role == "decode":
            self.peer = Client(info["address"], authkey=info["authkey"])
        else:
            self.peer = self.listener.accept()


def worker_main(role: str, cfg, relay_address, relay_authkey: bytes, ready: Connection) -> None:
    """Process entry point (spawned by :class:`kvtrail.serving.stack.Stack`)."""
    import signal

    # Ctrl-C reaches the whole process group; the router decides when workers stop (so they flush).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    engine = recorder = None
    try:
        import torch

        # One intra-op thread per worker: the ops are small, and two workers plus the router share the
        # machine's cores; torch's default thread pool made each decode step ~10x slower here.
        torch.set_num_threads(1)
        from kvtrail.audit.events import Producer
        from kvtrail.audit.recorder import Recorder
        from kvtrail.audit.relay import RelaySink
        from kvtrail.serving.allocator import PageAllocator
        from kvtrail.serving.kvpool import KVPool
        from kvtrail.serving.model import CopyModel, ModelConfig
        from kvtrail.serving.transfer import PoolBuffer, TransferConfig, TransferEngineHandle

        model = CopyModel(ModelConfig(num_layers=cfg.num_layers, num_heads=cfg.num_heads, head_dim=cfg.head_dim))
        num_pages = cfg.prefill_pages if role == "prefill" else cfg.decode_pages
        pool = KVPool(model.config.pool_config(num_pages, cfg.page_size))
        allocator = PageAllocator(num_pages, cfg.reuse)
        engine = TransferEngineHandle(TransferConfig(transfer_timeout_s=max(5, int(cfg.transfer_timeout_s))))
        buffers = [PoolBuffer.of(b) for b in pool.buffers()]
        engine.register(buffers)
        producer = Producer(cfg.cluster, f"{role}-0", role, "kvtrail-reference", __version__,
                            f"{role}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
        if cfg.audit:
            recorder = Recorder(RelaySink(relay_address, relay_authkey), producer, cfg.recorder)
        else:
            from kvtrail.audit.recorder import NullRecorder

            recorder = NullRecorder()
        recorder.node_config(
            pool_tokens=num_pages * cfg.page_size, pool_pages=num_pages, page_size=cfg.page_size,
            context_tokens=cfg.context_tokens, max_running_requests=cfg.max_running_requests,
            checksum_enabled=cfg.kv_digests, canary_enabled=False,
            deferred_release=role == "decode" and cfg.mode == "patched",
            page_tags=role == "decode" and cfg.page_tags, config_source="stack_config")
        if role == "prefill":
            from kvtrail.serving.prefill import PrefillWorker as cls
        else:
            from kvtrail.serving.decode import DecodeWorker as cls
        from kvtrail.serving.integrity import PoolIntegrity

        worker = cls(cfg, pool, model, engine, recorder, allocator)
        worker.integrity = PoolIntegrity(pool)
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        ready.send(("ready", {"address": listener.address, "authkey": authkey, "session": engine.session_id,
                              "buffers": [tuple(b) for b in buffers]}))
        router = listener.accept()
        worker.run(router, listener)
        listener.close()
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the start
        try:
            ready.send(("error", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        raise
    finally:
        if recorder is not None:
            recorder.close()
        if engine is not None:
            engine.close()  # unregisters the pool memory
