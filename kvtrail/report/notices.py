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
    f = r.findings.filter(
        pl.col("code").is_in(sorted(AFFECTED_CODES)) & pl.col("request_id").is_in(list(r.affected["request_id"]))
    )
    return (None, None) if f.is_empty() else (f["last_ns"].min(), f["last_ns"].max())


def art33(r) -> list[tuple]:
    """The items of GDPR Art. 33(3) (a)-(d), filled from the audit and the operator's input."""
    c, ctx = r.counts, r.context
    first, last = _span(r)
    when = f"between {format_utc(first)} and {format_utc(last)} (UTC)" if first is not None else "in the window"
    nature = (
        f"Confidentiality breach: {when}, KV-cache memory left by "
        f"{_n(c['other_tenant_victim_requests'], 'earlier request')} of "
        f"{_n(c['victim_tenants'], 'customer account')} was used to generate "
        f"{_n(c['other_tenant_responses'], 'response')} to {_n(c['other_tenant_recipients'], 'customer account')}"
        ", each time an account other than the one whose request left it, because the serving engine "
        "reused KV-cache pages without enforcing which request owned them."
    )
    if c["same_tenant_responses"]:
        nature += (
            f" Besides, memory left by {_n(c['same_tenant_victim_requests'], 'earlier request')} was used to "
            f"generate {_n(c['same_tenant_responses'], 'response')} to the account whose requests left it "
            f"({_n(c['same_tenant_tenants'], 'account')}): not another customer's data, but one request's "
            "data in another request's response."
        )
    if c["never_written_only_responses"]:
        n = c["never_written_only_responses"]
        nature += (
            f" {_n(n, 'response')} read only stale or uninitialised memory (KV-cache pages no request had "
            "written since their pool was created): no customer's data was identified in "
            + ("it." if n == 1 else "them.")
        )
    subjects = (
        f"Categories and approximate numbers: the end users of {c['victim_tenants']} customer account(s) "
        f"(data controllers) whose prompts or generated text were in the KV cache; about "
        f"{c['other_tenant_victim_requests']} records read by another customer (one per victim request, "
        f"{c['other_tenant_pages']} KV pages)"
        + (
            f" and {c['same_tenant_victim_requests']} read by another request of the same account"
            if c["same_tenant_victim_requests"]
            else ""
        )
        + f"; at most about {c['victim_requests']} data subjects if each record concerns one person. "
        "Method: victim requests from the audit's page-level replay; kvtrail stores no content, so whether "
        "a record held personal data is for each customer to assess."
    )
    contact = ctx.dpo or ctx.contact if ctx else None
    measures = (list(ctx.measures_taken) + list(ctx.remediation)) if ctx else []
    items = [
        f"(a) Nature of the breach: {nature}",
        subjects,
        f"(b) Contact point (DPO): {contact if contact else NOT_PROVIDED}",
        f"(c) Likely consequences: {ctx.likely_consequences if ctx and ctx.likely_consequences else NOT_PROVIDED}",
        "(d) Measures taken or proposed: " + (_join(measures) if measures else NOT_PROVIDED),
    ]
    aware = ctx and (ctx.declared_at or ctx.detected_at)
    if aware:
        items.append(
            f"Awareness: {format_utc(aware)}; notification to the supervisory authority due by "
            f"{format_utc(aware + _H72_NS)} (72 hours, Art. 33(1))."
        )
    return [("h2", "GDPR Art. 33 notification items"), ("ul", items)]


