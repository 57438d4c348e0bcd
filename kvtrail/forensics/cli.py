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

from kvtrail.errors import KvtrailError
from kvtrail.forensics import (
    NEVER_WRITTEN,
    Exclusions,
    ForensicsPolicy,
    OnlineReplay,
    ProbeRules,
    ReportOptions,
    Window,
    ask_affected,
    ask_exploitation,
    ask_exposure,
    ask_findings,
    ask_thresholds,
    build_report,
    load_context,
    load_exclusions,
    open_snapshot,
    open_store,
    require_store,
    save_findings,
    write_report,
)
from kvtrail.forensics.cli_remote import (
    Remote,
    lake_answer,
    lake_options,
    local,
    remote_of,
    remote_options,
    remote_report,
    repeat_polls,
    report_check,
    report_lines,
    watch_remote,
    window_params,
)
from kvtrail.forensics.lake.questions import (
    ask_lake_affected,
    ask_lake_exploitation,
    ask_lake_exposure,
    ask_lake_findings,
    ask_lake_thresholds,
)
from kvtrail.forensics.lake.report import check_out_of_lake, lake_report
from kvtrail.forensics.report.manifest import MANIFEST
from kvtrail.forensics.tables import (
    AFFECTED,
    EXPLOITATION,
    EXPOSURE,
    FINDINGS,
    THRESHOLDS,
    TableView,
    json_text,
    printable,
    render_table,
    terminal_text,
    window_scope,
)
from kvtrail.outputs import check_out_dir, csv_frame, refuse_clobber, write_file_atomically
from kvtrail.timeutil import format_utc, parse_utc

FORMATS = ("table", "csv", "json", "parquet")
ENGINES = ("replay", "sql")


def _window(from_: str | None, to: str | None, tenant: str | None = None, node: str | None = None) -> Window:
    return Window(parse_utc(from_, field="--from") if from_ else None, parse_utc(to, field="--to") if to else None,
                  tenant, node)


def _warn(answer) -> None:
    """Coverage gaps and integrity warnings go to stderr, whatever the format."""
    gaps = answer.gaps
    if len(gaps):
        click.echo(f"warning: coverage gap: {int(gaps['unexplained'].sum())} events missing from "
                   f"{len(gaps)} producer(s) without a recorder_gap explaining them "
                   f"({', '.join(printable(n) for n in gaps['node'].to_list()[:5])}); answers may be incomplete",
                   err=True)
    for text in answer.warnings:
        click.echo(f"warning: {printable(text)}", err=True)


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
        text = render_table(df, view, window_scope(w.from_ns, w.to_ns, w.tenant, w.node), notes=answer.notes,
                            width_chars=width, color=color)
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
    for opt in reversed([
        click.option("--db", default="kvtrail.duckdb", show_default=True, type=click.Path(dir_okay=False)),
        click.option("--from", "from_", help="UTC start of the window (ISO 8601)."),
        click.option("--to", "to", help="UTC end of the window (ISO 8601)."),
        click.option("--tenant", help="Only this tenant (as recipient or victim)."),
        click.option("--node", help="Only this node."),
        click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True),
        click.option("--out", type=click.Path(dir_okay=False), help="Write to this file instead of stdout "
                                                                   "(never the store or one of its files)."),
        click.option("--force", is_flag=True, help="Replace --out if it exists."),
    ]):
        f = opt(f)
    return f


def _exclusion_options(f):
    for opt in reversed([
        click.option("--exclude-tenant", "exclude_tenants", multiple=True, metavar="ID[=REASON]",
                     help="Leave this tenant's responses out of every count (repeatable)."),
        click.option("--exclude-file", type=click.Path(dir_okay=False),
                     help="YAML file of exclusions: tenants/api_key_ids/request_ids, each a list of {id, reason}."),
    ]):
        f = opt(f)
    return f


