"""``kvtrail forensics ...``: findings, affected responses, exposure, thresholds and exploitation in a
window (as a table or a file), and the disclosure report with its verification.

The query commands read a store file (``--db``) or ask a running service (``--url``/``--token``, or
``KVTRAIL_URL``/``KVTRAIL_TOKEN``) the same question, and print the same output either way."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import click
import duckdb

from kvtrail.answers.ask import ServiceAnswers, open_answers
from kvtrail.answers.tables import (
    AFFECTED,
    EXPLOITATION,
    EXPOSURE,
    FINDINGS,
    THRESHOLDS,
    TableView,
    json_text,
    printable,
    render_table,
    view_for,
    window_scope,
)
from kvtrail.answers.text import coverage_lines, terminal_text
from kvtrail.cli.options import exclusion_options, exclusions, probe_options, report_options
from kvtrail.cli.progress import replaying, step
from kvtrail.cli.report import report, verify_notice_cmd, verify_report_cmd
from kvtrail.cli.sources import (
    lake_options,
    remote_options,
    repeat_polls,
    watch_remote,
    with_lake_executor,
)
from kvtrail.errors import KvtrailError
from kvtrail.forensics import (
    NEVER_WRITTEN,
    ForensicsPolicy,
    OnlineReplay,
    Window,
    open_store,
)
from kvtrail.forensics.engine_signals import SignalPolicy
from kvtrail.forensics.lake.task import LakeCoverageError
from kvtrail.forensics.lake.watch import LakeWatch
from kvtrail.forensics.questions import require_store
from kvtrail.forensics.results.persist import save_findings
from kvtrail.outputs import csv_frame, refuse_clobber, write_file_atomically
from kvtrail.timeutil import format_utc, parse_utc

FORMATS = ("table", "csv", "json", "parquet")
ENGINES = ("replay", "sql")


def _window(from_: str | None, to: str | None, tenant: str | None = None, node: str | None = None) -> Window:
    return Window(
        parse_utc(from_, field="--from") if from_ else None, parse_utc(to, field="--to") if to else None, tenant, node
    )


def _warn(answer) -> None:
    """Coverage gaps and integrity warnings go to stderr, whatever the format."""
    for line in coverage_lines(answer.gaps, answer.warnings):
        click.echo(f"warning: {line}", err=True)


def _terminal() -> tuple[int, bool]:
    """(width in characters, colours?) of stdout: the terminal's, or 120 and none for a pipe or file."""
    if sys.stdout.isatty():
        return shutil.get_terminal_size((120, 24)).columns, True
    return 120, False


def _check_out(db: str, fmt: str, out: str | None, force: bool) -> None:
    """Refuse a bad ``--out`` before any query runs: the store's own files always, an existing file
    unless ``--force``."""
    if fmt == "parquet" and not out:
        raise KvtrailError("--out: required with --format parquet")
    if out:
        refuse_clobber(out, force, protected=(db,))


def _emit(answer, fmt: str, out: str | None, view: TableView, w: Window, db: str, force: bool) -> None:
    """The answer's rows in ``fmt`` (to ``out`` or stdout), its notes, warnings on stderr."""
    _warn(answer)
    df = answer.rows
    if fmt == "table":
        width, color = _terminal() if out is None else (120, False)
        text = render_table(
            df,
            view_for(df, view),
            window_scope(w.from_ns, w.to_ns, w.tenant, w.node),
            notes=answer.notes,
            width_chars=width,
            color=color,
        )
    elif fmt == "csv":
        text = csv_frame(df).write_csv()
    elif fmt == "json":
        text = json_text(df) + "\n"
    else:
        text = ""  # parquet: written from the frame
    if out is None:
        if fmt != "table" and sys.stdout.isatty():  # the table is plain text already
            text = terminal_text(text, json=fmt == "json")
        # color=True: click would otherwise cut escape sequences out of ids on their way to a pipe
        click.echo(text, nl=False, color=True)
    else:

        def write(tmp: Path) -> None:
            if fmt == "parquet":
                df.write_parquet(tmp)
            else:
                tmp.write_text(text)

        write_file_atomically(out, write, force=force, protected=(db,))
    if fmt != "table":
        for note in answer.notes:
            click.echo(printable(note), err=True)
    if out:
        click.echo(f"wrote {len(df)} rows to {printable(out)}")


