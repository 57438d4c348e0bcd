"""The explicit-state checker: breadth-first search over canonical states, shortest counterexamples.

Every state the bounds allow is explored once up to renaming (:func:`kvtrail.model.state.canonical`);
a violated property keeps the first, hence shortest, path that breaks it. A counterexample is then
carried on to the end of the run (every request answered, nothing in flight), so that as a history it
holds what the findings engines need to judge it; ``no_free_before_drain``'s is carried on until the
late write lands in a page another request holds.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtrail.model.properties import pages_conserved
from kvtrail.model.state import DPAGES, State, canonical, initial, is_quiescent
from kvtrail.model.transitions import Transitions
from kvtrail.model.variants import Bounds, Variant

EXTENSION_LIMIT = 200_000  # states the search for a counterexample's ending may visit


@dataclass(frozen=True)
class Step:
    """One transition of a concrete run: the action, its request and argument, the states around it."""

    action: str
    request: int
    arg: object
    before: State
    after: State
    violations: tuple = ()


@dataclass
class Counterexample:
    property: str
    detail: str
    steps: list[Step]
    violation_at: int  # index of the step that breaks the property


@dataclass
class CheckResult:
    variant: Variant
    bounds: Bounds
    states: int = 0
    depth: int = 0
    seconds: float = 0.0
    first_counterexample_s: float | None = None
    exhaustive: bool = True  # False: the search stopped at its state limit before the bounds were exhausted
    counterexamples: list[Counterexample] = field(default_factory=list)


def _class(prop: str, detail: str) -> str:
    """Which kind of counterexample: a foreign read of another tenant's page is kept beside the shortest."""
    if prop != "no_foreign_read":
        return ""
    m = re.search(r"\((tenant-\w)\) reads .*: last written by .* \((tenant-\w)\)$", detail)
    return "other_tenant" if m and m.group(1) != m.group(2) else "other"


class Checker:
    """Checks one variant within one set of bounds."""

    def __init__(self, variant: Variant, bounds: Bounds):
        self.variant = variant
        self.bounds = bounds
        self.reuse = bounds.reuse or variant.reuse
        self.symmetric_pages = self.reuse == "any"
        self.trans = Transitions(variant, bounds.chunks, self.reuse)

    def canon(self, s: State) -> State:
        return canonical(s, self.symmetric_pages)

    def run(self, max_states: int | None = None) -> CheckResult:
        started = time.perf_counter()
        result = CheckResult(self.variant, self.bounds)
        start = self.canon(initial(self.bounds.requests, self.bounds.pages, self.bounds.chunks))
        parent: dict[State, State | None] = {start: None}
        found: dict[tuple[str, str], tuple[State, tuple, State, str]] = {}
        frontier = [start]
        depth = 0
        succ, canon = self.trans.successors, self.canon
        memo: dict[State, State] = {}  # raw successor -> its representative (many raw states recur)
        while frontier:
            nxt_frontier = []
            for s in frontier:
                for label, t, viols in succ(s):
                    c = memo.get(t)
                    if c is None:
                        c = memo[t] = canon(t)
                    for prop, detail in viols:
                        key = (prop, _class(prop, detail))
                        if key not in found:
                            found[key] = (s, label, c, detail)
                            if result.first_counterexample_s is None:
                                result.first_counterexample_s = time.perf_counter() - started
                    if c not in parent:
                        parent[c] = s
                        nxt_frontier.append(c)
                        for prop, detail in pages_conserved(c):
                            found.setdefault((prop, ""), (s, label, c, detail))
                if max_states is not None and len(parent) >= max_states:
                    break
            if nxt_frontier:
                depth += 1
            frontier = nxt_frontier
            if max_states is not None and len(parent) >= max_states:
                break
        result.exhaustive = not frontier
        result.states, result.depth = len(parent), depth
        result.seconds = time.perf_counter() - started
        kept = _shortest_per_property(found)
        result.counterexamples = [self._counterexample(parent, start, key, found[key]) for key in kept]
        return result

    # ---- counterexamples -----------------------------------------------------------------------

    def _path(self, parent: dict, s: State) -> list[State]:
        path = [s]
        while (p := parent[path[-1]]) is not None:
            path.append(p)
        return path[::-1]

    def _counterexample(self, parent: dict, start: State, key, hit) -> Counterexample:
        s, label, c, detail = hit
        prop = key[0]
        canon_path = self._path(parent, s) + [c]
        concrete = start
        steps: list[Step] = []
        for k, target in enumerate(canon_path[1:]):
            last = k == len(canon_path) - 2
            for lab, t, viols in self.trans.successors(concrete):
                if self.canon(t) != target:
                    continue
                if last and lab[0] != label[0]:
                    continue
                if last and prop != "pages_conserved" and not any(v[0] == prop for v in viols):
                    continue
                steps.append(Step(lab[0], lab[1], lab[2], concrete, t, tuple(viols)))
                concrete = t
                break
            else:
                raise AssertionError(f"model: no concrete step reaches the counterexample's state {k + 1}")
        at = len(steps) - 1
        who = steps[-1].request
        goal: Callable[[State, tuple], bool] | None
        if prop == "no_free_before_drain":
            goal = _lands_on_another
        elif prop == "transferred_equals_reserved":  # carried on until decode reads what it committed
            goal = lambda st, lab: lab[0] == "read" and lab[1] == who  # noqa: E731
        elif prop == "aborted_never_sent":  # ... until the rejected request is served
            goal = lambda st, lab: lab[0] == "finish" and lab[1] == who  # noqa: E731
        else:
            goal = None
        steps += self._ending(concrete, goal)
        return Counterexample(prop, detail, steps, at)

    def _ending(self, s: State, goal) -> list[Step]:
        """The shortest way from ``s`` to the end of the run, through a step ``goal(state, label)`` holds
        for first when one is given (else just to the end); no steps when none is found within the limit."""
        for want_late in (True, False) if goal is not None else (False,):
            root = (self.canon(s), False)
            back: dict = {root: None}  # key -> (previous key, step)
            queue = deque([(s, False)])
            while queue and len(back) < EXTENSION_LIMIT:
                cur, flag = queue.popleft()
                if (flag or not want_late) and is_quiescent(cur):
                    steps = []
                    key = (self.canon(cur), flag)
                    while back[key] is not None:
                        key, step = back[key]
                        steps.append(step)
                    return steps[::-1]
                cur_key = (self.canon(cur), flag)
                for lab, t, viols in self.trans.successors(cur):
                    f = flag or (goal is not None and goal(cur, lab))
                    key = (self.canon(t), f)
                    if key not in back:
                        back[key] = (cur_key, Step(lab[0], lab[1], lab[2], cur, t, tuple(viols)))
                        queue.append((t, f))
        return []


def _lands_on_another(s: State, label: tuple) -> bool:
    """A write lands on a page another request holds (a late write's harm)."""
    if label[0] != "land":
        return False
    _, i, c = label
    page = s.reqs[i][DPAGES][c]
    owner = s.dpool[page][0]
    return owner >= 0 and owner != i


def _shortest_per_property(found: dict) -> list[tuple[str, str]]:
    """One counterexample per property, plus a foreign read of another tenant's page when that is not it."""
    keys = []
    for key in found:
        if key[1] == "other" and (key[0], "other_tenant") in found:
            # the shortest overall is whichever was found first; keep both only when they differ in kind
            keys.append(key)
        elif key not in keys:
            keys.append(key)
    return keys
