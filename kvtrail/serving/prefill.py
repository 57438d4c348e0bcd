"""Prefill worker: admit a prompt, wait for decode's page ids, run the forward pass, write KV into decode.

``vulnerable`` mode is SGLang before 0.5.20: a prompt longer than the pool is marked aborted and its
input replaced by a one-token placeholder, but admission checks "finished" rather than "aborted", so
the placeholder is prefilled, one page is sent and the transfer is reported complete. ``patched``
rejects it with 400 before bootstrap, allocation or transfer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from kvtrail.audit.events import RequestRef
from kvtrail.serving.integrity import DIGEST_ALGO
from kvtrail.serving.transfer import TransferError
from kvtrail.serving.worker import WorkerBase

_LATE_WRITE_DELAY_S = 0.5  # how long a flagged transfer is held back under the late_write fault


@dataclass
class _Pending:
    ref: RequestRef
    tokens: bytes
    held_back: bool
    dst_pages: np.ndarray | None = None
    due: float = 0.0


class PrefillWorker(WorkerBase):
    role = "prefill"

    def __init__(self, *args):
        super().__init__(*args)
        self.pending: dict[int, _Pending] = {}

    def on_peer(self, _room, info: dict) -> None:
        self.connect_peer(info)
        self.dst_buffers = [tuple(b) for b in info["buffers"]]
        self.src_buffers = [(b.data_ptr(), b.numel() * b.element_size(), b.stride(0) * b.element_size())
                            for b in self.pool.buffers()]

    def on_prefill(self, room: int, ref: RequestRef, tokens: bytes, held_back: bool) -> None:
        self.rec.request_received(ref, len(tokens))
        capacity = self.alloc.num_pages * self.cfg.page_size
        if len(tokens) > capacity:
            reason = f"input of {len(tokens)} tokens exceeds the KV pool of {capacity} tokens"
            self.rec.request_aborted(ref, "prefill_queue", reason, 400, len(tokens))
            if self.cfg.mode == "patched":
                self.send_router(("rejected", room, 400, f"field 'prompt': {reason}"))
                return
            # The bug: the aborted request keeps going with a one-token placeholder input, and the
            # queue only checks whether it is finished.
            tokens = tokens[:1]
        self.pending[room] = _Pending(ref, tokens, held_back and self.cfg.faults.late_write)
        self.send_router(("admitted", room))

    def on_dst(self, room: int, dst_pages, reserved_tokens: int) -> None:
        p = self.pending.get(room)
        if p is None:
            return  # rejected or already aborted here
        p.dst_pages = np.asarray(dst_pages, dtype=np.int32)
        p.due = time.monotonic() + (_LATE_WRITE_DELAY_S if p.held_back else 0.0)

    def on_cancel(self, room: int) -> None:
        """Decode could not reserve pages: the request ends before anything was allocated here."""
        p = self.pending.pop(room, None)
        if p is not None:
            self.rec.request_aborted(p.ref, "bootstrap", "decode could not reserve pages", 503, len(p.tokens))

    def on_abort(self, room: int) -> None:
        p = self.pending.get(room)
        if p is None:
            return
        if p.held_back:
            return  # under the late_write fault the write is already posted and cannot be recalled
        del self.pending[room]
        self.rec.request_aborted(p.ref, "prefill", "aborted by the client", 499, len(p.tokens))
        if self.peer is not None:
            self.send_peer(("abort_ack", room))  # nothing of ours is in flight to decode's pages

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
            self.send_peer(("kv_failed", room, "prefill KV pool exhausted"))
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
        dst = p.dst_pages[:need]
        try:
            self.engine.write_pages(self.peer_info["session"], self.src_buffers, self.dst_buffers, pages, dst)
        except (TransferError, ValueError) as exc:
            self.rec.request_aborted(p.ref, "transfer", str(exc)[:200], 500, len(p.tokens))
            self._free(p.ref, pages, "abort")
            self.send_peer(("kv_failed", room, str(exc)))
            return
        self.rec.transfer_sent(p.ref, pages, dst, len(p.tokens), True, req_digest,
                               DIGEST_ALGO if req_digest is not None else None)
        self._free(p.ref, pages, "finish")
        self.send_peer(("kv_done", room, first, len(p.tokens), len(pages), digests))

    def _free(self, ref: RequestRef, pages, reason: str) -> None:
        self.rec.pages_freed(ref, pages, reason)
        self.alloc.free(pages)

    def on_peer_lost(self) -> None:
        for room, p in list(self.pending.items()):
            self.rec.request_aborted(p.ref, "transfer", "decode worker is gone", 502, len(p.tokens))
        self.pending.clear()
