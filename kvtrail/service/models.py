"""Response models of the query API, so ``/openapi.json`` describes every table it returns.

A table's JSON is an array of row objects with exactly the fields of the CLI's ``--format json`` (the
same Polars frame, written by :func:`kvtrail.answers.tables.json_text`); the table rows' models are
generated from the questions' :mod:`~kvtrail.answers.spec`, so they state those fields, their types
and docs. Every field may be null (the frames allow it). Tenant tokens get their own,
narrower rows (``Tenant*``): their own requests and counts, never another tenant's ids.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, create_model

from kvtrail.answers import spec
from kvtrail.answers.spec import EVIDENCE, AnswerSpec

Ids = list[str | None] | None
Int = int | None
Str = str | None


class Row(BaseModel):
    """A table row: exactly these fields, each may be null."""

    model_config = ConfigDict(extra="forbid")


class Evidence(BaseModel):
    """One event that proves a finding: its producer and sequence number."""

    producer_id: Int
    seq: Int


def _field_type(dtype: pl.DataType | type[pl.DataType]) -> Any:
    """The JSON type of a column of that dtype (every value may be null)."""
    if dtype == pl.Utf8:
        return Str
    if dtype == pl.Boolean:
        return bool | None
    if dtype.is_float():
        return float | None
    if dtype.is_integer():
        return Int
    if isinstance(dtype, pl.List):
        inner = dtype.inner
        if inner == pl.Utf8:
            return Ids
        if inner == EVIDENCE:
            return list[Evidence] | None
        if inner is not None and inner.is_integer():
            return list[int] | None
    raise TypeError(f"no JSON type for {dtype}")


def row_model(model_name: str, spec: AnswerSpec) -> type[Row]:
    """The response model of one of ``spec``'s rows: exactly its columns, each documented."""
    fields: dict[str, Any] = {c.name: (_field_type(c.dtype), Field(description=c.doc)) for c in spec.columns}
    return create_model(model_name, __base__=Row, __doc__=spec.doc, **fields)


if TYPE_CHECKING:  # to the type checker every generated row model is a Row
    FindingRow = Row
    StoredFindingRow = Row
    AffectedRow = Row
    TenantAffectedRow = Row
    ExposureRow = Row
    TransferRow = Row
    NodeRow = Row
    ThresholdRow = Row
    ExploitationRow = Row
    CoverageRow = Row
else:
    FindingRow = row_model("FindingRow", spec.FINDINGS)
    StoredFindingRow = row_model("StoredFindingRow", spec.STORED_FINDINGS)
    AffectedRow = row_model("AffectedRow", spec.AFFECTED)
    TenantAffectedRow = row_model("TenantAffectedRow", spec.TENANT_AFFECTED)
    ExposureRow = row_model("ExposureRow", spec.EXPOSURE)
    TransferRow = row_model("TransferRow", spec.TRANSFERS)
    NodeRow = row_model("NodeRow", spec.NODES)
    ThresholdRow = row_model("ThresholdRow", spec.THRESHOLDS)
    ExploitationRow = row_model("ExploitationRow", spec.EXPLOITATION)
    CoverageRow = row_model("CoverageRow", spec.COVERAGE)

TABLE_MODELS = {
    "findings": FindingRow,
    "stored_findings": StoredFindingRow,
    "affected": AffectedRow,
    "tenant_affected": TenantAffectedRow,
    "exposure": ExposureRow,
    "transfers": TransferRow,
    "nodes": NodeRow,
    "thresholds": ThresholdRow,
    "exploitation": ExploitationRow,
    "coverage": CoverageRow,
}


class FindingsSince(BaseModel):
    """Persisted findings newer than a cursor, and the cursor to ask with next."""

    findings: list[StoredFindingRow]
    next: int


class TenantExposure(BaseModel):
    """Was the tenant's data read by other tenants' responses in the window, and by how many (counts only);
    reads by the tenant's own other requests apart."""

    tenant_id: str
    exposed: bool
    my_requests_read: list[str]
    reading_responses: int
    reading_tenants: int
    pages: int
    same_tenant_responses: int = 0
    same_tenant_pages: int = 0
    my_requests_read_by_own_responses: list[str] = []


class TenantRequest(BaseModel):
    """One of the tenant's own requests: did it read foreign data, and was its data read by others."""

    request_id: str
    affected: bool
    codes: list[str]
    pages_read_foreign: int
    other_requests: int
    other_tenants: int
    read_by_responses: int
    read_by_tenants: int


class SpanRow(Row):
    """Who held a page from its allocation to its free (the page ownership timeline's bars)."""

    node: Str
    page: Int
    holder: Str
    request_id: Str
    tenant_id: Str
    start_ns: Int
    end_ns: Int


class MarkRow(Row):
    """A write, a free, or the request's own read of a page (the timeline's marks)."""

    node: Str
    page: Int
    what: Str
    request_id: Str
    tenant_id: Str
    wall_ns: Int


class PageRow(Row):
    """A page the request read: foreign?, its last writer before the read, when it was freed, who came next."""

    node: Str
    page: Int
    foreign: bool | None
    read_ns: Int
    last_writer: Str
    last_writer_tenant: Str
    last_written_ns: Int
    freed_after_read_ns: Int
    next_holder: Str


class TransferDetailRow(Row):
    """What decode reserved, prefill sent and decode received for the request."""

    kind: Str
    node: Str
    wall_ns: Int
    transfer_id: Int
    num_tokens: Int
    num_pages: Int
    digest: Int
    digest_algo: Str
    status: Str


class ResponseDetail(Row):
    """The request's response: status, tokens, TTFT against the implied prefill rate."""

    http_status: Int
    prompt_tokens: Int
    completion_tokens: Int
    ttft_ns: Int
    latency_ns: Int
    tenant_id: Str
    implied_prefill_tokens_per_s: float | None
    latency_finding: Str


class RequestPages(BaseModel):
    """One request's drill-down: the page ownership timeline of the pages it read, its transfers, its response
    and its findings. For a tenant token, other requests, tenants and nodes are pseudonyms."""

    request_id: str
    tenant_id: Str
    pages_read: int
    spans: list[SpanRow]
    marks: list[MarkRow]
    pages: list[PageRow]
    transfers: list[TransferDetailRow]
    response: ResponseDetail | None
    findings: list[FindingRow]


class HeadRow(BaseModel):
    """A producer's chain head (kvtrail audit head --json)."""

    producer_id: int
    node: str
    instance: str
    batch_no: int
    last_seq: int
    digest: str


class Heads(BaseModel):
    """``{"heads": [...]}``, the file ``kvtrail audit verify --expect-heads`` reads."""

    heads: list[HeadRow]


class VerifyResult(BaseModel):
    """The chain verification (kvtrail audit verify --json), plus the access log's own chain."""

    model_config = ConfigDict(extra="allow")
    ok: bool
    batches_checked: int
    batches_pruned: int
    events_checked: int
    signatures_checked: int
    heads_checked: int
    problems: list[str]
    coverage: list[dict[str, Any]]
    unclean_ends: list[dict[str, Any]]
    chain_problems: int  # the first this many of problems are the chain's; the rest, saved heads not reached
    access_log: dict[str, Any]


class ErrorBody(BaseModel):
    """An error: what was wrong, naming the parameter where there is one."""

    detail: Any
