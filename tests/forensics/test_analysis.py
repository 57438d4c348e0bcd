"""Analyses over a hand-built incident: exclusions, exposure matrix, thresholds, exploitation verdicts."""

from __future__ import annotations

import duckdb
import polars as pl
import pytest

from kvtrail import forensics as an
from kvtrail.errors import KvtrailError
from kvtrail.forensics.analysis import (
    check_exclusions,
    exposed_tenants,
    exposure_links,
    exposure_matrix,
    node_capacity,
    requests_table,
    threshold_analysis,
    threshold_sentence,
)
from kvtrail.forensics.options import ReportOptions
from kvtrail.forensics.questions import Window, affected_with_exclusions, coverage_gaps, exploitation_for, findings
from tests.forensics.incident_fixture import MIN, PREFILL_POOL_TOKENS, RESEARCHER_KEY, W0, W1, build

EXCL = an.Exclusions(
    tenants=(("internal-qa", "provider's own tests"),), api_key_ids=((RESEARCHER_KEY, "researcher's reproduction"),)
)


@pytest.fixture(scope="module")
def con(tmp_path_factory):
    path = tmp_path_factory.mktemp("analysis") / "incident.duckdb"
    build(path)
    c = duckdb.connect(str(path), read_only=True)
    yield c
    c.close()


def _cell(matrix, recipient, victim):
    row = matrix.filter((pl.col("recipient_tenant") == recipient) & (pl.col("victim_tenant") == victim))
    return tuple(row.select("responses", "pages", "victim_requests").row(0)) if len(row) else None


def test_exclusions_remove_recipients_and_name_the_reason(con):
    kept, dropped, excluded = affected_with_exclusions(con, Window(W0, W1), EXCL)
    assert len(kept) == 13 and set(kept["tenant_id"]) == {"globex", "mallory", "hooli"}
    assert len(dropped) == 7
    reasons = dict(zip(dropped["request_id"], dropped["reason"]))
    assert {r for k, r in reasons.items() if k.startswith("internal-qa")} == {"provider's own tests"}
    assert {r for k, r in reasons.items() if k.startswith("initech")} == {"researcher's reproduction"}
    assert set(dropped["excluded_by"]) == {"tenant internal-qa", f"api key {RESEARCHER_KEY}"}
    # the researcher's key is excluded, not the whole initech tenant: its production traffic stays in
    initech = excluded.filter(pl.col("tenant_id") == "initech")
    assert len(initech) == 5 and set(initech["excluded_by"]) == {f"api key {RESEARCHER_KEY}"}
    # without exclusions every account counts
    all_kept, none, _ = affected_with_exclusions(con, Window(W0, W1), an.Exclusions())
    assert (len(all_kept), len(none)) == (20, 0)


def test_exclusions_bad_input_and_round_trip(con):
    with pytest.raises(KvtrailError, match="exclusions: unknown tenant 'nobody'"):
        check_exclusions(con, an.Exclusions(tenants=(("nobody", "x"),)))
    merged = EXCL.merged(an.Exclusions(tenants=(("internal-qa", "other reason"), ("acme", "test"))))
    assert dict(merged.tenants) == {"internal-qa": "provider's own tests", "acme": "test"}
    assert an.Exclusions.from_dict(merged.to_dict()) == merged
    assert an.Exclusions().empty and not EXCL.empty


def test_exposure_matrix_cells_and_exposed_tenants(con):
    kept, _, _ = affected_with_exclusions(con, Window(W0, W1), EXCL)
    links = exposure_links(findings(con, Window(W0, W1)), set(kept["request_id"]))
    matrix = exposure_matrix(links)
    # each over-long read covers 13 reserved pages: 1 placeholder page of its own, 2 umbrella, 4 acme, 6 never written
    assert _cell(matrix, "globex", "acme") == (4, 16, 4)
    assert _cell(matrix, "globex", "umbrella") == (4, 8, 4)
    assert _cell(matrix, "mallory", "acme") == (6, 24, 1)  # the probes re-read the same victim request
    assert _cell(matrix, "mallory", an.NEVER_WRITTEN) == (6, 36, 0)
    assert _cell(matrix, "initech", "acme") is None and _cell(matrix, "internal-qa", "acme") is None
    exposed = exposed_tenants(links)
    assert exposed["victim_tenant"].to_list() == ["acme", "umbrella"]  # the pseudo-victim is not a tenant
    acme = exposed.row(0, named=True)
    assert (acme["recipient_tenants"], acme["responses"], acme["pages"], acme["victim_requests"]) == (
        "globex,hooli,mallory",
        13,
        52,
        8,
    )


