"""Hooks on the PD transfer: pages prefill sends, what lands at decode, and the transferred-length check.

Prefill writes the tokens it actually covers, bound to the bootstrap room, into a spare slot of the
metadata ("aux") buffer that travels with the KV (``cached_tokens[idx][7..8]``: unused in 0.5.23 and
not reset by ``clear_slot``, hence the room tag). Decode reads it before it commits the transfer: that
is the only way decode learns how much of what it reserved was written. Where the slot is not this
room's, decode cannot tell: the receipt is ``unverified`` (nothing proven, no ``transfer_in`` write), unless
SGLang's checksum later proves the landing. With enforcement on (off by default; both roles must run the
plugin) decode aborts a request whose covered length differs from its reservation, or cannot be shown,
with HTTP 500, as SGLang's own corruption path does, instead of serving it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtrail.serving.sglang.pages import block_hashes, pages_of
from kvtrail.serving.sglang.resolver import Snapshot, snapshot
from kvtrail.serving.sglang.session import ReqState, Session

SLOT_TOKENS, SLOT_TAG = 7, 8
HTTP_INTERNAL_ERROR = 500
# SGLang's --disaggregation-enable-kv-checksum digest: Adler-32 of the pages' bytes in buffer order, equal to
# zlib.adler32 of their concatenation; prefill's and decode's receipts name it alike so F3 compares them.
DIGEST_ALGO = "adler32"


def room_tag(room: int) -> int:
    """A non-zero 31-bit tag of a bootstrap room (the slot is int32)."""
    return ((int(room) * 0x9E3779B1) & 0x7FFFFFFF) | 1


def write_covered(buffers: Any, req: Any) -> None:
    """Prefill: the tokens this transfer covers, bound to the room, into the request's metadata slot."""
    room = getattr(req, "bootstrap_room", None)
    if room is None:
        return
    covered = len(req.origin_input_ids) - int(getattr(req, "disagg_decode_prefix_len", 0) or 0)
    row = buffers.cached_tokens[req.metadata_buffer_index]
    row[SLOT_TOKENS] = max(covered, 0)
    row[SLOT_TAG] = room_tag(room)


def read_covered(queue: Any, decode_req: Any) -> int | None:
    """Decode: the tokens prefill said it covers, or None when the slot is not this room's."""
    req = decode_req.req
    row = queue.metadata_buffers.cached_tokens[decode_req.metadata_buffer_index]
    if req.bootstrap_room is None or int(row[SLOT_TAG]) != room_tag(req.bootstrap_room):
        return None
    return int(row[SLOT_TOKENS])


def reserved_tokens(req: Any) -> int:
    """What decode reserved for the transfer: its own prompt length past the prefix it already holds."""
    fill = len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)
    return fill - int(req.kv.cache_protected_len)


# ---- prefill: MetadataBuffers.set_kv_checksum (AFTER), CommonKVSender.send (AROUND) -----------------------


def on_set_kv_checksum(s: Session, _result: Any, _buffers: Any, req: Any, digest: int, signature: int) -> None:
    """SGLang's own transfer digest (--disaggregation-enable-kv-checksum), sent with the last chunk, and the
    tokens it covers: ``send_kv_chunk`` digests ``[disagg_decode_prefix_len, min(extend_end, prompt))``."""
    if digest and getattr(req, "bootstrap_room", None) is not None:
        s.digests[int(req.bootstrap_room)] = (int(digest), sent_digest_tokens(req))


def sent_digest_tokens(req: Any) -> int | None:
    """The tokens prefill's last-chunk digest covers (host ints only); None where the request has no extend
    end (SGLang itself needs one there: not a path it digests on)."""
    end = getattr(req, "extend_end", None)
    if end is None:
        return None
    covered = min(int(end), len(req.origin_input_ids)) - int(getattr(req, "disagg_decode_prefix_len", 0) or 0)
    return max(covered, 0)


def send_pre(
    s: Session,
    sender: Any,
    kv_indices: Any,
    state_indices: Any = None,
    num_kv_tokens: Any = None,
    indices_event: Any = None,
) -> Any:
    return sender, int(sender.curr_idx), kv_indices, num_kv_tokens, indices_event


