"""The HTTP (tokenizer) process: the status each client got, from SGLang's real _handle_abort_finish_reason, and
which process records the response (once)."""

from __future__ import annotations

import pytest

from tests.conftest import stored_events
from tests.sglang.pd import respond, streamer, tokenizer
from tests.sglang.world import Node, req


def _finished(rid, reason, output_tokens=0):
    r = req(rid, list(range(10)), 40 + len(rid))
    r.finished_reason = reason
    r.output_ids.extend(range(output_tokens))
    return r


def test_the_recorded_status_is_the_one_the_client_gets(plugin, tmp_path):
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH

    from kvtrail.forensics import ask_findings, open_store
    from tests.sglang.conftest import SharedStore

    db = tmp_path / "audit.duckdb"
    store = SharedStore(db)
    tm = tokenizer("decode")
    sched = plugin.start(Node("decode").scheduler, sink=store)
    s = plugin.start_frontend(tm, sink=store)
    try:
        assert s is not None and s.role == "decode" and not sched.records_responses
        assert respond(tm, _finished("ok", FINISH_LENGTH(3), 3), first_token_s=0.125) == 200
        assert respond(tm, _finished("bad", FINISH_ABORT("Input too long", 400, "BadRequestError"))) == 400
        assert respond(tm, _finished("busy", FINISH_ABORT("timeout", 503, "ServiceUnavailable"))) == 503
        assert respond(tm, _finished("bare", FINISH_ABORT()), stream=False) == 200  # no status: HTTP 200
        # decode's scheduler rejects a request after it streamed 2 tokens; the client streams, so SGLang
        # answers 200 and sends the error as an SSE event after those tokens
        sse = _finished("sse", None, 2)
        sse.set_finish_with_abort("Input too long")
        sse.finished_reason = sse.to_finish
        streamer().stream_output([sse], False)  # the scheduler's outcome: not recorded (the HTTP process does)
        assert respond(tm, sse, stream=True) == 200
    finally:
        plugin.session = plugin.frontend = None
        s.close()
        sched.close()
        store.store.close()
    events = stored_events(db)
    got = {e["request"]["request_id"]: e for e in events if e["kind"] == "response_sent"}
    assert len([e for e in events if e["kind"] == "response_sent"]) == 5
    assert {k: v["http_status"] for k, v in got.items()} == {
        "ok": 200,
        "bad": 400,
        "busy": 503,
        "sse": 200,
        "bare": 200,
    }
    assert got["ok"]["ttft_ns"] == 125_000_000 and got["ok"]["completion_tokens"] == 3
    assert got["ok"]["prompt_tokens"] == 10 and got["ok"]["finish_reason"] == "length"
    assert got["sse"]["finish_reason"] == "abort" and got["sse"]["completion_tokens"] == 2
    assert got["bad"]["request"]["transfer_id"] == 43
    con = open_store(db)
    try:
        found = ask_findings(con).found
    finally:
        con.close()
    # the streamed abort reached the client as a 200 with output: rejected but served
    assert {(f.code, f.request_id) for f in found if f.code == "F4"} == {("F4", "sse")}


def test_a_prefill_servers_http_process_records_no_responses(plugin):
    assert plugin.start_frontend(tokenizer("prefill"), sink="http://audit:8080") is None and plugin.frontend is None


def test_with_a_store_file_the_scheduler_records_the_responses(plugin, tmp_path):
    db = str(tmp_path / "node.duckdb")  # KVTRAIL_DB: DuckDB has one writer, the scheduler
    assert plugin.start_frontend(tokenizer("decode"), sink=db) is None
    s = plugin.start(Node("decode").scheduler, sink=db)
    plugin.session = None
    try:
        assert s.records_responses
    finally:
        s.close()


