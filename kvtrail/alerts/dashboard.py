"""The Grafana dashboard shipped in the package (``grafana/kvtrail.json``), generated from the metric table.

Every query names its metrics through :data:`~kvtrail.alerts.metrics.BY_NAME`, so a renamed metric cannot
leave a panel reading nothing; ``python -m kvtrail.alerts.dashboard`` writes the file again (a test checks the
shipped file is this module's output). Import it in Grafana with a Prometheus data source (the
``DS_PROMETHEUS`` input) scraping ``kvtrail serve``; its variables are ``cluster`` (from the ``producer`` label,
``cluster/node/role``), ``node`` and ``role``. Each alert rule of ``rules.yml`` is linked from the panel that
shows what it reads. SGLang's own ``sglang:max_total_num_tokens`` and ``sglang:context_len`` are drawn beside
kvtrail's pool and context when Prometheus scrapes SGLang with ``node`` and ``role`` target labels
(docs/alerts.md).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from kvtrail.alerts.metrics import BY_NAME
from kvtrail.alerts.rules import grafana_dashboard_path

UID = "kvtrail"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
SGLANG_POOL, SGLANG_CONTEXT = "sglang:max_total_num_tokens", "sglang:context_len"
# Selectors by label set: node metrics (node, role), findings (node), producer metrics (producer, node, role).
_NODE = '{node=~"$node", role=~"$role"}'
_PRODUCER = '{producer=~"$cluster/.*", node=~"$node", role=~"$role"}'


def _x(name: str) -> str:
    """A metric's exposed name (KeyError for a name the metric table does not define)."""
    return BY_NAME[name].exposed


