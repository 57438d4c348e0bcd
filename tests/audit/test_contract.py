"""The recorder contract: Recorder and NullRecorder implement it method by method; one factory picks between them."""

from __future__ import annotations

import inspect

import pytest

from kvtrail.audit.batch import to_dicts
from kvtrail.audit.contract import CONTRACT_METHODS, AuditRecorder, contract_problems
from kvtrail.audit.events import PAYLOAD_LAYOUT, RECORDER_KINDS, Producer, RequestRef
from kvtrail.audit.recorder import NullRecorder, Recorder, RecorderConfig, make_recorder
from kvtrail.audit.store import AuditStore, connect_readonly, read_events

PROD = Producer("c1", "decode-0", "decode", "kvtrail-reference", "0.1", "inst-1")
REQ = RequestRef("r1", 7, "acme")
RECORDING = tuple(m for m in CONTRACT_METHODS if m not in ("events_lost", "flush", "close", "stats"))


def _shape(fn) -> list[tuple[str, inspect._ParameterKind, object]]:
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    return [(p.name, p.kind, p.default) for p in params]


def test_the_listed_methods_are_exactly_the_protocols():
    declared = {n for n, v in vars(AuditRecorder).items() if inspect.isfunction(v) and not n.startswith("_")}
    assert declared == set(CONTRACT_METHODS)


@pytest.mark.parametrize("cls", [Recorder, NullRecorder])
def test_every_method_has_the_contract_signature(cls):
    for name in CONTRACT_METHODS:
        assert _shape(getattr(cls, name)) == _shape(getattr(AuditRecorder, name)), f"{cls.__name__}.{name}"
    assert contract_problems(cls) == []


def test_instances_satisfy_the_runtime_protocol(tmp_path):
    null = NullRecorder()
    assert isinstance(null, AuditRecorder) and contract_problems(null) == []
    with Recorder(tmp_path / "a.duckdb", PROD) as rec:
        assert isinstance(rec, AuditRecorder) and contract_problems(rec) == []
    assert not isinstance(object(), AuditRecorder)


class _Drifted:
    """Looks like a recorder by name; every signature has drifted in some way."""

    def node_config(self, pool_tokens, pool_pages, page_size, context_tokens): ...  # positional, not keyword-only
    def request_received(self, req, tokens, max_new_tokens=None): ...  # renamed
    def pages_allocated(self, req, pages, purpose, block_hashes=()): ...  # other default
    def pages_freed(self, req, pages, reason, when): ...  # extra required
    def kv_written(self, *args, **kwargs): ...  # accepts anything, names nothing
    def kv_read(self, pages, req, page_digests=None, digest_algo=None): ...  # reordered
    def transfer_reserved(self, req, pages, num_tokens, note=None): ...  # extra optional: fine

    # transfer_sent is missing
    transfer_received = request_aborted = response_sent = kv_written

    def flush(self, timeout=None): ...
    def close(self, timeout=30.0): ...
    def stats(self): ...


def test_contract_problems_names_each_drift():
    problems = contract_problems(_Drifted)
    text = "\n".join(problems)
    assert "node_config: parameter 'pool_tokens' is positional or keyword, expected keyword-only" in text
    assert "request_received: parameter 'prompt_tokens' is missing" in text
    assert "pages_allocated: parameter 'block_hashes' has default (), expected default None" in text
    assert "pages_freed: extra parameter 'when' has no default" in text
    assert "kv_written: parameter 'req' is missing" in text
    assert "kv_read: parameter 'req' is not at position 0" in text
    assert "transfer_sent: missing" in problems
    assert not any(p.startswith(("transfer_reserved", "flush", "close", "stats")) for p in problems)


# ---- the payload tuple each method builds follows the event registry -----------------------------

# Where a method's parameter name differs from the field it fills.
_PARAM_OF_FIELD = {"free_reason": "reason", "abort_reason": "reason"}
_LIST_PARAMS = {"pages", "dst_pages", "page_digests", "block_hashes"}
_NO_REQUEST = ("node_config", "kv_canary_violation")  # kinds recorded without a request


def _arguments(method) -> dict:
    """A distinct value for every parameter but the request: lists for page-like ones, strings otherwise."""
    args = {}
    for i, name in enumerate(inspect.signature(method).parameters):
        if name != "req":
            args[name] = [100 + i, 200 + i] if name in _LIST_PARAMS else f"<{name}>"
    return args


