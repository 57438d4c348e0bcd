"""The fleet trace simulator: determinism, valid batches, and fidelity of its ground truth to the replay engine."""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict

import duckdb
import pytest

from kvtrail.audit.store import AuditStore
from kvtrail.audit.verify import verify_store
from kvtrail.cli import main
from kvtrail.forensics.replay.engine import replay_store
from kvtrail.sim.fleet import ClusterHistory, FleetConfig, cluster_history, fleet_batches, holds_run, write_fleet
from kvtrail.sim.synth import runs_per_event
from tests.sim.digests import table_digest

# A small fleet that churns its pools within seconds: ~280 requests over 29 simulated seconds, prompts
# around 1k tokens with a tail past the 16k-token prefill pool, every fault armed often. Prefill nodes
# run at 30-60 % load: the engine measures their rates (F9) from requests that did not queue long.
SMALL = FleetConfig(
    hours=0.008,
    rate_per_s=10,
    prefill_nodes=2,
    decode_nodes=2,
    tenants=6,
    chunk_tokens=4096,
    prefill_pool_tokens=16_384,
    decode_pool_tokens=69_632,
    context_tokens=65_536,
    prefill_rate_min_tokens_per_s=40_000,
    prompt_median_tokens=1024,
    prompt_sigma=1.5,
    completion_median_tokens=48,
    max_new_tokens=1024,
    doc_median_tokens=512,
    plants_per_hour=1500,
)
AFFECTING = {"F1", "F5"}
POLICY_CODES = ("F9", "F10")  # findings that depend on engine policy; checked where the engine emits them


class Run:
    """One simulation written to a store, its ground truth and the replay engine's findings."""

    def __init__(self, path, cfg: FleetConfig):
        self.cfg = cfg
        self.db = str(path / "fleet.duckdb")
        with AuditStore(self.db) as store:
            self.summary = write_fleet(cfg, store, path / "truth.json")
        self.truth = json.loads((path / "truth.json").read_text())
        self.con = duckdb.connect(self.db, read_only=True)
        self.findings = replay_store(self.con)
        self.codes: defaultdict[str | None, set[str]] = defaultdict(set)
        self.f1_victims: defaultdict[str | None, set[str | None]] = defaultdict(set)
        for f in self.findings:
            self.codes[f.request_id].add(f.code)
            if f.code == "F1":
                self.f1_victims[f.request_id] |= set(f.victim_request_ids)

    def expected(self) -> dict[str, set[str]]:
        out: defaultdict[str, set[str]] = defaultdict(set)
        for p in self.truth["plants"]:
            for rid, codes in p["expected_codes"].items():
                out[rid] |= set(codes)
        return out


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    run = Run(tmp_path_factory.mktemp("planted"), dataclasses.replace(SMALL, seed=1))
    yield run
    run.con.close()


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    run = Run(tmp_path_factory.mktemp("clean"), dataclasses.replace(SMALL, seed=2, bugs=()))
    yield run
    run.con.close()


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    cfg = dataclasses.replace(SMALL, seed=3, bugs=(), cache_namespaces=False, public_doc_prob=0.3)
    run = Run(tmp_path_factory.mktemp("shared"), cfg)
    yield run
    run.con.close()


def test_same_seed_gives_identical_batches_and_another_seed_does_not():
    tiny = dataclasses.replace(SMALL, hours=0.001)
    first, again = list(fleet_batches(tiny)), list(fleet_batches(tiny))
    assert len(first) == len(again) and all(a.equals(b) for a, b in zip(first, again, strict=True))
    other = list(fleet_batches(dataclasses.replace(tiny, seed=9)))
    assert len(other) != len(first) or not all(a.equals(b) for a, b in zip(first, other, strict=True))


def test_a_seeded_fleet_is_unchanged():
    """Digests (tests/sim/digests.py) of every batch of a tiny seeded fleet, computed before fleet_batches moved
    to kvtrail.sim.fleet.run and hard-coded: moving code must not change a single simulated event."""
    truth: dict = {}
    tables = list(fleet_batches(dataclasses.replace(SMALL, seed=1, hours=0.001), truth))
    assert [table_digest(t) for t in tables] == [
        "e366f4aa12319aa8",
        "a8cf139d0ab960ce",
        "ec9e03603b262bdf",
        "60026c515bd3aba3",
        "7dd7e534d5274bc9",
    ]
    assert truth["summary"]["plants"] == {"double_alloc": 1, "late_write": 1}


