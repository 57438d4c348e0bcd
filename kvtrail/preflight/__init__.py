"""kvtrail.preflight: the deploy gate. SGLang's start-up logs, server info, metrics or a running server's
URL to node configurations, checked (pool >= context, integrity settings, engine version, transfer
bound) with exit code 0 / 1 / 2. See docs/alerts.md."""

from kvtrail.preflight.checks import FIXED_VERSION, CheckResult, check_node
from kvtrail.preflight.node import NodeConfig
from kvtrail.preflight.report import Verdict, judge
from kvtrail.preflight.serverinfo import parse_metrics, parse_server_info
from kvtrail.preflight.sources import SourceError, parse_text, read_source
from kvtrail.preflight.startlog import parse_startup_log

__all__ = [
    "FIXED_VERSION",
    "CheckResult",
    "NodeConfig",
    "SourceError",
    "Verdict",
    "check_node",
    "judge",
    "parse_metrics",
    "parse_server_info",
    "parse_startup_log",
    "parse_text",
    "read_source",
]
