"""Options the forensics commands share: exclusions of tenants and ids, the probing rules, the report's
window and baseline."""

from __future__ import annotations

import click

from kvtrail.errors import KvtrailError
from kvtrail.forensics import Exclusions, ProbeRules
from kvtrail.forensics.options import ReportOptions
from kvtrail.report.context import load_exclusions
from kvtrail.timeutil import parse_utc


def exclusion_options(f):
    for opt in reversed(
        [
            click.option(
                "--exclude-tenant",
                "exclude_tenants",
                multiple=True,
                metavar="ID[=REASON]",
                help="Leave this tenant's responses out of every count (repeatable).",
            ),
            click.option(
                "--exclude-file",
                type=click.Path(dir_okay=False),
                help="YAML file of exclusions: tenants/api_key_ids/request_ids, each a list of {id, reason}.",
            ),
        ]
    ):
        f = opt(f)
    return f


def exclusions(tenants: tuple[str, ...], file: str | None, base=None):
    """The exclusions of the flags (plus ``base``, e.g. from incident.yaml)."""

    pairs = []
    for t in tenants:
        tenant, _, reason = t.partition("=")
        if not tenant.strip():
            raise KvtrailError(f"--exclude-tenant: empty tenant id in {t!r}")
        pairs.append((tenant.strip(), reason.strip() or "excluded on the command line"))
    excl = Exclusions(
        tenants=tuple(sorted(dict(pairs).items())),
        sources=tuple((tenant, "--exclude-tenant") for tenant in sorted(dict(pairs))),
    )
    if file:
        excl = excl.merged(load_exclusions(file))
    return excl.merged(base) if base is not None else excl


def probe_options(f):
    for opt in reversed(
        [
            click.option(
                "--baseline-from",
                help="UTC start of the baseline period (default: as long as the window, right before --from).",
            ),
            click.option("--baseline-to", help="UTC end of the baseline period (default: --from)."),
            click.option(
                "--long-prompt-tokens",
                type=click.IntRange(1),
                help="Prompts longer than this are over-long (default: the smallest prefill pool).",
            ),
            click.option(
                "--burst-minutes",
                type=click.FloatRange(min=0, min_open=True),
                default=10.0,
                show_default=True,
                help="Length of a probing burst.",
            ),
            click.option(
                "--burst-count",
                type=click.IntRange(1),
                default=5,
                show_default=True,
                help="Over-long prompts within --burst-minutes that count as repeated probing.",
            ),
        ]
    ):
        f = opt(f)
    return f


def report_options(from_ns, to_ns, excl, baseline_from, baseline_to, long_prompt_tokens, burst_minutes, burst_count):

    if from_ns is None or to_ns is None:
        flag = "--from" if from_ns is None else "--to"
        raise KvtrailError(f"{flag}: required (the baseline and rates need a window)")
    if from_ns > to_ns:
        raise KvtrailError("--from: is after --to")
    b_from = parse_utc(baseline_from, field="--baseline-from") if baseline_from else None
    b_to = parse_utc(baseline_to, field="--baseline-to") if baseline_to else None
    o = ReportOptions(
        from_ns,
        to_ns,
        excl,
        b_from,
        b_to,
        long_prompt_tokens,
        ProbeRules(burst_minutes=burst_minutes, burst_count=burst_count),
    )
    lo, hi = o.baseline
    if lo > hi:
        raise KvtrailError("--baseline-from: is after the end of the baseline period")
    return o