def test_cluster_history_and_runs_in_a_store(tmp_path):
    cfg = dataclasses.replace(SMALL, seed=6, hours=0.0005, bugs=())
    with AuditStore(str(tmp_path / "h.duckdb")) as store:
        assert cluster_history(store, cfg.cluster) == ClusterHistory(producers=0, last_wall_ns=None)
        assert not holds_run(store, cfg)
        summary = write_fleet(cfg, store)
        history = cluster_history(store, cfg.cluster)
        assert history.producers == summary.producers and history.last_wall_ns == summary.to_ns
        assert holds_run(store, cfg) and not holds_run(store, dataclasses.replace(cfg, seed=7))
        assert cluster_history(store, "other").producers == 0
    assert ClusterHistory(3, 5_200_000_001).next_start_ns == 6_000_000_000
    assert ClusterHistory(3, 5_000_000_000).next_start_ns == 6_000_000_000
    assert ClusterHistory(0, None).next_start_ns is None


def test_batches_pass_the_store_and_the_chain_verifies(planted):
    assert verify_store(planted.con).ok
    s = planted.truth["summary"]
    stored = planted.con.execute("SELECT count(*), sum(num_pages) FROM events").fetchone()
    assert (
        (stored[0], stored[1])
        == (s["events"], s["page_events"])
        == (planted.summary.events, planted.summary.page_events)
    )
    assert s["producers"] == 1 + SMALL.prefill_nodes + SMALL.decode_nodes
    # every page-holding producer starts with node_config; clocks strictly increase per producer
    first = planted.con.execute("SELECT role, kind FROM events_v WHERE seq = 0").fetchall()
    assert sorted(k for r, k in first if r != "router") == ["node_config"] * (SMALL.prefill_nodes + SMALL.decode_nodes)
    backwards = planted.con.execute(
        "SELECT count(*) FROM (SELECT wall_ns - lag(wall_ns) OVER (PARTITION BY producer_id ORDER BY seq) AS d "
        "FROM events) WHERE d <= 0"
    ).fetchone()[0]
    assert backwards == 0


def test_ground_truth_lists_the_run(planted):
    t = planted.truth
    assert t["seed"] == 1 and t["config"]["prefill_pool_tokens"] == SMALL.prefill_pool_tokens
    assert t["window"]["from"] == "2026-09-01T00:00:00.000000Z" and t["window"]["to_ns"] > t["window"]["from_ns"]
    assert {p["class"] for p in t["plants"]} == {"placeholder", "use_after_free", "late_write", "double_alloc"}
    assert t["unplanned_foreign_reads"] == []
    misconfigured = [n["node"] for n in t["nodes"] if n["expected_codes"] == ["F8"]]
    assert misconfigured == ["prefill-0", "prefill-1"]  # 16k-token pools under a 64k context
    for p in t["plants"]:
        assert p["request_id"] in p["expected_codes"] or p["class"] == "late_write"
        assert len(p["victim_request_ids"]) == len(p["victim_tenant_ids"]) and p["pages"]


def test_every_plant_produces_its_findings(planted):
    for p in planted.truth["plants"]:
        for rid, codes in p["expected_codes"].items():
            wanted = set(codes) - set(POLICY_CODES)
            assert wanted <= planted.codes[rid], (p["class"], rid, codes, planted.codes[rid])


def test_affected_requests_and_foreign_read_victims_match_the_tracker(planted):
    found = {f.request_id for f in planted.findings if f.code in AFFECTING}
    assert found == set(planted.truth["affected_request_ids"])
    recipients = {p["request_id"]: p for p in planted.truth["plants"] if p["request_id"]}
    f1 = {rid for rid, codes in planted.expected().items() if "F1" in codes}
    assert f1 == {rid for rid, codes in planted.codes.items() if "F1" in codes}
    for rid in f1:
        assert planted.f1_victims[rid] == set(recipients[rid]["victim_request_ids"]), rid
    # nothing beyond what was planted (F8 aside, which is per node)
    expected = planted.expected()
    extra = [
        (f.code, f.request_id)
        for f in planted.findings
        if f.code != "F8" and f.code not in expected.get(f.request_id, ())
    ]
    assert extra == []


def test_the_incident_shape_of_a_placeholder_plant(planted):
    plants = [p for p in planted.truth["plants"] if p["class"] == "placeholder"]
    assert plants
    for p in plants:
        rid = p["request_id"]
        assert {"F1", "F2"} <= set(p["expected_codes"][rid]) and p["source_node"] == "prefill-0"
        assert p["detail"]["prompt_tokens"] > p["detail"]["pool_tokens"]
        status, prompt = planted.con.execute(
            "SELECT http_status, prompt_tokens FROM events_v WHERE request_id = ? AND kind = 'response_sent'", [rid]
        ).fetchone()
        assert (status, prompt) == (p["detail"]["http_status"], p["detail"]["prompt_tokens"])
        # served (not a client that disconnected first): rejected yet HTTP 200 (F4)
        assert ("F4" in p["expected_codes"][rid]) == (status == 200)
    assert any(p["detail"]["http_status"] == 200 for p in plants)