def _options(f):
    f = remote_options(f)
    for opt in reversed(
        [
            click.option("--db", default="kvtrail.duckdb", show_default=True, type=click.Path(dir_okay=False)),
            click.option("--from", "from_", help="UTC start of the window (ISO 8601)."),
            click.option("--to", "to", help="UTC end of the window (ISO 8601)."),
            click.option("--tenant", help="Only this tenant (as recipient or victim)."),
            click.option("--node", help="Only this node."),
            click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True),
            click.option(
                "--out",
                type=click.Path(dir_okay=False),
                help="Write to this file instead of stdout (never the store or one of its files).",
            ),
            click.option("--force", is_flag=True, help="Replace --out if it exists."),
        ]
    ):
        f = opt(f)
    return f


def _say_excluded(dropped) -> None:
    if len(dropped):
        reasons = sorted({f"{by} ({why})" for by, why in zip(dropped["excluded_by"], dropped["reason"])})
        click.echo(
            printable(
                f"excluded: {len(dropped)} affected responses of {len(reasons)} account(s): {'; '.join(reasons)}"
            ),
            err=True,
        )


@click.group()
def forensics() -> None:
    """Forensics over the audit store: findings F1-F11 with evidence, affected responses."""


def _policy_options(f):

    for opt in reversed(
        [
            click.option(
                "--engine",
                type=click.Choice(ENGINES),
                default="replay",
                show_default=True,
                help="Findings engine: the streaming replay or the independent SQL engine.",
            ),
            click.option(
                "--allow-tenant-cache-sharing",
                is_flag=True,
                help="The deployment lets tenants share prefix-cache pages: no F10.",
            ),
            click.option(
                "--latency-factor",
                type=click.FloatRange(1.0),
                default=ForensicsPolicy.latency_factor,
                show_default=True,
                help="F9: how many times faster than its node's measured prefill "
                "rate a response must be to be implausible.",
            ),
        ]
    ):
        f = opt(f)
    return f


def _policy(allow_tenant_cache_sharing: bool, latency_factor: float):

    return ForensicsPolicy(allow_tenant_cache_sharing=allow_tenant_cache_sharing, latency_factor=latency_factor)


@forensics.command(name="findings")
@_options
@click.option("--code", "codes", multiple=True, help="Only these finding codes (repeatable), e.g. F1.")
@exclusion_options
@_policy_options
@click.option(
    "--spec-min-accept-rate",
    type=click.FloatRange(0.0, 1.0, min_open=True),
    default=None,
    help="Name responses whose speculative-decoding acceptance rate is below this (over at least "
    f"{SignalPolicy.spec_min_verify_steps} verification passes) as an engine signal; off by default.",
)
@click.option(
    "--save",
    is_flag=True,
    help="Also keep the window's findings in the store (tables findings and "
    "forensic_runs); re-running a window adds no duplicates.",
)
@lake_options
def findings_cmd(
    db,
    url,
    api_token,
    from_,
    to,
    tenant,
    node,
    fmt,
    out,
    force,
    codes,
    exclude_tenants,
    exclude_file,
    engine,
    allow_tenant_cache_sharing,
    latency_factor,
    spec_min_accept_rate,
    save,
    lake_url,
    scheduler,
    workers,
) -> None:
    """Every finding in the window, with the event ids that prove it (excluded accounts' requests left out)."""
    _check_out(db, fmt, out, force)
    excl = exclusions(exclude_tenants, exclude_file)
    policy = _policy(allow_tenant_cache_sharing, latency_factor)
    w = _window(from_, to, tenant, node)
    if lake_url is not None and save:
        raise KvtrailError("--lake: not with --save (a lake is read-only; save findings into a store)")
    with open_answers(db, url, api_token, lake_url, scheduler, workers) as answers:
        if save and answers.kind == "service":
            raise KvtrailError("--save: not with --url (the service's live judge keeps the findings)")
        doing = "replaying the store" if answers.kind == "store" else f"asking the {answers.kind}"
        with replaying(f"findings: {doing}"):
            signals = SignalPolicy(spec_min_accept_rate=spec_min_accept_rate)
            answer = answers.findings(
                w, codes=tuple(codes), exclusions=excl, engine=engine, policy=policy, signals=signals
            )
    if save:
        with step(f"findings: saving {len(answer.found):,} findings into {db}"):
            _save(db, list(answer.found), w, engine, policy)
    if len(answer.excluded):
        click.echo(f"excluded: {len(answer.excluded)} findings of excluded accounts", err=True)
    _emit(answer, fmt, out, FINDINGS, w, db, force)


