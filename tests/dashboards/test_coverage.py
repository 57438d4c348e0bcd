"""The dashboard says what the answers say of the record they could not see: above the Findings and Affected
views, one warning per coverage line, from a store or through the service (an operator's; a tenant's answers
carry none). Here a node's recorder dropped 151 of its 203 events: every view would read "no affected
responses" without it."""

from __future__ import annotations

import shutil
from contextlib import contextmanager

import pytest

from kvtrail import forensics as fx
from kvtrail.answers.store import StoreSource
from kvtrail.audit.events import Producer, RequestRef
from kvtrail.audit.recorder import Recorder, RecorderConfig
from tests.dashboards.test_app import iso, run_app

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from kvtrail.answers.remote import RemoteSource  # noqa: E402
from kvtrail.service.app import create_app  # noqa: E402
from kvtrail.service.state import open_state  # noqa: E402
from kvtrail.service.tokens import add_token  # noqa: E402

LOST = "coverage: recorders reported 151 event(s) lost before they were stored (decode-0 (inst-1): 151 buffer full)"


@pytest.fixture(scope="module")
def lossy(tmp_path_factory):
    path = tmp_path_factory.mktemp("lossy") / "a.duckdb"
    producer = Producer("c1", "decode-0", "decode", "kvtrail-reference", "0.1", "inst-1")
    with Recorder(path, producer, RecorderConfig(flush_interval_s=3600, capacity_events=50)) as rec:
        rec.node_config(pool_tokens=64 * 16, pool_pages=64, page_size=16, context_tokens=4096)
        for i in range(200):
            rec.pages_allocated(RequestRef(f"r{i}", tenant_id="acme"), [1 + i % 60], "decode_growth")
        assert rec.flush(10)
    return path


@pytest.fixture(scope="module")
def lossy_window(lossy) -> fx.Window:
    with fx.open_store(lossy) as con:
        lo, hi = con.execute("SELECT min(min_wall_ns), max(max_wall_ns) FROM batches").fetchall()[0]
    return fx.Window(int(lo), int(hi))


def test_the_store_source_says_what_the_cli_prints(lossy, lossy_window):
    (line,) = StoreSource(lossy).coverage(lossy_window)
    assert line.startswith(LOST[:-1]) and line.endswith("so findings may be missing and counts too low"), line
    assert line == fx.ask_affected(lossy, lossy_window).warnings[0]


@pytest.mark.parametrize("view", ["Affected responses", "Findings"])
def test_the_views_show_the_warning_above_their_figures(monkeypatch, lossy, lossy_window, view):
    at = run_app(monkeypatch, lossy, view, **iso(lossy_window))
    shown = [w.value for w in at.warning]
    assert shown == StoreSource(lossy).coverage(lossy_window) and shown[0].startswith(LOST[:-1]), shown


@contextmanager
def _service(lossy, tmp_path, *roles: str):
    """A service on a copy of the lossy store, in process: (its test client, a token per role)."""
    db = tmp_path / "svc.duckdb"
    shutil.copy(lossy, db)
    state = open_state(db)
    try:
        with state.write_lock:
            tokens = [add_token(state.store.con, role)[1] for role in roles]
        with TestClient(create_app(state)) as client:
            yield client, tokens
    finally:
        state.close()


def test_an_operator_gets_the_same_lines_through_the_service_and_a_tenant_none(lossy, lossy_window, tmp_path):
    with _service(lossy, tmp_path, "operator", "tenant:acme") as (client, (operator, tenant)):
        remote = RemoteSource("http://testserver", operator, transport=client._transport)
        assert remote.coverage(lossy_window) == StoreSource(lossy).coverage(lossy_window)
        assert RemoteSource("http://testserver", tenant, transport=client._transport).coverage(lossy_window) == []


class _Counting:
    """The test client's transport, counting the paths asked."""

    def __init__(self, inner):
        self.inner, self.paths = inner, []

    def handle_request(self, request):
        self.paths.append(request.url.path)
        return self.inner.handle_request(request)

    def close(self):
        pass


def test_one_render_asks_the_service_once_for_the_warnings_and_the_rows(lossy, lossy_window, tmp_path):
    """The Affected view's warnings and rows over one window: one request in a render (the service replays
    the window for each); the next render asks again, and a filtered window is its own question."""
    with _service(lossy, tmp_path, "operator") as (client, (operator,)):
        counting = _Counting(client._transport)
        remote = RemoteSource("http://testserver", operator, transport=counting)

        def asked() -> int:
            n = counting.paths.count("/v1/affected")
            counting.paths.clear()
            return n

        for _ in range(2):
            render = remote.rendering()
            assert render.coverage(lossy_window) == StoreSource(lossy).coverage(lossy_window)
            assert render.affected(lossy_window).equals(StoreSource(lossy).affected(lossy_window))
            assert asked() == 1
        render = remote.rendering()
        render.coverage(lossy_window)
        render.affected(fx.Window(lossy_window.from_ns, lossy_window.to_ns, node="decode-0"))
        assert asked() == 2
        remote.coverage(lossy_window)  # outside a render (the CLI's way): every call asks
        remote.affected(lossy_window)
        assert asked() == 2
