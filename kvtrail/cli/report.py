"""``kvtrail forensics report`` and ``verify-report``: the disclosure report for a window (from a store, a
running service or a lake) and its re-check."""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path

import click

from kvtrail.answers.ask import hint_service
from kvtrail.answers.tables import printable
from kvtrail.audit.chain import SignatureChecker, Signer
from kvtrail.audit.snapshot import open_snapshot
from kvtrail.cli.options import exclusion_options, exclusions, probe_options, report_options
from kvtrail.cli.progress import replaying, step
from kvtrail.cli.sources import (
    lake_answer,
    lake_options,
    remote_of,
    remote_options,
    remote_report,
    remote_report_check,
    report_check,
    report_lines,
)
from kvtrail.errors import KvtrailError
from kvtrail.forensics.questions import require_store
from kvtrail.outputs import check_out_dir
from kvtrail.report.build import build_report, write_report
from kvtrail.report.context import load_context
from kvtrail.report.evidence import verify_notice, write_notices
from kvtrail.report.lake import check_out_of_lake, lake_report
from kvtrail.report.manifest import MANIFEST
from kvtrail.report.notices import notice_texts
from kvtrail.timeutil import parse_utc


@click.command()
@click.option("--db", default="kvtrail.duckdb", show_default=True, type=click.Path(dir_okay=False))
@click.option("--from", "from_", required=True, help="UTC start of the window (ISO 8601).")
@click.option("--to", "to", required=True, help="UTC end of the window (ISO 8601).")
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False),
    help="Folder to write the report into: new or empty (written whole, or not at all).",
)
@click.option("--force", is_flag=True, help="--out may hold files: the report's own are replaced, others left alone.")
@click.option(
    "--context",
    type=click.Path(dir_okay=False),
    help="The operator's incident.yaml (contact, times, measures, exclusions, tenant names).",
)
@click.option(
    "--signing-key",
    type=click.Path(exists=True, dir_okay=False),
    help="Ed25519 private key (PEM): also write notices/<tenant>/ per affected tenant, signed, with the "
    "log's checkpoint and inclusion proofs ('kvtrail forensics verify-notice' checks one offline; --db only).",
)
@exclusion_options
@probe_options
@remote_options
@lake_options
def report(
    db,
    from_,
    to,
    out,
    force,
    context,
    signing_key,
    exclude_tenants,
    exclude_file,
    url,
    api_token,
    lake_url,
    scheduler,
    workers,
    **probe,
) -> None:
    """Write the disclosure report (Markdown, HTML, PDF, CSV/JSON, report.json manifest) for a window
    (with --url: the service runs it on a snapshot of its store and sends the files; with --lake: on an
    audit lake, report.json recording its manifest)."""
    remote = remote_of(url, api_token)
    if remote is None and lake_url is None:
        require_store(db)
    if signing_key and (remote is not None or lake_url is not None):
        raise KvtrailError("--signing-key: notices with proofs are written from a store file (--db)")
    signer = Signer.from_file(signing_key) if signing_key else None
    if lake_url is not None:
        check_out_of_lake(out, lake_url)
    before = check_out_dir(out, force, protected=(db,))  # refused before the queries run, not after
    ctx = load_context(context) if context else None
    excl = exclusions(exclude_tenants, exclude_file, ctx.exclusions if ctx else None)
    options = report_options(parse_utc(from_, field="--from"), parse_utc(to, field="--to"), excl, **probe)
    with replaying("report: answering every question on the lake") if lake_url is not None else nullcontext():
        r = lake_answer(lake_url, scheduler, workers, url, lambda lk, ex: lake_report(lk, options, ctx, executor=ex))
    if r is None and remote is not None:
        with step("report: the service writes the report"):
            remote_report(
                remote,
                out,
                force,
                db,
                from_,
                to,
                excl,
                Path(context).read_text(encoding="utf-8") if context else None,
                before,
                probe,
            )
        return
    if r is None:
        con, heads = hint_service(lambda: open_snapshot(db))
        try:
            with replaying("report: answering every question"):
                r = build_report(con, options, ctx, heads)
        finally:
            con.close()
    with step(f"report: writing the files into {out}"):
        extra = None
        if signer is not None:
            texts, found = notice_texts(r), r.findings

            def extra(folder: Path, r=r) -> list[str]:
                return write_notices(folder, found, r.affected, texts, db, signer)

        manifest = write_report(r, out, lake_url or Path(db).name, force=force, protected=(db,), extra=extra)
    report_lines(
        before,
        {*manifest["files"], MANIFEST},
        out,
        len(r.coverage),
        int(r.coverage["unexplained"].sum()) if len(r.coverage) else 0,
        r.counts,
        manifest["results_digest"],
    )


@click.command(name="verify-report")
@click.argument("report_dir", metavar="DIR")
@click.option("--db", default="kvtrail.duckdb", show_default=True, type=click.Path(dir_okay=False))
@click.option("--strict", is_flag=True, help="Also fail when events committed after the report fall inside its window.")
@remote_options
@lake_options
def verify_report_cmd(report_dir, db, strict, url, api_token, lake_url, scheduler, workers) -> None:
    """Re-run a report's queries on the store (--url: a running service's; --lake: on the lake, re-checking
    its recorded manifest) and confirm its numbers, chain heads and files. Exit 1 if not."""
    remote = remote_of(url, api_token)
    if remote is not None and (lake_url or scheduler is not None or workers is not None):
        raise KvtrailError("--url: give either --url or --lake (with --scheduler/--workers)")
    store_name = Path(db).name
    if remote is not None:
        check, store_name = remote_report_check(remote, report_dir, strict)
    else:
        check = report_check(report_dir, db, strict, lake_url, scheduler, workers)
    for note in check.notes:
        click.echo(f"note: {printable(note)}")
    if not check.ok:
        for problem in check.problems:
            click.echo(f"FAILED: {printable(problem)}")
        sys.exit(1)
    source = f"the lake {lake_url}" if lake_url else f"the store {store_name}"
    what = "lake manifest, " if lake_url else ""
    click.echo(printable(f"confirmed: {report_dir} matches {source} ({what}results digest, chain heads, files)"))


@click.command(name="verify-notice")
@click.argument("notice_dir", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--public-key", required=True, type=click.Path(exists=True, dir_okay=False), help="The operator's Ed25519 key."
)
def verify_notice_cmd(notice_dir: str, public_key: str) -> None:
    """Check a notice folder (notices/<tenant>/) offline: its signature, every file, the checkpoint, every
    inclusion proof against it, and that the listed events support each finding. Exit 1 if anything fails."""
    problems = verify_notice(notice_dir, SignatureChecker.from_file(public_key))
    if problems:
        for p in problems:
            click.echo(f"FAILED: {p}")
        sys.exit(1)
    click.echo(f"OK: {notice_dir}: signed, every file as signed, every proof verifies, the events support each finding")
