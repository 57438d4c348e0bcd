"""The text of the disclosure report, as format-neutral blocks that ``render`` turns into MD/HTML/PDF.

A block is a tuple: ``("h1"|"h2"|"p"|"warn"|"mono", text)``, ``("ul", [items])``,
``("table", headers, rows)`` or ``("img", png_bytes, caption)`` (``kvtrail.report.figures``).
Everything the report says is here, once; the numbers come from the
:class:`~kvtrail.report.build.Report` model.
"""

from __future__ import annotations

import shlex

import polars as pl

from kvtrail.forensics import analysis as an
from kvtrail.forensics.findings import AFFECTED_CODES, CODES, NEVER_WRITTEN
from kvtrail.report import figures, notices
from kvtrail.timeutil import format_utc

MAX_ROWS = 50  # rows of a long table shown in the documents; the CSV/JSON files hold them all
NOT_PROVIDED = "(not provided in the incident file)"
_MOST_VICTIMS = 10  # victim tenants named per recipient in the exposure table (the heatmap shows them all)
_JOINED = {"recipient_tenants", "victim_request_ids", "same_tenant_victim_request_ids", "request_ids"}


def title(r) -> str:
    ctx = r.context
    text = "KV-cache isolation incident report"
    if ctx:
        text = f"{ctx.organisation}: {ctx.title or text}" + (f" ({ctx.incident_id})" if ctx.incident_id else "")
    return text


def _table(df: pl.DataFrame, columns: list[str], note_file: str | None = None) -> list[tuple]:
    shown = df.head(MAX_ROWS)
    rows = [[_cell(c, v) for c, v in zip(columns, row)] for row in shown.select(columns).iter_rows()]
    headers = [c[:-3] + " (UTC)" if c.endswith("_ns") else c for c in columns]
    out: list[tuple] = [("table", headers, rows)]
    if len(df) > MAX_ROWS:
        out.append(("p", f"{len(df) - MAX_ROWS} more rows" + (f" in {note_file}." if note_file else ".")))
    return out


def _cell(column: str, v) -> str:
    if v is None:
        return ""
    if column.endswith("_ns"):
        return format_utc(v)
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, int) and column.endswith("tokens"):
        return f"{v:,}"
    if isinstance(v, list):
        return ", ".join(str(x) for x in v)
    if column in _JOINED:  # ids joined with bare commas in the files: a space after each, so a line may break there
        return ", ".join(str(v).split(","))
    return str(v)


def report_blocks(r, store_name: str) -> list[tuple]:
    """Every section of the report, in reading order."""
    c = r.counts
    b: list[tuple] = [("h1", title(r))]
    b.append(
        (
            "p",
            f"Window (UTC): {format_utc(r.options.from_ns)} to {format_utc(r.options.to_ns)}. "
            f"Generated {format_utc(r.generated_ns)} by kvtrail {r.version} from the audit store "
            f"'{store_name}'.",
        )
    )
    if len(r.coverage):
        b.append(
            (
                "warn",
                f"Coverage gap: {int(r.coverage['unexplained'].sum())} audit events are missing from "
                f"{len(r.coverage)} producer(s) and no recorder_gap event accounts for them. Every count "
                "in this report may be too low.",
            )
        )
        b += _table(r.coverage, r.coverage.columns)
    for text in r.warnings:
        b.append(("warn", text[0].upper() + text[1:] + "."))
    if len(r.shared_transfer_ids):
        b += _table(r.shared_transfer_ids, ["transfer_id", "request_ids", "num_events"])
    if len(r.incomplete):
        b += _table(r.incomplete, ["request_id", "node", "instance"])
    if c["events_in_window"] == 0:
        b.append(("warn", "The audit store holds no events in this window: nothing can be concluded about it."))
    elif c["affected_responses"] == 0:
        b.append(
            ("p", "No affected responses were found in this window: no response read another request's KV-cache pages.")
        )
    b += _summary(r, c) + _categories(r) + _root_cause(r) + _thresholds(r) + _timeline(r) + _exploitation(r)
    b += [("h2", "Affected responses")] + _table(
        r.affected,
        [
            "request_id",
            "tenant_id",
            "http_status",
            "prompt_tokens",
            "codes",
            "pages_read_foreign",
            "victim_tenants",
            "last_ns",
        ],
        "affected_responses.csv",
    )
    if len(r.empty_after_abort):
        b += [
            ("h2", "Served empty after an abort (not exposure)"),
            (
                "p",
                f"{len(r.empty_after_abort)} response(s) got HTTP 2xx with no completion tokens after their "
                "request was aborted on some node (SGLang's abort-returns-200 pattern). No output reached "
                "the client, so they are neither rejected-but-served (F4) nor affected; they are listed "
                "because a 2xx here is not a success.",
            ),
        ]
        b += _table(r.empty_after_abort, ["request_id", "tenant_id", "http_status", "response_ns", "aborts"])
    b += [
        ("h2", "Exposed tenants (whose data was read)"),
        (
            "p",
            "Per victim tenant: the other tenants whose responses read its data, and apart from them the "
            "tenant's own responses that read another of its requests (same_tenant_*).",
        ),
    ] + _table(
        r.exposed,
        [
            "victim_tenant",
            "recipient_tenants",
            "responses",
            "pages",
            "victim_requests",
            "same_tenant_responses",
            "same_tenant_pages",
        ],
        "exposed_tenants.csv",
    )
    b += [("h2", "Exposure by recipient tenant (whose data its responses read)")] + _matrix(r)
    b += figures.exposure(r)
    b += _measures(r) + notices.art33(r) + notices.tenant_notices(r) + _integrity(r, store_name)
    return b