def test_without_a_python_tokenizer_the_scheduler_records_each_outcome_once(plugin, tmp_path, monkeypatch):
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    db = tmp_path / "audit.duckdb"
    monkeypatch.setenv("SGLANG_RUST_SERVER", "1")  # the Rust front end talks to the schedulers directly
    assert plugin.start_frontend(tokenizer("decode"), sink="unused") is None
    node = Node("decode")
    s = plugin.start(node.scheduler, sink=str(db))
    try:
        assert s.records_responses
        streamer().stream_output([_finished("rs", FINISH_ABORT("KV checksum mismatch", 500, "x"))], False)
    finally:
        plugin.session = None
        s.close()
    monkeypatch.delenv("SGLANG_RUST_SERVER")
    [resp] = [e for e in stored_events(db) if e["kind"] == "response_sent"]
    assert resp["http_status"] == 500 and resp["request"]["request_id"] == "rs"


def test_a_request_streamed_twice_by_the_overlap_schedule_is_one_response(plugin, tmp_path):
    """With the overlap schedule SGLang calls stream_output twice for a finished request (its delayed token) and
    skips the second by ``finished_output``, which the first call set: one response is recorded, not two."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    db = tmp_path / "audit.duckdb"
    s = plugin.start(Node("unified").scheduler, sink=str(db))  # a store file: the scheduler records responses
    try:
        r = _finished("twice", FINISH_LENGTH(2), 2)
        streamer().stream_output([r], False)
        r.finished_output = True  # what SGLang's stream of the finished request sets (the stand-in streams nothing)
        streamer().stream_output([r], False)
    finally:
        plugin.session = None
        s.close()
    assert [e["request"]["request_id"] for e in stored_events(db) if e["kind"] == "response_sent"] == ["twice"]


@pytest.mark.parametrize("grpc", ["grpc_mode", "smg_grpc_mode", "tokenizer_worker_num"])
def test_grpc_front_ends_and_extra_tokenizer_workers_leave_responses_to_the_scheduler(grpc):
    import types

    from kvtrail.serving.sglang.modes import responses_in_scheduler

    args = types.SimpleNamespace(grpc_mode=False, smg_grpc_mode=False, tokenizer_worker_num=1)
    assert not responses_in_scheduler(args)
    setattr(args, grpc, 2 if grpc == "tokenizer_worker_num" else True)
    assert responses_in_scheduler(args)


def test_where_the_http_hook_is_missing_the_scheduler_records_the_responses(plugin, tmp_path):
    from kvtrail.serving.sglang import targets
    from tests.sglang.conftest import SharedStore

    store = SharedStore(tmp_path / "audit.duckdb")
    plugin.missing = [targets.HTTP_OUTCOME]  # as check() finds it in a build where it was renamed
    try:
        s = plugin.start(Node("decode").scheduler, sink=store)
        plugin.session = None
        assert s.records_responses
        s.close()
    finally:
        plugin.missing = []
        store.store.close()


def _refusing_tokenizer(mode: str, context: int):
    """A TokenizerManager with what its real _validate_one_request reads, for a model of ``context`` tokens."""
    import types

    tm = tokenizer(mode)
    tm.context_len, tm.num_reserved_tokens, tm.allow_auto_truncate, tm.validate_total_tokens = context, 0, False, True
    tm.model_config = types.SimpleNamespace(joint_head_config=None, pointer_head=None)
    return tm


def _validate(tm, rid, n_tokens, tenant, room=None, host=None):
    """SGLang's own check of a tokenized request (the HTTP server answers 400 for its ValueError)."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    obj = GenerateReqInput(
        input_ids=list(range(n_tokens)),
        rid=rid,
        extra_key=tenant,
        sampling_params={"max_new_tokens": 4},
        bootstrap_room=room,
        bootstrap_host=host,
    )
    try:
        tm._validate_one_request(obj, list(obj.input_ids))
    except ValueError:
        return 400
    return 200


