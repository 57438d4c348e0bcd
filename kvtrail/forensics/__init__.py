"""kvtrail's forensics: the questions an incident responder asks of an audit store, and their answers.

This module is the public API that the CLI, the disclosure report, the HTTP service and the
dashboard use; nothing outside ``kvtrail.forensics`` imports its subpackages (``replay``, ``sql``,
``analysis``, ``report``). Every question takes a DuckDB connection to a store (or a store's path),
a :class:`Window` and options, and returns Polars frames or typed records.
"""

from kvtrail.audit.snapshot import open_snapshot
from kvtrail.forensics.analysis import (
    PSEUDO_VICTIMS,
    Exclusions,
    ProbeRules,
    check_exclusions,
    excluded_requests,
    exploitation_assessment,
    exposed_tenants,
    exposure_links,
    exposure_matrix,
    long_prompt_threshold,
    node_capacity,
    requests_table,
    split_excluded,
    threshold_analysis,
    threshold_sentence,
)
from kvtrail.forensics.findings import (
    AFFECTED_CODES,
    CODES,
    NEVER_WRITTEN,
    UNKNOWN_TENANT,
    Finding,
    FindingCode,
    findings_table,
)
from kvtrail.forensics.online import OnlineReplay, StoreTail
from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.forensics.questions import (
    Answer,
    affected_responses,
    affected_with_exclusions,
    ask_affected,
    ask_exploitation,
    ask_exposure,
    ask_findings,
    ask_node_configurations,
    ask_thresholds,
    coverage_gaps,
    exploitation_for,
    findings,
    findings_frame,
    findings_of,
    open_store,
    require_store,
)
from kvtrail.forensics.replay.engine import replay_store
from kvtrail.forensics.results.persist import save_findings, stored_findings
from kvtrail.forensics.sql.engine import sql_findings
from kvtrail.forensics.window import Window, check_window
from kvtrail.report.build import Report, build_report, write_report
from kvtrail.report.context import IncidentContext, load_context, load_exclusions
from kvtrail.report.options import ReportOptions
from kvtrail.report.verify import ReportCheck, check_digest, check_store_chain, verify_report

__all__ = [
    "AFFECTED_CODES",
    "Answer",
    "CODES",
    "Exclusions",
    "Finding",
    "FindingCode",
    "ForensicsPolicy",
    "IncidentContext",
    "NEVER_WRITTEN",
    "OnlineReplay",
    "PSEUDO_VICTIMS",
    "ProbeRules",
    "Report",
    "ReportCheck",
    "ReportOptions",
    "StoreTail",
    "UNKNOWN_TENANT",
    "Window",
    "affected_responses",
    "affected_with_exclusions",
    "ask_affected",
    "ask_exploitation",
    "ask_exposure",
    "ask_findings",
    "ask_node_configurations",
    "ask_thresholds",
    "build_report",
    "check_digest",
    "check_store_chain",
    "check_exclusions",
    "check_window",
    "coverage_gaps",
    "excluded_requests",
    "exploitation_assessment",
    "exploitation_for",
    "exposed_tenants",
    "exposure_links",
    "exposure_matrix",
    "findings",
    "findings_frame",
    "findings_of",
    "findings_table",
    "load_context",
    "load_exclusions",
    "long_prompt_threshold",
    "node_capacity",
    "open_snapshot",
    "open_store",
    "replay_store",
    "require_store",
    "requests_table",
    "save_findings",
    "split_excluded",
    "sql_findings",
    "stored_findings",
    "threshold_analysis",
    "threshold_sentence",
    "verify_report",
    "write_report",
]
