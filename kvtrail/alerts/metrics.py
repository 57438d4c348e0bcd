"""The metrics kvtrail exposes: one table of names, types, labels and meanings.

The collector (:mod:`kvtrail.alerts.collector`), ``docs/alerts.md`` and the alert rules all refer to
these names; a test checks the three agree. Names follow ``kvtrail_<subsystem>_<name>_<unit>``; a
counter's exposed name adds ``_total``. Labels are bounded: node, role, code, producer (the
``cluster/node/role`` a recorder reports as, summed over its restarts) and, where said, the abort
cause, the engine's name and version, a transfer's prefill and decode nodes, a model property or an
unaudited path (a mode the recorder names, a few per node) - never a request, tenant or API-key id.
"""

from __future__ import annotations

from dataclasses import dataclass

NODE = ("node", "role")
PRODUCER = ("producer", "node", "role")
# Causes of an abort during transfer, from the abort's reason and HTTP status (kvtrail.alerts.collector).
ABORT_CAUSES = ("client_disconnect", "timeout", "error")


@dataclass(frozen=True)
class MetricSpec:
    """One metric family: ``kind`` is ``gauge``, ``counter`` or ``info``."""

    name: str
    kind: str
    labels: tuple[str, ...]
    doc: str
    column: str | None = None  # the node_config column a node metric reads (its latest per node and role)
    per_unit: float = 1.0  # how many of the column's units make one of the metric's

    @property
    def exposed(self) -> str:
        """The sample name Prometheus sees."""
        return self.name + {"counter": "_total", "info": "_info", "gauge": ""}[self.kind]


def _m(
    name: str, kind: str, labels: tuple[str, ...], doc: str, column: str | None = None, per_unit: float = 1.0
) -> MetricSpec:
    return MetricSpec(name, kind, labels, doc, column, per_unit)


METRICS: tuple[MetricSpec, ...] = (
    # node configuration: the latest node_config of each node and role
    _m("kvtrail_node_kv_pool_tokens", "gauge", NODE, "KV pool capacity in tokens.", "pool_tokens"),
    _m(
        "kvtrail_node_context_length_tokens",
        "gauge",
        NODE,
        "Context length the node advertises, in tokens.",
        "context_tokens",
    ),
    _m("kvtrail_node_page_size_tokens", "gauge", NODE, "Tokens per KV page.", "page_size"),
    _m(
        "kvtrail_node_checksum_enabled",
        "gauge",
        NODE,
        "Per-transfer KV checksums on (1) or off (0).",
        "checksum_enabled",
    ),
    _m("kvtrail_node_canary_enabled", "gauge", NODE, "KV canary on (1) or off (0).", "canary_enabled"),
    _m(
        "kvtrail_node_deferred_release_enabled",
        "gauge",
        NODE,
        "Deferred KV release on (1) or off (0).",
        "deferred_release",
    ),
    _m(
        "kvtrail_node_release_timeout_seconds",
        "gauge",
        NODE,
        "How long the node holds the pages of an aborted transfer before reusing them (deferred release).",
        "release_timeout_ns",
        1e9,
    ),
    _m(
        "kvtrail_node_transfer_batch_max_pages",
        "gauge",
        NODE,
        "The most pages one transfer call moves.",
        "transfer_batch_max_pages",
    ),
    _m("kvtrail_node_engine", "info", (*NODE, "engine", "version"), "Serving engine and version of the node."),
    _m(
        "kvtrail_node_unaudited_paths",
        "gauge",
        (*NODE, "path"),
        "1 for each path of the node's page traffic its recorder declares it does not audit (a mode, a transfer "
        "backend, a hook that was not patched: the node_config's config_source); absent when it declares none.",
    ),
    # findings (the judge's persisted findings)
    _m("kvtrail_forensics_findings", "counter", ("code", "node"), "Findings stored, by code and node."),
    _m(
        "kvtrail_forensics_affected_responses",
        "counter",
        ("node",),
        "Responses that read data they did not own (requests with an F1 or F5).",
    ),
    _m(
        "kvtrail_forensics_transfer_length_mismatches",
        "counter",
        ("node",),
        "Transfers whose reserved, sent and landed lengths differ (F2).",
    ),
    _m("kvtrail_forensics_digest_mismatches", "counter", ("node",), "Transfers whose digests differ (F3)."),
    _m(
        "kvtrail_forensics_rejected_but_served",
        "counter",
        ("node",),
        "Requests rejected or aborted that the client still got as a 2xx with output (F4).",
    ),
    _m(
        "kvtrail_forensics_late_transfers",
        "counter",
        ("node",),
        "Transfers that outlived their decode node's release timeout (F11).",
    ),
    _m(
        "kvtrail_forensics_transfer_pair_mismatches",
        "counter",
        ("code", "prefill_node", "decode_node"),
        "Transfer length (F2) and digest (F3) mismatches by prefill -> decode pair: the prefill node whose send "
        "is in the finding's evidence, (unknown) when none is.",
    ),
    # the model's properties (docs/model.md), as the live judge's monitors find them broken
    _m(
        "kvtrail_model_violations",
        "counter",
        ("property", "node"),
        "Violations of the model's properties (docs/model.md) the live judge's monitors found, by property and "
        "the node of the first offending event.",
    ),
    # transfers
    _m(
        "kvtrail_transfer_aborts",
        "counter",
        (*NODE, "cause"),
        "Requests aborted during their KV transfer, by cause (client_disconnect, timeout, error).",
    ),
    # ingest, per producer
    _m("kvtrail_ingest_events", "counter", PRODUCER, "Events committed."),
    _m("kvtrail_ingest_page_events", "counter", PRODUCER, "Page entries committed (one per page an event lists)."),
    _m("kvtrail_ingest_last_batch_timestamp_seconds", "gauge", PRODUCER, "When the newest batch was committed."),
    _m(
        "kvtrail_ingest_lag_seconds",
        "gauge",
        PRODUCER,
        "Of the newest batch: commit time minus its newest event's wall clock.",
    ),
    _m(
        "kvtrail_ingest_producer_open",
        "gauge",
        PRODUCER,
        "1 while the producer's latest recorder instance has started and not closed cleanly.",
    ),
    _m("kvtrail_recorder_dropped_events", "counter", PRODUCER, "Events the recorder reported it dropped."),
    _m("kvtrail_recorder_missing_events", "gauge", PRODUCER, "Sequence numbers absent from the store."),
    _m(
        "kvtrail_recorder_explained_missing_events",
        "gauge",
        PRODUCER,
        "Of the missing sequence numbers, how many the recorder's own gap events account for.",
    ),
    _m(
        "kvtrail_judge_lag_seconds",
        "gauge",
        PRODUCER,
        "How long the producer's oldest committed batch the live judge has not judged yet has waited (0: none).",
    ),
    # OpenTelemetry export (kvtrail serve --otlp-endpoint; listed only while it is on)
    _m(
        "kvtrail_otel_exported_records",
        "counter",
        ("signal",),
        "Spans (signal span) and log records (signal log) the OpenTelemetry export delivered.",
    ),
    _m(
        "kvtrail_otel_dropped_records",
        "counter",
        ("signal",),
        "Spans and log records the OpenTelemetry export dropped: its queue was full or the receiver failed.",
    ),
)
BY_NAME: dict[str, MetricSpec] = {m.name: m for m in METRICS}
EXPOSED: dict[str, MetricSpec] = {m.exposed: m for m in METRICS}

for _spec in METRICS:
    assert _spec.name.startswith("kvtrail_") and not _spec.name.endswith("_total"), _spec.name
