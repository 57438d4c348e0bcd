"""The forensics commands' sources: a store file (``--db``), a running service (``--url``/``--token``) or an
audit lake (``--lake``, its partition tasks in-process or on Dask: ``--scheduler``/``--workers``).

The questions themselves go through :mod:`kvtrail.answers.ask` (the source chosen once); what is
here is the flags and what only the CLI does: the report's files from a service, verify-report's
sources, following the live judge.
"""

from __future__ import annotations

import io
import time
import zipfile
from pathlib import Path
from typing import Callable, TypeVar

import click

from kvtrail.answers.ask import ServiceAnswers, hint_service, lake_executor, window_params
from kvtrail.answers.tables import printable
from kvtrail.errors import KvtrailError
from kvtrail.forensics import Window
from kvtrail.forensics.findings import NEVER_WRITTEN
from kvtrail.forensics.lake.executor import Executor
from kvtrail.forensics.lake.questions import open_lake
from kvtrail.outputs import write_dir_atomically
from kvtrail.report.lake import verify_lake_report
from kvtrail.report.manifest import MANIFEST, load_manifest
from kvtrail.report.verify import ReportCheck, changed_files, verify_report
from kvtrail.signals import interrupt_on_stop_signals
from kvtrail.timeutil import format_utc

T = TypeVar("T")


def remote_of(url: str | None, token: str | None) -> ServiceAnswers | None:
    return ServiceAnswers(url, token) if url else None


def remote_options(f):
    for opt in reversed(
        [
            click.option(
                "--url", envvar="KVTRAIL_URL", help="Ask a running kvtrail service instead of --db (env KVTRAIL_URL)."
            ),
            click.option(
                "--token", "api_token", envvar="KVTRAIL_TOKEN", help="API token for --url (env KVTRAIL_TOKEN)."
            ),
        ]
    ):
        f = opt(f)
    return f


def remote_report(remote: ServiceAnswers, out, force, db, from_, to, excl, context_text, before, probe) -> None:
    # the window as typed: it parsed here, so it parses there
    params = {**window_params(Window(), excl), "from": from_, "to": to}
    body = {**{k: v for k, v in params.items() if k not in ("tenant", "node")}, **probe, "context_yaml": context_text}
    data, summary = remote.client.report(body)
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        files = {name: z.read(name) for name in z.namelist()}

    def write(staging: Path) -> None:
        for name, content in files.items():
            (staging / Path(name).name).write_bytes(content)

    write_dir_atomically(out, write, force=force, protected=(db,), last=(MANIFEST,))
    report_lines(
        before,
        set(files),
        out,
        summary["coverage_producers"],
        summary["coverage_unexplained"],
        summary["counts"],
        summary["results_digest"],
    )


def report_lines(before, ours: set, out, gap_producers: int, gap_events: int, c: dict, digest: str) -> None:
    """What ``report`` prints after writing, whether the store was local or a service's."""
    left = [name for name in before if name not in ours]
    if left:
        click.echo(
            printable(
                f"note: --out: {len(left)} other entries in {out} left as they were (not part of "
                f"the report): {', '.join(left[:5])}" + (", ..." if len(left) > 5 else "")
            ),
            err=True,
        )
    if gap_producers:
        click.echo(
            f"warning: coverage gap: {gap_events} events missing from "
            f"{gap_producers} producer(s) without a recorder_gap explaining them; the report says so",
            err=True,
        )
    if c["events_in_window"] == 0:
        click.echo("the store holds no events in this window", err=True)
    click.echo(
        f"{c['affected_responses']} affected responses, {c['recipient_tenants']} recipient tenants, "
        f"{c['victim_tenants']} victim tenants ({c['excluded_responses']} responses excluded)"
    )
    click.echo(printable(f"wrote {len(ours)} files to {out}; results digest {digest}"))