def send_post(s: Session, token: Any, _result: Any) -> None:
    if token is None:
        return
    sender, start, kv_indices, num_kv_tokens, indices_event = token
    end = int(sender.curr_idx)
    if end == start:  # skipped (already concluded, or a rank with nothing to send)
        return
    ref = s.rooms.get(int(sender.bootstrap_room))
    if ref is None:
        return
    pages = Snapshot(kv_indices, indices_event) if indices_event is not None else snapshot(kv_indices)
    dst = _dst_pages(sender, start, end)
    n = int(num_kv_tokens) if num_kv_tokens is not None else (end - start) * s.page_size
    last = end == int(sender.num_kv_indices)
    digest = s.digests.pop(int(sender.bootstrap_room), None) if last else None
    s.later("CommonKVSender.send", _record_sent, s, ref, pages, dst, n, last, digest)


def _digest_parts(digest: tuple[int, int | None] | None) -> tuple[int | None, str | None, int | None]:
    """(digest, its algorithm, the tokens it covers) of a kept prefill digest, or three Nones."""
    return (digest[0], DIGEST_ALGO, digest[1]) if digest is not None else (None, None, None)


def _dst_pages(sender: Any, start: int, end: int) -> np.ndarray | None:
    infos = getattr(sender.kv_mgr, "transfer_infos", {}).get(sender.bootstrap_room) or {}
    for info in infos.values():
        dst = getattr(info, "dst_kv_indices", None)
        if dst is not None:
            return np.asarray(dst[start:end], dtype=np.int64).copy()
    return None


def _record_sent(
    s: Session,
    ref: Any,
    pages: Snapshot,
    dst: np.ndarray | None,
    n: int,
    last: bool,
    digest: tuple[int, int | None] | None,
) -> None:
    src = pages.numpy().reshape(-1).copy()
    if dst is None or len(dst) != len(src):
        # decode's pages unknown here (no handshake info for the room): the event cannot be stored; say so
        s.recorder.events_lost(
            "invalid",
            1,
            len(src),
            f"sglang transfer_sent of transfer {ref.transfer_id}: decode's destination pages unknown to prefill",
        )
        return
    s.recorder.transfer_sent(ref, src, dst, n, last, *_digest_parts(digest))


# ---- decode: DecodeTransferQueue._commit_transfer_to_req ------------------------------------------------

UNVERIFIED = "unverified"


def record_landed(s: Session, decode_req: Any, covered: int | None, status: str) -> None:
    """The transfer's receipt, and the KV it wrote into decode's reserved pages, as far as decode can show it.

    ``covered``: the tokens prefill's slot says this transfer covers for this room; then the receipt and
    the ``transfer_in`` write cover exactly that (at most the reservation). None: decode cannot tell (the
    slot is another room's: prefill without the plugin, or no metadata for this room arrived), and the
    receipt says so: status ``unverified``, 0 tokens proven, every reserved page listed (their writer is
    unknown from now on) and no write recorded. SGLang's checksum, where enabled, can still prove it later
    (:func:`record_verified`).
    """
    req = decode_req.req
    st = s.state(str(req.rid))
    if covered is None:
        st.landed_tokens, st.unverified = 0, True
        s.later(
            "_commit_transfer_to_req",
            _record_landed,
            s,
            s.ref(req),
            st.reserved_pages,
            st.prefix_tokens,
            0,
            UNVERIFIED if status == "ok" else status,
            None,
            None,
            True,
        )
        return
    reserved = st.reserved_tokens or reserved_tokens(req)
    landed = min(covered, reserved)
    st.landed_tokens, st.unverified = landed, False
    s.later(
        "_commit_transfer_to_req",
        _record_landed,
        s,
        s.ref(req),
        st.reserved_pages,
        st.prefix_tokens,
        landed,
        status,
        None,
        req.origin_input_ids,
    )


def digested_tokens(req: Any) -> int:
    """The tokens SGLang's ``_verify_kv_checksums`` digests on decode: the prompt past the prefix decode's
    tree cache holds (what prefill sent and digested)."""
    return len(req.origin_input_ids) - int(req.kv.cache_protected_len)


