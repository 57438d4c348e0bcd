"""kvtrail's forensics: the questions an incident responder asks of an audit store, and their answers.

This module is the public API that the CLI, the disclosure report, the HTTP service and the
dashboard use; nothing outside ``kvtrail.forensics`` imports its subpackages (``replay``, ``sql``,
``analysis``, ``report``). Every question takes a DuckDB connection to a store (or a store's path),
a :class:`Window` and options, and returns Polars frames or typed records.
"""

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
from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.forensics.questions import (
    affected_responses,
    affected_with_exclusions,
    coverage_gaps,
    findings,
    findings_frame,
    findings_of,
)
from kvtrail.forensics.window import Window

__all__ = [
    "AFFECTED_CODES", "CODES", "NEVER_WRITTEN", "PSEUDO_VICTIMS", "UNKNOWN_TENANT",
    "Exclusions", "Finding", "FindingCode", "ForensicsPolicy", "ProbeRules", "Window",
    "affected_responses", "affected_with_exclusions", "check_exclusions", "coverage_gaps", "excluded_requests",
    "exploitation_assessment", "exposed_tenants", "exposure_links", "exposure_matrix", "findings",
    "findings_frame", "findings_of", "findings_table", "long_prompt_threshold", "node_capacity", "requests_table",
    "split_excluded", "threshold_analysis", "threshold_sentence",
]
