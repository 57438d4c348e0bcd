"""``verify-report``: is this report still what the store says?

:func:`verify_report` re-runs the queries on the store *as of the heads its manifest recorded* (later
batches are left out, so a store that kept growing still verifies, and the growth is reported), checks
that no producer's chain is behind or forked from those heads (:func:`kvtrail.audit.verify.compare_heads`,
as ``kvtrail audit verify --expect-heads`` does) and that the chain verifies, and that no report file
changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import duckdb

from kvtrail.audit.heads import chain_heads, compare_heads, parse_heads
from kvtrail.audit.snapshot import open_snapshot
from kvtrail.audit.store import connect_readonly
from kvtrail.audit.verify import verify_store
from kvtrail.errors import KvtrailError
from kvtrail.forensics.options import ReportOptions
from kvtrail.forensics.questions import require_store
from kvtrail.report.build import build_report
from kvtrail.report.manifest import MANIFEST, load_manifest, sha256_file


@dataclass
class ReportCheck:
    """Outcome of :func:`verify_report`: problems (exit 1 when any) and notes (informational)."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_report(report_dir: str | Path, db: str | Path, *, strict: bool = False) -> ReportCheck:
    """Re-run the report's queries and compare. ``strict``: events committed after the report that fall
    inside its window are a problem (otherwise a note)."""
    doc = load_manifest(report_dir)
    require_store(db)
    check = ReportCheck(problems=changed_files(doc, report_dir))
    options = ReportOptions.from_dict(doc["options"])
    heads = parse_heads(doc["chain_heads"], MANIFEST, "chain_heads")
    con = connect_readonly(db)
    try:
        try:
            now = {h["producer_id"]: h for h in chain_heads(con)}
        except duckdb.Error:
            raise KvtrailError(f"--db: {db} is not a kvtrail audit store") from None
        check_store_chain(con, heads, now, options, check, strict)
    finally:
        con.close()
    snap, _ = open_snapshot(db, heads)
    try:
        check_digest(check, lambda: build_report(snap, options, None, heads).results_digest(), doc["results_digest"])
    finally:
        snap.close()
    return check


def check_store_chain(con, heads: list[dict], now: dict, options, check: ReportCheck, strict: bool) -> None:
    """The store's side of a report check: no producer's chain behind or forked from the recorded heads (as
    ``kvtrail audit verify --expect-heads`` judges it), its growth since, and the chain itself."""
    check.problems.extend(f"chain head of {p}" for p in compare_heads(con, heads))
    note_growth(con, heads, now, options, check, strict)
    chain = verify_store(con)
    if not chain.ok:
        more = f" (+{len(chain.problems) - 1} more)" if len(chain.problems) > 1 else ""
        check.problems.append(f"audit chain: {chain.first_problem}{more}")


def check_digest(check: ReportCheck, recompute: Callable[[], str], recorded: object, what: str = "store") -> None:
    """Compare the results digest ``recompute()`` gives now with the recorded one (a failure to recompute is a
    problem too: a tampered store or lake may not even replay)."""
    try:
        digest = recompute()
    except Exception as exc:  # noqa: BLE001 - a failed recompute is a failed check, reported with its cause
        first_line = (str(exc).splitlines() or [""])[0]
        check.problems.append(f"results could not be recomputed: {type(exc).__name__}: {first_line}")
        return
    if digest != recorded:
        check.problems.append(
            f"results digest differs: the {what} now answers differently for this window "
            f"({digest[:16]}... now, {str(recorded)[:16]}... recorded)"
        )


def changed_files(doc: dict, report_dir: str | Path) -> list[str]:
    """The report's files (as ``report.json`` lists them) that are missing or changed, one line each."""
    d, problems = Path(report_dir), []
    for name, digest in sorted(doc["files"].items()):
        if not (d / name).is_file():
            problems.append(f"file {name}: missing")
        elif sha256_file(d / name) != digest:
            problems.append(f"file {name}: modified since the report was written")
    return problems


def note_growth(
    con, heads: list[dict], now: dict, options, check: ReportCheck, strict: bool, what: str = "store"
) -> None:
    """Say how the store (or lake: ``what``) grew after the report (batches past the heads, new producers)."""
    recorded = {h["producer_id"]: h["batch_no"] for h in heads}
    new_batches = sum(max(0, h["batch_no"] - recorded.get(pid, -1)) for pid, h in now.items())
    if not new_batches:
        return
    late = con.execute(
        "SELECT count(*) FROM events e LEFT JOIN (SELECT unnest(?::BIGINT[]) AS producer_id, "
        "unnest(?::BIGINT[]) AS head) h USING (producer_id) "
        "WHERE (h.head IS NULL OR e.batch_no > h.head) AND e.wall_ns BETWEEN ? AND ?",
        [list(recorded), list(recorded.values()), options.from_ns, options.to_ns],
    ).fetchone()[0]
    check.notes.append(
        f"the {what} has grown since the report: {new_batches} batches after the recorded heads; "
        f"results were re-computed only from batches up to those heads"
    )
    if late:
        msg = (
            f"{late} events committed after the report fall inside its window "
            f"(late arrivals): the report does not include them; re-run it to include them"
        )
        (check.problems if strict else check.notes).append(msg)
