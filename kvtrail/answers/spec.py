"""One :class:`AnswerSpec` per question: the table it answers with, column by column (name, Polars dtype,
a one-line doc, whether a tenant may see it).

The specs are the single statement of each answer's columns: the Polars schema the questions' frames
have, the service's response models (:mod:`kvtrail.service.models`, generated from them) and the
columns the CLI's tables may show (:mod:`kvtrail.answers.tables`). ``tests/answers/test_spec.py``
holds the three equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

EVIDENCE = pl.Struct({"producer_id": pl.Int64, "seq": pl.UInt64})


@dataclass(frozen=True)
class Col:
    """One column of an answer."""

    name: str
    dtype: pl.DataType | type[pl.DataType]
    doc: str
    tenant: bool = False  # a tenant token may see this column of its own rows


@dataclass(frozen=True)
class AnswerSpec:
    """A question's answer table."""

    name: str
    doc: str
    columns: tuple[Col, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    @property
    def schema(self) -> dict[str, pl.DataType | type[pl.DataType]]:
        return {c.name: c.dtype for c in self.columns}

    @property
    def tenant_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.tenant)

    def empty(self) -> pl.DataFrame:
        return pl.DataFrame(schema=self.schema)

    def extended(self, name: str, doc: str, *more: Col) -> AnswerSpec:
        return AnswerSpec(name, doc, self.columns + more)


def _cols(*rows: tuple) -> tuple[Col, ...]:
    return tuple(Col(*r) for r in rows)


S, I32, I64, F64, B = pl.Utf8, pl.Int32, pl.Int64, pl.Float64, pl.Boolean
IDS = pl.List(pl.Utf8)