def lake_options(f):
    """``--lake`` (instead of --db) and where its partition tasks run."""
    for opt in reversed(
        [
            click.option(
                "--lake",
                "lake_url",
                help="Ask an audit lake (a directory or s3://BUCKET/PREFIX written by "
                "`kvtrail lake export`) instead of --db.",
            ),
            click.option(
                "--scheduler", help="With --lake: run the partition tasks on this Dask scheduler (tcp://HOST:PORT)."
            ),
            click.option(
                "--workers",
                type=click.IntRange(1),
                help="With --lake: start a local Dask cluster of N worker processes for the partition tasks.",
            ),
        ]
    ):
        f = opt(f)
    return f


def lake_answer(lake_url: str | None, scheduler: str | None, workers: int | None, url: str | None, ask):
    """``ask(lake, executor)`` on the lake at ``lake_url``, or None when no --lake was given."""
    if lake_url is None:
        if scheduler is not None or workers is not None:
            raise KvtrailError("--scheduler/--workers: only with --lake")
        return None
    if url:
        raise KvtrailError("--lake: give either --lake or --url")
    return with_lake_executor(scheduler, workers, lambda executor: _ask_lake(lake_url, ask, executor))


def _ask_lake(lake_url: str, ask, executor: Executor):
    with open_lake(lake_url) as lake:
        return ask(lake, executor)


def with_lake_executor(scheduler: str | None, workers: int | None, fn: Callable[[Executor], T]) -> T:
    """``fn(executor)`` with the executor the flags ask for (in-process without either), closed after."""
    with lake_executor(scheduler, workers) as executor:
        return fn(executor)


def report_check(
    report_dir, db: str, strict: bool, lake_url: str | None, scheduler: str | None, workers: int | None
) -> ReportCheck:
    """``verify-report``'s check: against the store, or (``--lake``) against the lake, its tasks where the
    flags say."""
    if lake_url is None:
        if scheduler is not None or workers is not None:
            raise KvtrailError("--scheduler/--workers: only with --lake")
        return hint_service(lambda: verify_report(report_dir, db, strict=strict))
    return with_lake_executor(
        scheduler, workers, lambda ex: verify_lake_report(report_dir, lake_url, executor=ex, strict=strict)
    )


def remote_report_check(remote: ServiceAnswers, report_dir, strict: bool) -> tuple[ReportCheck, str]:
    """``verify-report --url``: the report's files checked here, the rest by the service on its store; the
    check (problems in the local form's order) and the store's name."""
    doc = load_manifest(report_dir)
    got = remote.client.verify_report(doc, strict=strict)
    return ReportCheck(problems=[*changed_files(doc, report_dir), *got["problems"]], notes=list(got["notes"])), str(
        got["store"]
    )


def repeat_polls(step: Callable[[], None], interval: float, polls: int) -> int:
    """Call ``step`` every ``interval`` seconds, ``polls`` times (0: until Ctrl-C or SIGTERM); the polls done."""
    done = 0
    try:
        with interrupt_on_stop_signals():
            while True:
                step()
                done += 1
                if polls and done >= polls:
                    break
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    return done


def watch_remote(remote: ServiceAnswers, interval: float, polls: int) -> None:
    """``forensics watch --url``: print each finding the service's live judge persists, as it is saved."""
    state = {"cursor": 0, "seen": 0}

    def step() -> None:
        rows, state["cursor"] = remote.client.findings_since(state["cursor"])
        for row in rows.iter_rows(named=True):
            click.echo(_row_line(row))
        state["seen"] += len(rows)

    done = repeat_polls(step, interval, polls)
    click.echo(f"followed {state['seen']} findings in {done} polls (cursor {state['cursor']})", err=True)


def _row_line(r: dict) -> str:
    """A persisted finding (a row of the service's ``findings``) in :func:`_finding_line`'s form."""
    victims = ",".join(v or NEVER_WRITTEN for v in r["victim_request_ids"] or [])
    return printable(
        f"{format_utc(r['last_ns'])} {r['code']} {r['severity']:<8} {r['node']} request "
        f"{r['request_id']} ({r['tenant_id']})" + (f" victims {victims}" if victims else "") + f": {r['detail']}"
    )