def tenant_notices(r) -> list[tuple]:
    """One plain-language notice per tenant whose data was read or whose responses read what they did not own,
    in words from that tenant's point of view: other customers never include the tenant itself, and pages no
    request wrote are stale or uninitialised memory, not anyone's data."""
    ctx = r.context
    name = ctx.display_name if ctx else (lambda t: t)
    org = ctx.organisation if ctx else "our service"
    contact = str(ctx.contact) if ctx else NOT_PROVIDED
    fix = _join(ctx.measures_taken) if ctx and ctx.measures_taken else "the cause has been identified and corrected"
    exposed = {row["victim_tenant"]: row for row in r.exposed.iter_rows(named=True)}
    kinds = dict(zip(r.reads["request_id"], r.reads["read"]))
    received: dict[str | None, dict[str, dict]] = {}
    for row in r.affected.iter_rows(named=True):
        kind = kinds.get(row["request_id"], "never_written")
        g = received.setdefault(row["tenant_id"], {}).setdefault(
            kind, {"n": 0, "first": row["last_ns"], "last": row["last_ns"], "ids": []}
        )
        g["n"] += 1
        g["first"], g["last"] = min(g["first"], row["last_ns"]), max(g["last"], row["last_ns"])
        g["ids"].append(row["request_id"])
    tenants = sorted(set(exposed) | {t for t in received if t})
    if not tenants:
        return []
    b = [("h2", "Notices to affected customers")]
    for t in tenants:
        parts = [
            f"Dear {name(t)},",
            f"A fault in {org}'s model serving let some responses be generated using memory that still held "
            "data from other, earlier requests, or memory no request had written.",
        ]
        e = exposed.get(t)
        if e and e["recipient_count"]:
            parts.append(
                f"Data from {e['victim_requests']} of your requests (request ids: "
                f"{_ids(e['victim_request_ids'].split(','))}) "
                f"may have appeared in {e['responses']} response(s) to {e['recipient_count']} other "
                "customer account(s). We cannot see what that data said: our audit records which "
                "requests were involved, never their content."
            )
        if e and e["same_tenant_responses"]:
            parts.append(
                f"Data from {e['same_tenant_victim_requests']} of your requests (request ids: "
                f"{_ids(e['same_tenant_victim_request_ids'].split(','))}) was read while generating "
                f"{e['same_tenant_responses']} other response(s) to your own account: no other customer "
                "received it, but a response to one of your requests may repeat fragments of another."
            )
        got = received.get(t, {})
        if "other_tenants" in got:
            g = got["other_tenants"]
            parts.append(
                f"{g['n']} response(s) your account received {_between(g)} may contain fragments of "
                f"other customers' data (request ids: {_ids(g['ids'])}). Please delete them and do not use "
                "or pass on their content."
            )
        if "same_tenant" in got:
            g = got["same_tenant"]
            parts.append(
                f"{g['n']} response(s) your account received {_between(g)} read memory left only by other "
                f"requests of your own account, no other customer's data (request ids: {_ids(g['ids'])}); "
                "they may repeat fragments of another of your requests."
            )
        if "never_written" in got:
            g = got["never_written"]
            parts.append(
                f"{g['n']} response(s) your account received {_between(g)} read stale or uninitialised "
                "memory (KV-cache pages no request had written): no customer's data was identified in "
                f"them (request ids: {_ids(g['ids'])}). Their output may be unreliable."
            )
        parts.append(f"What we have done: {fix}. Questions: {contact}.")
        b += [("h3", f"Notice to {name(t)}")] + [("p", part) for part in parts]
    return b


def _n(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _between(g: dict) -> str:
    if g["first"] == g["last"]:
        return f"at {format_utc(g['first'])} (UTC)"
    return f"between {format_utc(g['first'])} and {format_utc(g['last'])} (UTC)"


def _ids(ids, most: int = 10) -> str:
    """Up to ``most`` ids for a notice; the CSV/JSON files list them all."""
    ids = sorted(i for i in ids if i)
    return ", ".join(ids[:most]) + (f" and {len(ids) - most} more" if len(ids) > most else "")


def _join(sentences) -> str:
    """Operator sentences joined into one ("a; b"), without doubled full stops."""
    return "; ".join(s.rstrip(". ") for s in sentences)


def notice_texts(r) -> dict[str, str]:
    """Each tenant's notice alone, as Markdown (the notice folders' ``notice.md``)."""
    from kvtrail.report.render import markdown

    name = r.context.display_name if r.context else (lambda t: t)
    blocks = tenant_notices(r)
    tenants = sorted({t for t in r.affected["tenant_id"] if t} | set(r.exposed["victim_tenant"]))
    titles = {f"Notice to {name(t)}": t for t in tenants}
    out: dict[str, list[tuple]] = {}
    current = None
    for b in blocks:
        if b[0] == "h3":
            current = titles.get(b[1])
        if current is not None:
            out.setdefault(current, []).append(b)
    return {t: markdown(bl) for t, bl in out.items()}
