"""Response models of the query API, so ``/openapi.json`` describes every table it returns.

A table's JSON is an array of row objects with exactly the fields of the CLI's ``--format json`` (the
same Polars frame, written by :func:`kvtrail.answers.tables.json_text`); these models state those
fields and their types. Every field may be null (the frames allow it). Tenant tokens get their own,
narrower rows (``Tenant*``): their own requests and counts, never another tenant's ids.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

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


class FindingRow(Row):
    """A finding with its evidence (``kvtrail forensics findings --format json``)."""

    code: Str
    title: Str
    severity: Str
    node: Str
    request_id: Str
    tenant_id: Str
    victim_request_ids: Ids
    victim_tenant_ids: Ids
    pages: list[int] | None
    first_ns: Int
    last_ns: Int
    evidence: list[Evidence] | None
    detail: Str
    lineage_checked: Int
    lineage_matched: Int


class StoredFindingRow(FindingRow):
    """A finding the live judge persisted: its stable id and the judge runs that first and last saw it."""

    finding_id: Str
    first_run_id: Int
    last_run_id: Int


class AffectedRow(Row):
    """A response that read pages it did not own (``kvtrail forensics affected``)."""

    request_id: Str
    tenant_id: Str
    http_status: Int
    prompt_tokens: Int
    completion_tokens: Int
    codes: Ids
    pages_read_foreign: Int
    victim_tenants: Ids
    victim_requests: Ids
    first_ns: Int
    last_ns: Int


class TenantAffectedRow(Row):
    """One of the tenant's own responses that read data it did not own: how much, from how many other
    requests and tenants (never whose)."""

    request_id: Str
    http_status: Int
    prompt_tokens: Int
    completion_tokens: Int
    codes: Ids
    pages_read_foreign: Int
    other_requests: Int
    other_tenants: Int
    first_ns: Int
    last_ns: Int


class ExposureRow(Row):
    """Recipient tenant x victim tenant (``kvtrail forensics exposure``)."""

    recipient_tenant: Str
    victim_tenant: Str
    responses: Int
    pages: Int
    victim_requests: Int


class TransferRow(Row):
    """A length (F2) or digest (F3) mismatch and the prefill -> decode pair it crossed (``?`` where no
    prefill event names the request)."""

    last_ns: Int
    code: Str
    pair: Str
    prefill_node: Str
    decode_node: Str
    request_id: Str
    tenant_id: Str
    detail: Str


class NodeRow(Row):
    """A node configuration in effect during the window: pool vs advertised context."""

    node: Str
    role: Str
    instance: Str
    effective_from_ns: Int
    pool_tokens: Int
    context_tokens: Int
    page_size: Int
    pool_pages: Int
    pool_covers_context: bool | None
    shortfall_tokens: Int


class ThresholdRow(NodeRow):
    """Pool vs context per node with the prompts against it (``kvtrail forensics thresholds``)."""

    requests: Int
    affected: Int
    affected_over_pool: Int
    unaffected_over_pool: Int
    min_affected_prompt_tokens: Int
    max_unaffected_prompt_tokens: Int


class ExploitationRow(Row):
    """Per recipient tenant: over-long prompts vs its baseline, bursts, verdict (``kvtrail forensics exploitation``)."""

    tenant_id: Str
    excluded_by: Str
    affected_responses: Int
    requests: Int
    long_requests: Int
    long_per_hour: float | None
    baseline_requests: Int
    baseline_long_requests: Int
    baseline_long_per_hour: float | None
    max_long_per_hour: Int
    max_long_in_burst: Int
    first_long_ns: Int
    last_long_ns: Int
    verdict: Str
    reason: Str


class CoverageRow(Row):
    """A producer with sequence numbers missing that no recorder_gap explains."""

    node: Str
    instance: Str
    missing_events: Int
    reported_by_producer: Int
    unexplained: Int


class FindingsSince(BaseModel):
    """Persisted findings newer than a cursor, and the cursor to ask with next."""

    findings: list[StoredFindingRow]
    next: int


class TenantExposure(BaseModel):
    """Was the tenant's data read by other requests in the window, and by how many (counts only)."""

    tenant_id: str
    exposed: bool
    my_requests_read: list[str]
    reading_responses: int
    reading_tenants: int
    pages: int


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