FINDINGS = AnswerSpec(
    "findings",
    "A finding with its evidence (``kvtrail forensics findings --format json``).",
    _cols(
        ("code", S, "F1-F11"),
        ("title", S, "the finding's name"),
        ("severity", S, "critical, high, medium or low"),
        ("node", S, "the node where it was seen"),
        ("request_id", S, "the recipient (or the request the finding concerns)"),
        ("tenant_id", S, "the request's tenant"),
        ("victim_request_ids", IDS, "whose data it read, per page run: request ids, or a pseudo-victim"),
        ("victim_tenant_ids", IDS, "the victims' tenants"),
        ("pages", pl.List(pl.Int32), "the pages concerned"),
        ("first_ns", I64, "first event of the finding (ns since the epoch, UTC)"),
        ("last_ns", I64, "last event of the finding"),
        ("evidence", pl.List(EVIDENCE), "the events that prove it: (producer_id, seq)"),
        ("detail", S, "the finding in words"),
        ("lineage_checked", I32, "prefix-cache lineage: pages whose block hash could be checked"),
        ("lineage_matched", I32, "of those, pages whose block hash matched its writer's"),
    ),
)
STORED_FINDINGS = FINDINGS.extended(
    "stored_findings",
    "A finding the live judge persisted: its stable id and the judge runs that first and last saw it.",
    Col("finding_id", S, "stable id of the finding (the same finding judged again keeps it)"),
    Col("first_run_id", I64, "the judge run that first found it"),
    Col("last_run_id", I64, "the judge run that last found it"),
)
AFFECTED = AnswerSpec(
    "affected",
    "A response that read pages it did not own (``kvtrail forensics affected``).",
    _cols(
        ("request_id", S, "the response's request", True),
        ("tenant_id", S, "its tenant"),
        ("http_status", I32, "the status the client got", True),
        ("prompt_tokens", I64, "prompt tokens", True),
        ("completion_tokens", I64, "completion tokens", True),
        ("codes", IDS, "the finding codes that make it affected (F1, F5)", True),
        ("pages_read_foreign", I64, "pages it read that it did not own", True),
        ("victim_tenants", IDS, "whose data it read: tenants, or a pseudo-victim"),
        ("victim_requests", IDS, "whose data it read: requests"),
        ("first_ns", I64, "its first foreign read (ns since the epoch, UTC)", True),
        ("last_ns", I64, "its last foreign read", True),
    ),
)
TENANT_AFFECTED = AnswerSpec(
    "tenant_affected",
    "One of the tenant's own responses that read data it did not own: how much, from how many "
    "other requests and tenants (never whose).",
    _cols(
        ("request_id", S, "the response's request", True),
        ("http_status", I32, "the status the client got", True),
        ("prompt_tokens", I64, "prompt tokens", True),
        ("completion_tokens", I64, "completion tokens", True),
        ("codes", IDS, "the finding codes that make it affected (F1, F5)", True),
        ("pages_read_foreign", I64, "pages it read that it did not own", True),
        ("other_requests", I64, "how many other requests' data it read", True),
        ("other_tenants", I64, "how many other tenants' data it read", True),
        ("first_ns", I64, "its first foreign read (ns since the epoch, UTC)", True),
        ("last_ns", I64, "its last foreign read", True),
    ),
)
TENANT_EXPOSURE = AnswerSpec(
    "tenant_exposure",
    "Whether other requests read the tenant's data in the window, and how much (counts only): "
    "what a tenant's token gets for ``kvtrail forensics exposure``.",
    _cols(
        ("tenant_id", S, "the asking tenant", True),
        ("exposed", B, "whether any other request read its data", True),
        ("my_requests_read", IDS, "its requests whose data was read", True),
        ("reading_responses", I64, "responses that read its data", True),
        ("reading_tenants", I64, "other tenants whose responses read it", True),
        ("pages", I64, "pages of its data read", True),
        ("same_tenant_responses", I64, "its own other responses that read its requests' pages", True),
        ("same_tenant_pages", I64, "pages those responses read", True),
        ("my_requests_read_by_own_responses", IDS, "its requests whose pages its own responses read", True),
    ),
)
EXPOSURE = AnswerSpec(
    "exposure",
    "Recipient tenant x victim tenant (``kvtrail forensics exposure``).",
    _cols(
        ("recipient_tenant", S, "the tenant whose responses read foreign pages"),
        ("victim_tenant", S, "the tenant whose data they read, or a pseudo-victim"),
        ("responses", I64, "responses of the recipient that read the victim's data"),
        ("pages", I64, "pages read"),
        ("victim_requests", I64, "distinct victim requests"),
    ),
)
NODES = AnswerSpec(
    "nodes",
    "A node configuration in effect during the window: pool vs advertised context.",
    _cols(
        ("node", S, "node name"),
        ("role", S, "prefill, decode or unified"),
        ("instance", S, "the node's instance (a restart is a new one)"),
        ("effective_from_ns", I64, "when the configuration took effect"),
        ("pool_tokens", I64, "KV pool size in tokens"),
        ("context_tokens", I64, "advertised context length"),
        ("page_size", I32, "tokens per page"),
        ("pool_pages", I64, "KV pool size in pages"),
        ("pool_covers_context", B, "pool_tokens >= context_tokens"),
        ("shortfall_tokens", I64, "context_tokens - pool_tokens where positive"),
    ),
)
THRESHOLDS = NODES.extended(
    "thresholds",
    "Pool vs context per node with the prompts against it (``kvtrail forensics thresholds``).",
    *_cols(
        ("requests", I64, "requests the node served in the window"),
        ("affected", I64, "of those, affected responses"),
        ("affected_over_pool", I64, "affected with a prompt longer than the pool"),
        ("unaffected_over_pool", I64, "unaffected with a prompt longer than the pool"),
        ("min_affected_prompt_tokens", I64, "the shortest affected prompt"),
        ("max_unaffected_prompt_tokens", I64, "the longest unaffected prompt"),
    ),
)
EXPLOITATION = AnswerSpec(
    "exploitation",
    "Per recipient tenant: over-long prompts vs its baseline, bursts, verdict (``kvtrail forensics exploitation``).",
    _cols(
        ("tenant_id", S, "the recipient tenant"),
        ("excluded_by", S, "the exclusion that leaves it out of the counts, if any"),
        ("affected_responses", I64, "its affected responses in the window"),
        ("requests", I64, "its requests in the window"),
        ("long_requests", I64, "of those, over-long prompts"),
        ("long_per_hour", F64, "over-long prompts per hour in the window"),
        ("baseline_requests", I64, "its requests in the baseline period"),
        ("baseline_long_requests", I64, "of those, over-long prompts"),
        ("baseline_long_per_hour", F64, "over-long prompts per hour in the baseline"),
        ("max_long_per_hour", I64, "the most over-long prompts in one hour"),
        ("max_long_in_burst", I64, "the most over-long prompts within one burst length"),
        ("first_long_ns", I64, "its first over-long prompt"),
        ("last_long_ns", I64, "its last over-long prompt"),
        ("verdict", S, "consistent with normal use, or probing"),
        ("reason", S, "the verdict's reason in words"),
    ),
)
COVERAGE = AnswerSpec(
    "coverage",
    "A producer with sequence numbers missing that no recorder_gap explains.",
    _cols(
        ("node", S, "node name"),
        ("instance", S, "the producer's instance"),
        ("missing_events", I64, "events numbered but not stored"),
        ("reported_by_producer", I64, "events the producer reported dropped (recorder_gap)"),
        ("unexplained", I64, "missing events no recorder_gap explains"),
    ),
)
TRANSFERS = AnswerSpec(
    "transfers",
    "A length (F2) or digest (F3) mismatch and the prefill -> decode pair it crossed (``?`` where no "
    "prefill event names the request).",
    _cols(
        ("last_ns", I64, "when it was seen"),
        ("code", S, "F2 or F3"),
        ("pair", S, "prefill -> decode"),
        ("prefill_node", S, "the node that sent the request's KV"),
        ("decode_node", S, "the node that received it"),
        ("request_id", S, "the request"),
        ("tenant_id", S, "its tenant"),
        ("detail", S, "the mismatch in words"),
    ),
)

SPECS = {
    s.name: s
    for s in (
        FINDINGS,
        STORED_FINDINGS,
        AFFECTED,
        TENANT_AFFECTED,
        EXPOSURE,
        TENANT_EXPOSURE,
        NODES,
        THRESHOLDS,
        EXPLOITATION,
        COVERAGE,
        TRANSFERS,
    )
}