@dataclass(frozen=True)
class Panel:
    """One panel: its queries as ``(PromQL, legend)`` and the alert rules it shows the data of."""

    title: str
    description: str
    targets: tuple[tuple[str, str], ...]
    alerts: tuple[str, ...] = ()
    unit: str = "short"
    kind: str = "timeseries"


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    (
        "Capacity",
        (
            Panel(
                "KV pool vs context per node",
                "Each node's KV pool and the context it advertises, in tokens, as kvtrail records them and, when "
                "Prometheus also scrapes SGLang (with node and role target labels), as SGLang reports them. A pool "
                "below the context serves a full-length request from other requests' pages (the 2026 incident).",
                (
                    (f"{_x('kvtrail_node_kv_pool_tokens')}{_NODE}", "{{node}} ({{role}}) pool"),
                    (f"{_x('kvtrail_node_context_length_tokens')}{_NODE}", "{{node}} ({{role}}) context"),
                    (f"{SGLANG_POOL}{_NODE}", "{{node}} ({{role}}) SGLang max_total_num_tokens"),
                    (f"{SGLANG_CONTEXT}{_NODE}", "{{node}} ({{role}}) SGLang context_len"),
                ),
                ("KvtrailPoolSmallerThanContext",),
            ),
            Panel(
                "Pool headroom (pool - context)",
                "Tokens of pool left when one request uses the whole context; below zero the alert fires.",
                (
                    (
                        f"{_x('kvtrail_node_kv_pool_tokens')}{_NODE} - on (node, role) "
                        f"{_x('kvtrail_node_context_length_tokens')}{_NODE}",
                        "{{node}} ({{role}})",
                    ),
                ),
                ("KvtrailPoolSmallerThanContext",),
                kind="bargauge",
            ),
            Panel(
                "Unaudited paths per node",
                "Paths of a node's page traffic its recorder declares it does not audit (a mode such as HiCache "
                "load-back, the fake transfer backend, a hook that was not patched): pages moved that way are not "
                "in the record. Empty when every node is fully audited.",
                ((f"{_x('kvtrail_node_unaudited_paths')}{_NODE}", "{{node}} ({{role}}): {{path}}"),),
                ("KvtrailNodeUnaudited",),
            ),
        ),
    ),
    (
        "Findings",
        (
            Panel(
                "Foreign reads (F1) and affected responses",
                "Foreign reads the live judge stored and responses that read data they did not own (F1 or F5), per "
                "node, since the store began: a step is a new one.",
                (
                    (
                        f'sum by (node) ({_x("kvtrail_forensics_findings")}{{code="F1", node=~"$node"}})',
                        "{{node}} F1",
                    ),
                    (
                        f'sum by (node) ({_x("kvtrail_forensics_affected_responses")}{{node=~"$node"}})',
                        "{{node}} affected responses",
                    ),
                ),
                ("KvtrailForeignRead",),
            ),
            Panel(
                "Findings by code",
                "Findings stored, per code (F1-F11, docs/findings.md), over the selected nodes.",
                ((f'sum by (code) ({_x("kvtrail_forensics_findings")}{{node=~"$node"}})', "{{code}}"),),
            ),
            Panel(
                "Model property violations",
                "Violations of the model's properties (docs/model.md) the live judge's monitors found, per property "
                "and node, since the store began: a history the patched protocol does not allow.",
                (
                    (
                        f'sum by (property, node) ({_x("kvtrail_model_violations")}{{node=~"$node"}})',
                        "{{node}} {{property}}",
                    ),
                ),
                ("KvtrailModelViolation",),
            ),
            Panel(
                "Rejected but served (F4)",
                "Requests a node rejected or aborted that the client still got as a 2xx with output.",
                (
                    (
                        f'sum by (node) ({_x("kvtrail_forensics_rejected_but_served")}{{node=~"$node"}})',
                        "{{node}}",
                    ),
                ),
                ("KvtrailRejectedButServed",),
            ),
        ),
    ),
    (
        "Transfers (prefill -> decode)",
        (
            Panel(
                "Transfer length mismatches (F2) per prefill -> decode pair",
                "Transfers whose reserved, sent and landed lengths differ, by the prefill node whose send is in the "
                "finding's evidence ('(unknown)' when none is) and the decode node.",
                (
                    (
                        f"sum by (prefill_node, decode_node) ({_x('kvtrail_forensics_transfer_pair_mismatches')}"
                        f'{{code="F2", decode_node=~"$node"}} or {_x("kvtrail_forensics_transfer_pair_mismatches")}'
                        f'{{code="F2", prefill_node=~"$node"}})',
                        "{{prefill_node}} -> {{decode_node}}",
                    ),
                    (
                        f'sum by (node) ({_x("kvtrail_forensics_transfer_length_mismatches")}{{node=~"$node"}})',
                        "{{node}} (all pairs)",
                    ),
                ),
                ("KvtrailTransferLengthMismatch",),
            ),
            Panel(
                "Digest mismatches (F3) per prefill -> decode pair",
                "Transfers whose bytes on decode differ from what prefill digested, by pair.",
                (
                    (
                        f"sum by (prefill_node, decode_node) ({_x('kvtrail_forensics_transfer_pair_mismatches')}"
                        f'{{code="F3", decode_node=~"$node"}} or {_x("kvtrail_forensics_transfer_pair_mismatches")}'
                        f'{{code="F3", prefill_node=~"$node"}})',
                        "{{prefill_node}} -> {{decode_node}}",
                    ),
                    (
                        f'sum by (node) ({_x("kvtrail_forensics_digest_mismatches")}{{node=~"$node"}})',
                        "{{node}} (all pairs)",
                    ),
                ),
                ("KvtrailDigestMismatch",),
            ),
            Panel(
                "Aborts mid-transfer by cause",
                "Requests aborted while their KV was in flight, per second, by node and cause (client_disconnect, "
                "timeout, error): each is a late write waiting to happen.",
                (
                    (
                        f"sum by (node, role, cause) (rate({_x('kvtrail_transfer_aborts')}{_NODE}[$__rate_interval]))",
                        "{{node}} ({{role}}) {{cause}}",
                    ),
                ),
                ("KvtrailTransferAborts",),
                unit="reqps",
            ),
            Panel(
                "Transfers outliving the release timeout (F11)",
                "Transfers that lasted longer than their decode node holds an aborted transfer's pages, per node, "
                "beside each node's release timeout in seconds.",
                (
                    (
                        f'sum by (node) ({_x("kvtrail_forensics_late_transfers")}{{node=~"$node"}})',
                        "{{node}} transfers",
                    ),
                    (f"{_x('kvtrail_node_release_timeout_seconds')}{_NODE}", "{{node}} ({{role}}) timeout (s)"),
                ),
                ("KvtrailTransferOutlivedReleaseTimeout",),
            ),
        ),
    ),
    (
        "Audit pipeline",
        (
            Panel(
                "Recorder drops",
                "Events each recorder reported it dropped (its buffer was full): the audit of that node has a hole.",
                ((f"{_x('kvtrail_recorder_dropped_events')}{_PRODUCER}", "{{producer}}"),),
                ("KvtrailRecorderDrops",),
            ),
            Panel(
                "Sequence gaps",
                "Sequence numbers absent from the store, and of those the ones no gap event explains.",
                (
                    (f"{_x('kvtrail_recorder_missing_events')}{_PRODUCER}", "{{producer}} missing"),
                    (
                        f"{_x('kvtrail_recorder_missing_events')}{_PRODUCER} - "
                        f"{_x('kvtrail_recorder_explained_missing_events')}{_PRODUCER}",
                        "{{producer}} unexplained",
                    ),
                ),
                ("KvtrailRecorderSequenceGap",),
            ),
            Panel(
                "Ingest and judge lag",
                "Of each producer's newest batch: commit time minus its newest event's clock; and how long its "
                "oldest batch the live judge has not judged yet has waited.",
                (
                    (f"{_x('kvtrail_ingest_lag_seconds')}{_PRODUCER}", "{{producer}} ingest"),
                    (f"{_x('kvtrail_judge_lag_seconds')}{_PRODUCER}", "{{producer}} judge"),
                ),
                ("KvtrailIngestLag", "KvtrailJudgeLag"),
                unit="s",
            ),
            Panel(
                "Time since the last batch",
                "Seconds since each producer's newest batch was committed, for recorders that started and did not "
                "close.",
                (
                    (
                        f"(time() - {_x('kvtrail_ingest_last_batch_timestamp_seconds')}{_PRODUCER}) "
                        f"and on (producer) {_x('kvtrail_ingest_producer_open')}{_PRODUCER} == 1",
                        "{{producer}}",
                    ),
                ),
                ("KvtrailProducerSilent",),
                unit="s",
            ),
            Panel(
                "Events committed",
                "Audit events committed per second, per producer.",
                ((f"rate({_x('kvtrail_ingest_events')}{_PRODUCER}[$__rate_interval])", "{{producer}}"),),
                unit="ops",
            ),
        ),
    ),
)


