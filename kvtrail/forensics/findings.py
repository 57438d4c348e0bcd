"""Findings: what forensics concludes from the audit record, in the product's F1..F11 vocabulary.

A :class:`Finding` names the request it concerns (the *recipient* for reads), the victims whose data
was exposed, the pages on one node, the time span and the evidence: ``(producer_id, seq)`` keys of
the events that prove it. ``docs/mission.md`` defines the codes; :data:`CODES` is their registry.

Direction of a late write (F7): its ``request_id`` is the late *writer* - the source of the data, not
a recipient - and its victims are the requests holding the pages it landed on (whose KV it corrupts).
The request that later reads such a page is the recipient: it gets the F1, with the late writer as
victim. A response is affected only through F1 or F5 (:data:`AFFECTED_CODES`).
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa


@dataclass(frozen=True)
class FindingCode:
    code: str
    title: str
    severity: str  # critical / high / medium


CODES: dict[str, FindingCode] = {
    c.code: c
    for c in (
        FindingCode("F1", "foreign read", "critical"),
        FindingCode("F2", "transfer length mismatch", "high"),
        FindingCode("F3", "digest mismatch", "high"),
        FindingCode("F4", "rejected but served", "high"),
        FindingCode("F5", "read outside ownership", "critical"),
        FindingCode("F6", "double ownership", "medium"),
        FindingCode("F7", "late write", "critical"),
        FindingCode("F8", "capacity misconfiguration", "medium"),
        FindingCode("F9", "implausible latency", "high"),
        FindingCode("F10", "cross-tenant prefix sharing", "medium"),
        FindingCode("F11", "transfer outlived release timeout", "high"),
    )
}
# A response is affected (it read data it did not own) when its request has one of these. F7's request
# is the late writer, a source: the reader of its bytes has the F1.
AFFECTED_CODES = frozenset({"F1", "F5"})
# Pseudo-victims: a page read before anyone wrote it since the pool was created; a victim request
# whose events carry no tenant.
NEVER_WRITTEN = "(never written)"
UNKNOWN_TENANT = "(unknown tenant)"


@dataclass(frozen=True)
class Finding:
    """One finding with its proof. ``evidence`` holds ``(producer_id, seq)`` event keys."""

    code: str
    node: str | None
    request_id: str | None
    tenant_id: str | None
    victim_request_ids: tuple[str | None, ...]
    victim_tenant_ids: tuple[str | None, ...]
    pages: tuple[int, ...]
    first_ns: int
    last_ns: int
    severity: str
    evidence: tuple[tuple[int, int], ...]
    detail: str
    # Digest lineage (F1): of the foreign pages the reader digested, how many carry exactly the bytes
    # their last writer recorded - proof of whose data the stale page held.
    lineage_checked: int = 0
    lineage_matched: int = 0

    @property
    def title(self) -> str:
        return CODES[self.code].title


def make_finding(code: str, **kw) -> Finding:
    """A finding with the severity its code carries in :data:`CODES` (unless ``severity`` is given)."""
    if code not in CODES:
        raise ValueError(f"unknown finding code {code!r}; known: {', '.join(CODES)}")
    kw.setdefault("pages", ())
    kw.setdefault("victim_request_ids", ())
    kw.setdefault("victim_tenant_ids", ())
    kw.setdefault("severity", CODES[code].severity)
    return Finding(code=code, **kw)


# Finding details both engines word the same way.

REPEAT_DETAIL = "page(s) listed more than once in one allocation: the allocator handed them out twice"


def late_write_detail(why: str) -> str:
    return f"write {why}: a source of foreign data; the next reader of these pages has the F1"


# A transfer_received status: decode committed the transfer without evidence of what landed.
UNVERIFIED = "unverified"
NEVER_WRITTEN_DETAIL = "read of pages never written since the pool was created"


def unknown_writer_detail(num_unverified: int) -> str:
    """F1 detail for pages whose writer is unknown: never written, or landed by a transfer decode could not
    verify (``num_unverified`` of them; their receipts are the finding's evidence)."""
    if not num_unverified:
        return NEVER_WRITTEN_DETAIL
    return (
        f"read of pages whose writer is unknown: {num_unverified} page(s) landed by a transfer decode could "
        "not verify (stale origin unknown), the rest never written since the pool was created"
    )


def foreign_read_detail(writer: str | None, num_late: int, num_lost: int) -> str:
    """F1 detail: whose write the reader saw; how many of the pages a late write (F7) filled, and on how
    many of those the late bytes landed after the reader's own write (its own KV corrupted)."""
    text = f"read of pages last written by {writer}"
    if num_late:
        text += f"; {num_late} page(s) written late by {writer} (F7)"
    if num_lost:
        text += f", {num_lost} of them over this request's own write: its own KV was corrupted"
    return text


FINDINGS_SCHEMA = pa.schema(
    [
        pa.field("code", pa.string()),
        pa.field("title", pa.string()),
        pa.field("severity", pa.string()),
        pa.field("node", pa.string()),
        pa.field("request_id", pa.string()),
        pa.field("tenant_id", pa.string()),
        pa.field("victim_request_ids", pa.list_(pa.string())),
        pa.field("victim_tenant_ids", pa.list_(pa.string())),
        pa.field("pages", pa.list_(pa.int32())),
        pa.field("first_ns", pa.int64()),
        pa.field("last_ns", pa.int64()),
        pa.field("evidence", pa.list_(pa.struct([("producer_id", pa.int64()), ("seq", pa.uint64())]))),
        pa.field("detail", pa.string()),
        pa.field("lineage_checked", pa.int32()),
        pa.field("lineage_matched", pa.int32()),
    ]
)


def findings_table(findings: list[Finding]) -> pa.Table:
    """Findings as an Arrow table with :data:`FINDINGS_SCHEMA` (one row per finding)."""
    cols: dict[str, list] = {f.name: [] for f in FINDINGS_SCHEMA}
    for f in findings:
        cols["code"].append(f.code)
        cols["title"].append(CODES[f.code].title)
        cols["severity"].append(f.severity)
        for name in (
            "node",
            "request_id",
            "tenant_id",
            "first_ns",
            "last_ns",
            "detail",
            "lineage_checked",
            "lineage_matched",
        ):
            cols[name].append(getattr(f, name))
        cols["victim_request_ids"].append(list(f.victim_request_ids))
        cols["victim_tenant_ids"].append(list(f.victim_tenant_ids))
        cols["pages"].append(list(f.pages))
        cols["evidence"].append([{"producer_id": p, "seq": s} for p, s in f.evidence])
    return pa.table(cols, schema=FINDINGS_SCHEMA)


def late_transfer_detail(duration_ns: int, node: str, timeout_ns: int) -> str:
    """F11 detail: how long the transfer ran against the time its decode node holds the pages."""
    return (
        f"transfer ran {duration_ns / 1e9:.3f} s from its first send to its last event; {node} reuses the "
        f"pages of an aborted transfer after {timeout_ns / 1e9:g} s: a write still in flight lands late"
    )


def transfer_mismatch_detail(
    reserved_tokens: int, reserved_pages: int, problems: list[str], status: str, responses: list[tuple[int, int]]
) -> str:
    """F2 detail: what was reserved, what differs, what decode reported (its receipt's status) and what
    the client got (``responses``: (HTTP status, completion tokens) of the request's 2xx responses)."""
    served = "; ".join(f"client got HTTP {h} with {c} completion tokens" for h, c in sorted(responses))
    return (
        f"reserved {reserved_tokens} tokens/{reserved_pages} pages; "
        + ", ".join(problems)
        + f"; decode reported {status}; "
        + (served or "no 2xx response")
    )
