"""The store collector: each metric from the audit store at scrape time; promtool accepts the exposition."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtrail.alerts import EXPOSED, METRICS, exposition, registry_for
from kvtrail.audit.batch import from_dicts
from kvtrail.audit.store import AuditStore
from kvtrail.forensics import replay_store
from kvtrail.forensics.results.persist import save_findings
from tests.alerts.histories import CONTEXT_TOKENS, DECODE, POOL_TOKENS, foreign_read, node_configs, transfer_abort
from tests.conftest import T0, event

PRE = {"node": "prefill-0", "role": "prefill"}
DEC = {"node": "decode-0", "role": "decode"}
DEC_PRODUCER = {"producer": "c1/decode-0/decode", **DEC}


def _judged(store: AuditStore) -> None:
    with store.cursor() as con:
        save_findings(con, replay_store(con), from_ns=None, to_ns=None, engine="replay")


@pytest.fixture
def incident(tmp_path):
    with AuditStore(tmp_path / "a.duckdb") as store:
        store.append(from_dicts(node_configs()[:1]))
        store.append(
            from_dicts(
                [
                    node_configs()[1],
                    *foreign_read(),
                    transfer_abort(7, "client_disconnected", 499),
                    transfer_abort(8, "waiting timeout", 408, "r10"),
                    event(9, "recorder_gap", DECODE, wall_ns=T0 + 60_000, dropped_events=3, gap_reason="buffer_full"),
                ]
            )
        )
        _judged(store)
        yield store


def test_node_configuration_findings_and_producers(incident):
    reg = registry_for(incident.cursor, judge_progress=lambda: {})
    get = reg.get_sample_value
    assert get("kvtrail_node_kv_pool_tokens", PRE) == POOL_TOKENS
    assert get("kvtrail_node_context_length_tokens", PRE) == CONTEXT_TOKENS
    assert get("kvtrail_node_page_size_tokens", DEC) == 16
    assert get("kvtrail_node_checksum_enabled", PRE) == 0 and get("kvtrail_node_checksum_enabled", DEC) == 1
    assert get("kvtrail_node_canary_enabled", PRE) is None  # not reported: unknown, never a number
    assert get("kvtrail_node_release_timeout_seconds", PRE) == 30.0
    assert get("kvtrail_node_transfer_batch_max_pages", PRE) == 256
    assert get("kvtrail_node_release_timeout_seconds", DEC) is None
    assert get("kvtrail_node_engine_info", {**PRE, "engine": "kvtrail-reference", "version": "0.1"}) == 1
    assert get("kvtrail_forensics_findings_total", {"code": "F1", "node": "decode-0"}) == 2  # two victims' pages
    assert get("kvtrail_forensics_findings_total", {"code": "F8", "node": "prefill-0"}) == 1
    assert get("kvtrail_forensics_findings_total", {"code": "F3", "node": "decode-0"}) == 0  # listed at zero
    assert get("kvtrail_forensics_affected_responses_total", {"node": "decode-0"}) == 1
    assert get("kvtrail_forensics_transfer_length_mismatches_total", {"node": "prefill-0"}) == 0
    assert get("kvtrail_transfer_aborts_total", {**DEC, "cause": "client_disconnect"}) == 1
    assert get("kvtrail_transfer_aborts_total", {**DEC, "cause": "timeout"}) == 1
    assert get("kvtrail_transfer_aborts_total", {**DEC, "cause": "error"}) == 0
    assert get("kvtrail_ingest_events_total", DEC_PRODUCER) == 10
    assert get("kvtrail_ingest_page_events_total", DEC_PRODUCER) == 13  # 2+2+2+3+1+3 pages
    assert get("kvtrail_recorder_dropped_events_total", DEC_PRODUCER) == 3
    assert get("kvtrail_recorder_missing_events", DEC_PRODUCER) == 0
    assert get("kvtrail_ingest_producer_open", DEC_PRODUCER) == 0  # no recorder_started: not judged
    assert get("kvtrail_ingest_lag_seconds", DEC_PRODUCER) >= 0
    assert get("kvtrail_judge_lag_seconds", DEC_PRODUCER) > 0  # the judge read nothing yet
    reg_without_judge = registry_for(incident.cursor)
    assert reg_without_judge.get_sample_value("kvtrail_judge_lag_seconds", DEC_PRODUCER) is None


def test_values_follow_the_store_at_each_scrape(incident):
    reg = registry_for(incident.cursor)
    before = reg.get_sample_value("kvtrail_ingest_events_total", DEC_PRODUCER)
    incident.append(
        from_dicts(
            [
                event(10, "recorder_gap", DECODE, wall_ns=T0 + 70_000, dropped_events=1, gap_reason="buffer_full"),
                event(12, "recorder_gap", DECODE, wall_ns=T0 + 80_000, dropped_events=0, gap_reason="transport"),
            ]
        )
    )
    assert reg.get_sample_value("kvtrail_ingest_events_total", DEC_PRODUCER) == before + 2
    assert reg.get_sample_value("kvtrail_recorder_dropped_events_total", DEC_PRODUCER) == 4
    assert reg.get_sample_value("kvtrail_recorder_missing_events", DEC_PRODUCER) == 1  # seq 11
    assert reg.get_sample_value("kvtrail_recorder_explained_missing_events", DEC_PRODUCER) == 1
    incident.append(from_dicts(node_configs(1, pool_tokens=2_097_152, wall_ns=T0 + 90_000)[:1]))
    assert reg.get_sample_value("kvtrail_node_kv_pool_tokens", PRE) == 2_097_152  # the latest config counts


def test_no_label_names_a_request_or_tenant(incident):
    model = {("no_foreign_read", "decode-0"): 2}
    text = exposition(registry_for(incident.cursor, judge_progress=lambda: {}, model_violations=lambda: model)).decode()
    names = set()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            names |= set(s.labels)
            assert "r1" not in s.labels.values() and "t-r2" not in s.labels.values()
    assert names <= {
        "node",
        "role",
        "code",
        "producer",
        "cause",
        "engine",
        "version",
        "prefill_node",
        "decode_node",
        "property",
        "path",
    }
    # (path: kvtrail_node_unaudited_paths, listed only for a node that declares one; none does here)
    exposed = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    # the live judge's model violations as given, every other property and configured node at 0
    violations = {
        (s.labels["property"], s.labels["node"]): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "kvtrail_model_violations_total"
    }
    assert violations[("no_foreign_read", "decode-0")] == 2 and violations[("pages_conserved", "prefill-0")] == 0
    assert sum(violations.values()) == 2
    # every declared metric appears, no other; the OpenTelemetry export's only while it is on
    # (tests/alerts/test_otel.py), a transfer pair's once it has a mismatch (no zero per pair: many series), an
    # unaudited path's once a node declares one
    later = {"kvtrail_forensics_transfer_pair_mismatches_total", "kvtrail_node_unaudited_paths"}
    assert exposed == {n for n in EXPOSED if not n.startswith("kvtrail_otel_")} - later
    assert len(METRICS) == len(EXPOSED)


def test_an_empty_store_exposes_nothing_but_valid_text(tmp_path):
    with AuditStore(tmp_path / "e.duckdb") as store:
        text = exposition(registry_for(store.cursor)).decode()
    assert "kvtrail_forensics_findings_total{" not in text


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian prometheus) not installed")
def test_promtool_accepts_the_exposition(incident):
    text = exposition(registry_for(incident.cursor, judge_progress=lambda: {}))
    out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert out.returncode == 0, out.stdout.decode() + out.stderr.decode()
    assert not out.stdout.strip() and not out.stderr.strip(), "no lint warnings"


def test_late_transfers_count_f11_findings(incident):
    from kvtrail.forensics.findings import make_finding

    late = make_finding(
        "F11",
        node="decode-0",
        request_id="r7",
        tenant_id="t-r7",
        first_ns=T0,
        last_ns=T0 + 5,
        evidence=((1, 2),),
        detail="transfer ran 5 s",
    )
    with incident.cursor() as con:
        save_findings(con, [late], from_ns=None, to_ns=None, engine="replay")
    reg = registry_for(incident.cursor)
    assert reg.get_sample_value("kvtrail_forensics_late_transfers_total", {"node": "decode-0"}) == 1
    assert reg.get_sample_value("kvtrail_forensics_late_transfers_total", {"node": "prefill-0"}) == 0


def test_unaudited_paths_are_what_each_nodes_latest_config_declares(tmp_path):
    """kvtrail_node_unaudited_paths: one series per path the SGLang plugin's config_source names (modes not audited,
    hooks not patched), from each node's latest node_config; a node that declares none has no series."""
    pre, dec = node_configs()
    declared = "sglang-plugin; hooks missing: x.Y.send; not audited: HiCache load-back and write-back allocations"
    later = event(1, "node_config", DECODE, wall_ns=T0 + 10, **{k: v for k, v in dec.items() if k in _CONFIG_FIELDS})
    with AuditStore(tmp_path / "a.duckdb") as store:
        store.append(from_dicts([{**pre, "config_source": declared}]))
        store.append(from_dicts([{**dec, "config_source": "sglang-plugin; not audited: speculative decoding EAGLE"}]))
        get = registry_for(store.cursor).get_sample_value
        hicache = {**PRE, "path": "HiCache load-back and write-back allocations"}
        assert get("kvtrail_node_unaudited_paths", hicache) == 1
        assert get("kvtrail_node_unaudited_paths", {**PRE, "path": "hook not patched: x.Y.send"}) == 1
        assert get("kvtrail_node_unaudited_paths", {**DEC, "path": "speculative decoding EAGLE"}) == 1
        store.append(from_dicts([{**later, "config_source": "sglang-plugin; hooks all patched"}]))
        get = registry_for(store.cursor).get_sample_value
        assert get("kvtrail_node_unaudited_paths", {**DEC, "path": "speculative decoding EAGLE"}) is None  # restarted
        assert get("kvtrail_node_unaudited_paths", hicache) == 1


_CONFIG_FIELDS = ("pool_tokens", "pool_pages", "page_size", "context_tokens")
