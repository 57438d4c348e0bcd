"""kvtrail.alerts: Prometheus metrics computed from the audit store, the shipped alert rules.

``collector(store)`` is a prometheus-client collector to register in any registry; ``exposition``
renders one scrape in the text format; ``rules_path()`` is the rule file shipped in the package,
``grafana_dashboard_path()`` the Grafana dashboard; ``OtelExport`` / ``otlp_export`` send the live judge's
results to OpenTelemetry (``kvtrail serve --otlp-endpoint``). See docs/alerts.md.
"""

from kvtrail.alerts.collector import JudgeProgress, StoreCollector, collector
from kvtrail.alerts.exposition import CONTENT_TYPE, exposition, registry_for
from kvtrail.alerts.metrics import BY_NAME, EXPOSED, METRICS, MetricSpec
from kvtrail.alerts.otel import OtelExport, otlp_export
from kvtrail.alerts.rules import RULES_FILE, grafana_dashboard_path, rule_metrics, rule_names, rules_path

__all__ = [
    "BY_NAME",
    "CONTENT_TYPE",
    "EXPOSED",
    "METRICS",
    "RULES_FILE",
    "JudgeProgress",
    "MetricSpec",
    "OtelExport",
    "StoreCollector",
    "collector",
    "exposition",
    "grafana_dashboard_path",
    "otlp_export",
    "registry_for",
    "rule_metrics",
    "rule_names",
    "rules_path",
]
