"""The model's transitions against the reference stack: every request the stack runs in its tests (the
incident traffic, the late write) records, per role, a sequence of steps the matching variant allows
(``stack-vulnerable`` / ``stack-patched``), and the other mode's variant does not allow all of them.
A changed variant or a stack that behaves otherwise fails here (the mutations below)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from functools import cache
from pathlib import Path

import duckdb
import pytest

from kvtrail.audit.batch import parse_jsonl
from kvtrail.audit.store import read_events
from kvtrail.model.conformance import RequestAutomaton, read_request, request_automaton
from kvtrail.model.monitors import judge_order
from kvtrail.model.variants import VARIANTS, Bounds, Variant

BOUNDS = Bounds(2, 2, 2)  # exhaustive for both stack variants (docs/model.md)
FIXTURES = Path(__file__).parent / "fixtures"


@cache
def _automaton(v: Variant) -> RequestAutomaton:
    return request_automaton(v, BOUNDS)


def _requests(table) -> dict[str, list[dict]]:
    """Each request's events, in the judge's order (so each producer's in its own)."""
    per: dict[str, list[dict]] = defaultdict(list)
    for e in table.take(judge_order(table)).to_pylist():
        if e["request_id"] is not None:
            per[e["request_id"]].append(e)
    return dict(per)


def _stored(path: Path) -> dict[str, list[dict]]:
    con = duckdb.connect(str(path), read_only=True)
    try:
        return _requests(read_events(con, "TRUE", []))
    finally:
        con.close()


def _rejected(v: Variant, requests: dict[str, list[dict]]) -> list[tuple[str, dict]]:
    auto = _automaton(v)
    seqs = {rid: read_request(evs) for rid, evs in requests.items()}
    return [(rid, s) for rid, s in seqs.items() if not auto.accepts(s)]


@pytest.mark.parametrize(
    "variant, case", [(v, p.name) for v in ("vulnerable", "stack-vulnerable") for p in (FIXTURES / v).iterdir()]
)
def test_the_models_own_histories_conform_to_their_variant(variant, case):
    """The reader and the automaton's labels agree with what history.py writes for a counterexample."""
    table = None
    for p in sorted((FIXTURES / variant / case).glob("*.jsonl")):
        t = parse_jsonl(p.read_text())
        table = t if table is None else _concat(table, t)
    assert _rejected(VARIANTS[variant], _requests(table)) == []


def _concat(a, b):
    import pyarrow as pa

    return pa.concat_tables([a, b], promote_options="permissive")


def test_the_automaton_refuses_what_the_variant_does_not_do():
    patched, vulnerable = _automaton(VARIANTS["stack-patched"]), _automaton(VARIANTS["stack-vulnerable"])
    served = {"router": ["ok"], "prefill": ["received", "forward", "post", "released"]}
    normal = {**served, "decode": ["reserve", "land", "commit", "read", "freed"]}
    assert patched.accepts(normal) and vulnerable.accepts(normal)
    placeholder = {**normal, "prefill": ["received", "marked_rejected", "forward", "post", "released"]}
    assert vulnerable.accepts(placeholder) and not patched.accepts(placeholder)
    abort_freed_at_once = {"router": ["error"], **{k: v for k, v in served.items() if k != "router"}}
    abort_freed_at_once["decode"] = ["reserve", "aborted", "freed", "land"]
    assert vulnerable.accepts(abort_freed_at_once) and not patched.accepts(abort_freed_at_once)
    deferred = {**abort_freed_at_once, "decode": ["reserve", "aborted", "land", "freed"]}
    assert patched.accepts(deferred) and not vulnerable.accepts(deferred)
    assert not patched.accepts({**normal, "decode": ["reserve", "commit", "land", "read", "freed"]})  # read before land
    assert not patched.accepts({**normal, "router": []})  # never answered


@pytest.mark.slow
def test_every_request_of_the_stacks_runs_is_one_its_variant_allows(stack_runs):
    mode, stores = stack_runs
    own, other = VARIANTS[f"stack-{mode}"], VARIANTS["stack-patched" if mode == "vulnerable" else "stack-vulnerable"]
    requests = {rid: evs for path in stores for rid, evs in _stored(path).items()}
    assert len(requests) >= 8
    assert _rejected(own, requests) == []
    # the modes differ where the incident and the late write happen: the other variant refuses those
    refused = {rid for rid, _ in _rejected(other, requests)}
    assert len(refused) == 2, refused
    # mutations: a variant changed in the step each run exercises no longer accepts the stack's runs
    if mode == "patched":
        mutants = [replace(own, deferred_release=False), replace(own, reject_long=False)]
    else:
        mutants = [replace(own, deferred_release=True), replace(own, reject_long=True)]
    for mutant in mutants:
        assert _rejected(mutant, requests), mutant