def _exclusions(tenants: tuple[str, ...], file: str | None, base=None):
    """The exclusions of the flags (plus ``base``, e.g. from incident.yaml)."""

    pairs = []
    for t in tenants:
        tenant, _, reason = t.partition("=")
        if not tenant.strip():
            raise KvtrailError(f"--exclude-tenant: empty tenant id in {t!r}")
        pairs.append((tenant.strip(), reason.strip() or "excluded on the command line"))
    excl = Exclusions(tenants=tuple(sorted(dict(pairs).items())))
    if file:
        excl = excl.merged(load_exclusions(file))
    return excl.merged(base) if base is not None else excl


def _say_excluded(dropped) -> None:
    if len(dropped):
        reasons = sorted({f"{by} ({why})" for by, why in zip(dropped["excluded_by"], dropped["reason"])})
        click.echo(printable(f"excluded: {len(dropped)} affected responses of {len(reasons)} account(s): "
                             f"{'; '.join(reasons)}"), err=True)


def _probe_options(f):
    for opt in reversed([
        click.option("--baseline-from", help="UTC start of the baseline period (default: as long as the window, "
                                            "right before --from)."),
        click.option("--baseline-to", help="UTC end of the baseline period (default: --from)."),
        click.option("--long-prompt-tokens", type=click.IntRange(1),
                     help="Prompts longer than this are over-long (default: the smallest prefill pool)."),
        click.option("--burst-minutes", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
                     help="Length of a probing burst."),
        click.option("--burst-count", type=click.IntRange(1), default=5, show_default=True,
                     help="Over-long prompts within --burst-minutes that count as repeated probing."),
    ]):
        f = opt(f)
    return f


def _report_options(from_ns, to_ns, excl, baseline_from, baseline_to, long_prompt_tokens, burst_minutes,
                    burst_count):

    if from_ns is None or to_ns is None:
        flag = "--from" if from_ns is None else "--to"
        raise KvtrailError(f"{flag}: required (the baseline and rates need a window)")
    if from_ns > to_ns:
        raise KvtrailError("--from: is after --to")
    b_from = parse_utc(baseline_from, field="--baseline-from") if baseline_from else None
    b_to = parse_utc(baseline_to, field="--baseline-to") if baseline_to else None
    o = ReportOptions(from_ns, to_ns, excl, b_from, b_to, long_prompt_tokens,
                      ProbeRules(burst_minutes=burst_minutes, burst_count=burst_count))
    lo, hi = o.baseline
    if lo > hi:
        raise KvtrailError("--baseline-from: is after the end of the baseline period")
    return o


@click.group()
def forensics() -> None:
    """Forensics over the audit store: findings F1-F11 with evidence, affected responses."""


def _policy_options(f):

    for opt in reversed([
        click.option("--engine", type=click.Choice(ENGINES), default="replay", show_default=True,
                     help="Findings engine: the streaming replay or the independent SQL engine."),
        click.option("--allow-tenant-cache-sharing", is_flag=True,
                     help="The deployment lets tenants share prefix-cache pages: no F10."),
        click.option("--latency-factor", type=click.FloatRange(1.0), default=ForensicsPolicy.latency_factor,
                     show_default=True, help="F9: how many times faster than its node's measured prefill "
                                             "rate a response must be to be implausible."),
    ]):
        f = opt(f)
    return f


def _policy(allow_tenant_cache_sharing: bool, latency_factor: float):

    return ForensicsPolicy(allow_tenant_cache_sharing=allow_tenant_cache_sharing, latency_factor=latency_factor)


@forensics.command(name="findings")
@_options
@click.option("--code", "codes", multiple=True, help="Only these finding codes (repeatable), e.g. F1.")
@_exclusion_options
@_policy_options
@click.option("--save", is_flag=True, help="Also keep the window's findings in the store (tables findings and "
                                           "forensic_runs); re-running a window adds no duplicates.")
