"""``model validate`` agrees with the findings engines: on the simulator's planted classes, on a service's
store through ``--url``, and on the reference stack's vulnerable and patched runs."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from kvtrail.audit.pagelist import decode_runs, encode_runs
from kvtrail.audit.store import AuditStore
from kvtrail.forensics import Window
from kvtrail.forensics.questions import findings_of
from kvtrail.model import pagesteps
from kvtrail.model.validate import _decode_pages, validate_store
from kvtrail.sim.fleet.run import write_fleet
from tests.conftest import run_cli
from tests.sim.test_fleet import SMALL

# which requests each property names, and which findings name the same requests (recipient or source)
AGREES = {
    "no_foreign_read": ("F1", "F5"),
    "no_free_before_drain": ("F7",),
    "pages_conserved": ("F6",),
    "transferred_equals_reserved": ("F2",),
    "aborted_never_sent": ("F4",),
}


def _by_property(doc: dict) -> dict[str, set]:
    out: dict[str, set] = {p: set() for p in AGREES}
    for v in doc["violations"]:
        out[v["property"]].add(v["first_event"]["request_id"])
    return out


def _by_codes(found) -> dict[str, set]:
    return {p: {f.request_id for f in found if f.code in codes} for p, codes in AGREES.items()}


@pytest.mark.parametrize("bug", ["placeholder", "use_after_free", "late_write", "double_alloc", None])
def test_validate_agrees_with_the_findings_on_planted_classes(bug, tmp_path):
    cfg = replace(SMALL, bugs=(bug,) if bug else ())
    with AuditStore(tmp_path / "s.duckdb") as store:
        write_fleet(cfg, store)
        found = findings_of(store.con)
        doc = validate_store(store.con)
    model, engine = _by_property(doc), _by_codes(found)
    assert model == engine
    assert doc["coverage"] == []
    if bug is None:
        assert doc["violations"] == []
    else:
        assert any(model.values())  # the planted class is seen


def test_validate_through_a_service_answers_as_the_store_does(tmp_path, capsys):
    from kvtrail.service.state import open_state
    from tests.service.conftest import free_socket, make_token, served_in_thread

    db = tmp_path / "svc.duckdb"
    with AuditStore(db) as store:
        write_fleet(replace(SMALL, bugs=("late_write",)), store)
    rc, out, _ = run_cli(capsys, "model", "validate", "--db", str(db), "--json")
    local = json.loads(out[0])
    assert rc == 1 and local["violations"]
    state = open_state(db)
    try:
        token = make_token(state, "operator")
        with served_in_thread(state, free_socket()) as url:
            rc, out, _ = run_cli(capsys, "model", "validate", "--url", url, "--token", token, "--json")
            assert rc == 1 and json.loads(out[0]) == local
            bad = run_cli(capsys, "model", "validate", "--url", url, "--token", make_token(state, "producer"))
            assert bad[0] == 2 and "--token" in bad[2][-1]
    finally:
        state.close()


@pytest.mark.slow
def test_validate_agrees_with_the_findings_on_the_reference_stack(stack_runs):
    mode, (db, late) = stack_runs
    for path in (db, late):
        with AuditStore(path) as store:
            found = findings_of(store.con)
            doc = validate_store(store.con)
        model, engine = _by_property(doc), _by_codes(found)
        assert model == engine, path.name
        if mode == "patched":  # every history of the patched stack is one the patched model allows
            assert doc["violations"] == [], doc
        elif path == db:
            assert model["no_foreign_read"] and model["aborted_never_sent"] and model["transferred_equals_reserved"]
        else:
            assert model["no_free_before_drain"]


def test_the_lean_page_decoder_restores_what_the_run_encoding_holds():
    rng = np.random.default_rng(7)
    lists = [[], [5], [0, 1, 2, 9, 10, 3], [], list(range(100, 140)) + [7, 6, 5], [2**31 - 2, 2**31 - 1, 0]]
    lists += [sorted(rng.choice(5000, size=int(rng.integers(0, 60)), replace=False).tolist()) for _ in range(50)]
    flat = np.asarray([p for pages in lists for p in pages], np.int32)
    offsets = np.concatenate([[0], np.cumsum([len(pages) for pages in lists])]).astype(np.int64)
    row, _, start, length = encode_runs(flat, offsets)
    got, got_offsets = _decode_pages(len(lists), row, start, length)
    want, want_offsets = decode_runs(len(lists), row, start, length)
    assert got.dtype == np.int32
    assert got_offsets.tolist() == want_offsets.tolist() == offsets.tolist()
    assert got.tolist() == want.tolist() == flat.tolist()
    none, none_offsets = _decode_pages(3, row[:0], start[:0], length[:0])
    assert len(none) == 0 and none_offsets.tolist() == [0, 0, 0, 0]


def test_the_compiled_page_steps_judge_as_the_python_steps(tmp_path, monkeypatch):
    """Every planted class at once, judged with the compiled steps and with each event left to Python
    (the kernel stopping at once), whole and from part-way: the same document, byte for byte."""
    with AuditStore(tmp_path / "s.duckdb") as store:
        write_fleet(replace(SMALL, bugs=("placeholder", "use_after_free", "late_write", "double_alloc")), store)
        mid = store.con.sql("SELECT quantile_disc(wall_ns, 0.5) FROM events").fetchall()[0][0]
        compiled = [validate_store(store.con), validate_store(store.con, Window(from_ns=mid))]
        calls = []

        def python_only(*args):
            calls.append(args[-2])
            return args[-2], 0  # leave the next event to Python

        monkeypatch.setattr(pagesteps, "run_pages", python_only)
        by_python = [validate_store(store.con), validate_store(store.con, Window(from_ns=mid))]
    assert calls  # the Python steps did run every page event
    assert compiled[0]["violations"] and len(compiled[1]["violations"]) < len(compiled[0]["violations"])
    assert json.dumps(compiled) == json.dumps(by_python)
