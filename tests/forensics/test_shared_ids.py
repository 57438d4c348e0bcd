"""A request is (its id, its tenant), never the id text alone: two tenants' requests that share an id (clients
choose SGLang's ``rid``) are two requests in every engine - the replay (both paths), the SQL engine and both
on a lake exported from the store."""

from __future__ import annotations

import pytest

from kvtrail import forensics as fx
from kvtrail.audit.batch import from_dicts
from kvtrail.audit.lake.export import export_lake
from kvtrail.audit.store import AuditStore
from kvtrail.forensics.lake.checkpointer import write_checkpoints
from kvtrail.forensics.lake.questions import lake_findings, open_lake
from kvtrail.forensics.lake.sqltask import sql_lake_findings
from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.forensics.replay.engine import ReplayEngine, replay_store
from kvtrail.forensics.sql.engine import sql_findings
from tests.forensics.incident_fixture import LONG, SHORT, SHORT_ACME, Incident
from tests.forensics.test_replay import Timeline

DUP = "dup-7"


def _shared_incident() -> list[dict]:
    """The incident's requests of acme and mallory both named ``dup-7``; mallory's reads acme's pages."""
    inc = Incident()
    rids = [inc.request(10, "acme", SHORT_ACME), inc.request(11, "umbrella", SHORT), inc.request(13, "mallory", LONG)]
    for rid in rids[0], rids[2]:
        next(e["request"] for e in inc.events if e.get("request", {}).get("request_id") == rid)["request_id"] = DUP
    return inc.events


@pytest.fixture(scope="module")
def store_db(tmp_path_factory) -> str:
    db = str(tmp_path_factory.mktemp("shared") / "shared.duckdb")
    with AuditStore(db) as store:
        store.append(from_dicts(_shared_incident()))
    return db


def _engines(db: str) -> dict[str, list[fx.Finding]]:
    with AuditStore(db) as store:
        return {
            "replay": replay_store(store.con, fast=False),
            "replay fast": replay_store(store.con, fast=True),
            "sql": sql_findings(store.con),
        }


def test_the_read_of_acmes_pages_by_mallorys_dup_7_is_an_f1_with_acmes_request_as_victim(store_db):
    found = _engines(store_db)
    assert found["replay"] == found["replay fast"] == found["sql"]
    f1 = [f for f in found["replay"] if f.code == "F1" and f.request_id == DUP]
    assert f1 and {f.tenant_id for f in f1} == {"mallory"}  # acme's dup-7 read only its own pages
    victims = {v for f in f1 for v in zip(f.victim_request_ids, f.victim_tenant_ids)}
    assert (DUP, "acme") in victims and (DUP, "mallory") not in victims
    for f in found["replay"]:  # every finding of a dup-7 names the tenant of the request it is about
        for rid, tenant in zip(f.victim_request_ids, f.victim_tenant_ids):
            assert rid != DUP or tenant in ("acme", "mallory")
        assert f.request_id != DUP or f.tenant_id in ("acme", "mallory")


def test_a_lake_of_the_store_finds_the_same(store_db, tmp_path):
    lake = str(tmp_path / "lake")
    export_lake(store_db, lake, checkpoints=write_checkpoints)
    want = _engines(store_db)["sql"]
    with open_lake(lake) as lk:
        assert lake_findings(lk, fx.Window()) == want
        assert sql_lake_findings(lk, None, None, ForensicsPolicy(), None) == want


def test_events_naming_no_tenant_belong_to_the_first_tenant_named_for_the_id():
    """A page event of the id naming no tenant belongs to the request of the first tenant named for its id,
    before or after it (in another batch too); the other tenant's request of that id is apart."""
    tl = Timeline()
    tl.node("d")
    tl.tenant_of.update(a1="acme", m1="mallory")
    tl.id_of.update(a1="x", m1="x")
    tl.alloc("d", "a1", [1, 2])
    tl.events[-1]["request"].pop("tenant_id")  # acme's allocation names no tenant: acme is named later
    tl.write("d", "a1", [1, 2])
    tl.free("d", "a1", [1, 2])
    tl.alloc("d", "m1", [1, 2])
    tl.read("d", "m1", [1, 2])  # mallory's x reads acme's x's pages
    for split in (None, 1, 2, 3, 4):
        tables = (
            [from_dicts(tl.events)] if split is None else [from_dicts(tl.events[:split]), from_dicts(tl.events[split:])]
        )
        for fast in (False, True):
            engine = ReplayEngine(fast=fast)
            for t in tables:
                engine.feed(t)
            # acme's allocation was acme's (its write is no late write, F7), mallory's read is foreign
            got = [
                (f.code, f.request_id, f.tenant_id, f.victim_request_ids, f.victim_tenant_ids)
                for f in engine.findings()
            ]
            assert got == [("F1", "x", "mallory", ("x",), ("acme",))], (split, fast)
