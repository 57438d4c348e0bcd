"""How an answer's rows leave the CLI: a readable terminal table, or a file form that keeps everything.

The file forms (CSV, JSON, Parquet) keep every column and value: ``*_ns`` columns stay integers, list
columns stay lists (JSON arrays, Parquet lists) and are joined only in CSV. The table is for a
responder at a terminal: a one-line summary, the columns scanned first (one line per row), times as
ISO UTC in columns renamed ``*_ns`` -> ``*_at``, ids and numbers whole (columns left out, and named,
when the terminal is too narrow), lists as counts or short joins. Ids come from producers, so every
cell is stripped of control characters and printed as plain text (never as markup or escape
sequences), and the file forms printed to a terminal are escaped the same way (:func:`terminal_text`).
CSV text cells that a spreadsheet would run as a formula get a leading ``'``
(:func:`kvtrail.outputs.csv_frame`).
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import polars as pl
from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvtrail.answers import spec
from kvtrail.answers.spec import AnswerSpec
from kvtrail.answers.text import items, printable, shorten, shorten_items
from kvtrail.forensics.findings import CODES, NEVER_WRITTEN, UNKNOWN_TENANT
from kvtrail.timeutil import format_utc

PSEUDO_TENANTS = (NEVER_WRITTEN, UNKNOWN_TENANT)


@dataclass(frozen=True)
class Column:
    """One table column: its header, the frame columns it shows (the rest count as left out), how a
    row's cell reads (in full: the table shortens it), the most characters it takes, and how it gives
    way: an id (``middle``) or a number is never cut, text loses its end; a ``flex`` column shrinks first
    when the table is too wide, then whole columns are left out (named under the table)."""

    header: str
    sources: tuple[str, ...]
    cell: Callable[[dict], str]
    max_chars: int = 24
    numeric: bool = False
    middle: bool = False
    flex: bool = False
    listing: bool = False  # a joined list: cut between items, never inside an id


def ident(name: str, max_chars: int = 20, header: str | None = None) -> Column:
    return Column(header or name, (name,), lambda r: printable(r[name]), max_chars, middle=True)


def number(name: str, header: str | None = None) -> Column:
    def cell(r: dict) -> str:
        v = r[name]
        return "" if v is None else (f"{v:g}" if isinstance(v, float) else str(v))

    return Column(header or name, (name,), cell, 14, numeric=True)


def time_at(name: str) -> Column:
    """A ``*_ns`` column as ISO UTC under the name ``*_at``."""
    header = name[:-3] + "_at" if name.endswith("_ns") else name
    return Column(header, (name,), lambda r: format_utc(r[name]), 27)


def count(name: str, header: str | None = None) -> Column:
    return Column(header or name, (name,), lambda r: str(len(items(r[name]))), 8, numeric=True)


def _names(values) -> str:
    """Distinct names joined with ",", real tenants first and pseudo-victims last (cut from the end)."""
    names = {printable(v if v is not None else NEVER_WRITTEN) for v in values}
    return ",".join(sorted(names, key=lambda n: (n in PSEUDO_TENANTS, n)))


def joined(name: str, max_chars: int = 28, header: str | None = None) -> Column:
    """A list column as its distinct items joined with "," (e.g. victim tenants)."""
    return Column(header or name, (name,), lambda r: _names(items(r[name])), max_chars, flex=True, listing=True)


def text(name: str, max_chars: int = 60, header: str | None = None) -> Column:
    return Column(header or name, (name,), lambda r: printable(r[name]), max_chars, flex=True)


def flag(name: str, header: str | None = None) -> Column:
    return Column(header or name, (name,), lambda r: {True: "yes", False: "no"}.get(r[name], ""), 5)


@dataclass(frozen=True)
class TableView:
    """How one command's answer reads in a terminal: its summary line, the columns a responder scans
    first, and what to say when there are no rows."""

    spec: AnswerSpec  # the answer's columns: every column here shows some of them
    summary: Callable[[pl.DataFrame], str]
    columns: tuple[Column, ...]
    empty: str
    # Headers of the columns that give way first when the terminal is too narrow, in that order.
    leave_out: tuple[str, ...] = ()


MIN_CHARS = 10


@dataclass(frozen=True)
class Layout:
    """Which columns a table shows (indices into its columns), each one's width, and the columns left out
    to fit the terminal."""

    shown: tuple[int, ...]
    widths: tuple[int, ...]
    dropped: tuple[int, ...]


def _natural(col: Column, cells: list[str]) -> int:
    """A column's width when nothing has to give: an id or a number is never cut (a responder copies it),
    other cells at most ``max_chars``."""
    longest = max([0] + [cell_len(v) for v in cells])
    return max(cell_len(col.header), longest if col.middle or col.numeric else min(longest, col.max_chars))


def _layout(cols: list[Column], cells: list[list[str]], width_chars: int, leave_out: tuple[str, ...] = ()) -> Layout:
    """Fit the table in ``width_chars`` (each column takes one more for padding, one between columns):
    flex columns (prose, joined lists) shrink first, never below ``MIN_CHARS`` or their header; then whole
    columns are left out: the view's ``leave_out`` in order, then flex ones, then from the right (the
    views list the columns a responder scans first), never the first. Ids and numbers keep their width;
    only an id wider than the terminal itself wraps."""
    natural = [_natural(c, [row[i] for row in cells]) for i, c in enumerate(cols)]
    floor = [max(MIN_CHARS, cell_len(c.header)) if c.flex else natural[i] for i, c in enumerate(cols)]
    named = {c.header: i for i, c in enumerate(cols) if i}
    order = [named[h] for h in leave_out if h in named]
    order += [i for i in reversed(range(1, len(cols))) if cols[i].flex and i not in order]
    order += [i for i in reversed(range(1, len(cols))) if i not in order]
    shown = list(range(len(cols)))
    while True:
        widths = {i: natural[i] for i in shown}
        excess = sum(widths.values()) + 2 * len(shown) - 1 - width_chars
        while excess > 0 and (give := [i for i in shown if widths[i] > floor[i]]):
            widths[max(give, key=lambda j: (widths[j] - floor[j], j))] -= 1
            excess -= 1
        if excess <= 0 or len(shown) == 1:
            break
        shown.remove(order.pop(0))
    for i in sorted(shown, key=lambda j: -widths[j]):  # only an id wider than the terminal: it wraps
        if excess <= 0:
            break
        cut = min(excess, widths[i] - max(MIN_CHARS, cell_len(cols[i].header)))
        if cut > 0:
            widths[i] -= cut
            excess -= cut
    return Layout(tuple(shown), tuple(widths[i] for i in shown), tuple(i for i in range(len(cols)) if i not in shown))


def render_table(
    df: pl.DataFrame,
    view: TableView,
    scope: str = "",
    *,
    notes: tuple[str, ...] = (),
    width_chars: int = 120,
    color: bool = False,
) -> str:
    """The rows as a table, one line per row, under a one-line summary (``scope``, e.g. the window,
    appended to it), with a footer counting the columns only the file formats hold (and naming those left
    out to fit the width), then the notes."""
    console = Console(
        file=io.StringIO(),
        width=width_chars,
        force_terminal=color,
        no_color=not color,
        color_system="auto" if color else None,
        markup=False,
        emoji=False,
        highlight=False,
    )
    if df.is_empty():
        console.print(Text(printable(view.empty)))
    else:
        _print_table(console, df, view, scope)
    for note in notes:
        console.print(Text(printable(note)))  # prose: wrapped at words
    out = console.file
    assert isinstance(out, io.StringIO), "the console writes to its own buffer"
    return out.getvalue()


def _print_table(console: Console, df: pl.DataFrame, view: TableView, scope: str) -> None:
    width_chars = console.width
    all_cols = [c for c in view.columns if all(s in df.columns for s in c.sources)]
    all_cells = [[c.cell(row) for c in all_cols] for row in df.iter_rows(named=True)]
    layout = _layout(all_cols, all_cells, width_chars, view.leave_out)
    cols = [all_cols[i] for i in layout.shown]
    table = Table(
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        padding=(0, 1, 0, 0),
        header_style="bold" if console.is_terminal else "",
    )
    for c, w in zip(cols, layout.widths):
        whole = c.middle or c.numeric  # ids and numbers wrap rather than lose characters
        table.add_column(
            Text(c.header),
            justify="right" if c.numeric else "left",
            no_wrap=not whole,
            overflow="fold" if whole else "ellipsis",
            width=w,
        )
    for row in all_cells:
        table.add_row(
            *(
                Text(row[i] if c.middle or c.numeric else shorten_items(row[i], w) if c.listing else shorten(row[i], w))
                for i, c, w in zip(layout.shown, cols, layout.widths)
            )
        )
    summary = printable(view.summary(df))
    if scope and cell_len(summary) + 2 + cell_len(scope) <= width_chars:
        summary, scope = f"{summary}, {scope}", ""
    for line in (summary, scope):
        if line:
            console.print(Text(printable(line)))  # wrapped at words: its numbers are never cut
    console.print(table)
    shown = {s for c in cols for s in c.sources}
    left_out = [c for c in df.columns if c not in shown]
    if left_out:
        console.print(Text(f"({len(left_out)} more columns in --format csv/json/parquet)"))
    if layout.dropped:
        names = ", ".join(all_cols[i].header for i in layout.dropped)
        console.print(
            Text(
                f"(left out to fit {width_chars} characters: {names}; a wider terminal or --format "
                "csv/json/parquet shows them)"
            )
        )


def json_text(df: pl.DataFrame) -> str:
    """A JSON array of row objects: list columns as arrays, integers (``*_ns`` too) as integers."""
    return df.write_json()


def window_scope(from_ns: int | None, to_ns: int | None, tenant: str | None = None, node: str | None = None) -> str:
    """The window in words for the summary line, e.g. "window 2026-09-09T00:00:00.000000Z to ..."."""
    if from_ns is None and to_ns is None:
        words = "whole store"
    else:
        words = f"window {format_utc(from_ns) or 'start'} to {format_utc(to_ns) or 'end'}"
    return words + (f", tenant {tenant}" if tenant else "") + (f", node {node}" if node else "")


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _tenants(values) -> set[str]:
    return {v for v in values if v is not None and v not in PSEUDO_TENANTS}


def _findings_summary(df: pl.DataFrame) -> str:
    by_code = Counter(df["code"].to_list())
    order = {c: i for i, c in enumerate(CODES)}
    parts = ", ".join(f"{c} {n}" for c, n in sorted(by_code.items(), key=lambda kv: (order.get(kv[0], 99), kv[0])))
    return f"{_plural(len(df), 'finding')}: {parts}"


def _affected_summary(df: pl.DataFrame) -> str:
    victims = _tenants(v for cell in df["victim_tenants"].to_list() for v in items(cell))
    return (
        f"{_plural(len(df), 'affected response')}; tenants: {len(_tenants(df['tenant_id']))} recipient, "
        f"{len(victims)} victim"
    )


def _tenant_affected_summary(df: pl.DataFrame) -> str:
    return (
        f"{_plural(len(df), 'affected response')} of this tenant; data of up to "
        f"{max(df['other_tenants'].fill_null(0).to_list(), default=0)} other tenant(s) read by one response"
    )


def _tenant_exposure_summary(df: pl.DataFrame) -> str:
    r = df.row(0, named=True)
    if not r["exposed"]:
        return f"{printable(r['tenant_id'])}: no other request read this tenant's data"
    return (
        f"{printable(r['tenant_id'])}: data of {_plural(len(items(r['my_requests_read'])), 'request')} read by "
        f"{_plural(r['reading_responses'], 'response')} of {r['reading_tenants']} other tenant(s), "
        f"{_plural(r['pages'], 'page')}"
    )


def _exposure_summary(df: pl.DataFrame) -> str:
    return (
        f"{_plural(len(df), 'recipient x victim pair')}: "
        f"{_plural(len(_tenants(df['recipient_tenant'])), 'recipient tenant')}, "
        f"{_plural(len(_tenants(df['victim_tenant'])), 'victim tenant')}"
    )


def _thresholds_summary(df: pl.DataFrame) -> str:
    short = int((~df["pool_covers_context"].fill_null(True)).sum())
    affected = int(df["affected"].fill_null(0).sum()) if "affected" in df.columns else 0
    requests = int(df["requests"].fill_null(0).sum()) if "requests" in df.columns else 0
    return (
        f"{_plural(len(df), 'node configuration')} on {_plural(df['node'].n_unique(), 'node')}, "
        f"{short} with a pool smaller than the context; {affected} of {requests} prefill requests affected"
    )


def _exploitation_summary(df: pl.DataFrame) -> str:
    verdicts = Counter(df["verdict"].to_list())
    # "consistent with normal long-context use" -> "consistent": the column holds the full verdict
    ranked = sorted(verdicts.items(), key=lambda kv: (-kv[1], kv[0]))
    parts = ", ".join(f"{v.split(' with ')[0]} {n}" for v, n in ranked)
    return f"{_plural(len(df), 'account')}: {parts}"


def _victims(r: dict) -> str:
    """A finding's victims: their tenants when one or two, else how many."""
    rids, tenants = items(r["victim_request_ids"]), items(r["victim_tenant_ids"])
    names = {
        t if t is not None else (NEVER_WRITTEN if i >= len(rids) or rids[i] is None else UNKNOWN_TENANT)
        for i, t in enumerate(tenants)
    }
    return _names(names) if len(names) <= 2 else f"{len(names)} victims"


