"""KV page writes from one process's pool memory into another's with Mooncake's transfer engine.

Decode registers its pool buffers with its own engine and tells prefill its session id and the
buffers' addresses; prefill then writes each contiguous run of (source page, destination page) pairs
as one entry per buffer, as SGLang's Mooncake connector does. The engine's cost is per entry, not per
byte (about 45 us per entry on loopback TCP), so merging runs is what makes scattered pages cheap.

The engine itself only checks that a remote range lies inside *some* region the receiver registered:
a wrong page inside a pool lands silently. Hence, before anything is sent, every page is
range-checked against both sides' buffer sizes and destination pages must be distinct. A batch
larger than the per-peer TCP queue fails and still writes part of itself, so batches hold at most
``max_batch_entries`` entries and one handle never has two batches to the same peer in flight.

Mooncake is imported lazily, when the first :class:`TransferEngineHandle` is built.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from kvtrail.errors import KvtrailError

LOOPBACK = "127.0.0.1"
MAX_BATCH_ENTRIES = 1024
MIN_TRANSFER_TIMEOUT_S = 5  # Mooncake's own floor for MC_TRANSFER_TIMEOUT
QUEUE_ENV = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
_QUEUE_DEFAULT = 1024
_LOG_LEVELS = ("INFO", "WARNING", "ERROR", "TRACE")  # anything else silently falls back to INFO
_RC_OVERLAPPED = -7


class TransferError(KvtrailError):
    """The transfer engine failed an operation (``op``: initialize, register, unregister, write, use).

    ``rc`` is the engine's return code (``None`` when the engine was not called). For a failed write,
    ``batch`` is the index of the batch that failed out of ``num_batches`` and ``entries_done`` the
    entries of earlier batches that completed; what the failed batch itself wrote is unknown.
    """

    http_status = 502

    def __init__(
        self,
        op: str,
        rc: int | None,
        reason: str,
        *,
        peer: str | None = None,
        batch: int | None = None,
        num_batches: int | None = None,
        entries_done: int = 0,
    ):
        self.op, self.rc, self.reason, self.peer = op, rc, reason, peer
        self.batch, self.num_batches, self.entries_done = batch, num_batches, entries_done
        where = f" to {peer}" if peer else ""
        super().__init__(f"{op}{where}: {reason}" + ("" if rc is None else f" (rc {rc})"))


class PoolBuffer(NamedTuple):
    """One pool buffer: base address, size in bytes, bytes per page (``item_len``)."""

    addr: int
    nbytes: int
    item_len: int

    @classmethod
    def of(cls, buf) -> "PoolBuffer":
        """Describe a contiguous CPU torch tensor or numpy array whose first axis is the page."""
        if hasattr(buf, "data_ptr"):  # torch.Tensor, without importing torch
            if buf.device.type != "cpu" or not buf.is_contiguous() or buf.dim() < 1:
                raise ValueError("buf: needs a contiguous CPU tensor with at least one dimension")
            size = buf.element_size()
            return cls(buf.data_ptr(), buf.numel() * size, buf.stride(0) * size)
        if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous or buf.ndim < 1:
            raise ValueError("buf: needs a C-contiguous numpy array or torch tensor")
        return cls(buf.ctypes.data, buf.nbytes, buf.strides[0])


@dataclass(frozen=True)
class TransferConfig:
    """How a :class:`TransferEngineHandle` is built.

    ``transfer_timeout_s`` sets ``MC_TRANSFER_TIMEOUT`` (how long a write to a frozen peer blocks;
    Mooncake's default is 30 s) for the whole process; ``None`` leaves it alone.
    """

    host: str = LOOPBACK
    transfer_timeout_s: int | None = None
    max_batch_entries: int = MAX_BATCH_ENTRIES

    def __post_init__(self):
        if not self.host or ":" in self.host:
            raise ValueError(f"host: {self.host!r} must be a bare address (the port is picked by the engine)")
        if self.transfer_timeout_s is not None and self.transfer_timeout_s < MIN_TRANSFER_TIMEOUT_S:
            raise ValueError(f"transfer_timeout_s: must be >= {MIN_TRANSFER_TIMEOUT_S} (Mooncake's minimum)")
        if self.max_batch_entries < 1:
            raise ValueError("max_batch_entries: must be >= 1")


@dataclass(frozen=True)
class EntryPlan:
    """Transfer entries, one per (buffer pair, page run), in buffer order then run order."""

    src_addrs: np.ndarray
    dst_addrs: np.ndarray
    lengths: np.ndarray
    num_pages: int
    num_runs: int

    @property
    def num_entries(self) -> int:
        return int(self.lengths.size)

    @property
    def num_bytes(self) -> int:
        return int(self.lengths.sum())


@dataclass(frozen=True)
class TransferResult:
    """What one write did: pages, merged runs, entries, ``batch_transfer_sync_write`` calls, bytes, time."""

    peer: str
    num_pages: int
    num_runs: int
    num_entries: int
    num_batches: int
    num_bytes: int
    elapsed_s: float

    @property
    def mb_per_s(self) -> float:
        return self.num_bytes / 1e6 / self.elapsed_s if self.elapsed_s > 0 else 0.0


def _page_array(pages, name: str) -> np.ndarray:
    arr = np.asarray(pages)
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"{name}: must be a 1-D list of integer page ids")
    return arr.astype(np.int64, copy=False)  # int64 so page+1 cannot wrap at the int32 limit


def _run_arrays(src_pages, dst_pages) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    src, dst = _page_array(src_pages, "src_pages"), _page_array(dst_pages, "dst_pages")
    if src.size != dst.size:
        raise ValueError(f"dst_pages: has {dst.size} pages, src_pages {src.size}")
    n = src.size
    if n == 0:
        return src, dst, np.empty(0, dtype=np.int64)
    is_break = np.empty(n, dtype=bool)
    is_break[0] = True
    np.logical_or(src[1:] != src[:-1] + 1, dst[1:] != dst[:-1] + 1, out=is_break[1:])
    starts = np.flatnonzero(is_break)
    return src[starts], dst[starts], np.diff(np.append(starts, n))


def merge_runs(src_pages, dst_pages) -> list[tuple[int, int, int]]:
    """Split paired page lists into ``(src_start, dst_start, num_pages)`` runs.

    A run ends wherever either side stops being ascending-contiguous; runs keep the lists' order.
    """
    src, dst, length = _run_arrays(src_pages, dst_pages)
    return list(zip(src.tolist(), dst.tolist(), length.tolist()))


def _buffers(bufs: Sequence, name: str) -> list[PoolBuffer]:
    out = []
    for i, b in enumerate(bufs):
        addr, nbytes, item_len = (int(x) for x in b[:3])
        if addr <= 0 or item_len <= 0 or nbytes < item_len:
            raise ValueError(f"{name}[{i}]: needs addr > 0 and nbytes >= item_len > 0, got {tuple(b[:3])}")
        out.append(PoolBuffer(addr, nbytes, item_len))
    return out


def _check_pages(pages: np.ndarray, bufs: list[PoolBuffer], name: str) -> None:
    if pages.size == 0:
        return
    limit = min(b.nbytes // b.item_len for b in bufs)  # pages every buffer of this side holds
    lo, hi = int(pages.min()), int(pages.max())
    if lo < 0 or hi >= limit:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name}: page {bad} is outside the buffers (pages 0..{limit - 1})")


def plan_entries(src_bufs: Sequence, dst_bufs: Sequence, src_pages, dst_pages) -> EntryPlan:
    """Checked entries for writing ``src_pages`` of ``src_bufs`` into ``dst_pages`` of ``dst_bufs``.

    Buffers are ``(addr, nbytes, item_len)`` triples (or :class:`PoolBuffer`), paired by position;
    a pair must agree on ``item_len``. Raises ``ValueError`` before anything is sent for a page out of
    range on either side, a repeated destination page, or mismatched lists.
    """
    src_b, dst_b = _buffers(src_bufs, "src_bufs"), _buffers(dst_bufs, "dst_bufs")
    if not src_b or len(src_b) != len(dst_b):
        raise ValueError(f"dst_bufs: has {len(dst_b)} buffers, src_bufs {len(src_b)} (need equal, >= 1)")
    for i, (s, d) in enumerate(zip(src_b, dst_b)):
        if s.item_len != d.item_len:
            raise ValueError(f"dst_bufs[{i}]: item_len {d.item_len} differs from src_bufs[{i}]'s {s.item_len}")
    flat_src, flat_dst = _page_array(src_pages, "src_pages"), _page_array(dst_pages, "dst_pages")
    src, dst, length = _run_arrays(flat_src, flat_dst)
    num_pages = int(length.sum())
    if num_pages:
        _check_pages(flat_src, src_b, "src_pages")
        _check_pages(flat_dst, dst_b, "dst_pages")
        # Two entries racing into one destination page leave it holding either source: refuse.
        if np.unique(flat_dst).size != flat_dst.size:
            raise ValueError("dst_pages: a destination page appears more than once")
    item = np.array([b.item_len for b in src_b], dtype=np.int64)[:, None]
    src_base = np.array([b.addr for b in src_b], dtype=np.int64)[:, None]
    dst_base = np.array([b.addr for b in dst_b], dtype=np.int64)[:, None]
    return EntryPlan(
        src_addrs=(src_base + src[None, :] * item).ravel(),
        dst_addrs=(dst_base + dst[None, :] * item).ravel(),
        lengths=(length[None, :] * item).ravel(),
        num_pages=num_pages,
        num_runs=int(length.size),
    )


def _check_session(peer_session: str) -> None:
    host, _, port = str(peer_session).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        # A session without a port is not refused by the engine: it silently tries port 12001.
        raise ValueError(f"peer_session: {peer_session!r} is not 'host:port'")


def _prepare_env(config: TransferConfig) -> None:
    """Check, then set, the process-wide Mooncake variables; runs before the engine is imported and built."""
    if os.environ.get("MC_LOG_DIR"):
        raise ValueError("MC_LOG_DIR: Mooncake aborts the process at import when it is set; unset it")
    level = os.environ.get("MC_LOG_LEVEL", "ERROR")
    if level not in _LOG_LEVELS:
        raise ValueError(f"MC_LOG_LEVEL: {level!r} is not one of {', '.join(_LOG_LEVELS)} (Mooncake would log INFO)")
    queue = int(os.environ.get(QUEUE_ENV, _QUEUE_DEFAULT))
    if config.max_batch_entries > queue:
        raise ValueError(
            f"max_batch_entries: {config.max_batch_entries} exceeds {QUEUE_ENV}={queue}; a larger "
            "batch fails and still writes part of itself"
        )
    os.environ["MC_LOG_LEVEL"] = level
    os.environ["MC_FORCE_TCP"] = "1"  # same transport on a host with an RDMA NIC as on CI
    if config.transfer_timeout_s is not None:
        os.environ["MC_TRANSFER_TIMEOUT"] = str(int(config.transfer_timeout_s))


def _engine_class():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise ImportError(
            "kvtrail.serving.transfer needs mooncake-transfer-engine-non-cuda (the 'serving' "
            f"extra) and the Debian libraries libibverbs1 libnuma1 libcurl4: {exc}"
        ) from exc
    return TransferEngine


class TransferEngineHandle:
    """One initialized Mooncake transfer engine in this process: TCP, P2P handshake, random ports.

    ``session_id`` is what peers write to. Buffers given to :meth:`register` must stay alive until
    :meth:`unregister_all` (nothing stops remote writes into freed memory). :meth:`close` unregisters
    and destroys the engine, which blocks for about a second; so does process exit.
    """

    def __init__(self, config: TransferConfig | None = None):
        self.config = config or TransferConfig()
        _prepare_env(self.config)
        engine = _engine_class()()
        t0 = time.perf_counter()
        rc = engine.initialize(self.config.host, "P2PHANDSHAKE", "tcp", "")
        self.init_s = time.perf_counter() - t0
        if rc != 0:
            raise TransferError("initialize", rc, "the engine did not initialize")
        # Only an initialized engine is ever stored: any other call before initialize segfaults.
        self._engine = engine
        self.session_id = f"{self.config.host}:{engine.get_rpc_port()}"
        self._registered: dict[int, int] = {}
        self._lock = threading.Lock()
        self._peer_locks: dict[str, threading.Lock] = {}

    def _live(self):
        if self._engine is None:
            raise TransferError("use", None, "the handle is closed")
        return self._engine

    @property
    def registered(self) -> tuple[tuple[int, int], ...]:
        """``(addr, nbytes)`` of every buffer this handle registered and has not unregistered."""
        return tuple(self._registered.items())

    def register(self, buffers: Sequence) -> None:
        """Register ``(addr, nbytes, ...)`` buffers; ones already registered here are skipped.

        One call per buffer, so after a failure the buffers before it are known to be registered
        (and :meth:`unregister_all` releases them).
        """
        engine = self._live()
        for i, b in enumerate(buffers):
            addr, nbytes = int(b[0]), int(b[1])
            if addr <= 0 or nbytes <= 0:
                raise ValueError(f"buffers[{i}]: needs addr > 0 and nbytes > 0, got {(addr, nbytes)}")
            with self._lock:
                if self._registered.get(addr) == nbytes:
                    continue
                rc = engine.register_memory(addr, nbytes)
                if rc != 0:
                    why = "overlaps a registered region" if rc == _RC_OVERLAPPED else "was refused"
                    raise TransferError("register", rc, f"buffers[{i}] at {addr:#x} ({nbytes} bytes) {why}")
                self._registered[addr] = nbytes

    def unregister_all(self) -> None:
        """Unregister every buffer this handle registered; a no-op when there are none or it is closed."""
        if self._engine is None:
            return
        with self._lock:
            addrs, self._registered = list(self._registered), {}
            failed = [(a, rc) for a in addrs if (rc := self._engine.unregister_memory(a)) != 0]
        if failed:
            addr, rc = failed[0]
            raise TransferError("unregister", rc, f"{len(failed)} of {len(addrs)} buffers, first at {addr:#x}")

    def is_peer_alive(self, peer_session: str) -> bool:
        """``send_probe``: False within a millisecond for a dead peer. Blocks ~60 s on a frozen one."""
        _check_session(peer_session)
        return self._live().send_probe(peer_session) == 0

    def write_pages(
        self, peer_session: str, src_bufs: Sequence, dst_bufs: Sequence, src_pages, dst_pages
    ) -> TransferResult:
        """Write pages ``src_pages`` of every local buffer into pages ``dst_pages`` of the peer's.

        See :func:`plan_entries` for the checks. Raises :class:`TransferError` when a batch fails:
        then an unknown subset of the destination pages was written and may still be being written.
        """
        return self.write_plan(peer_session, plan_entries(src_bufs, dst_bufs, src_pages, dst_pages))

    def write_plan(self, peer_session: str, plan: EntryPlan) -> TransferResult:
        """Send ``plan`` in ``batch_transfer_sync_write`` calls of at most ``max_batch_entries``.

        The entries are not range-checked here; build plans with :func:`plan_entries`.
        """
        _check_session(peer_session)
        engine = self._live()
        step = self.config.max_batch_entries
        srcs, dsts, lens = plan.src_addrs.tolist(), plan.dst_addrs.tolist(), plan.lengths.tolist()
        num_batches = -(-len(lens) // step)
        with self._lock:
            peer_lock = self._peer_locks.setdefault(peer_session, threading.Lock())
        t0 = time.perf_counter()
        for k, i in enumerate(range(0, len(lens), step)):
            with peer_lock:
                rc = engine.batch_transfer_sync_write(
                    peer_session, srcs[i : i + step], dsts[i : i + step], lens[i : i + step]
                )
            if rc != 0:
                raise TransferError(
                    "write",
                    rc,
                    f"batch {k + 1} of {num_batches} ({len(lens[i : i + step])} entries) failed: unknown "
                    "subset written, and the engine may still be writing it; treat every destination page of "
                    "this transfer as unknown",
                    peer=peer_session,
                    batch=k,
                    num_batches=num_batches,
                    entries_done=i,
                )
        return TransferResult(
            peer_session,
            plan.num_pages,
            plan.num_runs,
            plan.num_entries,
            num_batches,
            plan.num_bytes,
            time.perf_counter() - t0,
        )

    def close(self) -> None:
        """Unregister everything and destroy the engine (blocks ~1 s). Idempotent."""
        if self._engine is None:
            return
        try:
            self.unregister_all()
        finally:
            engine, self._engine = self._engine, None
            del engine

    def __enter__(self) -> "TransferEngineHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
