"""The disclosure report: every answer for one window collected into one model, then written out.

:func:`build_report` runs the questions (findings, affected responses) and the analyses (exclusions,
exposure, thresholds, exploitation) on a store snapshot; :func:`write_report` writes Markdown, HTML
and PDF (``kvtrail.report.render``, text from ``kvtrail.report.disclosure``), CSV/JSON of the
affected responses and exposed tenants, and the ``report.json`` manifest that
``kvtrail forensics verify-report`` checks (``kvtrail.report.manifest``).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import polars as pl

from kvtrail import __version__
from kvtrail.audit.verify import UncleanEnd
from kvtrail.forensics import analysis as an
from kvtrail.forensics.findings import NEVER_WRITTEN, Finding
from kvtrail.forensics.options import ReportOptions
from kvtrail.forensics.questions import (
    Window,
    affected_with_exclusions,
    coverage_gaps,
    exploitation_for,
    findings_frame,
    findings_of,
    report_requests,
)
from kvtrail.forensics.symptoms import (
    empty_after_abort,
    incomplete_requests,
    reported_losses,
    shared_transfer_ids,
    warning_texts,
    window_ends,
    withhold_incomplete,
)
from kvtrail.outputs import csv_frame, write_dir_atomically
from kvtrail.report.context import IncidentContext

DATA_FILES = ("affected_responses", "exposed_tenants")


@dataclass(frozen=True)
class Report:
    """Everything a disclosure report says, as data (frames are Polars DataFrames)."""

    options: ReportOptions
    context: IncidentContext | None
    generated_ns: int
    events_in_window: int
    affected: pl.DataFrame  # affected responses, exclusions applied
    excluded_affected: pl.DataFrame  # affected responses of excluded accounts, with reason
    findings: pl.DataFrame  # every finding of the window, excluded requests removed
    excluded_findings: int
    matrix: pl.DataFrame  # recipient tenant x victim tenant
    exposed: pl.DataFrame  # per victim tenant
    links: pl.DataFrame  # (response, victim, page) rows behind both
    capacity: pl.DataFrame  # pool vs context per node configuration
    thresholds: pl.DataFrame
    threshold_summary: dict
    exploitation: pl.DataFrame
    long_prompt_tokens: int | None
    coverage: pl.DataFrame
    chain_heads: tuple[dict, ...]
    version: str = __version__
    # what is not a finding but must be said (kvtrail.forensics.symptoms)
    shared_transfer_ids: pl.DataFrame = field(default_factory=pl.DataFrame)
    empty_after_abort: pl.DataFrame = field(default_factory=pl.DataFrame)
    unclean_ends: tuple[UncleanEnd, ...] = ()
    incomplete: pl.DataFrame = field(default_factory=pl.DataFrame)  # requests in flight at an unclean end
    withheld_findings: int = 0  # their F2/F3, withheld as incomplete
    reported_losses: pl.DataFrame = field(default_factory=pl.DataFrame)  # symptoms.reported_losses
    # for a report on an audit lake: the lake manifest it was built from (kvtrail.report.lake)
    lake: dict | None = None

    @property
    def warnings(self) -> tuple[str, ...]:
        """Integrity and coverage warnings about the record, as every answer carries them."""
        return warning_texts(
            self.shared_transfer_ids,
            list(self.unclean_ends),
            self.incomplete,
            self.withheld_findings,
            self.reported_losses,
        )

    @property
    def reads(self) -> pl.DataFrame:
        """Per affected response, what it read from its tenant's point of view (``analysis.response_reads``)."""
        return an.response_reads(self.links, self.affected)

    @property
    def counts(self) -> dict:
        links = self.links
        pages = links.select("request_id", "node", "page").unique()
        unknown = links.filter(pl.col("victim_tenant") == NEVER_WRITTEN).select("request_id", "node", "page")
        # From each response's tenant's point of view: another tenant's data, its own tenant's, or none.
        own_tenant = an.same_tenant()
        other = links.filter((pl.col("victim_tenant") != NEVER_WRITTEN) & ~own_tenant)
        own = links.filter(own_tenant)
        reads = self.reads
        kind = {k: reads.filter(pl.col("read") == k) for k in an.READ_KINDS}
        return {
            "affected_responses": len(self.affected),
            "recipient_tenants": self.affected["tenant_id"].drop_nulls().n_unique(),
            "victim_tenants": int((self.exposed["recipient_count"] > 0).sum()),
            "victim_requests": links["victim_request_id"].drop_nulls().n_unique(),
            "other_tenant_responses": len(kind["other_tenants"]),
            "other_tenant_recipients": kind["other_tenants"]["tenant_id"].drop_nulls().n_unique(),
            "other_tenant_victim_requests": other["victim_request_id"].drop_nulls().n_unique(),
            "other_tenant_pages": len(other.select("request_id", "node", "page").unique()),
            "same_tenant_responses": own["request_id"].n_unique(),
            "same_tenant_only_responses": len(kind["same_tenant"]),
            "same_tenant_tenants": own["recipient_tenant"].n_unique(),
            "same_tenant_victim_requests": own["victim_request_id"].drop_nulls().n_unique(),
            "never_written_only_responses": len(kind["never_written"]),
            "pages_read_foreign": len(pages),
            "pages_no_known_origin": len(unknown.unique()),
            "responses_without_victim": int((self.affected["victim_tenants"].list.len() == 0).sum()),
            "responses_served_2xx": int(self.affected["http_status"].is_between(200, 299).sum()),
            "excluded_responses": len(self.excluded_affected),
            "excluded_accounts": self.excluded_affected["excluded_by"].n_unique(),
            "excluded_findings": self.excluded_findings,
            "findings": len(self.findings),
            "shared_transfer_ids": len(self.shared_transfer_ids),
            "unclean_ends": len(self.unclean_ends),
            "incomplete_requests": len(self.incomplete),
            "withheld_findings": self.withheld_findings,
            "responses_2xx_empty_after_abort": len(self.empty_after_abort),
            "events_in_window": self.events_in_window,
        }

    def results(self) -> dict:
        """The query results the report stands on, in a canonical order (see :func:`results_digest`)."""

        def rows(df: pl.DataFrame) -> list[str]:
            return sorted(json.dumps(r, sort_keys=True, separators=(",", ":"), default=str) for r in df.to_dicts())

        return {
            "options": self.options.to_dict(),
            "events_in_window": self.events_in_window,
            "affected": rows(self.affected),
            "excluded_affected": rows(self.excluded_affected),
            "findings": rows(self.findings),
            "excluded_findings": self.excluded_findings,
            "exposure": rows(self.matrix),
            "exposed_tenants": rows(self.exposed),
            "capacity": rows(self.capacity),
            "thresholds": rows(self.thresholds),
            "threshold_summary": self.threshold_summary,
            "exploitation": rows(self.exploitation),
            "long_prompt_tokens": self.long_prompt_tokens,
            "coverage": rows(self.coverage),
            "shared_transfer_ids": rows(self.shared_transfer_ids),
            "empty_after_abort": rows(self.empty_after_abort),
            "unclean_ends": sorted(str(e) for e in self.unclean_ends),
            "incomplete": rows(self.incomplete),
            "withheld_findings": self.withheld_findings,
        }

    def results_digest(self) -> str:
        """SHA-256 (hex) of :meth:`results` serialised as sorted-key, compact JSON."""
        text = json.dumps(self.results(), sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(text.encode()).hexdigest()


def build_report(
    con: duckdb.DuckDBPyConnection,
    options: ReportOptions,
    context: IncidentContext | None = None,
    heads: list[dict] | None = None,
    *,
    findings: list[Finding] | None = None,
    lake: dict | None = None,
) -> Report:
    """Run every question and analysis for the window (``con``: a store, a snapshot of one or a lake's
    catalog). ``findings``: every finding of the window already computed elsewhere (an audit lake's
    partition replay, :func:`kvtrail.forensics.lake.questions.lake_findings`) instead of replaying ``con``;
    ``lake``: the lake manifest record that goes into ``report.json``."""
    from kvtrail.audit.heads import chain_heads

    o = options
    w = Window(o.from_ns, o.to_ns)
    ends = window_ends(con, w)
    incomplete = incomplete_requests(con, w, ends)
    # one replay serves the affected responses and the findings
    every, withheld = withhold_incomplete(findings_of(con, w) if findings is None else findings, incomplete)
    kept, dropped, excluded = affected_with_exclusions(con, w, o.exclusions, every)
    found = findings_frame(every, w)
    found_kept = found.filter(~an.excluded_mask(excluded, o.exclusions))
    links = an.exposure_links(found_kept, set(kept["request_id"]))
    capacity = an.node_capacity(con, o.from_ns, o.to_ns)
    requests = report_requests(con, o, kept, dropped)
    not_excluded = requests.filter(~pl.col("request_id").is_in(excluded["request_id"].to_list()))
    thresholds, summary = an.threshold_analysis(not_excluded, set(kept["request_id"]))
    exploitation, long_tokens = exploitation_for(con, o, w, (kept, dropped, excluded, capacity, requests))
    row = con.execute("SELECT count(*) FROM events WHERE wall_ns BETWEEN ? AND ?", [o.from_ns, o.to_ns]).fetchone()
    events = row[0] if row else 0
    return Report(
        o,
        context,
        time.time_ns(),
        int(events),
        kept,
        dropped,
        found_kept,
        len(found) - len(found_kept),
        an.exposure_matrix(links),
        an.exposed_tenants(links),
        links,
        capacity,
        thresholds,
        summary,
        exploitation,
        long_tokens,
        coverage_gaps(con),
        tuple(heads if heads is not None else chain_heads(con)),
        shared_transfer_ids=shared_transfer_ids(con, w),
        empty_after_abort=empty_after_abort(con, w),
        unclean_ends=tuple(ends),
        incomplete=incomplete,
        withheld_findings=len(withheld),
        reported_losses=reported_losses(con, w),
        lake=lake,
    )


def write_report(
    report: Report,
    out_dir: str | Path,
    store_name: str,
    *,
    force: bool = False,
    protected: Iterable[str | Path] = (),
    extra: Callable[[Path], list[str]] | None = None,
) -> dict:
    """Write every report file into a staging folder beside ``out_dir`` (the manifest last), then move
    them into place (:func:`kvtrail.outputs.write_dir_atomically`): ``out_dir`` must be new or empty,
    or with ``force`` only the report's own files in it are replaced; a failure leaves it as it was.
    ``protected``: the store's paths, never written over. ``extra(folder)`` writes more files (the
    notices), listed in the manifest with the others. Returns the manifest."""
    from kvtrail.report import manifest

    done: dict = {}
    write_dir_atomically(
        out_dir,
        lambda staging: done.update(_write_files(report, staging, store_name, extra)),
        force=force,
        protected=protected,
        last=(manifest.MANIFEST,),
    )
    return done


def _write_files(report: Report, out: Path, store_name: str, extra: Callable[[Path], list[str]] | None = None) -> dict:
    """Every report file into the (new, empty) folder ``out``, the manifest last; returns the manifest."""
    from kvtrail.report import disclosure, manifest, render

    written = []
    # Excluded responses stay in the file, marked, so the exclusion itself can be reviewed.
    unmarked = report.affected.with_columns(
        pl.lit(None, pl.Utf8).alias("excluded_by"), pl.lit(None, pl.Utf8).alias("reason")
    )
    affected = _with_times(pl.concat([unmarked, report.excluded_affected], how="vertical_relaxed"))
    for name, df in (("affected_responses", affected), ("exposed_tenants", report.exposed)):
        csv_frame(df).write_csv(out / f"{name}.csv")
        (out / f"{name}.json").write_text(json.dumps(df.to_dicts(), indent=1, default=str) + "\n", encoding="utf-8")
        written += [f"{name}.csv", f"{name}.json"]
    blocks = disclosure.report_blocks(report, store_name)
    (out / "report.md").write_text(render.markdown(blocks), encoding="utf-8")
    (out / "report.html").write_text(render.html(blocks, title=disclosure.title(report)), encoding="utf-8")
    render.pdf(blocks, out / "report.pdf", title=disclosure.title(report))
    written += ["report.md", "report.html", "report.pdf"]
    if extra is not None:
        written += extra(out)
    return manifest.write_manifest(report, out, written, store_name)


def _with_times(df: pl.DataFrame) -> pl.DataFrame:
    """Add UTC strings beside the ns columns (the files are read by people as well as programs)."""
    from kvtrail.timeutil import format_utc

    return df.with_columns(
        [
            pl.col(c).map_elements(format_utc, return_dtype=pl.Utf8).alias(c[:-3] + "_utc")
            for c in ("first_ns", "last_ns")
            if c in df.columns
        ]
    )
