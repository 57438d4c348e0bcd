"""The model checker: the patched protocols hold within bounds, the vulnerable ones yield the incident and
the late write as their shortest counterexamples, and symmetry reduction changes no verdict."""

from __future__ import annotations

import random

import pytest

from kvtrail.errors import KvtrailError
from kvtrail.model.checker import Checker
from kvtrail.model.properties import PROPERTIES
from kvtrail.model.state import LONG, State, canonical, initial
from kvtrail.model.transitions import Transitions
from kvtrail.model.variants import VARIANTS, Bounds


def run(variant: str, requests: int, pages: int, chunks: int, reuse: str | None = None):
    return Checker(VARIANTS[variant], Bounds(requests, pages, chunks, reuse)).run()


@pytest.mark.parametrize("variant", ["patched", "stack-patched"])
def test_the_patched_protocols_hold_within_the_bounds(variant):
    res = run(variant, 3, 3, 2)
    assert res.counterexamples == []
    assert res.states > 5_000 and res.depth > 20  # a real search, not an empty one


@pytest.mark.parametrize("variant", ["vulnerable", "stack-vulnerable"])
def test_the_vulnerable_protocols_break_four_properties_and_conserve_pages(variant):
    res = run(variant, 2, 2, 2)
    broken = {cx.property for cx in res.counterexamples}
    assert broken == set(PROPERTIES) - {"pages_conserved"}
    assert res.first_counterexample_s is not None and res.first_counterexample_s <= res.seconds


def _actions(cx, request=None):
    return [(s.action, s.request) for s in cx.steps if request is None or s.request == request]


def test_the_vulnerable_model_yields_the_incident():
    res = run("vulnerable", 2, 2, 2)
    incident = [cx for cx in res.counterexamples if cx.property == "no_foreign_read" and "last written by" in cx.detail]
    assert incident, [cx.detail for cx in res.counterexamples]
    cx = incident[0]
    reader = cx.steps[cx.violation_at].request
    first = cx.steps[0].before
    assert first.reqs[reader][LONG]  # the over-long prompt ...
    acts = [a for a, _ in _actions(cx, reader)]
    assert "admit" in acts and "reject" not in acts  # ... admitted as a placeholder
    assert acts.index("commit") < acts.index("read")
    assert "(tenant-b) reads" in cx.detail and "(tenant-a)" in cx.detail  # another tenant wrote the page


def test_the_vulnerable_model_yields_the_late_write():
    res = run("vulnerable", 2, 2, 2)
    (cx,) = [c for c in res.counterexamples if c.property == "no_free_before_drain"]
    broken = cx.steps[cx.violation_at]
    assert broken.action == "decode_abort"  # decode freed at once on the abort
    late = [
        s
        for s in cx.steps[cx.violation_at :]
        if s.action == "land" and s.request == broken.request and s.before.dpool[_page(s)][0] not in (-1, s.request)
    ]
    assert late, _actions(cx)  # ... and the write landed in a page the next request holds


def _page(step) -> int:
    return step.before.reqs[step.request][9][step.arg]


def test_counterexamples_are_shortest():
    # a breadth-first search: no shorter path breaks the property, so the patched length check is the only
    # thing between the placeholder and the commit
    res = run("vulnerable", 1, 2, 2)
    (cx,) = [c for c in res.counterexamples if c.property == "transferred_equals_reserved"]
    assert [a for a, _ in _actions(cx)][: cx.violation_at + 1] == [
        "admit",
        "reserve",
        "forward",
        "post",
        "complete",
        "notify",
        "land",
        "commit",
    ]


def _shuffled(s: State, rng: random.Random) -> State:
    """``s`` with requests of equal attributes swapped and pages renamed (a state equal up to renaming)."""
    n, m = len(s.reqs), len(s.dpool)
    perm = list(range(n))
    rng.shuffle(perm)
    if [s.reqs[i][:2] for i in perm] != [r[:2] for r in s.reqs]:
        perm = list(range(n))
    pmap = list(range(m))
    rng.shuffle(pmap)
    inv = {old: new for new, old in enumerate(perm)}

    def rq(x):
        return inv[x] if x >= 0 else -1

    reqs = []
    for old in perm:
        r = s.reqs[old]
        reqs.append(r[:9] + (tuple(pmap[p] for p in r[9]), r[10]) + r[11:])
    dpool: list = [None] * m
    for p, (o, w, late) in enumerate(s.dpool):
        dpool[pmap[p]] = (rq(o), rq(w), late)
    ppool = [(sum(1 << inv[i] for i in range(n) if h >> i & 1), ns, rq(w)) for h, ns, w in s.ppool]
    return State(tuple(reqs), tuple(dpool), tuple(sorted(pmap[p] for p in s.dfree)), tuple(ppool), s.pfree)


def test_canonical_forms_are_equal_for_renamed_states():
    rng = random.Random(7)
    trans = Transitions(VARIANTS["vulnerable"], 2, "any")
    s = initial(3, 3, 2)
    checked = 0
    for _ in range(300):
        succ = trans.successors(s)
        if not succ:
            s = initial(3, 3, 2)
            continue
        s = rng.choice(succ)[1]
        if canonical(_shuffled(s, rng), True) == canonical(s, True):
            checked += 1
    assert checked > 200


def test_symmetry_reduction_keeps_the_verdicts():
    # pages renamed (any) against no page symmetry (lowest): the same properties break, in fewer states
    sym, plain = run("vulnerable", 2, 3, 2, reuse="any"), run("vulnerable", 2, 3, 2, reuse="lowest")
    assert {c.property for c in sym.counterexamples} == {c.property for c in plain.counterexamples}
    assert run("patched", 2, 3, 2, reuse="lifo").counterexamples == []


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"requests": 0}, "--requests"),
        ({"pages": 9}, "--pages"),
        ({"chunks": 0}, "--chunks"),
        ({"pages": 1, "chunks": 2}, "--pages"),
        ({"reuse": "fifo"}, "--reuse"),
    ],
)
def test_bad_bounds_name_the_field(kw, field):
    with pytest.raises(KvtrailError, match=field):
        Bounds(**kw)