@pytest.mark.parametrize("kind", RECORDING)
def test_each_method_lays_its_payload_out_as_the_registry_says(kind, tmp_path):
    # A real store, so the writer commits the recorder's own framing; the method's call is taken at _put
    # and must not reach the store. (A sink that refused every append cost each case ~8 s of the
    # writer's retries at close.)
    path = tmp_path / "a.duckdb"
    rec = Recorder(AuditStore(path), PROD)
    captured = []
    rec._put = lambda code, req, pages, dst, payload: captured.append((req, pages, dst, payload))
    try:
        method = getattr(rec, kind)
        args = _arguments(method)
        method(**({} if kind in _NO_REQUEST else {"req": REQ}), **args)
    finally:
        rec.close()
    assert rec.stats()["writer_errors_total"] == 0
    con = connect_readonly(path)
    try:
        assert [e["kind"] for e in to_dicts(read_events(con))] == ["recorder_started", "recorder_closed"]
    finally:
        con.close()
    ((req, pages, dst, payload),) = captured
    layout = PAYLOAD_LAYOUT[kind]
    assert len(payload) == len(layout)
    got = dict(zip(layout, payload))
    for field in layout:
        value = args[_PARAM_OF_FIELD.get(field, field)]
        assert got[field] == (tuple(value) if isinstance(value, list) else value), field
    # Every argument lands somewhere: in the payload or as one of the page lists.
    used = {_PARAM_OF_FIELD.get(f, f) for f in layout} | {"pages", "dst_pages"}
    assert set(args) <= used
    assert pages == (None if "pages" not in args else tuple(args["pages"]))
    assert dst == (None if "dst_pages" not in args else tuple(args["dst_pages"]))
    assert req == (None if kind in _NO_REQUEST else REQ)


def test_every_kind_but_the_gap_has_a_recording_method():
    assert set(PAYLOAD_LAYOUT) - set(RECORDER_KINDS) == set(RECORDING)


def test_null_recorder_accepts_every_call_and_reports_nothing():
    null = NullRecorder()
    for kind in RECORDING:
        method = getattr(null, kind)
        assert method(**({} if kind in _NO_REQUEST else {"req": REQ}), **_arguments(method)) is None
    assert null.events_lost("hook_error", 2, 8, "x") is None
    assert null.flush(0) is True and null.stats() == {}
    null.close()


def test_events_lost_reaches_the_store_as_a_gap_with_its_reason(tmp_path):
    path = tmp_path / "a.duckdb"
    rec = Recorder(AuditStore(path), PROD, RecorderConfig(capacity_events=100, flush_interval_s=0.005))
    rec.events_lost("hook_error", 3, 24, "hook pages_allocated: boom")
    rec.close()
    con = connect_readonly(path)
    try:
        gaps = [e for e in to_dicts(read_events(con)) if e["kind"] == "recorder_gap"]
    finally:
        con.close()
    assert [(g["gap_reason"], g["dropped_events"], g["dropped_pages"], g["detail"]) for g in gaps] == [
        ("hook_error", 3, 24, "hook pages_allocated: boom")
    ]


# ---- make_recorder -----------------------------------------------------------------------------


def test_disabled_factory_returns_a_null_recorder_and_never_builds_the_sink():
    def sink():
        raise AssertionError("the sink must not be created when auditing is off")

    rec = make_recorder(False, sink, PROD)
    assert isinstance(rec, NullRecorder) and isinstance(rec, AuditRecorder)


def test_enabled_factory_records_into_the_sink_it_builds_once(tmp_path):
    path = tmp_path / "a.duckdb"
    built = []

    def sink():
        built.append(AuditStore(path))
        return built[-1]

    config = RecorderConfig(capacity_events=1000, flush_interval_s=0.005)
    rec = make_recorder(True, sink, PROD, config)
    assert isinstance(rec, Recorder) and rec.config is config and len(built) == 1
    rec.node_config(pool_tokens=64 * 16, pool_pages=64, page_size=16, context_tokens=4096)
    rec.pages_allocated(REQ, [1, 2], "decode_reservation")
    assert rec.flush(10)
    assert rec.stats()["committed_events_total"] == 3  # recorder_started + the two
    rec.close()
    con = connect_readonly(path)
    try:
        kinds = [e["kind"] for e in to_dicts(read_events(con))]
    finally:
        con.close()
    assert kinds == ["recorder_started", "node_config", "pages_allocated", "recorder_closed"]


def test_enabled_factory_defaults_the_config(tmp_path):
    rec = make_recorder(True, lambda: AuditStore(tmp_path / "a.duckdb"), PROD)
    try:
        assert isinstance(rec, Recorder) and rec.config == RecorderConfig()
    finally:
        rec.close()
