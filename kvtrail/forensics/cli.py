"""``kvtrail forensics ...``: findings and affected responses in a window, as a table or a file."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from kvtrail.errors import KvtrailError
from kvtrail.timeutil import format_utc, parse_utc

FORMATS = ("table", "csv", "json", "parquet")


def _window(db: str, from_: str | None, to: str | None, tenant: str | None, node: str | None):
    from kvtrail.audit.store import connect_readonly
    from kvtrail.forensics.questions import Window

    if not Path(db).exists():
        raise KvtrailError(f"--db: store not found: {db}")
    w = Window(parse_utc(from_, field="--from") if from_ else None, parse_utc(to, field="--to") if to else None,
               tenant, node)
    return connect_readonly(db), w


def _emit(df, fmt: str, out: str | None, empty_msg: str, gaps) -> None:
    import polars as pl

    if len(gaps):
        click.echo(f"warning: coverage gap: {int(gaps['unexplained'].sum())} events missing from "
                   f"{len(gaps)} producer(s) without a recorder_gap explaining them "
                   f"({', '.join(gaps['node'].to_list()[:5])}); answers may be incomplete", err=True)
    if fmt == "parquet" and not out:
        raise KvtrailError("--out: required with --format parquet")
    if fmt == "table":
        if df.is_empty():
            click.echo(empty_msg)
            return
        shown = df.with_columns([pl.col(c).map_elements(format_utc, return_dtype=pl.Utf8)
                                 for c in ("first_ns", "last_ns") if c in df.columns])
        shown = shown.drop([c for c in ("evidence",) if c in shown.columns])
        with pl.Config(tbl_rows=200, tbl_cols=20, fmt_str_lengths=60, tbl_width_chars=200):
            click.echo(shown)
        return
    flat = df.with_columns(pl.col("evidence").map_elements(
        lambda ev: ";".join(f"{e['producer_id']}:{e['seq']}" for e in ev), return_dtype=pl.Utf8)) \
        if fmt == "csv" and "evidence" in df.columns else df
    for c in ("victim_request_ids", "victim_tenant_ids", "pages"):
        if fmt == "csv" and c in flat.columns:
            flat = flat.with_columns(pl.col(c).map_elements(lambda v: ",".join(str(x) for x in v), return_dtype=pl.Utf8))
    target = out or sys.stdout
    if fmt == "csv":
        text = flat.write_csv()
        click.echo(text, nl=False) if out is None else Path(out).write_text(text)
    elif fmt == "json":
        text = df.write_json()
        click.echo(text) if out is None else Path(out).write_text(text)
    else:
        df.write_parquet(target)
    if out:
        click.echo(f"wrote {len(df)} rows to {out}")


def _options(f):
    for opt in reversed([
        click.option("--db", default="kvtrail.duckdb", show_default=True, type=click.Path(dir_okay=False)),
        click.option("--from", "from_", help="UTC start of the window (ISO 8601)."),
        click.option("--to", "to", help="UTC end of the window (ISO 8601)."),
        click.option("--tenant", help="Only this tenant (as recipient or victim)."),
        click.option("--node", help="Only this node."),
        click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True),
        click.option("--out", type=click.Path(dir_okay=False), help="Write to this file instead of stdout."),
    ]):
        f = opt(f)
    return f


@click.group()
def forensics() -> None:
    """Forensics over the audit store: findings F1-F10 with evidence, affected responses."""


@forensics.command(name="findings")
@_options
@click.option("--code", "codes", multiple=True, help="Only these finding codes (repeatable), e.g. F1.")
def findings_cmd(db, from_, to, tenant, node, fmt, out, codes) -> None:
    """Every finding in the window, with the event ids that prove it."""
    from kvtrail.forensics.findings import CODES
    from kvtrail.forensics.questions import coverage_gaps, findings

    bad = [c for c in codes if c not in CODES]
    if bad:
        raise KvtrailError(f"--code: unknown finding code {bad[0]!r}; known: {', '.join(CODES)}")
    con, w = _window(db, from_, to, tenant, node)
    try:
        df, gaps = findings(con, w, tuple(codes)), coverage_gaps(con)
    finally:
        con.close()
    _emit(df, fmt, out, "no findings in this window", gaps)


@forensics.command()
@_options
def affected(db, from_, to, tenant, node, fmt, out) -> None:
    """Which responses read foreign pages in the window, and whose data it was."""
    from kvtrail.forensics.questions import affected_responses, coverage_gaps

    con, w = _window(db, from_, to, tenant, node)
    try:
        df, gaps = affected_responses(con, w), coverage_gaps(con)
    finally:
        con.close()
    _emit(df, fmt, out, "no affected responses in this window", gaps)