def _summary(r, c) -> list[tuple]:
    ex = r.excluded_affected
    reasons = sorted({f"{by} ({reason})" for by, reason in zip(ex["excluded_by"], ex["reason"])})
    items = [
        f"Affected responses: {c['affected_responses']} ({c['responses_served_2xx']} of them returned HTTP 2xx): "
        f"{c['other_tenant_responses']} read other customers' data (pages another tenant's requests wrote), "
        f"{c['same_tenant_only_responses']} only pages other requests of their own tenant wrote, "
        f"{c['never_written_only_responses']} only stale or uninitialised memory (pages never written, no "
        "customer's data identified)",
        f"Recipient tenants (whose responses read pages they did not own): {c['recipient_tenants']}, "
        f"{c['other_tenant_recipients']} of them received other customers' data",
        f"Victim tenants (whose data another customer read): {c['victim_tenants']}",
        f"Victim requests (whose KV was read): {c['victim_requests']} ({c['other_tenant_victim_requests']} of "
        f"them read by another tenant's responses, {c['same_tenant_victim_requests']} by responses of their own "
        "tenant)",
        f"KV pages read foreign: {c['pages_read_foreign']}, of which {c['pages_no_known_origin']} had no known "
        "origin (never written since their pool was created)",
        f"Excluded: {c['excluded_responses']} affected responses of {c['excluded_accounts']} excluded "
        f"account(s)" + (": " + "; ".join(reasons) if reasons else ""),
    ]
    how = (
        f"How counted: a response is affected when its request has a finding {', '.join(sorted(AFFECTED_CODES))} "
        "(it read KV pages another request wrote, or pages it did not hold), from a replay of every page "
        "allocation, write, transfer and read in the audit log. A write that landed after its request's "
        "ownership ended (F7) makes that request a source: the request that read the late bytes is the "
        "recipient, the late writer its victim. A 2xx without output after an abort is not counted (no "
        "data reached the client). Recipient tenants are "
        "the tenants of affected responses; victim tenants are the tenants of the requests whose pages they "
        "read, each counted from its own point of view: a tenant is never another customer of itself (a "
        "read of another request of the same tenant is counted apart), and a page never written since its "
        "pool was created holds no customer's data. Exclusions remove the excluded accounts' own responses "
        "from every count (their reads are not exposure to a customer); data of an excluded account read "
        "by someone else still counts as exposed."
    )
    if c["responses_without_victim"]:
        how += f" {c['responses_without_victim']} affected responses read pages with no other holder or writer."
    return [("h2", "Summary"), ("ul", items), ("p", how)]


def _categories(r) -> list[tuple]:
    extra = list(r.context.data_categories) if r.context else []
    return [
        ("h2", "What data was and was not exposed"),
        (
            "ul",
            [
                "Exposed: KV-cache contents (attention keys and values) computed from other requests' prompts and "
                "partial generations. A response that attended to them can repeat fragments of that text."
            ]
            + [f"Operator's description of that content: {x}" for x in extra]
            + [
                "Not exposed through this mechanism: account and billing data, API keys, stored files; only KV-cache "
                "pages of recent requests on the same node could be read.",
                "kvtrail itself stores no prompt or output content: ids, counts, page ids and digests only "
                "(API keys as hashes). This report therefore says which requests' data was exposed, not what it said.",
            ],
        ),
    ]


