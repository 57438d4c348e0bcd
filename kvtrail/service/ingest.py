"""``POST /v1/events``: one batch from one producer instance, committed before the reply.

The body is JSON lines (``application/x-ndjson``, event schema v1) or an Arrow IPC stream
(``application/vnd.apache.arrow.stream``, what :class:`~kvtrail.audit.httpsink.HttpSink` and the relay
send). It is counted while it is read, so a body over the limit is refused (413) without being
buffered whole. The batch is checked by the store's own validation when the committer appends it: any
invalid event refuses the whole batch (422, the error names event index, kind, field and reason) and
nothing of it is stored. The 200 reply comes only after the commit, with the stored batch's number and
chain digest; a re-sent batch gets the stored batch's reply with ``duplicate: true``.
"""

import asyncio
from typing import Annotated

import numpy as np
import pyarrow as pa
from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from kvtrail.audit.batch import parse_jsonl, read_ipc
from kvtrail.audit.events import Producer
from kvtrail.audit.validate import PRODUCER_NAMES, Prechecked, precheck_batch, producer_id
from kvtrail.errors import KvtrailError, ValidationError
from kvtrail.service.auth import check_ingest, principal_dependency, require_role
from kvtrail.service.committer import IngestReply
from kvtrail.service.config import DEFAULT_MAX_BODY_BYTES
from kvtrail.service.state import ServiceState
from kvtrail.service.tokens import Principal

NDJSON = "application/x-ndjson"
ARROW = "application/vnd.apache.arrow.stream"


class BodyTooLarge(KvtrailError):
    """The request body is over the service's limit."""

    http_status = 413


class UnsupportedMediaType(KvtrailError):
    """The request body is neither JSON lines nor an Arrow IPC stream."""

    http_status = 415


class EventError(BaseModel):
    """Why a batch was refused: the event (index in the batch), its kind, the field and the reason."""

    event: int | None
    kind: str | None
    field: str
    reason: str


class IngestErrors(BaseModel):
    errors: list[EventError]


class ErrorDetail(BaseModel):
    detail: str


_BODY = {
    "required": True,
    "content": {
        NDJSON: {"schema": {"type": "string"}},
        ARROW: {"schema": {"type": "string", "format": "binary"}},
    },
}
_RESPONSES: dict[int | str, dict] = {
    401: {"model": ErrorDetail, "description": "missing or unknown token"},
    403: {"model": ErrorDetail, "description": "the token may not send for this producer"},
    409: {"model": ErrorDetail, "description": "the seq range overlaps stored batches without being one of them"},
    413: {"model": ErrorDetail, "description": "body over the service's limit"},
    415: {"model": ErrorDetail, "description": "body neither JSON lines nor Arrow IPC"},
    422: {"model": IngestErrors, "description": "the batch breaks the event model; nothing of it was stored"},
    503: {"model": ErrorDetail, "description": "the store failed or the service is stopping; nothing was stored"},
}


def _kind_at(table: pa.Table, i: int) -> str | None:
    if "kind" not in table.column_names:
        return None
    value = table.column("kind")[i].as_py()
    return value if isinstance(value, str) else None


def require_events(table: pa.Table) -> pa.Table:
    """``table``, or ValidationError if it holds no event (a batch holds at least one)."""
    if table.num_rows == 0:
        raise ValidationError("(batch)", "no events: a batch holds at least one event")
    return table


def prechecked_identity(pre: Prechecked) -> tuple[Producer, np.ndarray]:
    """The one producer instance a prechecked batch comes from and its events' seq numbers; ValidationError
    if it mixes producers (one request is one producer's batch), naming the first event of another one and
    the first identity field where it differs from event 0."""
    t = pre.table
    if len(pre.producers) > 1:
        i = int(np.flatnonzero(pre.producer_index != 0)[0])
        first, other = pre.producers[0], pre.producers[pre.producer_index[i]]
        name = next(n for n in PRODUCER_NAMES if getattr(first, n) != getattr(other, n))
        raise ValidationError(
            name,
            f"one request is one producer instance's batch: {getattr(other, name)!r} here, "
            f"{getattr(first, name)!r} at event 0",
            event=i,
            kind=_kind_at(t, i),
        )
    seq = t.column("seq")
    return pre.producers[0], (seq.chunk(0) if seq.num_chunks == 1 else seq.combine_chunks()).to_numpy()


def batch_identity(table: pa.Table) -> tuple[Producer, np.ndarray]:
    """The one producer instance a batch comes from and its events' seq numbers, once the batch passed the
    rules that need nothing of the store (:func:`precheck_batch`; ValidationError otherwise)."""
    return prechecked_identity(precheck_batch(require_events(table)))


def decode_body(content_type: str, body: bytes) -> pa.Table:
    """A request body as a batch table (JSON lines or Arrow IPC); ValidationError naming what is wrong."""
    if content_type == NDJSON:
        return parse_jsonl(body)
    return read_ipc(body)


async def read_body(request: Request, max_body_bytes: int) -> bytes:
    """The body, counted while it arrives: BodyTooLarge as soon as it passes ``max_body_bytes``."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body_bytes:
        raise BodyTooLarge(f"body of {declared} bytes is over the limit of {max_body_bytes} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise BodyTooLarge(f"body is over the limit of {max_body_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def media_type(request: Request) -> str:
    """The request's content type without parameters; UnsupportedMediaType unless ingest accepts it."""
    ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if ctype not in (NDJSON, ARROW):
        raise UnsupportedMediaType(f"content type {ctype or '(none)'!r}: send {NDJSON} or {ARROW}")
    return ctype


def router(state: ServiceState, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> APIRouter:
    """The ingest route of one service."""
    api = APIRouter()
    # Evaluated here (this module has no postponed annotations): FastAPI reads the dependency off it.
    Who = Annotated[Principal, Depends(principal_dependency(state))]

    @api.post(
        "/v1/events",
        response_model=IngestReply,
        responses=_RESPONSES,
        openapi_extra={"requestBody": _BODY},
        summary="Ingest one batch of one producer instance",
        tags=["ingest"],
    )
    async def ingest_events(request: Request, who: Who) -> IngestReply:
        require_role(who, "producer", "operator")
        ctype = media_type(request)
        body = await read_body(request, max_body_bytes)

        def parse() -> tuple[Prechecked, Producer, np.ndarray]:
            # The rules that need nothing of the store run here, beside other requests, not in the writer;
            # the batch's producer and seq numbers come out of them, not out of a second pass.
            pre = precheck_batch(require_events(decode_body(ctype, body)))
            return pre, *prechecked_identity(pre)

        pre, producer, seq = await run_in_threadpool(parse)
        check_ingest(who, [producer])
        # Shielded: a client that hangs up must not cancel a batch the committer may be storing.
        commit = await asyncio.shield(asyncio.wrap_future(state.committer.submit(pre, producer_id(producer), seq)))
        return commit

    return api
