"""The regulator's and the customers' parts of the report: GDPR Art. 33(3) items and one plain-language
notice per affected tenant (whose data was read, or who received others' data).

Numbers of data subjects cannot be known from an audit that stores no content, so the estimate says
how it is made: each victim request is one record (its prompt and partial generation); each victim
tenant is a data controller whose end users may be data subjects, at most about one per record.
"""

from __future__ import annotations

from datetime import timedelta

import polars as pl

from kvtrail.forensics.findings import AFFECTED_CODES
from kvtrail.timeutil import format_utc

NOT_PROVIDED = "(not provided in the incident file)"
_H72_NS = int(timedelta(hours=72).total_seconds()) * 1_000_000_000


def _span(r) -> tuple[int | None, int | None]:
    f = r.findings.filter(pl.col("code").is_in(sorted(AFFECTED_CODES))
                          & pl.col("request_id").is_in(list(r.affected["request_id"])))
    return (None, None) if f.is_empty() else (f["last_ns"].min(), f["last_ns"].max())


def art33(r) -> list[tuple]:
    """The items of GDPR Art. 33(3) (a)-(d), filled from the audit and the operator's input."""
    c, ctx = r.counts, r.context
    first, last = _span(r)
    when = f"between {format_utc(first)} and {format_utc(last)} (UTC)" if first is not None else "in the window"
    nature = (f"Confidentiality breach: {when}, {c['affected_responses']} responses to {c['recipient_tenants']} "
              f"customer account(s) were generated from KV-cache memory left by {c['victim_requests']} earlier "
              f"requests of {c['victim_tenants']} other customer account(s), because the serving engine reused "
              "KV-cache pages without enforcing which request owned them.")
    subjects = (f"Categories and approximate numbers: the end users of {c['victim_tenants']} customer account(s) "
                f"(data controllers) whose prompts or generated text were in the KV cache; about "
                f"{c['victim_requests']} records (one per victim request, {c['pages_read_foreign']} KV pages); at "
                f"most about {c['victim_requests']} data subjects if each record concerns one person. Method: "
                "victim requests from the audit's page-level replay; kvtrail stores no content, so whether a "
                "record held personal data is for each customer to assess.")
    contact = ctx.dpo or ctx.contact if ctx else None
    measures = (list(ctx.measures_taken) + list(ctx.remediation)) if ctx else []
    items = [f"(a) Nature of the breach: {nature}", subjects,
             f"(b) Contact point (DPO): {contact if contact else NOT_PROVIDED}",
             f"(c) Likely consequences: {ctx.likely_consequences if ctx and ctx.likely_consequences else NOT_PROVIDED}",
             "(d) Measures taken or proposed: " + (_join(measures) if measures else NOT_PROVIDED)]
    aware = ctx and (ctx.declared_at or ctx.detected_at)
    if aware:
        items.append(f"Awareness: {format_utc(aware)}; notification to the supervisory authority due by "
                     f"{format_utc(aware + _H72_NS)} (72 hours, Art. 33(1)).")
    return [("h2", "GDPR Art. 33 notification items"), ("ul", items)]


def tenant_notices(r) -> list[tuple]:
    """One plain-language notice per tenant whose data was read or who received others' data."""
    ctx = r.context
    name = ctx.display_name if ctx else (lambda t: t)
    org = ctx.organisation if ctx else "our service"
    contact = str(ctx.contact) if ctx else NOT_PROVIDED
    fix = _join(ctx.measures_taken) if ctx and ctx.measures_taken else "the cause has been identified and corrected"
    exposed = {row["victim_tenant"]: row for row in r.exposed.iter_rows(named=True)}
    received: dict[str | None, dict] = {}
    for row in r.affected.iter_rows(named=True):
        g = received.setdefault(row["tenant_id"], {"n": 0, "first": row["last_ns"], "last": row["last_ns"], "ids": []})
        g["n"] += 1
        g["first"], g["last"] = min(g["first"], row["last_ns"]), max(g["last"], row["last_ns"])
        g["ids"].append(row["request_id"])
    tenants = sorted(set(exposed) | {t for t in received if t})
    if not tenants:
        return []
    b = [("h2", "Notices to affected customers")]
    for t in tenants:
        parts = [f"Dear {name(t)},",
                 f"A fault in {org}'s model serving let some responses be generated using memory that still held "
                 "data from other, earlier requests."]
        if t in exposed:
            e = exposed[t]
            parts.append(f"Data from {e['victim_requests']} of your requests (request ids: "
                         f"{_ids(e['victim_request_ids'].split(','))}) "
                         f"may have appeared in {e['responses']} response(s) to {e['recipient_count']} other "
                         "customer account(s). We cannot see what that data said: our audit records which "
                         "requests were involved, never their content.")
        if t in received:
            g = received[t]
            parts.append(f"{g['n']} response(s) your account received between {format_utc(g['first'])} and "
                         f"{format_utc(g['last'])} (UTC) may contain fragments of other customers' data (request "
                         f"ids: {_ids(g['ids'])}). Please delete them and do not use or pass on their content.")
        parts.append(f"What we have done: {fix}. Questions: {contact}.")
        b += [("h3", f"Notice to {name(t)}")] + [("p", part) for part in parts]
    return b


def _ids(ids, most: int = 10) -> str:
    """Up to ``most`` ids for a notice; the CSV/JSON files list them all."""
    ids = sorted(i for i in ids if i)
    return ", ".join(ids[:most]) + (f" and {len(ids) - most} more" if len(ids) > most else "")


def _join(sentences) -> str:
    """Operator sentences joined into one ("a; b"), without doubled full stops."""
    return "; ".join(s.rstrip(". ") for s in sentences)
