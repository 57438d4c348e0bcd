"""The typed messages of the control channels: router <-> workers and prefill <-> decode.

Each kind of message is one frozen dataclass, pickled over ``multiprocessing.connection`` sockets on
127.0.0.1 (auth key). ``room`` is the request's transfer id (SGLang's bootstrap room); replies to the
router are matched to their waiter by reply type and room (:class:`~kvtrail.serving.link.WorkerLink`).
Control requests that belong to no request use :data:`CONTROL_ROOM`.

The ``*_INBOX`` tuples say which messages each receiver takes; a worker dispatches on the message's
type and rejects anything else with :class:`ProtocolError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import numpy as np

from kvtrail.audit.events import RequestRef
from kvtrail.errors import KvtrailError

CONTROL_ROOM = -1  # the room of control requests (audit switch, page digests): no request has it


class ProtocolError(KvtrailError):
    """A message that its receiver does not take arrived on a control channel."""

    http_status = 502


def unexpected(receiver: str, msg: object) -> ProtocolError:
    """The error for ``msg`` arriving at ``receiver``, naming the message's type."""
    return ProtocolError(f"{receiver}: no handler for message {type(msg).__module__}.{type(msg).__qualname__}")


# ---- worker start (over the start pipe, worker -> stack) ---------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """Where a worker listens for control connections and which pool buffers its engine registered."""

    address: tuple[str, int]
    authkey: bytes
    session: str  # the transfer engine's session id ("127.0.0.1:port"), what peers write to
    buffers: tuple[tuple[int, int, int], ...]  # (addr, nbytes, item_len) per pool buffer


@dataclass(frozen=True, slots=True)
class WorkerReady:
    """The worker built its pool, model and engine and waits for the router to connect."""

    info: WorkerInfo


@dataclass(frozen=True, slots=True)
class WorkerFailed:
    """The worker could not start; ``error`` is the exception, type name first."""

    error: str


# ---- router (or stack) -> worker ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConnectPeer:
    """Wire the worker to its PD peer (decode connects to prefill's listener)."""

    info: WorkerInfo


@dataclass(frozen=True, slots=True)
class PrefillRequest:
    """Admit a prompt on prefill; ``held_back``: the client asked for an abort while KV is in flight."""

    room: int
    ref: RequestRef
    tokens: bytes
    held_back: bool


@dataclass(frozen=True, slots=True)
class DecodeRequest:
    """Reserve decode pages for ``prompt_tokens`` and generate up to ``max_new_tokens`` once KV landed."""

    room: int
    ref: RequestRef
    prompt_tokens: int
    max_new_tokens: int


@dataclass(frozen=True, slots=True)
class Abort:
    """The client went away: end the request (sent to both workers)."""

    room: int


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Stop the worker loop; the worker flushes its recorder and unregisters its pool."""


@dataclass(frozen=True, slots=True)
class SetAudit:
    """Switch recording on or off at run time; answered with :class:`AuditSet`."""

    room: int
    enabled: bool


@dataclass(frozen=True, slots=True)
class DigestPages:
    """Ask for the SHA-256 of some pages' bytes in the worker's pool; answered with :class:`PagesDigest`."""

    room: int
    pages: tuple[int, ...]


# ---- worker -> router ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Admitted:
    """Prefill took the prompt and waits for decode's page ids."""

    room: int


@dataclass(frozen=True, slots=True)
class Rejected:
    """Prefill refused the prompt before bootstrap (patched mode); ``error`` names the field."""

    room: int
    http_status: int
    error: str


@dataclass(frozen=True, slots=True)
class Response:
    """Decode's answer to the client: the generated text, or an error status."""

    room: int
    http_status: int
    text: str
    completion_tokens: int
    first_token_mono_ns: int | None  # CLOCK_MONOTONIC, one clock for every process of the host
    finish_reason: str
    error: str | None


@dataclass(frozen=True, slots=True)
class GetAuditStats:
    """Ask a worker for its recorder's counters (``Recorder.stats``); answered with :class:`AuditStats`."""

    room: int


@dataclass(frozen=True, slots=True)
class AuditStats:
    """Answers :class:`GetAuditStats`: the worker's recorder counters (empty when it records nothing)."""

    room: int
    stats: tuple[tuple[str, int], ...]  # (name, value) pairs: hashable, compares by value


@dataclass(frozen=True, slots=True)
class AuditSet:
    """Acknowledges :class:`SetAudit`: recording is now ``enabled``."""

    room: int
    enabled: bool


@dataclass(frozen=True, slots=True)
class PagesDigest:
    """Answers :class:`DigestPages`: hex SHA-256 of the pages' bytes, every buffer in pool order."""

    room: int
    sha256_hex: str


# ---- prefill <-> decode --------------------------------------------------------------------------------
# The page lists stay numpy arrays (compact to pickle); array fields make ``==`` ambiguous, so these
# messages compare by identity (eq=False).


@dataclass(frozen=True, slots=True, eq=False)
class DstPages:
    """Decode -> prefill: the pages reserved for the request, where prefill writes its KV."""

    room: int
    pages: np.ndarray  # int32 page ids, in page-table order
    reserved_tokens: int


@dataclass(frozen=True, slots=True)
class Cancel:
    """Decode -> prefill: decode could not reserve pages; drop the admitted request."""

    room: int


@dataclass(frozen=True, slots=True)
class AbortAck:
    """Prefill -> decode: the aborted request has no write in flight; its pages may be released."""

    room: int


@dataclass(frozen=True, slots=True, eq=False)
class KvDone:
    """Prefill -> decode: the KV write completed; ``page_digests`` (uint64) when digests are on."""

    room: int
    first_token: int
    tokens_sent: int
    pages_sent: int
    page_digests: np.ndarray | None


@dataclass(frozen=True, slots=True)
class KvFailed:
    """Prefill -> decode: the request's KV could not be written (pool exhausted or transfer failed)."""

    room: int
    error: str


RouterReply = Admitted | Rejected | Response | AuditSet | AuditStats | PagesDigest

_COMMON_INBOX = (ConnectPeer, Abort, Shutdown, SetAudit, GetAuditStats, DigestPages)
PREFILL_INBOX: tuple[type, ...] = (*_COMMON_INBOX, PrefillRequest, DstPages, Cancel)
DECODE_INBOX: tuple[type, ...] = (*_COMMON_INBOX, DecodeRequest, KvDone, KvFailed, AbortAck)
ROUTER_INBOX: tuple[type, ...] = get_args(RouterReply)
START_INBOX: tuple[type, ...] = (WorkerReady, WorkerFailed)