@lake_options
def findings_cmd(db, url, api_token, from_, to, tenant, node, fmt, out, force, codes, exclude_tenants, exclude_file,
                 engine, allow_tenant_cache_sharing, latency_factor, save, lake_url, scheduler, workers) -> None:
    """Every finding in the window, with the event ids that prove it (excluded accounts' requests left out)."""
    _check_out(db, fmt, out, force)
    excl = _exclusions(exclude_tenants, exclude_file)
    policy = _policy(allow_tenant_cache_sharing, latency_factor)
    w = _window(from_, to, tenant, node)
    remote = remote_of(url, api_token)
    if lake_url is not None and (save or engine != "replay"):
        raise KvtrailError("--lake: not with --save or --engine sql (the lake's partitions are replayed)")
    answer = lake_answer(lake_url, scheduler, workers, url, lambda lk, ex: ask_lake_findings(
        lk, w, codes=tuple(codes), policy=policy, exclusions=excl, executor=ex))
    if answer is None and remote is not None:
        if save:
            raise KvtrailError("--save: not with --url (the service's live judge keeps the findings)")
        answer = remote.answer("/v1/findings", {**window_params(from_, to, tenant, node, excl), "code": list(codes),
                                                "engine": engine, "latency_factor": latency_factor,
                                                "allow_tenant_cache_sharing": allow_tenant_cache_sharing or None})
    elif answer is None:
        answer = local(lambda: ask_findings(db, w, codes=tuple(codes), engine=engine, policy=policy,
                                             exclusions=excl))
    if save:
        _save(db, list(answer.found), w, engine, policy)
    if len(answer.excluded):
        click.echo(f"excluded: {len(answer.excluded)} findings of excluded accounts", err=True)
    _emit(answer, fmt, out, FINDINGS, w, db, force)


@forensics.command()
@_options
@_exclusion_options
@lake_options
def affected(db, url, api_token, from_, to, tenant, node, fmt, out, force, exclude_tenants, exclude_file,
             lake_url, scheduler, workers) -> None:
    """Which responses read foreign pages in the window, and whose data it was."""
    _check_out(db, fmt, out, force)
    excl = _exclusions(exclude_tenants, exclude_file)
    w = _window(from_, to, tenant, node)
    remote = remote_of(url, api_token)
    answer = lake_answer(lake_url, scheduler, workers, url,
                         lambda lk, ex: ask_lake_affected(lk, w, exclusions=excl, executor=ex))
    if answer is None:
        answer = (remote.answer("/v1/affected", window_params(from_, to, tenant, node, excl)) if remote
                  else local(lambda: ask_affected(db, w, exclusions=excl)))
    _say_excluded(answer.excluded)
    _emit(answer, fmt, out, AFFECTED, w, db, force)


def _save(db: str, found, w, engine: str, policy) -> None:


    try:
        con = duckdb.connect(db)
    except duckdb.Error as exc:
        raise KvtrailError(f"--save: cannot open {db} for writing (another process holds it?): {exc}") from exc
    try:
        run = save_findings(con, found, from_ns=w.from_ns, to_ns=w.to_ns, engine=engine, policy=policy)
    finally:
        con.close()
    click.echo(f"saved run {run.run_id}: {run.num_findings} findings, {run.num_new} new "
               f"(results digest {run.results_digest[:16]})", err=True)


@forensics.command()
@click.option("--db", default="kvtrail.duckdb", show_default=True, type=click.Path(dir_okay=False))
@click.option("--interval", type=click.FloatRange(0.05), default=2.0, show_default=True,
              help="Seconds between polls of the store.")
@click.option("--polls", type=click.IntRange(0), default=0, show_default=True,
              help="Stop after this many polls (0: until Ctrl-C).")
@click.option("--allow-tenant-cache-sharing", is_flag=True, help="The deployment lets tenants share prefix-cache "
                                                                 "pages: no F10.")
