"""F9's prefill rates are kept between evaluations (a live judge evaluates every poll): asked after every
step of a random stream, they equal the rates derived from scratch by the definition, also when aborts,
role changes, receipts or writes arrive out of the engine's order."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.forensics.replay.joins import PREFILL_ROLES, CrossNodeJoins

POLICY = ForensicsPolicy()


def rates_by_definition(j: CrossNodeJoins) -> dict:
    """Every forward write's sample derived again: tokens over the time since the later of the node's
    previous forward write and its request's receipt there (if that came first in the engine's order);
    requests the node aborted and nodes that are not prefill nodes left out."""
    samples: dict = {}
    by_node: dict = {}
    for w in j.forward_writes:
        by_node.setdefault(w[0], []).append(w)
    for nk, writes in by_node.items():
        if j.role.get(nk) not in PREFILL_ROLES:
            continue
        prev = None
        for _, ord_, wall, rid, tokens in sorted(writes, key=lambda w: w[1]):
            rec = j.receipts.get((nk, rid))
            starts = [t for t in (prev, rec.wall_ns if rec is not None and rec.ord < ord_ else None) if t is not None]
            prev = wall
            if starts and tokens > 0 and wall > max(starts) and (nk, rid) not in j.aborted_at:
                samples.setdefault(nk, []).append(tokens / (wall - max(starts)))
    return {
        nk: float(np.quantile(np.array(xs), POLICY.latency_quantile))
        for nk, xs in samples.items()
        if len(xs) >= POLICY.min_latency_samples
    }


def _event(nk, rid, ord_, wall):
    return SimpleNamespace(node_key=nk, request_id=rid, tenant_id=None, ord=ord_, wall_ns=wall)


@pytest.mark.parametrize("seed", range(6))
def test_rates_kept_between_evaluations_equal_the_definition(seed):
    rng = random.Random(seed)
    j = CrossNodeJoins(POLICY)
    nodes = [("c", f"n{i}") for i in range(3)]
    for nk in nodes:
        j.role[nk] = "prefill"
    ord_, wall, checked = 0, 0, 0
    rids = [f"r{i}" for i in range(40)] + [None]
    for _ in range(600):
        ord_ += 1
        wall += rng.randint(0, 3) * 1000
        nk, rid, step = rng.choice(nodes), rng.choice(rids), rng.random()
        if step < 0.45:
            j.forward_writes.append((nk, ord_, wall, rid, rng.choice([0, 16, 256, 1024])))
        elif step < 0.7:
            j.request_received(_event(nk, rid, ord_, wall))
        elif step < 0.75:  # an abort after the request's samples were taken still removes them
            j.aborted_at.add((nk, rid))
        elif step < 0.78:  # the node's role changes (a new instance): its samples count or stop counting
            j.role[nk] = rng.choice(["prefill", "decode", "unified"])
        elif step < 0.81:  # a write collected out of the engine's order
            j.forward_writes.append((nk, rng.randint(1, ord_), wall, rid, 512))
        elif step < 0.85:  # a receipt collected out of the engine's order: before a write already taken
            w = rng.choice(j.forward_writes) if j.forward_writes else None
            if w is not None and (w[0], w[3]) not in j.receipts:
                j.request_received(_event(w[0], w[3], w[1] - 1, rng.randint(max(0, w[2] - 5000), w[2])))
        if rng.random() < 0.3:
            got, want = j.prefill_rates(), rates_by_definition(j)
            assert got.keys() == want.keys()
            for nk in want:
                assert got[nk] == pytest.approx(want[nk], rel=1e-12)
            checked += bool(want)
    assert checked > 10  # the streams do reach nodes with enough samples


def test_a_fresh_evaluation_of_a_long_history_only_takes_the_new_writes():
    j = CrossNodeJoins(POLICY)
    nk = ("c", "p0")
    j.role[nk] = "prefill"
    for i in range(1, 1001):
        j.forward_writes.append((nk, 2 * i, 1000 * i, f"r{i}", 100))
    first = j.prefill_rates()
    held = j._samples[nk]
    assert len(held.rates) == 999  # the first write has no start
    j.forward_writes.append((nk, 2002, 1_001_500, "r1001", 100))
    again = j.prefill_rates()
    assert j._samples[nk] is held and len(held.rates) == 1000  # one sample added, none derived again
    assert again == rates_by_definition(j) and first == pytest.approx({nk: 0.1})
