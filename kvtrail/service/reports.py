"""``POST /v1/reports``: the disclosure report for a window, run on one snapshot of the live store and
returned as an archive (zip or tar.gz) of exactly the files ``kvtrail forensics report`` writes.

The report's ``report.json`` records the chain heads of the snapshot, so ``kvtrail forensics
verify-report`` checks it later against the store like a report written by the CLI. The counts the
CLI prints go in the ``X-Kvtrail-Report`` header.

``POST /v1/reports/verify`` is ``verify-report --url``: the client checks the report's files itself and
sends ``report.json``; :func:`check_report` runs the store's part of the check (heads, growth, chain,
the results re-computed as of the recorded heads) as ``verify_report`` does on a store file.
"""

from __future__ import annotations

import io
import json
import tarfile
import tempfile
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import duckdb
from fastapi import Response
from pydantic import BaseModel, ConfigDict, Field

from kvtrail.answers.client import REPORT_HEADER
from kvtrail.audit.heads import chain_heads, parse_heads
from kvtrail.audit.snapshot import live_snapshot
from kvtrail.errors import KvtrailError
from kvtrail.forensics.options import ReportOptions
from kvtrail.report.build import build_report, write_report
from kvtrail.report.context import load_context
from kvtrail.report.verify import ReportCheck, check_digest, check_store_chain

MEDIA = {"zip": "application/zip", "tar.gz": "application/gzip"}
MANIFEST = "report.json"


class ReportBody(BaseModel):
    """What a report is run for: the window and the options of ``kvtrail forensics report``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    from_: str = Field(alias="from", description="UTC start of the window (ISO 8601).")
    to: str = Field(description="UTC end of the window (ISO 8601).")
    exclude_tenant: list[str] = Field(default=[], description="ID[=REASON] entries.")
    exclude_api_key: list[str] = Field(default=[], description="ID[=REASON] entries.")
    exclude_request: list[str] = Field(default=[], description="ID[=REASON] entries.")
    baseline_from: str | None = None
    baseline_to: str | None = None
    long_prompt_tokens: int | None = Field(default=None, ge=1, le=2**62)
    burst_minutes: float = Field(default=10.0, gt=0, le=1e9)
    burst_count: int = Field(default=5, ge=1, le=2**31)
    context_yaml: str | None = Field(
        default=None, max_length=2**20, description="The text of the operator's incident.yaml."
    )
    archive: Literal["zip", "tar.gz"] = "zip"

    def probe(self) -> dict:
        return {
            "baseline_from": self.baseline_from,
            "baseline_to": self.baseline_to,
            "long_prompt_tokens": self.long_prompt_tokens,
            "burst_minutes": self.burst_minutes,
            "burst_count": self.burst_count,
        }


def _archive(folder: Path, kind: str) -> bytes:
    buf = io.BytesIO()
    names = sorted(p.name for p in folder.iterdir())
    if kind == "zip":
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
            for name in names:
                z.write(folder / name, name)
    else:
        with tarfile.open(fileobj=buf, mode="w:gz") as t:
            for name in names:
                t.add(folder / name, name)
    return buf.getvalue()


def report_response(
    cur: duckdb.DuckDBPyConnection, options: ReportOptions, body: ReportBody, store_name: str
) -> Response:
    """Build and write the report in a temporary folder; the archive of its files as the response."""
    with tempfile.TemporaryDirectory(prefix="kvtrail-report-") as tmp:
        ctx = None
        if body.context_yaml is not None:
            path = Path(tmp) / "incident.yaml"
            path.write_text(body.context_yaml, encoding="utf-8")
            ctx = load_context(path)
            options = replace(options, exclusions=options.exclusions.merged(ctx.exclusions))
        with live_snapshot(cur) as heads:
            report = build_report(cur, options, ctx, heads)
        out = Path(tmp) / "report"
        manifest = write_report(report, out, store_name)
        data = _archive(out, body.archive)
    summary = {
        "counts": report.counts,
        "results_digest": manifest["results_digest"],
        "files": sorted(manifest["files"]),
        "coverage_unexplained": int(report.coverage["unexplained"].sum()) if len(report.coverage) else 0,
        "coverage_producers": len(report.coverage),
    }
    ext = "zip" if body.archive == "zip" else "tar.gz"
    return Response(
        data,
        media_type=MEDIA[body.archive],
        headers={
            REPORT_HEADER: json.dumps(summary, ensure_ascii=True, separators=(",", ":"), default=str),
            "Content-Disposition": f'attachment; filename="kvtrail-report.{ext}"',
        },
    )


class ReportCheckBody(BaseModel):
    """A report's ``report.json`` to check against the store, and ``verify-report``'s ``--strict``."""

    model_config = ConfigDict(extra="forbid")
    manifest: dict[str, Any] = Field(description="The report's report.json, as written.")
    strict: bool = False


class ReportCheckResult(BaseModel):
    """The store's part of ``verify-report``: problems (the check fails when any), notes, the store's name."""

    ok: bool
    problems: list[str]
    notes: list[str]
    store: str


def _options(d: object) -> ReportOptions:
    """A manifest's options (KvtrailError naming the field if it is not what kvtrail writes)."""
    try:
        if not isinstance(d, dict):
            raise TypeError("not an object")
        options = ReportOptions.from_dict(d)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise KvtrailError(
            f"{MANIFEST}: field 'options': not a report's options ({type(exc).__name__}: {exc})"
        ) from None
    for name in ("from_ns", "to_ns"):
        v = getattr(options, name)
        if type(v) is not int or not 0 <= v < 2**63:
            raise KvtrailError(f"{MANIFEST}: field 'options.{name}': not a time in ns")
    return options


def check_report(cur: duckdb.DuckDBPyConnection, doc: dict, strict: bool) -> ReportCheck:
    """``verify_report``'s checks of a manifest against the live store (its files are the client's to check):
    the recorded heads still reached, growth since, the chain, and the results digest as of those heads."""
    for key in ("options", "chain_heads", "results_digest"):
        if key not in doc:
            raise KvtrailError(f"{MANIFEST}: field '{key}': missing")
    options = _options(doc["options"])
    heads = parse_heads(doc["chain_heads"], MANIFEST, "chain_heads")
    check = ReportCheck()
    now = {h["producer_id"]: h for h in chain_heads(cur)}
    check_store_chain(cur, heads, now, options, check, strict)

    def recompute() -> str:
        with live_snapshot(cur, heads):
            return build_report(cur, options, None, heads).results_digest()

    check_digest(check, recompute, doc["results_digest"])
    return check