@remote_options
def watch(db, interval, polls, allow_tenant_cache_sharing, url, api_token) -> None:
    """Tail a store: print each new finding as its batch commits (online replay; cross-node findings are
    provisional until their other half lands). The store is opened read-only for each poll only.
    With --url, follow a running service's live judge instead (the findings it persists, in the same lines).
    Ctrl-C or SIGTERM stops it (exit 0)."""
    if url:
        if allow_tenant_cache_sharing:
            raise KvtrailError("--allow-tenant-cache-sharing: the service's judge runs with the service's policy; "
                               "it cannot be set with --url")
        watch_remote(Remote(url, api_token), interval, polls)
        return
    require_store(db)
    online = OnlineReplay(ForensicsPolicy(allow_tenant_cache_sharing=allow_tenant_cache_sharing))

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


def _finding_line(f) -> str:
    """One finding as ``watch`` prints it; ids come from producers, so escaped (:func:`printable`)."""
    victims = ",".join(v or NEVER_WRITTEN for v in f.victim_request_ids)
    return printable(f"{format_utc(f.last_ns)} {f.code} {f.severity:<8} {f.node} request {f.request_id} "
                     f"({f.tenant_id})" + (f" victims {victims}" if victims else "") + f": {f.detail}")


@forensics.command()
@_options
@_exclusion_options
@lake_options
def exposure(db, url, api_token, from_, to, tenant, node, fmt, out, force, exclude_tenants, exclude_file,
             lake_url, scheduler, workers) -> None:
    """Exposure matrix: recipient tenant x victim tenant, with responses, pages and victim requests."""
    _check_out(db, fmt, out, force)
    excl = _exclusions(exclude_tenants, exclude_file)
    w = _window(from_, to, tenant, node)
    remote = remote_of(url, api_token)
    answer = lake_answer(lake_url, scheduler, workers, url,
                         lambda lk, ex: ask_lake_exposure(lk, w, exclusions=excl, executor=ex))
    if answer is None:
        answer = (remote.answer("/v1/exposure", window_params(from_, to, tenant, node, excl)) if remote
                  else local(lambda: ask_exposure(db, w, exclusions=excl)))
    _say_excluded(answer.excluded)
    _emit(answer, fmt, out, EXPOSURE, w, db, force)


@forensics.command()
@_options
@_exclusion_options
@lake_options
def thresholds(db, url, api_token, from_, to, tenant, node, fmt, out, force, exclude_tenants, exclude_file,
               lake_url, scheduler, workers) -> None:
    """Pool vs advertised context per node, and affected vs unaffected prompts against the prefill pool."""
    _check_out(db, fmt, out, force)
    w = _window(from_, to, tenant, node)
    excl = _exclusions(exclude_tenants, exclude_file)
    remote = remote_of(url, api_token)
    answer = lake_answer(lake_url, scheduler, workers, url,
                         lambda lk, ex: ask_lake_thresholds(lk, w, exclusions=excl, executor=ex))
    if answer is None:
        answer = (remote.answer("/v1/thresholds", window_params(from_, to, tenant, node, excl)) if remote
                  else local(lambda: ask_thresholds(db, w, exclusions=excl)))
    _say_excluded(answer.excluded)
    _emit(answer, fmt, out, THRESHOLDS, w, db, force)


@forensics.command()
@_options
@_exclusion_options
@_probe_options
@lake_options
def exploitation(db, url, api_token, from_, to, tenant, node, fmt, out, force, exclude_tenants, exclude_file,
                 lake_url, scheduler, workers, **probe) -> None:
    """Per recipient tenant: over-long prompts in the window vs its own baseline, bursts, and a verdict."""
    _check_out(db, fmt, out, force)
    w = _window(from_, to, tenant, node)
    remote = remote_of(url, api_token)
    if remote is None and lake_url is None:
        require_store(db)
    excl = _exclusions(exclude_tenants, exclude_file)
    options = _report_options(w.from_ns, w.to_ns, excl, **probe)
    answer = lake_answer(lake_url, scheduler, workers, url,
                         lambda lk, ex: ask_lake_exploitation(lk, options, w, executor=ex))
    if answer is None:
        answer = (remote.answer("/v1/exploitation", {**window_params(from_, to, tenant, node, excl), **probe})
                  if remote else local(lambda: ask_exploitation(db, options, w)))
    _emit(answer, fmt, out, EXPLOITATION, w, db, force)