def _root_cause(r) -> list[tuple]:
    f, ids = r.findings, set(r.affected["request_id"])
    per_code = f.group_by("code").len().sort("code")
    counts = dict(zip(per_code["code"], per_code["len"]))
    b: list[tuple] = [("h2", "Root-cause evidence from the audit"), ("p", "KV pool vs advertised context per node:")]
    b += _table(
        r.capacity,
        [
            "node",
            "role",
            "instance",
            "effective_from_ns",
            "pool_tokens",
            "context_tokens",
            "pool_covers_context",
            "shortfall_tokens",
        ],
    )
    b += figures.note(r) + figures.pool_vs_context(r)
    short = r.capacity.filter(~pl.col("pool_covers_context"))
    if len(short):
        b.append(
            ("p", f"{short['node'].n_unique()} node(s) advertised a longer context than their KV pool holds (F8).")
        )
    rows = [
        [
            code,
            CODES[code].title,
            str(counts.get(code, 0)),
            str(len(ids & set(f.filter(pl.col("code") == code)["request_id"].drop_nulls()))),
        ]
        for code in CODES
    ]
    b += [
        ("p", "Findings in the window (excluded accounts removed) and how many affected responses share each:"),
        ("table", ["code", "finding", "findings", "affected responses with it"], rows),
    ]
    for code, what in (
        ("F2", "Reserved vs sent (F2): decode reserved more than prefill sent"),
        ("F4", "Rejected but served (F4): rejected on a node, still answered 2xx"),
    ):
        sub = f.filter(pl.col("code") == code)
        if len(sub):
            b += [("p", f"{what}: {len(sub)} request(s).")] + _table(sub, ["request_id", "tenant_id", "node", "detail"])
    return b


def _thresholds(r) -> list[tuple]:
    return [("h2", "Threshold analysis"), ("p", an.threshold_sentence(r.threshold_summary))] + _table(
        r.thresholds, [c for c in r.thresholds.columns if c != "prefill_config_ns"]
    )


def _timeline(r) -> list[tuple]:
    f, ctx = r.findings, r.context
    aff = f.filter(
        pl.col("code").is_in(sorted(AFFECTED_CODES)) & pl.col("request_id").is_in(list(r.affected["request_id"]))
    )
    events = []
    if len(f):
        first = f.sort("last_ns").row(0, named=True)
        events.append(
            (first["last_ns"], f"first finding in the window ({first['code']} {first['title']}, node {first['node']})")
        )
    if len(aff):
        events += [(aff["last_ns"].min(), "first foreign read"), (aff["last_ns"].max(), "last foreign read")]
    if ctx:
        events += [
            (getattr(ctx, n), label)
            for n, label in (
                ("detected_at", "detected" + (f": {ctx.detection}" if ctx.detection else "")),
                ("declared_at", "incident declared"),
                ("mitigated_at", "mitigated"),
                ("fixed_at", "fixed"),
            )
            if getattr(ctx, n) is not None
        ]
        events += list(ctx.timeline)
    rows = [[format_utc(t), what] for t, what in sorted(events, key=lambda e: e[0])]
    b = [("h2", "Timeline (UTC)")]
    if len(aff):
        b.append(
            (
                "p",
                f"Exposure window: {format_utc(aff['last_ns'].min())} to {format_utc(aff['last_ns'].max())} "
                "(first to last foreign read).",
            )
        )
    return b + [("table", ["time (UTC)", "event"], rows)] + figures.timeline(r)


