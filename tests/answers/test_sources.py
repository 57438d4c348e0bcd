"""The same question asked of the three sources (a store file, the service holding a copy of it, the lake
exported from it) returns the same rows, for every question the faces ask through ``kvtrail.answers``."""

from __future__ import annotations

import json
import shutil

import pytest

from kvtrail.answers.ask import LakeAnswers, ServiceAnswers, StoreAnswers, open_answers
from kvtrail.answers.client import Client
from kvtrail.answers.remote import RemoteSource
from kvtrail.answers.store import StoreSource
from kvtrail.answers.tables import json_text
from kvtrail.errors import KvtrailError
from kvtrail.forensics import Exclusions, ReportOptions, Window
from kvtrail.forensics.lake.executor import LocalExecutor
from kvtrail.forensics.lake.questions import open_lake
from tests.lake.conftest import BOUNDARY_NS, fleet_db, fleet_lake  # noqa: F401

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from kvtrail.service.app import create_app  # noqa: E402
from kvtrail.service.state import open_state  # noqa: E402
from kvtrail.service.tokens import add_token  # noqa: E402

S = 1_000_000_000
WINDOWS = [
    Window(),
    Window(BOUNDARY_NS - 9 * S, BOUNDARY_NS + 14 * S),
    Window(BOUNDARY_NS - 9 * S, BOUNDARY_NS + 14 * S, tenant="tenant-001"),
]


@pytest.fixture(scope="module")
def sources(fleet_db, fleet_lake, tmp_path_factory):  # noqa: F811
    db = tmp_path_factory.mktemp("answers") / "served.duckdb"
    shutil.copy(fleet_db, db)
    state = open_state(db)
    try:
        with state.write_lock:
            operator = add_token(state.store.con, "operator")[1]
        state.judge.wait_idle(120)
        with TestClient(create_app(state)) as http, open_lake(fleet_lake) as lake:
            service = ServiceAnswers(
                "http://testserver", operator, client=Client("http://testserver", operator, transport=http._transport)
            )
            remote = RemoteSource("http://testserver", operator, transport=http._transport)
            yield (
                {"store": StoreAnswers(fleet_db), "service": service, "lake": LakeAnswers(lake, LocalExecutor())},
                StoreSource(fleet_db),
                remote,
            )
    finally:
        state.close()


def _rows(answer) -> list[dict]:
    return json.loads(json_text(answer.rows))


QUESTIONS = {
    "findings": lambda a, w: a.findings(w),
    "findings F1 F2 excluding a tenant": lambda a, w: a.findings(
        w, codes=("F1", "F2"), exclusions=Exclusions(tenants=(("tenant-002", "tests"),))
    ),
    "affected": lambda a, w: a.affected(w),
    "exposure": lambda a, w: a.exposure(w),
    "thresholds": lambda a, w: a.thresholds(w),
}


@pytest.mark.parametrize("question", sorted(QUESTIONS))
@pytest.mark.parametrize("w", WINDOWS, ids=["whole", "window", "tenant"])
def test_every_source_gives_the_same_rows(sources, question, w):
    answers, _, _ = sources
    got = {kind: QUESTIONS[question](a, w) for kind, a in answers.items()}
    want = _rows(got["store"])
    if question != "thresholds" or w.tenant is None:
        assert want, "the history must answer something here, or the comparison shows nothing"
    for kind in ("service", "lake"):
        assert _rows(got[kind]) == want, kind
        assert got[kind].gaps.equals(got["store"].gaps), kind


@pytest.mark.parametrize("w", WINDOWS[1:], ids=["window", "tenant"])
def test_exploitation_is_the_same_from_every_source(sources, w):
    answers, _, _ = sources
    options = ReportOptions(w.from_ns, w.to_ns, long_prompt_tokens=4096)
    want = _rows(answers["store"].exploitation(w, options))
    assert want
    for kind in ("service", "lake"):
        assert _rows(answers[kind].exploitation(w, options)) == want, kind


def test_the_transfers_view_names_both_ends_through_the_service(sources):
    _, store, remote = sources
    w = WINDOWS[1]
    want = store.transfers(w)
    assert len(want) and want["prefill_node"].null_count() == 0
    got = remote.transfers(w)
    assert got.equals(want)
    assert not any(p.startswith("? ->") for p in got["pair"])


def test_the_choice_of_source_is_made_once(fleet_db, fleet_lake):  # noqa: F811
    with open_answers(db=fleet_db) as a:
        assert a.kind == "store"
    with open_answers(db=fleet_db, lake=fleet_lake) as a:
        assert a.kind == "lake"
    with open_answers(db=fleet_db, url="http://127.0.0.1:9", token="t") as a:
        assert a.kind == "service"
    with pytest.raises(KvtrailError, match="--lake: give either --lake or --url"):
        with open_answers(url="http://127.0.0.1:9", lake=fleet_lake):
            pass
    with pytest.raises(KvtrailError, match="--scheduler/--workers: only with --lake"):
        with open_answers(db=fleet_db, workers=2):
            pass