@forensics.command()
@click.option("--db", default="kvtrail.duckdb", show_default=True, type=click.Path(dir_okay=False))
@click.option("--from", "from_", required=True, help="UTC start of the window (ISO 8601).")
@click.option("--to", "to", required=True, help="UTC end of the window (ISO 8601).")
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Folder to write the report into: new or empty (written whole, or not at all).")
@click.option("--force", is_flag=True, help="--out may hold files: the report's own are replaced, others left alone.")
@click.option("--context", type=click.Path(dir_okay=False),
              help="The operator's incident.yaml (contact, times, measures, exclusions, tenant names).")
@_exclusion_options
@_probe_options
@remote_options
@lake_options
def report(db, from_, to, out, force, context, exclude_tenants, exclude_file, url, api_token, lake_url, scheduler,
           workers, **probe) -> None:
    """Write the disclosure report (Markdown, HTML, PDF, CSV/JSON, report.json manifest) for a window
    (with --url: the service runs it on a snapshot of its store and sends the files; with --lake: on an
    audit lake, report.json recording its manifest)."""
    remote = remote_of(url, api_token)
    if remote is None and lake_url is None:
        require_store(db)
    if lake_url is not None:
        check_out_of_lake(out, lake_url)
    before = check_out_dir(out, force, protected=(db,))  # refused before the queries run, not after
    ctx = load_context(context) if context else None
    excl = _exclusions(exclude_tenants, exclude_file, ctx.exclusions if ctx else None)
    options = _report_options(parse_utc(from_, field="--from"), parse_utc(to, field="--to"), excl, **probe)
    r = lake_answer(lake_url, scheduler, workers, url, lambda lk, ex: lake_report(lk, options, ctx, executor=ex))
    if r is None and remote is not None:
        remote_report(remote, out, force, db, from_, to, excl, Path(context).read_text(encoding="utf-8")
                       if context else None, before, probe)
        return
    if r is None:
        con, heads = local(lambda: open_snapshot(db))
        try:
            r = build_report(con, options, ctx, heads)
        finally:
            con.close()
    manifest = write_report(r, out, lake_url or Path(db).name, force=force, protected=(db,))
    report_lines(before, {*manifest["files"], MANIFEST}, out, len(r.coverage),
                  int(r.coverage["unexplained"].sum()) if len(r.coverage) else 0, r.counts, manifest["results_digest"])


@forensics.command(name="verify-report")
@click.argument("report_dir", metavar="DIR")
@click.option("--db", default="kvtrail.duckdb", show_default=True, type=click.Path(dir_okay=False))
@click.option("--strict", is_flag=True, help="Also fail when events committed after the report fall inside its window.")
@lake_options
def verify_report_cmd(report_dir, db, strict, lake_url, scheduler, workers) -> None:
    """Re-run a report's queries on the store (or --lake: on the lake, re-checking its recorded manifest)
    and confirm its numbers, chain heads and files. Exit 1 if not."""
    check = report_check(report_dir, db, strict, lake_url, scheduler, workers)
    for note in check.notes:
        click.echo(f"note: {printable(note)}")
    if not check.ok:
        for problem in check.problems:
            click.echo(f"FAILED: {printable(problem)}")
        sys.exit(1)
    source = f"the lake {lake_url}" if lake_url else f"the store {Path(db).name}"
    what = "lake manifest, " if lake_url else ""
    click.echo(printable(f"confirmed: {report_dir} matches {source} ({what}results digest, chain heads, files)"))