def record_verified(s: Session, req: Any, st: ReqState, status: str, digest: int | None) -> None:
    """Decode's checksum verdict (SGLang's _verify_kv_checksums): a second receipt of the same transfer that
    carries the digest decode computed over its reserved pages, ``ok`` or ``mismatch``.

    After an unverified commit a matching digest is the proof the commit lacked: decode's pages hold what
    prefill digested, so the receipt covers the digested tokens and records the transfer's write. A
    mismatch proves nothing landed as sent: 0 tokens, the pages' writer stays unknown. Each receipt carries the
    tokens decode's digest covered (``digest_tokens``), whatever it proves.
    """
    covered = digested_tokens(req) if digest is not None else None
    if st.unverified:
        if status == "ok" and digest is not None:
            st.landed_tokens, st.unverified = digested_tokens(req), False
            s.later(
                "_verify_kv_checksums",
                _record_landed,
                s,
                s.ref(req),
                st.reserved_pages,
                st.prefix_tokens,
                st.landed_tokens,
                status,
                digest,
                req.origin_input_ids,
                False,
                covered,
            )
            return
        s.later(
            "_verify_kv_checksums",
            _record_landed,
            s,
            s.ref(req),
            st.reserved_pages,
            st.prefix_tokens,
            0,
            status,
            digest,
            None,
            True,
            covered,
        )
        return
    landed = st.landed_tokens if st.landed_tokens is not None else reserved_tokens(req)
    s.later(
        "_verify_kv_checksums",
        _record_landed,
        s,
        s.ref(req),
        st.reserved_pages,
        st.prefix_tokens,
        landed,
        status,
        digest,
        None,
        False,
        covered,
    )


def _record_landed(
    s: Session,
    ref: Any,
    reserved: Snapshot | None,
    prefix: int,
    landed: int,
    status: str,
    digest: int | None,
    ids: Any,
    every_page: bool = False,
    digest_tokens: int | None = None,
) -> None:
    """The receipt; with the request's token ids (``ids``; None: a receipt only) the KV written into decode's
    pages, with the pages' content keys, so a later prefix hit on decode's radix cache matches its writer.
    ``every_page``: the receipt lists every reserved page (an unproven landing: their writer is unknown)."""
    if ref.transfer_id is None:  # SGLang's fake transfer (a health check, warm-up): nothing was transferred
        return
    ps = s.page_size
    pages = pages_of(reserved.numpy(), ps) if reserved is not None else np.zeros(0, dtype=np.int64)
    covered = pages if every_page else (pages[: -(-landed // ps)] if landed else pages[:0])
    algo = DIGEST_ALGO if digest is not None else None
    s.recorder.transfer_received(ref, covered, landed, status, digest, algo, digest_tokens)
    if ids is not None and len(covered):
        keys = block_hashes(ids, prefix // ps, len(covered), ps)
        s.recorder.kv_written(ref, covered, prefix, prefix + landed, "transfer_in", block_hashes=keys)


def exempt(req: Any) -> bool:
    """Requests SGLang itself commits without a transfer (its fake transfers: warm-up, health checks)."""
    from sglang.srt.disaggregation.utils import _is_fake_transfer

    return bool(_is_fake_transfer(req))


def abort_mismatch(queue: Any, decode_req: Any, covered: int | None, reserved: int) -> None:
    """Enforcement: abort just this request with 500, as SGLang's own metadata-corruption path does.
    ``covered`` None: decode cannot show that any transfer wrote this request's KV."""
    from sglang.srt.disaggregation.utils import prepare_abort

    what = f"prefill covered {covered} tokens" if covered is not None else "no transfer metadata of this request's room"
    prepare_abort(
        decode_req.req,
        f"Transferred length mismatch: {what}, decode reserved {reserved}",
        status_code=HTTP_INTERNAL_ERROR,
    )
    if decode_req.kv_receiver is not None:
        decode_req.kv_receiver.clear()
        decode_req.kv_receiver = None
