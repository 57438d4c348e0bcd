"""Small simulated fleets whose 30 s of traffic straddle an hour boundary, and lakes exported from them."""

from __future__ import annotations

import dataclasses
import shutil

import duckdb
import pytest

from kvtrail.audit.lake.export import export_lake
from kvtrail.audit.lake.partition import HOUR_NS
from kvtrail.audit.store import AuditStore
from kvtrail.forensics.lake.checkpointer import write_checkpoints
from kvtrail.sim.fleet import FleetConfig, write_fleet
from kvtrail.sim.fleet.config import DEFAULT_START_NS

BOUNDARY_NS = DEFAULT_START_NS + HOUR_NS
# tests/sim's small fleet (pools that churn within seconds, every fault armed often) without cache
# namespaces, so cross-tenant prefix hits (F10) are planted too; it starts 14 s before an hour boundary.
FLEET = FleetConfig(
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
    seed=1,
    cache_namespaces=False,
    public_doc_prob=0.3,
    start_ns=BOUNDARY_NS - 14_000_000_000,
)


def make_store(path, cfg: FleetConfig = FLEET) -> str:
    db = str(path)
    with AuditStore(db) as store:
        write_fleet(cfg, store, f"{db}.truth.json")
    return db


@pytest.fixture(scope="session")
def fleet_db(tmp_path_factory) -> str:
    return make_store(tmp_path_factory.mktemp("fleet") / "fleet.duckdb")


@pytest.fixture(scope="session")
def fleet_lake(tmp_path_factory, fleet_db) -> str:
    lake = str(tmp_path_factory.mktemp("lake") / "lake")
    export_lake(fleet_db, lake, checkpoints=write_checkpoints)
    return lake


@pytest.fixture
def lake_copy(tmp_path, fleet_lake) -> str:
    """A copy of the session's lake, for tests that damage it."""
    dst = str(tmp_path / "lake")
    shutil.copytree(fleet_lake, dst)
    return dst


@pytest.fixture(scope="session")
def fleet_con(fleet_db):
    con = duckdb.connect(fleet_db, read_only=True)
    yield con
    con.close()


def second_cluster(cfg: FleetConfig = FLEET) -> FleetConfig:
    return dataclasses.replace(cfg, cluster="fleet-west", seed=5, prefill_nodes=1, decode_nodes=1)
