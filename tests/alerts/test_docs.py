"""docs/alerts.md names every metric (with its labels) and every shipped alert rule."""

from __future__ import annotations

from pathlib import Path

from kvtrail.alerts import METRICS, rule_names

DOC = (Path(__file__).resolve().parents[2] / "docs" / "alerts.md").read_text()


def test_every_metric_with_its_labels_is_documented():
    for m in METRICS:
        assert f"| `{m.exposed}` | {m.kind} | {', '.join(m.labels)} |" in DOC, m.exposed


def test_every_rule_is_documented():
    for name in rule_names():
        assert f"| `{name}` |" in DOC, name
