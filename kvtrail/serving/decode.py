"""Decode worker: reserve pages for the prompt length the router announced, take prefill's KV, generate.

Generation attends to every reserved page (``seq_len`` is the announced prompt length), one token
per request per loop step, so requests interleave as in continuous batching. In ``patched`` mode
decode checks tokens landed == tokens reserved before generating (500 otherwise) and releases the
pages of an aborted request only once prefill confirms nothing is in flight (deferred release).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from multiprocessing.connection import Client
from typing import Any

import numpy as np
import torch

from kvtrail.audit.events import RequestRef
from kvtrail.serving.integrity import DIGEST_ALGO
from kvtrail.serving.messages import (
    Abort,
    AbortAck,
    Cancel,
    ConnectPeer,
    DecodeRequest,
    DstPages,
    KvDone,
    KvFailed,
    Response,
)
from kvtrail.serving.worker_base import WorkerBase


@dataclass
class _Req:
    ref: RequestRef
    prompt_len: int
    max_new: int
    pages: np.ndarray
    arrived_ns: int
    state: str = "waiting_kv"  # waiting_kv | running | aborted_waiting
    table: np.ndarray | None = None
    out: bytearray = field(default_factory=bytearray)
    step: int = 1
    freed: bool = False
    first_token_mono_ns: int | None = None  # CLOCK_MONOTONIC is one clock for every process of the host
    tags: np.ndarray | None = None  # ownership tags this request holds, one per page of its table


class DecodeWorker(WorkerBase):
    """Reserves pages, takes prefill's KV into them and generates, one token per request per step."""

    role = "decode"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.reqs: dict[int, _Req] = {}
        self.forgotten: dict[int, _Req] = {}  # aborted and released: a late write may still arrive
        self.quarantine: list[tuple[float, _Req]] = []

    def on_connect_peer(self, msg: ConnectPeer) -> None:
        """Decode dials prefill's listener: the channel page ids and KV completions travel on."""
        self.peer = Client(msg.info.address, authkey=msg.info.authkey)

    # ---- admission and transfer ----------------------------------------------------------------

    def on_decode(self, msg: DecodeRequest) -> None:
        room, ref, prompt_len, max_new = msg.room, msg.ref, msg.prompt_tokens, msg.max_new_tokens
        self.rec.request_received(ref, prompt_len, max_new)
        if len(self.reqs) >= self.cfg.max_running_requests:
            self.rec.request_aborted(ref, "decode_prealloc", "decode at max running requests", 503, prompt_len)
            self.send_peer(Cancel(room))
            self._respond(room, 503, error="decode is at its max running requests")
            return
        need = -(-prompt_len // self.cfg.page_size)
        pages = self._reserve(need)
        if pages is None:
            self.rec.request_aborted(ref, "decode_prealloc", "decode KV pool exhausted", 503, prompt_len)
            self.send_peer(Cancel(room))  # prefill admitted it and is waiting for page ids
            self._respond(room, 503, error="decode KV pool exhausted")
            return
        self.rec.transfer_reserved(ref, pages, prompt_len)
        self.rec.pages_allocated(ref, pages, "decode_reservation")
        self.reqs[room] = _Req(
            ref, prompt_len, max_new, pages, time.monotonic_ns(), tags=self.integrity.allocate(pages)
        )
        self.send_peer(DstPages(room, pages, prompt_len))

    def _reserve(self, need: int) -> np.ndarray | None:
        victims = [r for r in self.reqs.values() if r.state == "running" and not r.freed]
        if self.cfg.faults.double_alloc and victims and need > 1:
            # Fault: one page still held by a running request is handed out again.
            pages = self.alloc.alloc(need - 1)
            if pages is None:
                return None
            stolen = int(victims[0].pages[-1])
            self.alloc.force_alloc([stolen])
            return np.append(pages, np.int32(stolen)).astype(np.int32)
        return self.alloc.alloc(need)

    def on_kv_done(self, msg: KvDone) -> None:
        room, tokens_sent, sent_digests = msg.room, msg.tokens_sent, msg.page_digests
        r = self.reqs.get(room) or self.forgotten.pop(room, None)
        if r is None:
            return
        landed = r.pages[: msg.pages_sent]
        if self.cfg.faults.corrupt_transfer and len(landed):
            self._corrupt(int(landed[0]))
        digests = req_digest = None
        bad = landed[:0]
        if self.cfg.kv_digests and sent_digests is not None:
            digests = self.integrity.page_digests(landed)
            req_digest = self.integrity.request_digest(digests)
            bad = landed[digests != np.asarray(sent_digests, dtype=np.uint64)]
        algo = DIGEST_ALGO if digests is not None else None
        if r.state == "aborted_waiting" or room not in self.reqs:
            # The write of an aborted request finished. With deferred release its pages were still
            # held (safe to release now); without, it landed in pages that may belong to someone else.
            self.rec.transfer_received(r.ref, landed, tokens_sent, "aborted", req_digest, algo)
            self.rec.kv_written(r.ref, landed, 0, tokens_sent, "transfer_in", digests, algo)
            if room in self.reqs:
                self._release(room, "deferred_release")
            return
        ok = tokens_sent == r.prompt_len and not len(bad)
        self.rec.transfer_received(r.ref, landed, tokens_sent, "ok" if ok else "mismatch", req_digest, algo)
        self.rec.kv_written(r.ref, landed, 0, tokens_sent, "transfer_in", digests, algo)
        if not ok and self.cfg.mode == "patched":
            if len(bad):
                reason = f"KV digest mismatch on pages {bad[:8].tolist()}"
            else:
                reason = f"transfer length mismatch: {tokens_sent} tokens landed, {r.prompt_len} reserved"
            self._abort_running(room, r, reason)
            return
        r.state = "running"
        r.table = r.pages.copy()
        r.out.append(msg.first_token)
        r.first_token_mono_ns = time.monotonic_ns()
        if self.cfg.faults.premature_free:
            self._free_pages(r, r.pages, "finish")  # fault: freed while the request goes on reading
            r.freed = True
        if not self._tags_hold(room, r):
            return
        if self.cfg.kv_digests:  # what attention reads, digested: forensics' lineage evidence for stale pages
            self.rec.kv_read(r.ref, r.table, self.integrity.page_digests(r.table), DIGEST_ALGO)
        else:
            self.rec.kv_read(r.ref, r.table)

    def _tags_hold(self, room: int, r: _Req) -> bool:
        """Patched mode: every page must still carry the tag this request was given, or it is not read."""
        if not self.cfg.page_tags:
            return True
        foreign = self.integrity.foreign_pages(r.table, r.tags)
        if len(foreign):
            self._abort_running(room, r, f"page ownership tag mismatch on pages {foreign[:8].tolist()}: not attended")
            return False
        return True

    def _abort_running(self, room: int, r: _Req, reason: str) -> None:
        self.rec.request_aborted(r.ref, "decode", reason, 500, r.prompt_len)
        self._release(room, "abort")
        self._respond(room, 500, error=reason)

    def _corrupt(self, page: int) -> None:
        """Fault injection: flip one bit of a page that just landed (corruption in flight)."""
        row = self.pool.buffers()[0][page].view(-1).view(torch.uint8)
        row[0] ^= 1

    def on_kv_failed(self, msg: KvFailed) -> None:
        room, error = msg.room, msg.error
        r = self.reqs.get(room)
        if r is None:
            return
        self.rec.transfer_received(r.ref, r.pages[:0], 0, "failed")
        self.rec.request_aborted(r.ref, "transfer", error[:200], 500, r.prompt_len)
        if self.cfg.mode == "patched":
            # A failed batch may still be writing: keep the pages out of the pool for the engine timeout.
            self.quarantine.append((time.monotonic() + self.cfg.transfer_timeout_s, self.reqs.pop(room)))
        else:
            self._release(room, "abort")
        self._respond(room, 500, error=f"KV transfer failed: {error}")

    def on_abort(self, msg: Abort) -> None:
        room = msg.room
        r = self.reqs.get(room)
        if r is None:
            return
        self.rec.request_aborted(r.ref, "decode", "aborted by the client", 499, r.prompt_len)
        self._respond(room, 499, error="aborted by the client")
        if r.state == "waiting_kv" and self.cfg.mode == "patched":
            r.state = "aborted_waiting"  # deferred release: wait for prefill's kv_done or abort_ack
            return
        if r.state == "waiting_kv":
            self.forgotten[room] = r
        self._release(room, "abort")

    def on_abort_ack(self, msg: AbortAck) -> None:
        r = self.reqs.get(msg.room)
        if r is not None and r.state == "aborted_waiting":
            self._release(msg.room, "deferred_release")

    def on_peer_lost(self) -> None:
        for room, r in list(self.reqs.items()):
            if r.state in ("waiting_kv", "aborted_waiting"):
                if r.state == "waiting_kv":
                    self.rec.request_aborted(r.ref, "transfer", "prefill worker is gone", 502, r.prompt_len)
                    self._respond(room, 502, error="prefill worker is gone")
                self._release(room, "abort")  # the writer is dead: nothing more can land

    # ---- generation ----------------------------------------------------------------------------

    def has_work(self) -> bool:
        return any(r.state == "running" for r in self.reqs.values())

    def step(self) -> None:
        now = time.monotonic()
        while self.quarantine and self.quarantine[0][0] <= now:
            _, r = self.quarantine.pop(0)
            self._free_pages(r, r.pages, "deferred_release")
        running = [(room, r) for room, r in self.reqs.items() if r.state == "running"]
        if not running:
            return
        if self.cfg.decode_step_delay_s:
            time.sleep(self.cfg.decode_step_delay_s)  # the time a real decode step takes
        ps = self.cfg.page_size
        for room, r in running:
            if len(r.out) >= r.max_new:
                self._finish(room, r)
                continue
            if not self._tags_hold(room, r):
                continue
            assert r.table is not None and r.tags is not None, "decode: a running request has a table and tags"
            token = self.model.decode_step(self.pool, r.table, r.prompt_len, r.step)
            r.out.append(token)
            pos = r.prompt_len + r.step - 1  # where this token's own K/V goes
            if pos // ps >= len(r.table):
                new = self.alloc.alloc(1)
                if new is None:
                    self.rec.request_aborted(
                        r.ref, "decode", "decode KV pool exhausted while generating", 503, r.prompt_len
                    )
                    self._release(room, "abort")
                    self._respond(room, 503, error="decode KV pool exhausted")
                    continue
                self.rec.pages_allocated(r.ref, new, "decode_growth")
                self.rec.kv_read(r.ref, new)
                r.table = np.append(r.table, new).astype(np.int32)
                r.tags = np.append(r.tags, self.integrity.allocate(new))
            self.model.write_token(self.pool, r.table, pos, token)
            r.step += 1

    def _finish(self, room: int, r: _Req) -> None:
        text = bytes(r.out).decode("utf-8", errors="replace")
        self._release(room, "finish")
        self._respond(
            room,
            200,
            text=text,
            completion_tokens=len(r.out),
            first_token_mono_ns=r.first_token_mono_ns,
            finish_reason="length",
        )

    # ---- helpers -------------------------------------------------------------------------------

    def _release(self, room: int, reason: str) -> None:
        r = self.reqs.pop(room)
        own = r.table if r.table is not None else r.pages
        if r.freed:  # prematurely freed reservation: only growth pages are still ours
            own = own[len(r.pages) :]
        self._free_pages(r, own, reason)

    def _free_pages(self, r: _Req, pages, reason: str) -> None:
        if len(pages):
            self.rec.pages_freed(r.ref, pages, reason)
            self.alloc.free(pages)
            self.integrity.free(pages)

    def _respond(
        self,
        room: int,
        status: int,
        *,
        text: str = "",
        completion_tokens: int = 0,
        first_token_mono_ns=None,
        finish_reason: str = "abort",
        error: str | None = None,
    ) -> None:
        self.send_router(Response(room, status, text, completion_tokens, first_token_mono_ns, finish_reason, error))

    HANDLERS = {
        **WorkerBase.HANDLERS,
        ConnectPeer: on_connect_peer,
        DecodeRequest: on_decode,
        KvDone: on_kv_done,
        KvFailed: on_kv_failed,
        Abort: on_abort,
        AbortAck: on_abort_ack,
    }
