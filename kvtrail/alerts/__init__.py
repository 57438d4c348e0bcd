"""kvtrail.alerts: Prometheus metrics computed from the audit store, the shipped alert rules.

``collector(store)`` is a prometheus-client collector to register in any registry; ``exposition``
renders one scrape in the text format; ``rules_path()`` is the rule file shipped in the package.
See docs/alerts.md.
"""

from kvtrail.alerts.collector import JudgeProgress, StoreCollector, collector
from kvtrail.alerts.exposition import CONTENT_TYPE, exposition, registry_for
from kvtrail.alerts.metrics import BY_NAME, EXPOSED, METRICS, MetricSpec
from kvtrail.alerts.rules import RULES_FILE, rule_metrics, rule_names, rules_path

__all__ = [
    "BY_NAME",
    "CONTENT_TYPE",
    "EXPOSED",
    "METRICS",
    "RULES_FILE",
    "JudgeProgress",
    "MetricSpec",
    "StoreCollector",
    "collector",
    "exposition",
    "registry_for",
    "rule_metrics",
    "rule_names",
    "rules_path",
]