@forensics.command()
@_options
@exclusion_options
@lake_options
def affected(**kw) -> None:
    """Which responses read foreign pages in the window, and whose data it was."""
    _ask_table("affected", AFFECTED, **kw)


def _ask_table(
    question: str,
    view: TableView,
    *,
    db,
    url,
    api_token,
    from_,
    to,
    tenant,
    node,
    fmt,
    out,
    force,
    exclude_tenants,
    exclude_file,
    lake_url,
    scheduler,
    workers,
) -> None:
    """One table question (affected, exposure, thresholds) asked of the store, the service or the lake the
    options name, and printed or written as ``view`` says."""
    _check_out(db, fmt, out, force)
    excl = exclusions(exclude_tenants, exclude_file)
    w = _window(from_, to, tenant, node)
    with open_answers(db, url, api_token, lake_url, scheduler, workers) as answers:
        answer = getattr(answers, question)(w, exclusions=excl)
    _say_excluded(answer.excluded)
    _emit(answer, fmt, out, view, w, db, force)


def _save(db: str, found, w, engine: str, policy) -> None:

    try:
        con = duckdb.connect(db)
    except duckdb.Error as exc:
        raise KvtrailError(f"--save: cannot open {db} for writing (another process holds it?): {exc}") from exc
    try:
        run = save_findings(con, found, from_ns=w.from_ns, to_ns=w.to_ns, engine=engine, policy=policy)
    finally:
        con.close()
    click.echo(
        f"saved run {run.run_id}: {run.num_findings} findings, {run.num_new} new "
        f"(results digest {run.results_digest[:16]})",
        err=True,
    )


@forensics.command()
@click.option("--db", default="kvtrail.duckdb", show_default=True, type=click.Path(dir_okay=False))
@click.option(
    "--interval",
    type=click.FloatRange(0.05),
    default=2.0,
    show_default=True,
    help="Seconds between polls of the store.",
)
@click.option(
    "--polls",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="Stop after this many polls (0: until Ctrl-C).",
)
@click.option(
    "--allow-tenant-cache-sharing", is_flag=True, help="The deployment lets tenants share prefix-cache pages: no F10."
)
@remote_options
@lake_options
def watch(db, interval, polls, allow_tenant_cache_sharing, url, api_token, lake_url, scheduler, workers) -> None:
    """Tail a store: print each new finding as its batch commits (online replay; cross-node findings are
    provisional until their other half lands). The store is opened read-only for each poll only.
    With --url, follow a running service's live judge instead (the findings it persists, in the same lines).
    With --lake, follow an audit lake: each new export's new findings (its changed partitions re-judged).
    Ctrl-C or SIGTERM stops it (exit 0)."""
    policy = ForensicsPolicy(allow_tenant_cache_sharing=allow_tenant_cache_sharing)
    if lake_url is not None:
        if url:
            raise KvtrailError("--lake: give either --lake or --url")
        with_lake_executor(scheduler, workers, lambda ex: _watch_lake(lake_url, policy, ex, interval, polls))
        return
    if scheduler is not None or workers is not None:
        raise KvtrailError("--scheduler/--workers: only with --lake")
    if url:
        if allow_tenant_cache_sharing:
            raise KvtrailError(
                "--allow-tenant-cache-sharing: the service's judge runs with the service's policy; "
                "it cannot be set with --url"
            )
        watch_remote(ServiceAnswers(url, api_token), interval, polls)
        return
    require_store(db)
    online = OnlineReplay(policy)

    def step() -> None:
        try:
            con = open_store(db)
        except duckdb.Error as exc:  # a writer holds the file right now: try again next poll
            click.echo(printable(f"note: store busy ({str(exc).splitlines()[0][:120]})"), err=True)
            return
        try:
            for f in online.poll(con):
                click.echo(_finding_line(f))
        finally:
            con.close()

    done = repeat_polls(step, interval, polls)
    click.echo(f"watched {online.num_events} events in {done} polls", err=True)