# Per command, the columns a responder scans first; headers are the file formats' names, shortened
# where the name is much wider than its values (120 characters hold about ten columns).
FINDINGS = TableView(
    spec.FINDINGS,
    _findings_summary,
    (
        ident("code", 4),
        ident("severity", 8),
        ident("node", 16),
        ident("request_id"),
        ident("tenant_id", 16),
        Column("victims", ("victim_tenant_ids", "victim_request_ids"), _victims, 28, flex=True),
        count("pages"),
        time_at("first_ns"),
        text("detail", 80),
    ),
    "no findings in this window",
    ("first_at", "severity", "pages", "detail", "node"),
)
AFFECTED = TableView(
    spec.AFFECTED,
    _affected_summary,
    (
        ident("request_id"),
        ident("tenant_id", 16),
        number("http_status", "status"),
        number("prompt_tokens", "prompt"),
        number("completion_tokens", "completion"),
        number("pages_read_foreign", "pages"),
        joined("victim_tenants", 32),
        count("victim_requests", "victim_reqs"),
        time_at("first_ns"),
    ),
    "no affected responses in this window",
    ("victim_reqs", "first_at", "completion", "prompt", "status"),
)
EXPOSURE = TableView(
    spec.EXPOSURE,
    _exposure_summary,
    (
        ident("recipient_tenant", 24),
        ident("victim_tenant", 24),
        number("responses"),
        number("pages"),
        number("victim_requests"),
    ),
    "no exposure in this window",
)
THRESHOLDS = TableView(
    spec.THRESHOLDS,
    _thresholds_summary,
    (
        ident("node", 16),
        ident("role", 8),
        time_at("effective_from_ns"),
        number("pool_tokens", "pool"),
        number("context_tokens", "context"),
        number("shortfall_tokens", "shortfall"),
        number("requests"),
        number("affected"),
        number("affected_over_pool", "aff>pool"),
        number("unaffected_over_pool", "unaff>pool"),
    ),
    "no node configuration in this window",
    ("effective_from_at", "unaff>pool", "aff>pool", "role"),
)
EXPLOITATION = TableView(
    spec.EXPLOITATION,
    _exploitation_summary,
    (
        ident("tenant_id", 16),
        number("affected_responses", "affected"),
        number("long_requests", "long"),
        number("long_per_hour", "long/h"),
        number("baseline_long_per_hour", "base/h"),
        number("max_long_in_burst", "burst"),
        ident("verdict", 40),
        text("reason", 90),
    ),
    "no recipient tenant and no over-long prompt in this window",
    ("reason", "base/h", "long/h", "burst"),
)
# What a tenant's token gets for the same commands (its own rows, other tenants as counts).
TENANT_AFFECTED = TableView(
    spec.TENANT_AFFECTED,
    _tenant_affected_summary,
    (
        ident("request_id"),
        number("http_status", "status"),
        number("prompt_tokens", "prompt"),
        number("completion_tokens", "completion"),
        joined("codes", 8),
        number("pages_read_foreign", "pages"),
        number("other_requests", "other_reqs"),
        number("other_tenants", "other_tenants"),
        time_at("first_ns"),
    ),
    "no affected responses of this tenant in this window",
    ("first_at", "completion", "prompt", "status"),
)
TENANT_EXPOSURE = TableView(
    spec.TENANT_EXPOSURE,
    _tenant_exposure_summary,
    (
        ident("tenant_id", 16),
        flag("exposed"),
        joined("my_requests_read", 40, "requests_read"),
        number("reading_responses", "responses"),
        number("reading_tenants", "tenants"),
        number("pages"),
    ),
    "no answer",
)
VIEWS = (FINDINGS, AFFECTED, TENANT_AFFECTED, EXPOSURE, TENANT_EXPOSURE, THRESHOLDS, EXPLOITATION)


def view_for(df: pl.DataFrame, view: TableView) -> TableView:
    """``view``, or the view whose spec has exactly ``df``'s columns (a tenant's token gets its own table
    for the same command: ``TENANT_AFFECTED`` for ``AFFECTED``)."""
    if set(view.spec.names) <= set(df.columns):
        return view
    return next((v for v in VIEWS if v.spec.names == tuple(df.columns)), view)