@pytest.mark.parametrize("code", POLICY_CODES)
def test_policy_findings_where_the_engine_emits_them(planted, shared_cache, code):
    run = planted if code == "F9" else shared_cache
    wanted = {rid for rid, codes in run.expected().items() if code in codes}
    assert wanted, f"the fixture plants no {code}"
    got = {f.request_id for f in run.findings if f.code == code}
    if not got:
        pytest.skip(f"the replay engine emitted no {code} at all (not implemented yet?)")
    assert got == wanted


def test_no_bugs_means_no_findings_but_capacity(clean):
    assert clean.truth["plants"] == [] and clean.truth["affected_request_ids"] == []
    assert {(f.code, f.node) for f in clean.findings} == {("F8", "prefill-0"), ("F8", "prefill-1")}
    assert clean.summary.responses.get("400", 0) > 0  # over-long prompts rejected properly: no finding


def test_legitimate_prefix_sharing_reads_no_foreign_data(clean, shared_cache):
    for run in (clean, shared_cache):
        hits, reads = run.con.execute(
            "SELECT count(*) FILTER (kind = 'pages_allocated' AND purpose = 'prefix_hit'), "
            "count(*) FILTER (kind = 'kv_read' AND role = 'prefill') FROM events_v"
        ).fetchone()
        assert hits > 20 and reads == hits
        assert not [f for f in run.findings if f.code in AFFECTING]
    # without namespaces the hits cross tenants: each is a planted cross_tenant_prefix, never an F1
    crossing = [p for p in shared_cache.truth["plants"] if p["class"] == "cross_tenant_prefix"]
    assert crossing and all(p["victim_tenant_ids"][0] != p["tenant_id"] for p in crossing)


def test_pools_fragment_as_they_churn():
    tables = list(fleet_batches(dataclasses.replace(SMALL, seed=4, bugs=())))
    reservations = runs_per_event(tables, kind="pages_allocated", purpose="decode_reservation")
    assert reservations.lists > 100 and reservations.mean_runs > 2.0
    assert runs_per_event(tables, kind="transfer_sent").mean_runs > 1.2


def test_target_page_events_stops_generation():
    cfg = dataclasses.replace(SMALL, bugs=(), hours=1000.0, target_page_events=300_000)
    truth: dict = {}
    total = sum(t.num_rows for t in fleet_batches(cfg, truth))
    assert total == truth["summary"]["events"]
    assert 300_000 <= truth["summary"]["page_events"] < 900_000  # in-flight requests finish after the target


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="^rate_per_s: "):
        FleetConfig(rate_per_s=0)
    with pytest.raises(ValueError, match="^bugs: .*cache_namespaces=False"):
        FleetConfig(bugs=("cross_tenant_prefix",))
    with pytest.raises(ValueError, match="^decode_pool_tokens: "):
        FleetConfig(decode_pool_tokens=1_000_000)


def test_cli_simulates_refuses_a_second_run_and_rejects_bad_flags(tmp_path, capsys):
    db = str(tmp_path / "sim.duckdb")
    argv = [
        "simulate",
        "--db",
        db,
        "--seed",
        "5",
        "--nodes",
        "2",
        "--hours",
        "0.001",
        "--rate",
        "20",
        "--prefill-pool-tokens",
        "16384",
        "--decode-pool-tokens",
        "69632",
        "--context-tokens",
        "65536",
        "--max-new-tokens",
        "1024",
        "--bugs",
        "placeholder,late_write,cross_tenant_prefix",
        "--plants-per-hour",
        "3000",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "producers 5" in out and f"ground truth: {db}.truth.json" in out
    truth = json.loads((tmp_path / "sim.duckdb.truth.json").read_text())
    assert truth["config"]["cache_namespaces"] is False and truth["config"]["bugs"] == ["placeholder", "late_write"]
    assert main(argv) == 2
    assert "already holds cluster 'fleet-sim'" in capsys.readouterr().err
    assert main(argv + ["--append", "--truth", str(tmp_path / "second.json")]) == 0
    capsys.readouterr()
    for bad, needle in (
        (["--rate", "-1"], "--rate"),
        (["--bugs", "nope"], "--bugs"),
        (["--decode-pool-tokens", "1000"], "--decode-pool-tokens"),
        (["--start", "soon"], "--start"),
    ):
        assert main(["simulate", "--db", str(tmp_path / "bad.duckdb"), *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert needle in err[-1]
    assert not (tmp_path / "bad.duckdb").exists()
