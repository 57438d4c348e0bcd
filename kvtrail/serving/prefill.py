"""Prefill worker: admit a prompt, wait for decode's page ids, run the forward pass, write KV into decode.

``vulnerable`` mode is SGLang before 0.5.20: a prompt longer than the pool is marked aborted and its
input replaced by a one-token placeholder, but admission checks "finished" rather than "aborted", so
the placeholder is prefilled, one page is sent and the transfer is reported complete. ``patched``
rejects it with 400 before bootstrap, allocation or transfer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtrail.audit.events import RequestRef
from kvtrail.serving.integrity import DIGEST_ALGO
from kvtrail.serving.messages import (
    Abort,
    AbortAck,
    Admitted,
    Cancel,
    ConnectPeer,
    DstPages,
    KvDone,
    KvFailed,
    PrefillRequest,
    Rejected,
)
from kvtrail.serving.transfer import TransferError
from kvtrail.serving.worker_base import WorkerBase

_LATE_WRITE_DELAY_S = 0.5  # how long a flagged transfer is held back under the late_write fault


@dataclass
class _Pending:
    ref: RequestRef
    tokens: bytes
    held_back: bool
    dst_pages: np.ndarray | None = None
    due: float = 0.0


class PrefillWorker(WorkerBase):
    """Admits prompts, runs the forward pass and writes the KV into the pages decode reserved."""

    role = "prefill"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.pending: dict[int, _Pending] = {}
        self.peer_session = ""  # decode's transfer engine session, set by ConnectPeer
        self.src_buffers: list[tuple[int, int, int]] = []
        self.dst_buffers: list[tuple[int, int, int]] = []

    def on_connect_peer(self, msg: ConnectPeer) -> None:
        """Decode connects to this worker's listener; its pool buffers are where the KV goes."""
        assert self.listener is not None, "prefill: the peer is wired only once the loop runs"
        self.peer = self.listener.accept()
        self.peer_session = msg.info.session
        self.dst_buffers = list(msg.info.buffers)
        self.src_buffers = [
            (b.data_ptr(), b.numel() * b.element_size(), b.stride(0) * b.element_size()) for b in self.pool.buffers()
        ]

    def on_prefill(self, msg: PrefillRequest) -> None:
        room, ref, tokens = msg.room, msg.ref, msg.tokens
        self.rec.request_received(ref, len(tokens))
        capacity = self.alloc.num_pages * self.cfg.page_size
        if len(tokens) > capacity:
            reason = f"input of {len(tokens)} tokens exceeds the KV pool of {capacity} tokens"
            self.rec.request_aborted(ref, "prefill_queue", reason, 400, len(tokens))
            if self.cfg.mode == "patched":
                self.send_router(Rejected(room, 400, f"field 'prompt': {reason}"))
                return
            # The bug: the aborted request keeps going with a one-token placeholder input, and the
            # queue only checks whether it is finished.
            tokens = tokens[:1]
        self.pending[room] = _Pending(ref, tokens, msg.held_back and self.cfg.faults.late_write)
        self.send_router(Admitted(room))

    def on_dst(self, msg: DstPages) -> None:
        p = self.pending.get(msg.room)
        if p is None:
            return  # rejected or already aborted here
        p.dst_pages = np.asarray(msg.pages, dtype=np.int32)
        p.due = time.monotonic() + (_LATE_WRITE_DELAY_S if p.held_back else 0.0)

    def on_cancel(self, msg: Cancel) -> None:
        """Decode could not reserve pages: the request ends before anything was allocated here."""
        p = self.pending.pop(msg.room, None)
        if p is not None:
            self.rec.request_aborted(p.ref, "bootstrap", "decode could not reserve pages", 503, len(p.tokens))

    def on_abort(self, msg: Abort) -> None:
        room = msg.room
        p = self.pending.get(room)
        if p is None:
            return
        if p.held_back:
            return  # under the late_write fault the write is already posted and cannot be recalled
        del self.pending[room]
        self.rec.request_aborted(p.ref, "prefill", "aborted by the client", 499, len(p.tokens))
        if self.peer is not None:
            self.send_peer(AbortAck(room))  # nothing of ours is in flight to decode's pages

    def has_work(self) -> bool:
        return any(p.dst_pages is not None for p in self.pending.values())

    def step(self) -> None:
        now = time.monotonic()
        for room in [r for r, p in self.pending.items() if p.dst_pages is not None and p.due <= now]:
            self._run(room, self.pending.pop(room))

    def _run(self, room: int, p: _Pending) -> None:
        ps = self.cfg.page_size
        need = -(-len(p.tokens) // ps)
        pages = self.alloc.alloc(need)
        if pages is None:
            self.rec.request_aborted(p.ref, "prefill_forward", "prefill KV pool exhausted", 503, len(p.tokens))
            self.send_peer(KvFailed(room, "prefill KV pool exhausted"))
            return
        self.rec.pages_allocated(p.ref, pages, "prefill_extend")
        first = self.model.prefill(self.pool, p.tokens, pages)
        digests, req_digest = None, None
        if self.cfg.kv_digests:
            digests = self.integrity.page_digests(pages)
            req_digest = self.integrity.request_digest(digests)
            self.rec.kv_written(p.ref, pages, 0, len(p.tokens), "forward", digests, DIGEST_ALGO)
        else:
            self.rec.kv_written(p.ref, pages, 0, len(p.tokens), "forward")
        assert p.dst_pages is not None, "prefill: run only once decode's pages arrived"
        dst = p.dst_pages[:need]
        try:
            self.engine.write_pages(self.peer_session, self.src_buffers, self.dst_buffers, pages, dst)
        except (TransferError, ValueError) as exc:
            self.rec.request_aborted(p.ref, "transfer", str(exc)[:200], 500, len(p.tokens))
            self._free(p.ref, pages, "abort")
            self.send_peer(KvFailed(room, str(exc)))
            return
        self.rec.transfer_sent(
            p.ref, pages, dst, len(p.tokens), True, req_digest, DIGEST_ALGO if req_digest is not None else None
        )
        self._free(p.ref, pages, "finish")
        self.send_peer(KvDone(room, first, len(p.tokens), len(pages), digests))

    def _free(self, ref: RequestRef, pages, reason: str) -> None:
        self.rec.pages_freed(ref, pages, reason)
        self.alloc.free(pages)

    def on_peer_lost(self) -> None:
        for p in self.pending.values():
            self.rec.request_aborted(p.ref, "transfer", "decode worker is gone", 502, len(p.tokens))
        self.pending.clear()

    HANDLERS = {
        **WorkerBase.HANDLERS,
        ConnectPeer: on_connect_peer,
        PrefillRequest: on_prefill,
        DstPages: on_dst,
        Cancel: on_cancel,
        Abort: on_abort,
    }
