"""The disclosure report on an audit lake: ``kvtrail forensics report --lake`` and ``verify-report --lake``.

:func:`lake_report` is :func:`~kvtrail.report.build.build_report` on the lake's catalog, fed the
findings of the partition replay (:func:`~kvtrail.forensics.lake.questions.lake_findings`) instead of
replaying one store, so it equals the report on the store the lake came from (same affected responses,
same results digest). ``report.json`` also records the lake manifest the report was built from: its
number, SHA-256 and the chain heads it holds.

:func:`verify_lake_report` checks that manifest is still in the lake unchanged, that the lake verifies
(``kvtrail lake verify``: a missing, altered or extra file is named), that it still holds the report's
chain heads (not behind, not forked), and recomputes the results digest from the files the recorded
manifest lists, so a lake that kept growing by later exports still verifies and the growth is a note.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from kvtrail.audit.heads import chain_heads, compare_heads, parse_heads
from kvtrail.audit.lake.catalog import LAKE_TABLES, open_catalog
from kvtrail.audit.lake.fs import LakeFS
from kvtrail.audit.lake.manifest import manifest_name, manifest_numbers, read_manifest
from kvtrail.audit.lake.verify import LakeVerifyReport, check_files, verify_lake
from kvtrail.errors import KvtrailError
from kvtrail.forensics.lake.executor import Executor
from kvtrail.forensics.lake.questions import Lake, lake_findings, open_lake
from kvtrail.forensics.options import ReportOptions
from kvtrail.forensics.window import Window
from kvtrail.report.build import Report, build_report
from kvtrail.report.context import IncidentContext
from kvtrail.report.manifest import MANIFEST, load_manifest
from kvtrail.report.verify import ReportCheck, changed_files, check_digest, note_growth


def lake_record(lake: Lake) -> dict:
    """What ``report.json`` says of the lake: where it is, which manifest, its SHA-256 and chain heads."""
    m = lake.manifest
    return {
        "url": lake.fs.url,
        "manifest": m.number,
        "manifest_sha256": hashlib.sha256(m.raw).hexdigest(),
        "chain_heads": m.doc.chain_heads,
    }


def lake_report(
    lake: Lake, options: ReportOptions, context: IncidentContext | None = None, *, executor: Executor | None = None
) -> Report:
    """The disclosure report of ``options``' window on ``lake`` (partition tasks on ``executor``)."""
    found = lake_findings(lake, Window(options.from_ns, options.to_ns), executor=executor)
    return build_report(lake.con, options, context, findings=found, lake=lake_record(lake))


def check_out_of_lake(out: str | Path, url: str) -> None:
    """Refuse a report folder inside a local lake: its files would be extra files there."""
    if "://" in url:
        return
    lake, target = Path(url).resolve(), Path(out).resolve()
    if target == lake or lake in target.parents:
        raise KvtrailError(
            f"--out: {out} is inside the lake {url}; kvtrail never writes into a lake (choose another folder)"
        )


def _recorded(doc: dict, report_dir: str | Path) -> dict:
    rec = doc.get("lake")
    if not isinstance(rec, dict):
        raise KvtrailError(
            f"--lake: {MANIFEST} of {report_dir} records no lake manifest (the report was written "
            "from a store: verify it with --db)"
        )
    for name, kind in (("manifest", int), ("manifest_sha256", str), ("chain_heads", dict)):
        if not isinstance(rec.get(name), kind):
            raise KvtrailError(f"{MANIFEST}: field 'lake.{name}': missing or of the wrong type")
    return rec


def _heads_still_held(
    fs: LakeFS, heads: list[dict], damaged: set[str], options: ReportOptions, check: ReportCheck, strict: bool
) -> None:
    """The current lake's chains against the report's heads, and how the lake grew past them."""
    current = read_manifest(fs)
    usable = {t: sorted(p for p in current.files_of(t) if p not in damaged) for t in LAKE_TABLES}
    con = open_catalog(fs, usable)
    try:
        check.problems.extend(f"chain head of {p}" for p in compare_heads(con, heads))
        now = {h["producer_id"]: h for h in chain_heads(con)}
        note_growth(con, heads, now, options, check, strict, what="lake")
    finally:
        con.close()


def verify_lake_report(
    report_dir: str | Path, url: str, *, executor: Executor | None = None, strict: bool = False
) -> ReportCheck:
    """Re-check a report written from a lake against the lake at ``url`` (see the module doc)."""
    doc = load_manifest(report_dir)
    rec = _recorded(doc, report_dir)
    check = ReportCheck(problems=changed_files(doc, report_dir))
    fs = LakeFS.open(url)
    number, name = rec["manifest"], manifest_name(rec["manifest"])
    if number not in manifest_numbers(fs):
        check.problems.append(f"lake manifest {name}: missing (the report was built from it)")
        return check
    if hashlib.sha256(fs.read(name)).hexdigest() != rec["manifest_sha256"]:
        check.problems.append(f"lake manifest {name}: altered since the report (SHA-256 differs)")
        return check
    recorded = read_manifest(fs, number)
    if recorded.doc.chain_heads != rec["chain_heads"]:
        check.problems.append(f"{MANIFEST}: the lake chain heads it records are not those of {name}")
    lake_check = verify_lake(url)
    check.problems.extend(f"lake: {p}" for p in lake_check.problems)
    if lake_check.manifest != number:
        # files the report's manifest lists that a later export no longer does
        older = LakeVerifyReport()
        check_files(fs, recorded, older, extras=False)
        check.problems.extend(p for p in (f"lake: {q}" for q in older.problems) if p not in check.problems)
        check.notes.append(
            f"the lake has new exports since the report (manifest {lake_check.manifest} now); "
            f"results were re-computed from manifest {number}"
        )
    options = ReportOptions.from_dict(doc["options"])
    _heads_still_held(
        fs, parse_heads(doc["chain_heads"], MANIFEST, "chain_heads"), lake_check.damaged, options, check, strict
    )

    def recompute() -> str:
        with open_lake(url, number) as lake:
            return lake_report(lake, options, executor=executor).results_digest()

    check_digest(check, recompute, doc["results_digest"], "lake")
    return check
