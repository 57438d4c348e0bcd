"""Worker process entry: build the pool, model, transfer engine and recorder, then run the role's loop.

The loops themselves are :class:`~kvtrail.serving.prefill.PrefillWorker` and
:class:`~kvtrail.serving.decode.DecodeWorker`. The router's process imports this module only to hand
:func:`worker_main` to ``spawn``, so everything heavy (torch, the engine, the roles) is imported in
the worker process itself.

Mooncake's native logging (glog) writes straight to fd 2 and cannot be turned off: at any
``MC_LOG_LEVEL`` each engine prints an "E... Local segment descriptor not found" line at start, and
``GLOG_*`` variables are overridden. So the worker points fd 2 at a log file before the engine is
loaded, and keeps Python's own ``sys.stderr`` on the original stream: tracebacks and warnings stay
visible, the engine's lines go to the file (the stack shows its last lines when a worker fails).
"""

from __future__ import annotations

import os
import secrets
import sys
import uuid
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import TYPE_CHECKING

from kvtrail import __version__
from kvtrail.serving.messages import WorkerFailed, WorkerInfo, WorkerReady
from kvtrail.signals import ignore_stop_signals

if TYPE_CHECKING:
    from kvtrail.audit.contract import AuditRecorder
    from kvtrail.serving.transfer import TransferEngineHandle


def route_native_stderr(log_path: Path) -> None:
    """Send this process's fd 2 (native libraries) to ``log_path``; keep ``sys.stderr`` where it was."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stderr.flush()
    original = os.dup(2)
    try:
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    sys.stderr = open(original, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=True)


def worker_main(
    role: str, cfg, relay_address, relay_authkey: bytes, ready: Connection, log_path: str | None = None
) -> None:
    """Process entry point (spawned by :class:`kvtrail.serving.stack.Stack`).

    ``log_path``: where native stderr goes (see the module docstring); None leaves fd 2 alone.
    """
    # Ctrl-C and a SIGTERM to the unit reach the whole process group; the router decides when workers
    # stop, after their in-flight requests are drained (so they flush).
    ignore_stop_signals()
    # The kernels' parallel loops run on an OpenMP pool whose idle threads spin by default: on a shared
    # machine that spin took most of a worker's CPU between requests. Read when the pool starts, below.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    engine: TransferEngineHandle | None = None
    recorder: AuditRecorder | None = None
    try:
        if log_path is not None:
            route_native_stderr(Path(log_path))  # before the engine is imported: it logs at load
        import torch

        # One intra-op thread per worker: the ops are small, and two workers plus the router share the
        # machine's cores; torch's default thread pool made each decode step ~10x slower here.
        torch.set_num_threads(1)
        from kvtrail.audit.events import Producer
        from kvtrail.audit.recorder import make_recorder
        from kvtrail.audit.relay import RelaySink
        from kvtrail.serving.allocator import PageAllocator
        from kvtrail.serving.decode import DecodeWorker
        from kvtrail.serving.integrity import PoolIntegrity
        from kvtrail.serving.kvpool import KVPool
        from kvtrail.serving.model import CopyModel, ModelConfig
        from kvtrail.serving.prefill import PrefillWorker
        from kvtrail.serving.transfer import PoolBuffer, TransferConfig, TransferEngineHandle

        model = CopyModel(ModelConfig(num_layers=cfg.num_layers, num_heads=cfg.num_heads, head_dim=cfg.head_dim))
        num_pages = cfg.prefill_pages if role == "prefill" else cfg.decode_pages
        pool = KVPool(model.config.pool_config(num_pages, cfg.page_size))
        allocator = PageAllocator(num_pages, cfg.reuse)
        engine = TransferEngineHandle(TransferConfig(transfer_timeout_s=max(5, int(cfg.transfer_timeout_s))))
        buffers = [PoolBuffer.of(b) for b in pool.buffers()]
        engine.register(buffers)
        producer = Producer(
            cfg.cluster,
            f"{role}-0",
            role,
            "kvtrail-reference",
            __version__,
            f"{role}-{os.getpid()}-{uuid.uuid4().hex[:6]}",
        )
        recorder = make_recorder(cfg.audit, lambda: RelaySink(relay_address, relay_authkey), producer, cfg.recorder)
        recorder.node_config(
            pool_tokens=num_pages * cfg.page_size,
            pool_pages=num_pages,
            page_size=cfg.page_size,
            context_tokens=cfg.context_tokens,
            max_running_requests=cfg.max_running_requests,
            checksum_enabled=cfg.kv_digests,
            canary_enabled=False,
            deferred_release=role == "decode" and cfg.mode == "patched",
            page_tags=role == "decode" and cfg.page_tags,
            config_source="stack_config",
        )
        cls = PrefillWorker if role == "prefill" else DecodeWorker
        worker = cls(cfg, pool, model, engine, recorder, allocator, PoolIntegrity(pool))
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        ready.send(
            WorkerReady(
                WorkerInfo(
                    listener.address, authkey, engine.session_id, tuple((b.addr, b.nbytes, b.item_len) for b in buffers)
                )
            )
        )
        router = listener.accept()
        worker.run(router, listener)
        listener.close()
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the start
        try:
            ready.send(WorkerFailed(f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        raise
    finally:
        if recorder is not None:
            recorder.close()
        if engine is not None:
            engine.close()  # unregisters the pool memory
