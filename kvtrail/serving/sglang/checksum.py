"""Hooks on decode's side of SGLang's KV checksum (``--disaggregation-enable-kv-checksum``).

``_commit_transfer_to_req`` copies prefill's digest into ``req.expected_kv_checksum``; when the request
first enters a batch, ``Scheduler._verify_kv_checksums`` digests decode's own reserved row once
(``KvChecksumComputer.compute`` per request, in batch order), zeroes the expected value of every request
it checked and hands each mismatch to ``_handle_kv_checksum_mismatch``, which aborts it with 500. The
plugin pairs the computed digests with the requests checked, in order, and records each verdict as a
``transfer_received`` carrying decode's digest: kvtrail's F3 compares it with the digest prefill's
``transfer_sent`` carried. Only host-side ints are read: ``compute`` already returned a Python int.
"""

from __future__ import annotations

from typing import Any

from kvtrail.serving.sglang.session import Session
from kvtrail.serving.sglang.transfer import record_verified


class Verification:
    """One ``_verify_kv_checksums`` call: the requests that had a digest to check, what compute returned."""

    __slots__ = ("expected", "computed", "mismatched")

    def __init__(self, expected: list) -> None:
        self.expected = expected  # (req, prefill's digest, its ReqState) in batch order
        self.computed: list[int] = []
        self.mismatched: set[str] = set()


def verify_pre(s: Session, scheduler: Any, batch: Any) -> Any:
    """Before SGLang verifies: which requests of the batch carry prefill's digest."""
    if getattr(scheduler, "kv_checksum_computer", None) is None:
        return None
    # the states are taken now: a mismatch streams the abort, which ends the request's state
    expected = [
        (r, int(r.expected_kv_checksum), s.state(str(r.rid)))
        for r in batch.reqs
        if getattr(r, "expected_kv_checksum", 0)
    ]
    if not expected:
        return None
    prev = getattr(s.local, "verifying", None)
    s.local.verifying = Verification(expected)
    return prev, s.local.verifying


def on_compute(s: Session, result: Any, _computer: Any, *_: Any, **__: Any) -> None:
    """KvChecksumComputer.compute (AFTER): one digest, paired in order with the requests being checked."""
    v = getattr(s.local, "verifying", None)
    if v is not None and result is not None:
        v.computed.append(int(result))


def on_mismatch(s: Session, _scheduler: Any, req: Any, _msg: str) -> None:
    """_handle_kv_checksum_mismatch (BEFORE): SGLang drops this request (any attention-TP rank's mismatch)."""
    v = getattr(s.local, "verifying", None)
    if v is not None:
        v.mismatched.add(str(req.rid))


def verify_post(s: Session, token: Any, _result: Any) -> None:
    """Record each verdict; a request SGLang skipped (health check, a peer it does not verify) keeps its digest."""
    if token is None:
        return
    prev, v = token
    s.local.verifying = prev
    checked = [x for x in v.expected if not getattr(x[0], "expected_kv_checksum", 0)]
    if len(checked) != len(v.computed):
        raise RuntimeError(f"{len(checked)} requests checked, {len(v.computed)} digests computed")
    for (req, expected, st), digest in zip(checked, v.computed):
        if str(req.rid) in v.mismatched:
            # a mismatch on a peer rank only: this rank's digest matched, so it cannot show the difference
            record_verified(s, req, st, "mismatch", digest if digest != expected else None)
        else:
            record_verified(s, req, st, "ok", digest)
