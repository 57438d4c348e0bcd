"""The shipped alert rules: promtool accepts them, and each one fires when it should and stays silent
when it should not (``promtool test rules`` on cases built here, annotations included)."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from kvtrail.alerts import EXPOSED, rule_metrics, rule_names, rules_path

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool (Debian prometheus) not installed"
)
P = {"node": "prefill-0", "role": "prefill"}
D = {"node": "decode-0", "role": "decode"}
DP = {"producer": "c1/decode-0/decode", **D}
SEVERITY = {"KvtrailPoolSmallerThanContext": "critical", "KvtrailForeignRead": "critical"}
_TEMPLATE = re.compile(r"\{\{\s*(\$labels\.(\w+)|\$value(\s*\|\s*humanizeDuration)?)\s*\}\}")


@dataclass
class Case:
    """Series (name, labels, promtool values), then (eval minute, alert labels or None for silence, $value)."""

    alert: str
    series: list[tuple[str, dict, str]]
    at_min: int
    fires: dict | None
    value: str = ""
    extra: list[tuple[str, dict, str]] = field(default_factory=list)


def _series(name: str, labels: dict, values: str) -> dict:
    return {"series": name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}", "values": values}


def _new_since(alert: str, metric: str, labels: dict) -> list[Case]:
    """A counter rule: fires on a series that appears above zero and on one that grows; silent at zero
    and once the change is older than 15 minutes."""
    return [
        Case(alert, [(metric, labels, "_x5 1x30")], 7, labels),
        Case(alert, [(metric, labels, "0x5 2x30")], 8, labels),
        Case(alert, [(metric, labels, "0x30")], 10, None),
        Case(alert, [(metric, labels, "1x40")], 20, None),
    ]


CASES: list[Case] = [
    Case(
        "KvtrailPoolSmallerThanContext",
        [("kvtrail_node_kv_pool_tokens", P, "681280x10"), ("kvtrail_node_context_length_tokens", P, "1048576x10")],
        1,
        P,
        "681280",
    ),
    Case(
        "KvtrailPoolSmallerThanContext",
        [("kvtrail_node_kv_pool_tokens", D, "2097152x10"), ("kvtrail_node_context_length_tokens", D, "1048576x10")],
        1,
        None,
    ),
    Case(
        "KvtrailNodeUnaudited",
        [("kvtrail_node_unaudited_paths", {**P, "path": "HiCache load-back and write-back allocations"}, "1x10")],
        1,
        {**P, "path": "HiCache load-back and write-back allocations"},
        "1",
    ),
    Case(  # a node that declares nothing has no series: silent
        "KvtrailNodeUnaudited",
        [("kvtrail_node_kv_pool_tokens", P, "2097152x10")],
        1,
        None,
    ),
    *_new_since("KvtrailForeignRead", "kvtrail_forensics_findings_total", {"code": "F1", "node": "decode-0"}),
    Case(
        "KvtrailForeignRead",
        [("kvtrail_forensics_findings_total", {"code": "F8", "node": "prefill-0"}, "_x5 1x30")],
        7,
        None,
    ),
    *_new_since(
        "KvtrailTransferLengthMismatch", "kvtrail_forensics_transfer_length_mismatches_total", {"node": "decode-0"}
    ),
    *_new_since("KvtrailDigestMismatch", "kvtrail_forensics_digest_mismatches_total", {"node": "decode-0"}),
    *_new_since("KvtrailRejectedButServed", "kvtrail_forensics_rejected_but_served_total", {"node": "decode-0"}),
    *_new_since(
        "KvtrailTransferOutlivedReleaseTimeout", "kvtrail_forensics_late_transfers_total", {"node": "decode-0"}
    ),
    *_new_since(
        "KvtrailModelViolation",
        "kvtrail_model_violations_total",
        {"property": "no_free_before_drain", "node": "decode-0"},
    ),
    *_new_since("KvtrailRecorderDrops", "kvtrail_recorder_dropped_events_total", DP),
    Case(
        "KvtrailTransferAborts",
        [("kvtrail_transfer_aborts_total", {**D, "cause": "client_disconnect"}, "0+1x30")],
        20,
        {**D, "cause": "client_disconnect"},
    ),
    Case("KvtrailTransferAborts", [("kvtrail_transfer_aborts_total", {**D, "cause": "error"}, "0+0.1x30")], 20, None),
    Case(
        "KvtrailRecorderSequenceGap",
        [("kvtrail_recorder_missing_events", DP, "3x20"), ("kvtrail_recorder_explained_missing_events", DP, "1x20")],
        10,
        DP,
        "2",
    ),
    Case(
        "KvtrailRecorderSequenceGap",
        [("kvtrail_recorder_missing_events", DP, "3x20"), ("kvtrail_recorder_explained_missing_events", DP, "3x20")],
        10,
        None,
    ),
    Case(
        "KvtrailRecorderSequenceGap",
        [
            ("kvtrail_recorder_missing_events", DP, "0x2 3 0x20"),  # in flight
            ("kvtrail_recorder_explained_missing_events", DP, "0x20"),
        ],
        4,
        None,
    ),
    Case(
        "KvtrailProducerSilent",
        [("kvtrail_ingest_last_batch_timestamp_seconds", DP, "0x30"), ("kvtrail_ingest_producer_open", DP, "1x30")],
        20,
        DP,
        "20m 0s",
    ),
    Case(
        "KvtrailProducerSilent",
        [
            ("kvtrail_ingest_last_batch_timestamp_seconds", DP, "0x30"),  # closed cleanly
            ("kvtrail_ingest_producer_open", DP, "0x30"),
        ],
        20,
        None,
    ),
    Case(
        "KvtrailProducerSilent",
        [("kvtrail_ingest_last_batch_timestamp_seconds", DP, "0+60x30"), ("kvtrail_ingest_producer_open", DP, "1x30")],
        20,
        None,
    ),
    Case("KvtrailIngestLag", [("kvtrail_ingest_lag_seconds", DP, "120x20")], 10, DP, "2m 0s"),
    Case("KvtrailIngestLag", [("kvtrail_ingest_lag_seconds", DP, "5x20")], 10, None),
    Case("KvtrailIngestLag", [("kvtrail_ingest_lag_seconds", DP, "5 120 5x20")], 3, None),  # one slow batch
    Case("KvtrailJudgeLag", [("kvtrail_judge_lag_seconds", DP, "90x20")], 10, DP, "1m 30s"),
    Case("KvtrailJudgeLag", [("kvtrail_judge_lag_seconds", DP, "0x20")], 10, None),
]


def _rules() -> dict[str, dict]:
    doc = yaml.safe_load(rules_path().read_text())
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"]}


def _render(text: str, labels: dict, value: str) -> str:
    """The rules' annotation templates use only ``$labels.<name>``, ``$value`` and humanizeDuration."""
    return _TEMPLATE.sub(lambda m: labels[m.group(2)] if m.group(2) else value, text)


