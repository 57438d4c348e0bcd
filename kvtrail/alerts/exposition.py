"""One scrape in Prometheus' text format, from a registry holding the store's collector."""

from __future__ import annotations

from collections.abc import Callable

import duckdb
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvtrail.alerts.collector import JudgeProgress, ModelViolations, StoreCollector
from kvtrail.alerts.otel import ExportCollector, OtelExport

CONTENT_TYPE = CONTENT_TYPE_LATEST


def registry_for(
    connect: Callable[[], duckdb.DuckDBPyConnection],
    *,
    judge_progress: JudgeProgress | None = None,
    model_violations: ModelViolations | None = None,
    export: OtelExport | None = None,
) -> CollectorRegistry:
    """A fresh registry with only the store's collector (no process or platform collectors: a scrape
    says what the audit holds, nothing about the Python process serving it), and the OpenTelemetry
    export's counters when ``export`` is given."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(connect, judge_progress=judge_progress, model_violations=model_violations))
    if export is not None:
        registry.register(ExportCollector(export))
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    """The text exposition of every metric in ``registry``."""
    return generate_latest(registry)
