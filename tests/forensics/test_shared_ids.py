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


# ---- bootstrap rooms: one transfer id, prefill's request id and decode's -------------------------------------

ROOM = 7


def _room(tl, pre: str, dec: str, tid: int | None, *, sent_tokens: int = 32, sent_digest: int = 5) -> None:
    """One SGLang PD request: prefill records it as ``pre``, decode as ``dec``, both with transfer id ``tid`` (the
    bootstrap room). Decode reserves and receives 32 tokens with digest 5; prefill sends ``sent_tokens``."""
    tl.add("p", "request_received", pre, tid, prompt_tokens=32)
    tl.add("d", "request_received", dec, tid, prompt_tokens=32)
    if tid is None:  # a health check: no room, nothing transferred
        return
    tl.add("d", "transfer_reserved", dec, tid, pages=[5, 6], num_tokens=32)
    tl.alloc("d", dec, [5, 6], "decode_reservation")
    tl.alloc("p", pre, [1, 2])
    tl.write("p", pre, [1, 2])
    tl.add(
        "p",
        "transfer_sent",
        pre,
        tid,
        pages=[1, 2],
        dst_pages=[5, 6],
        num_tokens=sent_tokens,
        is_last_chunk=True,
        digest=sent_digest,
        digest_algo="adler32",
    )
    tl.free("p", pre, [1, 2])
    tl.write("d", dec, [5, 6], source="transfer_in")
    tl.add(
        "d", "transfer_received", dec, tid, pages=[5, 6], num_tokens=32, status="ok", digest=5, digest_algo="adler32"
    )
    tl.read("d", dec, [5, 6])
    tl.add("d", "response_sent", dec, tid, http_status=200, prompt_tokens=32, completion_tokens=4, latency_ns=5)


def _pd(**names) -> Timeline:
    tl = Timeline()
    tl.node("p", "prefill")
    tl.node("d", "decode")
    for rid, shown in names.items():
        tl.id_of[rid] = shown
        tl.tenant_of[rid] = "acme"
    return tl


def _judged(tl: Timeline, tmp_path) -> tuple[list[fx.Finding], fx.Answer]:
    """Every engine's findings of the history (asserted equal: replay, its fast path, SQL, both on a lake)
    and the findings answer (its warnings)."""
    db = str(tmp_path / "room.duckdb")
    with AuditStore(db) as store:
        store.append(from_dicts(tl.events))
    found = _engines(db)
    assert found["replay"] == found["replay fast"] == found["sql"]
    lake = str(tmp_path / "lake")
    export_lake(db, lake, checkpoints=write_checkpoints)
    with open_lake(lake) as lk:
        assert lake_findings(lk, fx.Window()) == found["sql"]
        assert sql_lake_findings(lk, None, None, ForensicsPolicy(), None) == found["sql"]
    return found["sql"], fx.ask_findings(db)


def test_a_bootstrap_rooms_prefill_and_decode_ids_are_one_transfer(tmp_path):
    tl = _pd(pre="prefill-rid-1", dec="decode-rid-1")
    _room(tl, "pre", "dec", ROOM, sent_tokens=16, sent_digest=9)  # prefill sent half, with another digest
    found, answer = _judged(tl, tmp_path)
    assert sorted(f.code for f in found) == ["F2", "F3"]  # decode's receipt alone agrees with its reservation
    for f in found:  # named by decode's id (whose response the client got), prefill's kept
        assert (f.request_id, f.tenant_id) == ("decode-rid-1", "acme")
        assert f.detail.endswith("; prefill's request id: prefill-rid-1")
    assert "sent 16 tokens/2 pages" in next(f.detail for f in found if f.code == "F2")
    assert "prefill digest 0x9 != decode digest 0x5" in next(f.detail for f in found if f.code == "F3")
    assert answer.warnings == ()  # one request per side: no collision


def test_a_clean_room_and_health_checks_without_a_room_say_nothing(tmp_path):
    tl = _pd(pre="prefill-rid-1", dec="decode-rid-1", hp="health-p", hd="health-d")
    _room(tl, "pre", "dec", ROOM)
    _room(tl, "hp", "hd", None)  # never joined: no transfer id
    found, answer = _judged(tl, tmp_path)
    assert found == [] and answer.warnings == ()


def test_two_senders_of_one_room_are_a_collision_joined_with_nobody(tmp_path):
    tl = _pd(pre="prefill-rid-1", dec="decode-rid-1", pre2="prefill-rid-2")
    _room(tl, "pre", "dec", ROOM, sent_tokens=16, sent_digest=9)
    tl.add("p", "transfer_sent", "pre2", ROOM, pages=[3], dst_pages=[5], num_tokens=16, is_last_chunk=True)
    found, answer = _judged(tl, tmp_path)
    assert found == []  # decode's reservation and receipt agree; no send is decode's
    (warning,) = answer.warnings
    assert "1 transfer id(s) carried by more than one request" in warning
    assert f"{ROOM}: decode-rid-1, prefill-rid-1, prefill-rid-2" in warning


def test_a_rooms_prefill_abort_and_decodes_served_response_are_one_requests_f4(tmp_path):
    """The incident through a router: prefill rejects the over-long prompt into a placeholder and still sends it
    (0.5.19), decode serves the response under its own id. Both ids are one request: F4, named by decode's id."""
    tl = _pd(pre="prefill-rid-1", dec="decode-rid-1", other="prefill-rid-2")
    tl.add("p", "request_aborted", "pre", ROOM, stage="prefill", abort_reason="input too long", http_status=400)
    _room(tl, "pre", "dec", ROOM)
    tl.add("p", "request_aborted", "other", ROOM + 1, stage="prefill", abort_reason="input too long", http_status=400)
    found, answer = _judged(tl, tmp_path)
    f4 = [f for f in found if f.code == "F4"]
    assert [(f.request_id, f.tenant_id) for f in f4] == [("decode-rid-1", "acme")]  # not the unpaired abort
    assert "after abort: prefill: input too long (400)" in f4[0].detail
    assert answer.warnings == ()


def test_two_tenants_affected_requests_sharing_an_id_are_two_responses_each_with_its_own(store_db):
    """The affected-responses answer keys a request by (id, tenant): if acme's ``dup-7`` had read foreign
    pages too, it is its own row with acme's response (its own prompt), never merged into mallory's row."""
    from dataclasses import replace

    from kvtrail.forensics.questions import affected_responses

    with AuditStore(store_db) as store:
        found = replay_store(store.con, fast=False)
        f1 = next(f for f in found if f.code == "F1" and f.request_id == DUP)
        as_acme = replace(f1, tenant_id="acme", victim_tenant_ids=("mallory",), victim_request_ids=(DUP,))
        for pair in ([f1, as_acme], [as_acme, f1]):  # whichever the findings name first
            rows = affected_responses(store.con, found=pair).to_dicts()
            by_tenant = {r["tenant_id"]: r for r in rows}
            assert len(rows) == 2 and set(by_tenant) == {"acme", "mallory"}
            assert by_tenant["acme"]["prompt_tokens"] == SHORT_ACME
            assert by_tenant["mallory"]["prompt_tokens"] == LONG
            assert by_tenant["acme"]["victim_tenants"] == ["mallory"]
            assert by_tenant["mallory"]["victim_tenants"] == ["acme"]