@pytest.mark.parametrize("mode", ["decode", "null", "prefill"])
def test_a_request_the_http_process_refuses_is_recorded_with_its_tenant_status_and_reason(plugin, tmp_path, mode):
    db = tmp_path / "audit.duckdb"
    tm = _refusing_tokenizer(mode, 64)
    s = plugin.start_refusals(tm, sink=str(db))
    try:
        assert _validate(tm, "fits", 20, "tenant-a", room=7) == 200  # SGLang's check passes: nothing recorded here
        assert _validate(tm, "long", 80, "tenant-b", room=8) == 400  # over the context: refused before any scheduler
        assert _validate(tm, "anon", 80, None) == 400
    finally:
        plugin.refusals = None
        s.close()
    assert not db.exists()  # a store file's one writer is the scheduler: the refusals go to their own file
    events = stored_events(tmp_path / "audit.http.duckdb")
    by_kind: dict[str, list[dict]] = {}
    for e in events:
        by_kind.setdefault(e["kind"], []).append(e)
    assert {e["request"]["request_id"] for e in by_kind["request_received"]} == {"long", "anon"}
    [recv] = [e for e in by_kind["request_received"] if e["request"]["request_id"] == "long"]
    assert recv["request"]["tenant_id"] == "tenant-b" and recv["prompt_tokens"] == 80
    assert recv["request"]["transfer_id"] == 8 and recv["max_new_tokens"] == 4
    aborts = {e["request"]["request_id"]: e for e in by_kind["request_aborted"]}
    assert set(aborts) == {"long", "anon"}
    assert aborts["long"]["stage"] == "http" and aborts["long"]["http_status"] == 400
    assert "longer than the model's context length (64 tokens)" in aborts["long"]["abort_reason"]
    assert aborts["anon"]["request"]["tenant_id"] == "(unknown tenant)"
    responses = {e["request"]["request_id"]: e for e in by_kind.get("response_sent", [])}
    if mode == "prefill":  # prefill's answer goes to the router, not to the client
        assert responses == {}
    else:
        assert {k: (v["http_status"], v["completion_tokens"]) for k, v in responses.items()} == {
            "long": (400, 0),
            "anon": (400, 0),
        }
        assert responses["long"]["prompt_tokens"] == 80 and responses["long"]["request"]["tenant_id"] == "tenant-b"


def test_with_the_service_the_refusals_go_where_the_responses_go(plugin, tmp_path):
    from tests.sglang.conftest import SharedStore

    db = tmp_path / "audit.duckdb"
    store = SharedStore(db)
    tm = _refusing_tokenizer("decode", 64)
    s = plugin.start_frontend(tm, sink=store)
    plugin._frontend_tried = True
    try:
        assert s is not None and plugin.refusal_session(tm) is s
        assert _validate(tm, "long", 80, "tenant-b") == 400
    finally:
        plugin.frontend = None
        s.close()
        store.store.close()
    [resp] = [e for e in stored_events(db) if e["kind"] == "response_sent"]
    assert resp["http_status"] == 400 and resp["request"]["request_id"] == "long"


def test_sglang_health_checks_carry_no_transfer_id(plugin, tmp_path):
    """A PD server's /health request has SGLang's fake bootstrap host and room 0: it transfers nothing, so room 0
    is not recorded as a transfer id (it would be one transfer shared by every health check)."""
    from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    from kvtrail.serving.sglang import session

    assert (session.FAKE_BOOTSTRAP_HOST, session.HEALTH_CHECK_RID_PREFIX) == (
        FAKE_BOOTSTRAP_HOST,
        HEALTH_CHECK_RID_PREFIX,
    )
    tm = _refusing_tokenizer("decode", 64)
    db = tmp_path / "audit.duckdb"
    s = plugin.start_refusals(tm, sink=str(db))
    try:
        rid = f"{HEALTH_CHECK_RID_PREFIX}_0"
        assert _validate(tm, rid, 80, None, room=0, host=FAKE_BOOTSTRAP_HOST) == 400
        assert _validate(tm, "real", 80, None, room=0, host="127.0.0.1") == 400
    finally:
        plugin.refusals = None
        s.close()
    events = stored_events(tmp_path / "audit.http.duckdb")
    rooms = {e["request"]["request_id"]: e["request"].get("transfer_id") for e in events if "request" in e}
    assert rooms == {rid: None, "real": 0}  # every event of the health check: no transfer id