def _exploitation(r) -> list[tuple]:
    e = r.exploitation
    main, ex = e.filter(pl.col("excluded_by").is_null()), e.filter(pl.col("excluded_by").is_not_null())
    out = main.filter(pl.col("verdict") == "stands out")
    lo, hi = r.options.baseline
    rules = r.options.rules
    tokens = f"{r.long_prompt_tokens:,}" if r.long_prompt_tokens is not None else "unknown"
    b = [
        ("h2", "Exploitation assessment"),
        (
            "p",
            f"Over-long prompt: more than {tokens} tokens. Baseline period: {format_utc(lo)} to {format_utc(hi)}. "
            f"Repeated probing: {rules.burst_count} or more over-long prompts within {rules.burst_minutes:g} "
            f"minutes; unusual volume: {rules.min_long_requests} or more at over {rules.rate_ratio:g}x the "
            "tenant's own baseline rate.",
        ),
        (
            "p",
            "No tenant stands out: the remaining requests are consistent, in timing and volume, with normal "
            "long-context use; no evidence of deliberate exploitation."
            if len(main) and not len(out)
            else f"{len(out)} tenant(s) stand out: "
            + "; ".join(f"{t}: {why}" for t, why in zip(out["tenant_id"], out["reason"]))
            if len(out)
            else "No tenant to assess.",
        ),
    ]
    cols = [
        "tenant_id",
        "affected_responses",
        "long_requests",
        "long_per_hour",
        "baseline_long_requests",
        "baseline_long_per_hour",
        "max_long_in_burst",
        "verdict",
        "reason",
    ]
    b += _table(main, cols)
    if len(ex):
        b += [("p", "Excluded accounts (not counted above):")] + _table(
            ex, ["tenant_id", "excluded_by", "affected_responses", "long_requests", "max_long_in_burst", "reason"]
        )
    return b


def _matrix(r) -> list[tuple]:
    """The recipient x victim matrix in long form, one row per recipient tenant (a 20-tenant matrix is 20
    columns no page can hold): other tenants' data, its own tenant's other requests, never-written pages."""
    m = r.matrix
    if m.is_empty():
        return [("p", "No exposure.")]
    rows = []
    for recipient in sorted(set(m["recipient_tenant"])):
        mine = m.filter(pl.col("recipient_tenant") == recipient).sort(
            ["responses", "pages", "victim_tenant"], descending=[True, True, False]
        )
        other = mine.filter(~an.same_tenant() & (pl.col("victim_tenant") != NEVER_WRITTEN))
        own = mine.filter(an.same_tenant())
        never = mine.filter(pl.col("victim_tenant") == NEVER_WRITTEN)
        shown = [f"{v}: {n} / {p}" for v, n, p in other.select("victim_tenant", "responses", "pages").iter_rows()]
        more = f"; and {len(shown) - _MOST_VICTIMS} more tenants" if len(shown) > _MOST_VICTIMS else ""
        rows.append(
            [
                recipient,
                "; ".join(shown[:_MOST_VICTIMS]) + more,
                *(f"{x['responses'][0]} / {x['pages'][0]}" if len(x) else "" for x in (own, never)),
            ]
        )
    return [
        (
            "p",
            "Responses / pages read, per recipient tenant: of other tenants (their data), of the tenant's "
            "own other requests, and of pages never written (stale or uninitialised memory, no customer's "
            "data).",
        ),
        (
            "table",
            [
                "recipient tenant",
                "other tenants' data read (tenant: responses / pages)",
                "own tenant's other requests",
                "never-written pages",
            ],
            rows,
        ),
    ]


def _measures(r) -> list[tuple]:
    ctx = r.context
    return [
        ("h2", "Measures taken and remediation"),
        (
            "ul",
            (list(ctx.measures_taken) + list(ctx.remediation))
            if ctx and (ctx.measures_taken or ctx.remediation)
            else [NOT_PROVIDED],
        ),
    ]


def _integrity(r, store_name: str) -> list[tuple]:
    heads = [
        [h["node"], h["instance"], str(h["producer_id"]), str(h["batch_no"]), str(h["last_seq"]), h["digest"]]
        for h in r.chain_heads
    ]
    return [
        ("h2", "Audit integrity"),
        ("p", "The audit store is a hash chain of event batches per producer. At report time its heads were:"),
        ("table", ["node", "instance", "producer", "batch", "last seq", "digest (SHA-256)"], heads),
        (
            "p",
            f"SHA-256 of the canonical query results behind this report: {r.results_digest()}. "
            "report.json lists it with the hash of every file; to confirm the report against the store:",
        ),
        # a command to paste into a shell: the store's file name quoted as the shell reads it
        (
            "mono",
            f"kvtrail forensics verify-report REPORT_DIR {'--lake' if r.lake else '--db'} {shlex.quote(store_name)}",
        ),
    ]