def _test_file(tmp_path: Path) -> Path:
    rules = _rules()
    tests = []
    for c in CASES:
        exp = []
        if c.fires is not None:
            labels = {**c.fires, "severity": SEVERITY.get(c.alert, rules[c.alert]["labels"]["severity"])}
            exp = [
                {
                    "exp_labels": labels,
                    "exp_annotations": {
                        k: _render(v, c.fires, c.value) for k, v in rules[c.alert]["annotations"].items()
                    },
                }
            ]
        tests.append(
            {
                "interval": "1m",
                "input_series": [_series(*s) for s in c.series + c.extra],
                "alert_rule_test": [{"eval_time": f"{c.at_min}m", "alertname": c.alert, "exp_alerts": exp}],
            }
        )
    path = tmp_path / "rules_test.yml"
    path.write_text(
        yaml.safe_dump(
            {"rule_files": [str(rules_path())], "evaluation_interval": "1m", "tests": tests}, sort_keys=False
        )
    )
    return path


def test_every_rule_has_a_firing_and_a_silent_case_and_says_node_and_runbook():
    names = rule_names()
    assert {c.alert for c in CASES if c.fires} == set(names) == {c.alert for c in CASES if not c.fires}
    for name, rule in _rules().items():
        ann = rule["annotations"]
        assert set(ann) == {"summary", "description"}, name
        assert "$labels.node" in ann["summary"] + ann["description"] or "$labels.producer" in ann["summary"], name
        assert "Runbook:" in ann["description"], name
        for m in _TEMPLATE.finditer(ann["summary"] + ann["description"]):
            assert m.group(2) is None or m.group(2) in ("node", "role", "producer", "cause", "property", "path")
        assert ann["summary"].count("{{") == len(_TEMPLATE.findall(ann["summary"])), "only the rendered subset"
        assert ann["description"].count("{{") == len(_TEMPLATE.findall(ann["description"]))


def test_rules_read_only_metrics_the_collector_exposes():
    assert rule_metrics() <= set(EXPOSED)


def test_the_pool_rule_names_the_incident_runbook():
    ann = _rules()["KvtrailPoolSmallerThanContext"]["annotations"]
    assert "lower --context-length or raise" in ann["description"] and "kvtrail preflight" in ann["description"]


@needs_promtool
def test_promtool_checks_the_rules():
    out = subprocess.run(["promtool", "check", "rules", str(rules_path())], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(rule_names())} rules found" in out.stdout


@needs_promtool
def test_promtool_unit_tests_every_rule(tmp_path):
    path = _test_file(tmp_path)
    out = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "SUCCESS" in out.stdout
