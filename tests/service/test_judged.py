"""Answers from the live judge: for a window covering the whole store, ``affected`` and ``findings`` come
from the findings the judge holds (no replay) and equal the CLI's answers; other windows are replayed."""

from __future__ import annotations

import json

import pytest

from kvtrail.forensics import AFFECTED_CODES, Exclusions, Window, ask_affected, ask_findings
from kvtrail.forensics.tables import json_text
from kvtrail.service import judged
from kvtrail.timeutil import format_utc
from tests.forensics.incident_fixture import W0, W1
from tests.service.access_fixtures import bearer, served_fixture  # noqa: F401

EXCL = Exclusions(tenants=(("hooli", "tests"),))


def _span(served) -> tuple[int, int]:
    cur = served.state.cursor()
    try:
        return cur.execute("SELECT min(min_wall_ns), max(max_wall_ns) FROM batches").fetchone()
    finally:
        cur.close()


def _same(a, b) -> None:
    assert a.rows.equals(b.rows) and a.excluded.equals(b.excluded) and a.gaps.equals(b.gaps)
    assert (a.notes, a.warnings) == (b.notes, b.warnings)


def test_a_covering_window_is_answered_from_the_judge_as_the_cli_answers(served):
    first, last = _span(served)
    cur = served.state.cursor()
    try:
        for w in (Window(None, None), Window(first - 10**9, last + 10**9), Window(first, None, tenant="acme")):
            with judged.judged_findings(cur, served.state, w) as found:
                assert found is not None, w
                _same(judged.affected_answer(cur, w, found, EXCL), ask_affected(served.state.store.cursor(), w,
                                                                                exclusions=EXCL))
                for codes in ((), tuple(sorted(AFFECTED_CODES)), ("F2", "F8")):
                    _same(judged.findings_answer(cur, w, found, codes, EXCL),
                          ask_findings(served.state.store.cursor(), w, codes=codes, exclusions=EXCL))
        for w in (Window(W0, W1), Window(first + 1, None), Window(None, last - 1)):
            with judged.judged_findings(cur, served.state, w) as found:
                assert found is None, w  # replayed as the CLI does
    finally:
        cur.close()


@pytest.mark.parametrize("path", ["/v1/affected", "/v1/findings"])
def test_the_routes_give_the_cli_rows_for_a_covering_window(served, path):
    first, last = _span(served)
    w = Window(first - 10**9, last + 10**9)
    expected = (ask_affected if path == "/v1/affected" else ask_findings)(served.state.store.cursor(), w)
    assert len(expected.rows) > 0
    for _ in range(2):  # the second from the same judged state
        r = served.client.get(path, params={"from": format_utc(w.from_ns), "to": format_utc(w.to_ns)},
                              headers=bearer(served.tokens["operator"]))
        assert r.status_code == 200, r.text
        assert r.json() == json.loads(json_text(expected.rows))
        assert json.loads(r.headers["x-kvtrail-answer"])["warnings"] == list(expected.warnings)
