"""The replay engine's shared pieces: the page-array declarations, the event record, the state object."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrail.audit.batch import BATCH_SCHEMA
from kvtrail.forensics.replay.batch import from_table, in_engine_order
from kvtrail.forensics.replay.engine import ReplayEngine
from kvtrail.forensics.replay.event import SCALARS, ReplayEvent
from kvtrail.forensics.replay.pagestate import PAGE_ARRAYS, PageState
from tests.forensics.test_replay_fast import EVENT, free_form


def test_page_arrays_are_allocated_as_declared() -> None:
    pool = PageState.empty(5)
    assert [spec.name for spec in PAGE_ARRAYS][:3] == ["owner", "gen", "alloc_req"]
    assert pool.arrays() == tuple(getattr(pool, spec.name) for spec in PAGE_ARRAYS)
    for spec in PAGE_ARRAYS:
        arr = getattr(pool, spec.name)
        assert arr.dtype == np.dtype(spec.dtype) and arr.shape == ((6,) if spec.width == 1 else (6, spec.width))
        assert (arr == spec.fill).all(), spec.name


def test_growth_keeps_every_declared_array_and_fills_the_new_pages() -> None:
    pool = PageState.empty(3)
    for spec in PAGE_ARRAYS:
        getattr(pool, spec.name)[2] = 1
    pool.extra[2] = {7}
    pool.grow(9)
    assert pool.num_entries == 9 and pool.extra == {2: {7}}
    for spec in PAGE_ARRAYS:
        arr = getattr(pool, spec.name)
        assert len(arr) == 9 and arr.dtype == np.dtype(spec.dtype), spec.name
        assert (arr[2] == 1).all() and (arr[4:] == spec.fill).all(), spec.name


def test_the_kernel_takes_the_declared_arrays_in_order() -> None:
    kernels = pytest.importorskip("kvtrail.forensics.replay.kernels")
    params = list(inspect.signature(kernels.replay_page_events.py_func).parameters)
    start = params.index("has_pool") + 1
    assert params[start:-1] == [spec.name for spec in kernels.KERNEL_ARRAYS] and params[-1] == "freed"


def test_event_scalars_are_wire_fields() -> None:
    assert SCALARS[:3] == ("kind", "seq", "wall_ns") and "node_key" not in SCALARS
    assert set(SCALARS) <= set(BATCH_SCHEMA.names)
    assert ReplayEvent._fields[len(SCALARS) :] == (
        "node_key",
        "instance",
        "key",
        "ord",
        "pages",
        "digests",
        "hashes",
        "num_dst_pages",
    )


def _recorded(engine: ReplayEngine) -> list[ReplayEvent]:
    """The events the engine's handlers are given from now on (the list fills as it replays)."""
    seen: list[ReplayEvent] = []
    handle = engine.handlers.handle

    def record(ev: ReplayEvent) -> None:
        seen.append(ev)
        handle(ev)

    setattr(engine.handlers, "handle", record)  # noqa: B010 - an instance attribute shadowing the method
    return seen


def _same(a: ReplayEvent, b: ReplayEvent) -> bool:
    """Field by field (the lists are arrays)."""
    for x, y in zip(a, b):
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray)) or x.tolist() != y.tolist():
                return False
        elif x != y or type(x) is not type(y):
            return False
    return True


@settings(max_examples=60, deadline=None)
@given(st.lists(EVENT, max_size=40))
def test_both_paths_build_the_same_event_records(events) -> None:
    """The pure path's records (every event it handles) equal the batch's, built one by one or many at once."""
    table = in_engine_order(free_form(events))
    pure = ReplayEngine(fast=False)
    seen = _recorded(pure)
    pure.feed(table)
    assert len(seen) == table.num_rows and pure.state.num_events == table.num_rows
    batch = from_table(table, lambda ident: pure.producer_ids[ident])
    many = batch.events(np.arange(table.num_rows), 0)
    for i, ev in enumerate(seen):
        assert _same(ev, many[i]) and _same(ev, batch.event(i, i)), (i, ev)


def test_both_paths_share_the_engines_state() -> None:
    pytest.importorskip("numba")
    engine = ReplayEngine(fast=True)
    assert engine.fast_path is not None
    assert engine.fast_path.state is engine.state and engine.handlers.state is engine.state
    assert engine.fast_path.handlers is engine.handlers


def test_the_event_record_is_immutable() -> None:
    table = in_engine_order(free_form([("alloc", "a", 1, [1, 2], False)]))
    ev = from_table(table, lambda ident: 0).event(0, 0)
    with pytest.raises(AttributeError):
        ev.kind = "kv_read"  # type: ignore[misc]
    assert isinstance(ev, tuple) and ev.kind == "node_config"


def test_order_numbers_continue_across_feeds() -> None:
    table = free_form([("alloc", "a", 1, [1, 2], False), ("write", "a", 1, [1], True), ("read", "b", 2, [3], False)])
    engine = ReplayEngine(fast=False)
    seen = _recorded(engine)
    engine.feed(table.slice(0, 3))
    engine.feed(table.slice(3))
    assert [ev.ord for ev in seen] == list(range(table.num_rows)) and engine.state.num_events == table.num_rows
