"""kvtrail's forensics: the judge. Its surface is the findings vocabulary and one ``ask_*`` per question.

The engines (``replay``, ``sql``) are reached only through these names; the analyses over the answers
are :mod:`kvtrail.forensics.analysis`, what the judge writes back into a store is
:mod:`kvtrail.forensics.results`, the fan-out over a lake :mod:`kvtrail.forensics.lake`. The faces ask
through :mod:`kvtrail.answers`; the rules themselves are stated in ``docs/findings.md``.
"""

from kvtrail.forensics.analysis import PSEUDO_VICTIMS, Exclusions, ProbeRules
from kvtrail.forensics.findings import AFFECTED_CODES, CODES, NEVER_WRITTEN, UNKNOWN_TENANT, Finding, FindingCode
from kvtrail.forensics.online import OnlineReplay, StoreTail
from kvtrail.forensics.options import ReportOptions
from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.forensics.questions import (
    Answer,
    ask_affected,
    ask_exploitation,
    ask_exposure,
    ask_findings,
    ask_node_configurations,
    ask_thresholds,
    coverage_gaps,
    open_store,
)
from kvtrail.forensics.replay.engine import replay_store
from kvtrail.forensics.window import Window, check_window

__all__ = [
    "AFFECTED_CODES",
    "Answer",
    "CODES",
    "Exclusions",
    "Finding",
    "FindingCode",
    "ForensicsPolicy",
    "NEVER_WRITTEN",
    "OnlineReplay",
    "PSEUDO_VICTIMS",
    "ProbeRules",
    "ReportOptions",
    "StoreTail",
    "UNKNOWN_TENANT",
    "Window",
    "ask_affected",
    "ask_exploitation",
    "ask_exposure",
    "ask_findings",
    "ask_node_configurations",
    "ask_thresholds",
    "check_window",
    "coverage_gaps",
    "open_store",
    "replay_store",
]