def _watch_lake(lake_url: str, policy: ForensicsPolicy, executor, interval: float, polls: int) -> None:
    """``watch --lake``: poll the lake's manifest; print each export's new findings once."""
    watcher = LakeWatch(lake_url, policy, executor)
    noted: set[str] = set()

    def step() -> None:
        try:
            found = watcher.poll()
        except LakeCoverageError as exc:  # e.g. an export replaced a checkpoint while it was read: next poll
            click.echo(printable(f"note: {str(exc).splitlines()[0][:200]} (retrying next poll)"), err=True)
            return
        if not watcher.manifest and "empty" not in noted:
            noted.add("empty")
            click.echo(f"note: {lake_url} holds no lake manifest yet (waiting for kvtrail lake export)", err=True)
        for f in found:
            click.echo(_finding_line(f))

    done = repeat_polls(step, interval, polls)
    click.echo(
        f"watched manifest {watcher.manifest} ({watcher.tasks_run} partition tasks run, "
        f"{len(watcher.seen)} findings) in {done} polls",
        err=True,
    )


def _finding_line(f) -> str:
    """One finding as ``watch`` prints it; ids come from producers, so escaped (:func:`printable`)."""
    victims = ",".join(v or NEVER_WRITTEN for v in f.victim_request_ids)
    return printable(
        f"{format_utc(f.last_ns)} {f.code} {f.severity:<8} {f.node} request {f.request_id} "
        f"({f.tenant_id})" + (f" victims {victims}" if victims else "") + f": {f.detail}"
    )


@forensics.command()
@_options
@exclusion_options
@lake_options
def exposure(**kw) -> None:
    """Exposure matrix: recipient tenant x victim tenant, with responses, pages and victim requests."""
    _ask_table("exposure", EXPOSURE, **kw)


@forensics.command()
@_options
@exclusion_options
@lake_options
def thresholds(**kw) -> None:
    """Pool vs advertised context per node, and affected vs unaffected prompts against the prefill pool."""
    _ask_table("thresholds", THRESHOLDS, **kw)


@forensics.command()
@_options
@exclusion_options
@probe_options
@lake_options
def exploitation(
    db,
    url,
    api_token,
    from_,
    to,
    tenant,
    node,
    fmt,
    out,
    force,
    exclude_tenants,
    exclude_file,
    lake_url,
    scheduler,
    workers,
    **probe,
) -> None:
    """Per recipient tenant: over-long prompts in the window vs its own baseline, bursts, and a verdict."""
    _check_out(db, fmt, out, force)
    w = _window(from_, to, tenant, node)
    if not url and lake_url is None:
        require_store(db)
    excl = exclusions(exclude_tenants, exclude_file)
    options = report_options(w.from_ns, w.to_ns, excl, **probe)
    with open_answers(db, url, api_token, lake_url, scheduler, workers) as answers:
        answer = answers.exploitation(w, options)
    _emit(answer, fmt, out, EXPLOITATION, w, db, force)


forensics.add_command(report)
forensics.add_command(verify_report_cmd)
forensics.add_command(verify_notice_cmd)