def _variable(name: str, label: str, query: str, regex: str = "") -> dict:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": f"{name}-values"},
        "definition": query,
        "regex": regex,
        "refresh": 2,  # on time range change
        "includeAll": True,
        "multi": True,
        "current": {},
        "sort": 1,
        "hide": 0,
        "options": [],
    }


VARIABLES = (
    _variable("cluster", "Cluster", f"label_values({_x('kvtrail_ingest_events')}, producer)", r"/^([^/]+)\/.*/"),
    _variable("node", "Node", f'label_values({_x("kvtrail_ingest_events")}{{producer=~"$cluster/.*"}}, node)'),
    _variable("role", "Role", f'label_values({_x("kvtrail_node_kv_pool_tokens")}{{node=~"$node"}}, role)'),
)


def _panel(p: Panel, panel_id: int, x: int, y: int) -> dict:
    panel: dict = {
        "id": panel_id,
        "type": p.kind,
        "title": p.title,
        "description": p.description
        + "".join(f"\n\nAlert rule {a} (kvtrail rules.yml) reads this panel's data." for a in p.alerts),
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(p.targets)
        ],
        "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "showLegend": True}}
        if p.kind == "timeseries"
        else {"orientation": "horizontal", "displayMode": "basic"},
        "links": [
            {"title": f"Alert rule {a}", "url": f"/alerting/list?search={a}", "targetBlank": True} for a in p.alerts
        ],
    }
    return panel


def dashboard() -> dict:
    """The dashboard as Grafana's export format (with ``__inputs`` for the data source to import it with)."""
    panels: list[dict] = []
    y, next_id = 0, 1
    for title, row in ROWS:
        panels.append(
            {
                "id": next_id,
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        next_id, y = next_id + 1, y + 1
        for i, p in enumerate(row):
            panels.append(_panel(p, next_id, 12 * (i % 2), y + 8 * (i // 2)))
            next_id += 1
        y += 8 * ((len(row) + 1) // 2)
    kinds = sorted({p.kind for _, row in ROWS for p in row})
    return {
        "__inputs": [
            {
                "name": "DS_PROMETHEUS",
                "label": "Prometheus",
                "description": "The Prometheus that scrapes kvtrail serve (GET /metrics) and, optionally, SGLang.",
                "type": "datasource",
                "pluginId": "prometheus",
                "pluginName": "Prometheus",
            }
        ],
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.0.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
            *({"type": "panel", "id": k, "name": k, "version": ""} for k in kinds),
        ],
        "uid": UID,
        "title": "kvtrail: KV page ownership",
        "description": "Capacity, findings, transfers and the audit pipeline of kvtrail (docs/alerts.md).",
        "tags": ["kvtrail", "sglang", "kv-cache"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "timezone": "browser",
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "templating": {"list": list(VARIABLES)},
        "links": [],
        "panels": panels,
    }


def render() -> str:
    """The shipped file's text."""
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":  # regenerate the shipped file
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else grafana_dashboard_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render())