def test_threshold_analysis_against_the_prefill_pool(con):
    capacity = node_capacity(con, W0, W1)
    prefill = capacity.filter(pl.col("role") == "prefill").row(0, named=True)
    assert (
        prefill["pool_tokens"],
        prefill["context_tokens"],
        prefill["pool_covers_context"],
        prefill["shortfall_tokens"],
    ) == (PREFILL_POOL_TOKENS, 512, False, 384)
    assert capacity.filter(pl.col("role") == "decode")["pool_covers_context"].to_list() == [True]
    kept, dropped, excluded = affected_with_exclusions(con, Window(W0, W1), EXCL)
    requests = requests_table(con, W0, W1, kept["request_id"].to_list())
    assert requests.filter(pl.col("request_id") == kept["request_id"][0])["prefill_node"].to_list() == ["prefill-0"]
    requests = requests.filter(~pl.col("request_id").is_in(excluded["request_id"].to_list()))
    by_node, s = threshold_analysis(requests, set(kept["request_id"]))
    assert (s["affected"], s["affected_over_pool"], s["unaffected_over_pool"], s["affected_pool_tokens"]) == (
        13,
        13,
        0,
        [PREFILL_POOL_TOKENS],
    )
    assert by_node.row(0, named=True)["max_unaffected_prompt_tokens"] < PREFILL_POOL_TOKENS
    text = threshold_sentence(s)
    assert text.startswith("Every affected prompt (13 of 13) was longer than the prefill pool of its node (128 tokens)")
    assert "0 of 21 unaffected prompts were longer" in text
    assert threshold_sentence({**s, "affected_over_pool": 12}).startswith("12 of 13 affected prompts were")


def test_exploitation_verdicts(con):
    df, long_tokens = exploitation_for(con, ReportOptions(W0, W1, EXCL))
    assert long_tokens == PREFILL_POOL_TOKENS
    v = {r["tenant_id"]: r for r in df.iter_rows(named=True)}
    assert v["globex"]["verdict"] == "consistent with normal long-context use"
    assert (v["globex"]["long_requests"], v["globex"]["baseline_long_requests"]) == (4, 4)
    assert v["mallory"]["verdict"] == "stands out" and "repeated probing" in v["mallory"]["reason"]
    assert v["mallory"]["max_long_in_burst"] == 6 and v["mallory"]["max_long_per_hour"] == 6
    assert v["hooli"]["verdict"] == "stands out" and "none among its 2 requests" in v["hooli"]["reason"]
    assert v["internal-qa"]["verdict"] == "excluded" and v["internal-qa"]["excluded_by"] == "tenant internal-qa"
    assert v["initech"]["verdict"] == "excluded" and "researcher" in v["initech"]["reason"]
    assert df["excluded_by"].is_null().to_list() == [True, True, True, False, False]  # excluded rows last
    # the researcher's burst would stand out if it were not excluded
    raw, _ = exploitation_for(con, ReportOptions(W0, W1))
    assert raw.filter(pl.col("tenant_id") == "initech")["verdict"].to_list() == ["stands out"]


def test_exploitation_rules_and_baseline_choice(con):
    lenient = an.ProbeRules(burst_count=10)
    df, _ = exploitation_for(con, ReportOptions(W0, W1, EXCL, rules=lenient))
    mallory = df.filter(pl.col("tenant_id") == "mallory").row(0, named=True)
    assert mallory["verdict"] == "consistent with normal long-context use"
    assert "no requests in the baseline period" in mallory["reason"]
    # a baseline period with no data at all: judged on timing only
    early = ReportOptions(W0, W1, EXCL, baseline_from_ns=W0 - 2000 * MIN, baseline_to_ns=W0 - 1900 * MIN)
    df, _ = exploitation_for(con, early)
    assert "no baseline data" in df.filter(pl.col("tenant_id") == "hooli")["reason"][0]
    # a higher over-long threshold: nothing is over-long, recipients are still listed
    df, _ = exploitation_for(con, ReportOptions(W0, W1, EXCL, long_prompt_tokens=10_000))
    assert df.filter(pl.col("excluded_by").is_null())["long_requests"].to_list() == [0, 0, 0]
    with pytest.raises(KvtrailError, match="field 'burst_count'"):
        an.ProbeRules(burst_count=0)


def test_max_within_a_span():
    from kvtrail.forensics.analysis.exploitation import _max_within

    assert _max_within([], 10) == 0
    assert _max_within([0, 5, 10, 11, 30], 10) == 3
    assert _max_within([0, 100, 200], 10) == 1


def test_sequence_gap_is_a_coverage_gap(tmp_path):
    path = tmp_path / "gap.duckdb"
    build(path, gap=True)
    with duckdb.connect(str(path), read_only=True) as c:
        gaps = coverage_gaps(c)
    assert gaps.select("node", "unexplained").rows() == [("router-0", 5)]
