"""Analyses over the answers of the questions: exclusions, exposure, thresholds, exploitation.

Every function returns Polars DataFrames (or plain dicts of counts) so the CLI and the disclosure
report print and export the same numbers.
"""

from kvtrail.forensics.analysis.exclusions import (
    Exclusions,
    check_exclusions,
    excluded_mask,
    excluded_requests,
    split_excluded,
)
from kvtrail.forensics.analysis.exploitation import ProbeRules, exploitation_assessment, long_prompt_threshold
from kvtrail.forensics.analysis.exposure import (
    PSEUDO_VICTIMS,
    READ_KINDS,
    exposed_tenants,
    exposure_links,
    exposure_matrix,
    response_reads,
    same_tenant,
)
from kvtrail.forensics.analysis.thresholds import (
    node_capacity,
    requests_table,
    threshold_analysis,
    threshold_sentence,
    thresholds_table,
)

__all__ = [
    "PSEUDO_VICTIMS",
    "READ_KINDS",
    "Exclusions",
    "ProbeRules",
    "check_exclusions",
    "excluded_mask",
    "excluded_requests",
    "exploitation_assessment",
    "exposed_tenants",
    "exposure_links",
    "exposure_matrix",
    "long_prompt_threshold",
    "node_capacity",
    "requests_table",
    "response_reads",
    "same_tenant",
    "split_excluded",
    "threshold_analysis",
    "threshold_sentence",
    "thresholds_table",
]
