"""POST /v1/events in-process: committed before the reply, refused whole, idempotent re-sends, limits."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvtrail.audit.batch import from_dicts, read_ipc, write_ipc
from kvtrail.audit.store import read_events
from kvtrail.audit.validate import producer_id
from kvtrail.errors import ValidationError
from kvtrail.service.committer import ConflictError
from kvtrail.service.ingest import batch_identity
from tests.conftest import alloc, config, producer
from tests.service.conftest import NDJSON, arrow_body, auth, jsonl_body, make_token


def _count(state, sql: str) -> int:
    cur = state.cursor()
    try:
        return cur.execute(sql).fetchone()[0]
    finally:
        cur.close()


def test_a_batch_is_committed_before_the_reply_with_its_number_and_digest(client, service_state, producer_token):
    r = client.post("/v1/events", content=arrow_body([config(0), alloc(1, [1, 2, 3])]), headers=auth(producer_token))
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["batch_no"], body["first_seq"], body["last_seq"]) == (0, 0, 1)
    assert (body["events"], body["page_events"], body["duplicate"]) == (2, 3, False)
    cur = service_state.cursor()
    stored = cur.execute("SELECT producer_id, digest FROM batches").fetchall()
    cur.close()
    assert stored == [(body["producer_id"], bytes.fromhex(body["digest"]))]
    r = client.post("/v1/events", content=jsonl_body([alloc(2, [4])]), headers=auth(producer_token, NDJSON))
    assert r.status_code == 200, r.text
    assert (r.json()["batch_no"], r.json()["first_seq"]) == (1, 2)
    assert _count(service_state, "SELECT count(*) FROM events") == 3


@pytest.mark.parametrize("content_type", ["arrow", NDJSON])
def test_an_invalid_event_refuses_the_whole_batch_naming_the_field(client, service_state, producer_token, content_type):
    events = [config(0), alloc(1, [1]), alloc(2, [999])]
    body = jsonl_body(events) if content_type == NDJSON else arrow_body(events)
    r = client.post(
        "/v1/events",
        content=body,
        headers=auth(producer_token, NDJSON) if content_type == NDJSON else auth(producer_token),
    )
    assert r.status_code == 422, r.text
    [err] = r.json()["errors"]
    assert (err["event"], err["kind"], err["field"]) == (2, "pages_allocated", "pages")
    assert "page id 999 out of pool" in err["reason"]
    assert _count(service_state, "SELECT count(*) FROM events") == 0
    assert _count(service_state, "SELECT count(*) FROM batches") == 0


def test_rules_that_need_nothing_of_the_store_refuse_a_batch_before_the_writer_sees_it(
    client, service_state, producer_token, monkeypatch
):
    submitted = []
    real = service_state.committer.submit
    monkeypatch.setattr(service_state.committer, "submit", lambda *a: submitted.append(a) or real(*a))
    bad = dict(alloc(1, [1]), purpose="no such purpose")
    r = client.post("/v1/events", content=arrow_body([config(0), bad]), headers=auth(producer_token))
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["field"] == "purpose" and submitted == []  # refused where it arrived
    r = client.post("/v1/events", content=arrow_body([config(0), alloc(1, [1])]), headers=auth(producer_token))
    assert r.status_code == 200, r.text
    r = client.post("/v1/events", content=arrow_body([alloc(2, [999])]), headers=auth(producer_token))
    assert r.status_code == 422, r.text  # beyond the pool the stored node_config states: checked by the writer
    [err] = r.json()["errors"]
    assert err["field"] == "pages" and "page id 999 out of pool" in err["reason"] and len(submitted) == 2


def test_unparseable_bodies_are_422_not_5xx(client, producer_token):
    r = client.post("/v1/events", content=b"{nope\n", headers=auth(producer_token, NDJSON))
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "(json)"
    r = client.post("/v1/events", content=b"not arrow", headers=auth(producer_token))
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "(arrow)"
    r = client.post("/v1/events", content=b"", headers=auth(producer_token, NDJSON))
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "(batch)"


def test_a_batch_is_one_producer_instances(client, service_state, producer_token):
    other = producer(instance="i2")
    r = client.post("/v1/events", content=arrow_body([config(0), config(1, prod=other)]), headers=auth(producer_token))
    assert r.status_code == 422
    [err] = r.json()["errors"]
    assert (err["event"], err["field"]) == (1, "instance")
    assert "'i2' here" in err["reason"] and err["kind"] == "node_config"
    # the first identity field, in the envelope's order, that differs at the first event of another producer
    third = producer(node="decode-7", instance="i3")
    body = arrow_body([config(0), alloc(1, [1]), alloc(2, [2], prod=third), config(3, prod=other)])
    r = client.post("/v1/events", content=body, headers=auth(producer_token))
    assert r.status_code == 422
    [err] = r.json()["errors"]
    assert (err["event"], err["kind"], err["field"]) == (2, "pages_allocated", "node")
    assert _count(service_state, "SELECT count(*) FROM events") == 0


def test_a_batch_with_no_events_is_422(client, producer_token):
    body = arrow_body([config(0)])
    empty = read_ipc(body).slice(0, 0)
    r = client.post("/v1/events", content=write_ipc(empty), headers=auth(producer_token))
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["field"] == "(batch)"


def test_a_resent_batch_is_acknowledged_once_and_stored_once(client, service_state, producer_token):
    body = arrow_body([config(0), alloc(1, [1, 2])])
    first = client.post("/v1/events", content=body, headers=auth(producer_token)).json()
    again = client.post("/v1/events", content=body, headers=auth(producer_token)).json()
    assert again == {**first, "duplicate": True}
    assert _count(service_state, "SELECT count(*) FROM events") == 2
    # a later batch still lands, and re-sending the first one is still a duplicate
    assert (
        client.post("/v1/events", content=arrow_body([alloc(2, [3])]), headers=auth(producer_token)).json()["batch_no"]
        == 1
    )
    assert client.post("/v1/events", content=body, headers=auth(producer_token)).json()["duplicate"] is True
    assert service_state.committer.duplicates == 2


def test_an_overlapping_range_that_is_no_stored_batch_is_a_conflict(client, service_state, producer_token):
    assert (
        client.post(
            "/v1/events", content=arrow_body([config(0), alloc(1, [1])]), headers=auth(producer_token)
        ).status_code
        == 200
    )
    r = client.post("/v1/events", content=arrow_body([alloc(1, [1]), alloc(2, [2])]), headers=auth(producer_token))
    assert r.status_code == 409 and "overlaps stored batch 0" in r.json()["detail"]
    assert _count(service_state, "SELECT count(*) FROM events") == 2


def test_a_sequence_gap_is_stored_as_the_store_stores_it(client, service_state, producer_token):
    assert client.post("/v1/events", content=arrow_body([config(0)]), headers=auth(producer_token)).status_code == 200
    r = client.post("/v1/events", content=arrow_body([alloc(5, [1])]), headers=auth(producer_token))
    assert r.status_code == 200
    cur = service_state.cursor()
    assert [e["seq"] for e in read_events(cur).to_pylist()] == [0, 5]
    cur.close()


def test_body_limit_is_413_with_or_without_a_declared_length(client, producer_token):
    big = b"x" * ((1 << 20) + 1)
    assert client.post("/v1/events", content=big, headers=auth(producer_token, NDJSON)).status_code == 413

    def chunks():  # no Content-Length: the limit is checked while the body is read
        for _ in range(64):
            yield b"y" * 32768

    r = client.post("/v1/events", content=chunks(), headers=auth(producer_token, NDJSON))
    assert r.status_code == 413, r.text


def test_other_content_types_are_415(client, producer_token):
    r = client.post("/v1/events", content=b"{}", headers=auth(producer_token, "application/json"))
    assert r.status_code == 415 and "application/x-ndjson" in r.json()["detail"]


def test_tokens_roles_and_nodes(client, service_state):
    body = arrow_body([config(0)])
    assert client.post("/v1/events", content=body, headers={"Content-Type": NDJSON}).status_code == 401
    assert client.post("/v1/events", content=body, headers=auth("kvt_000000000000_nope")).status_code == 401
    assert (
        client.post("/v1/events", content=body, headers=auth(make_token(service_state, "tenant:acme"))).status_code
        == 403
    )
    bound = make_token(service_state, "producer", nodes=("decode-9",))
    assert client.post("/v1/events", content=body, headers=auth(bound)).status_code == 403
    assert (
        client.post("/v1/events", content=body, headers=auth(make_token(service_state, "operator"))).status_code == 200
    )


def test_healthz_needs_no_token_and_openapi_describes_ingest(client):
    assert client.get("/healthz").json()["status"] == "ok"
    spec = client.get("/openapi.json").json()
    post = spec["paths"]["/v1/events"]["post"]
    assert set(post["requestBody"]["content"]) == {NDJSON, "application/vnd.apache.arrow.stream"}
    assert post["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/IngestReply")
    assert post["responses"]["422"]["content"]["application/json"]["schema"]["$ref"].endswith("/IngestErrors")
    assert {"409", "413", "415", "401", "403"} <= set(post["responses"])
    assert "/healthz" in spec["paths"]


def test_concurrent_producers_share_transactions_but_each_request_is_one_batch(service_state):
    producers = [producer(node=f"decode-{i}", role="decode") for i in range(6)]
    results: dict[int, list] = {i: [] for i in range(len(producers))}

    def send(i: int) -> None:
        prod = producers[i]
        for k in range(5):
            if k == 0:
                events = [config(0, prod=prod)]
            else:
                events = [alloc(2 * k - 1, [k], prod=prod), alloc(2 * k, [k + 1], prod=prod)]
            table = from_dicts(events)
            p, seq = batch_identity(table)
            results[i].append(service_state.committer.submit(table, producer_id(p), seq).result(30))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(producers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, commits in results.items():
        assert [c.batch_no for c in commits] == [0, 1, 2, 3, 4], i
        assert not any(c.duplicate for c in commits)
    assert _count(service_state, "SELECT count(*) FROM batches") == 30
    assert service_state.committer.transactions <= 30


def test_batches_queued_together_share_one_commit_and_a_bad_one_is_refused_alone(service_state):
    prods = [producer(node=f"decode-{i}", role="decode") for i in range(3)]
    tables = [from_dicts([config(0, prod=p), alloc(1, [1, 2], prod=p)]) for p in prods]
    tables[1] = from_dicts([config(0, prod=prods[1]), alloc(1, [999], prod=prods[1])])  # out of its pool
    committer = service_state.committer

    def submit(t):
        p, seq = batch_identity(t)
        return committer.submit(t, producer_id(p), seq)

    before = committer.transactions
    with service_state.write_lock:  # the writer takes a first batch and waits for the lock with it
        first = submit(from_dicts([config(0, prod=producer(node="decode-9", role="decode"))]))
        deadline = time.monotonic() + 30
        while not committer._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        futures = [submit(t) for t in tables]  # queued meanwhile: taken together once the lock is free
    first.result(30)
    good = [futures[0].result(30), futures[2].result(30)]
    with pytest.raises(ValidationError, match="999 out of pool"):
        futures[1].result(30)
    assert [c.batch_no for c in good] == [0, 0] and not any(c.duplicate for c in good)
    assert committer.transactions - before == 2  # the first batch's commit, then the two good ones'
    cur = service_state.cursor()
    try:
        stored = cur.execute("SELECT producer_id, digest FROM batches ORDER BY producer_id").fetchall()
    finally:
        cur.close()
    mine = {c.producer_id for c in good}
    assert sorted((c.producer_id, bytes.fromhex(c.digest)) for c in good) == [r for r in stored if r[0] in mine]
    assert len(stored) == 3  # the first batch and the two good ones: nothing of the bad one


def test_committer_conflict_names_the_stored_batch(service_state):
    t = from_dicts([config(0), alloc(1, [1]), alloc(2, [2])])
    p, seq = batch_identity(t)
    service_state.committer.submit(t, producer_id(p), seq).result(30)
    part = t.slice(1, 2)
    with pytest.raises(ConflictError, match="batch 0"):
        service_state.committer.submit(part, producer_id(p), np.asarray(seq[1:])).result(30)


@pytest.mark.parametrize("pool_pages", [2**25, 2**63 - 1])
def test_an_implausible_pool_is_refused_whole_naming_pool_pages(client, service_state, pool_pages):
    # the probe's 336-byte event, sent with a producer token bound to its own node
    token = make_token(service_state, "producer", nodes=(producer()["node"],))
    events = [dict(config(0), pool_pages=pool_pages), alloc(1, [1])]
    for body, ctype in ((arrow_body(events), "arrow"), (jsonl_body(events), NDJSON)):
        r = client.post("/v1/events", content=body, headers=auth(token) if ctype == "arrow" else auth(token, NDJSON))
        assert r.status_code == 422, r.text
        [err] = r.json()["errors"]
        assert (err["event"], err["kind"], err["field"]) == (0, "node_config", "pool_pages")
    assert _count(service_state, "SELECT count(*) FROM batches") == 0
    r = client.post("/v1/events", content=arrow_body([config(0, pool_pages=2**25)]), headers=auth(token))
    assert r.status_code == 200, r.text  # 2^25 pages of 16 tokens, stated consistently, is a plausible pool
