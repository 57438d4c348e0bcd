"""The typed control messages: picklable, documented, each handled by the worker it is sent to, and the
reply matching of the router's WorkerLink (by reply type and transfer id)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import inspect
import pickle
from multiprocessing import Pipe

import numpy as np
import pytest

from kvtrail.audit.events import RequestRef
from kvtrail.audit.recorder import NullRecorder
from kvtrail.serving import messages as m
from kvtrail.serving.decode import DecodeWorker
from kvtrail.serving.kvpool import KVPool, KVPoolConfig
from kvtrail.serving.link import WorkerDown, WorkerLink
from kvtrail.serving.prefill import PrefillWorker

REF = RequestRef("r1", 7, "acme", "k:0123456789ab")
INFO = m.WorkerInfo(("127.0.0.1", 4242), b"secret", "127.0.0.1:15001", ((4096, 8192, 512),))
SAMPLES = [
    m.WorkerReady(INFO),
    m.WorkerFailed("OSError: no"),
    m.ConnectPeer(INFO),
    m.PrefillRequest(7, REF, b"hello", False),
    m.DecodeRequest(7, REF, 5, 16),
    m.Abort(7),
    m.Shutdown(),
    m.SetAudit(m.CONTROL_ROOM, True),
    m.DigestPages(m.CONTROL_ROOM, (1, 2)),
    m.Admitted(7),
    m.Rejected(7, 400, "field 'prompt': too long"),
    m.Response(7, 200, "hi", 2, 123, "length", None),
    m.AuditSet(m.CONTROL_ROOM, False),
    m.PagesDigest(m.CONTROL_ROOM, "ab" * 32),
    m.Cancel(7),
    m.AbortAck(7),
    m.KvFailed(7, "pool exhausted"),
    m.GetAuditStats(m.CONTROL_ROOM),
    m.AuditStats(m.CONTROL_ROOM, (("recorded_events", 3), ("writer_cpu_ns_total", 1200))),
]
ARRAY_SAMPLES = [
    m.DstPages(7, np.array([3, 4, 9], np.int32), 40),
    m.KvDone(7, 104, 40, 3, np.array([1, 2**63, 5], np.uint64)),
    m.KvDone(7, 104, 40, 3, None),
]
MESSAGE_TYPES = [
    c for _, c in inspect.getmembers(m, inspect.isclass) if dataclasses.is_dataclass(c) and c.__module__ == m.__name__
]


class _Unknown:
    room = 7


def _fields(msg):
    return [getattr(msg, f.name) for f in dataclasses.fields(msg)]


def test_every_message_kind_is_sampled_frozen_slotted_and_documented():
    assert {type(s) for s in SAMPLES + ARRAY_SAMPLES} | {m.WorkerInfo} == set(MESSAGE_TYPES)
    for cls in MESSAGE_TYPES:
        assert cls.__dataclass_params__.frozen, cls
        assert "__slots__" in cls.__dict__, cls
        assert (cls.__doc__ or "").strip() and not cls.__doc__.startswith(cls.__name__ + "("), cls
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.Abort(1).room = 2


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda s: type(s).__name__)
def test_messages_pickle_round_trip(msg):
    back = pickle.loads(pickle.dumps(msg))
    assert type(back) is type(msg) and back == msg


@pytest.mark.parametrize("msg", ARRAY_SAMPLES, ids=lambda s: type(s).__name__)
def test_array_messages_pickle_round_trip_with_their_dtypes(msg):
    back = pickle.loads(pickle.dumps(msg))
    assert type(back) is type(msg)
    for want, got in zip(_fields(msg), _fields(back)):
        if isinstance(want, np.ndarray):
            assert got.dtype == want.dtype and np.array_equal(got, want)
        else:
            assert got == want


def test_each_worker_handles_exactly_its_inbox():
    assert set(PrefillWorker.HANDLERS) == set(m.PREFILL_INBOX)
    assert set(DecodeWorker.HANDLERS) == set(m.DECODE_INBOX)
    for cls in (PrefillWorker, DecodeWorker):
        for kind, handler in cls.HANDLERS.items():
            assert getattr(cls, handler.__name__) is handler, (cls, kind)  # a method of the class, not stale
    # Every message kind has a receiver: a worker, the router or the stack's start pipe.
    receivers = set(m.PREFILL_INBOX) | set(m.DECODE_INBOX) | set(m.ROUTER_INBOX) | set(m.START_INBOX)
    assert receivers == set(MESSAGE_TYPES) - {m.WorkerInfo}


def _worker(cls, pool=None):
    return cls(None, pool, None, None, "the recorder", None, None)


@pytest.mark.parametrize(
    "msg",
    [_Unknown(), ("audit", -1, True), m.DecodeRequest(7, REF, 5, 16)],
    ids=["foreign class", "old tuple", "decode's message"],
)
def test_a_prefill_worker_rejects_what_it_does_not_take(msg):
    with pytest.raises(m.ProtocolError, match=f"prefill worker: no handler for message .*{type(msg).__qualname__}"):
        _worker(PrefillWorker).dispatch(msg)


def test_decode_rejects_prefills_messages():
    with pytest.raises(m.ProtocolError, match="decode worker: no handler for message .*PrefillRequest"):
        _worker(DecodeWorker).dispatch(m.PrefillRequest(7, REF, b"x", False))


def test_control_requests_are_answered_with_their_reply_types():
    pool = KVPool(KVPoolConfig(num_layers=1, num_pages=4, page_size=2, num_heads=1, head_dim=4))
    pool.k[0][2] = 1.5
    worker = _worker(DecodeWorker, pool)
    router, worker.router = Pipe()
    worker.dispatch(m.SetAudit(m.CONTROL_ROOM, False))
    assert router.recv() == m.AuditSet(m.CONTROL_ROOM, False) and isinstance(worker.rec, NullRecorder)
    worker.dispatch(m.SetAudit(m.CONTROL_ROOM, True))
    assert router.recv() == m.AuditSet(m.CONTROL_ROOM, True) and worker.rec == "the recorder"
    worker.dispatch(m.DigestPages(m.CONTROL_ROOM, (2, 3)))
    assert router.recv() == m.PagesDigest(m.CONTROL_ROOM, hashlib.sha256(pool.page_bytes([2, 3])).hexdigest())
    worker.dispatch(m.Shutdown())
    assert not worker._running


class _CountingRecorder(NullRecorder):
    def stats(self) -> dict[str, int]:
        return {"recorded_events": 5, "writer_cpu_ns_total": 7}


def test_audit_stats_come_from_the_real_recorder_even_while_recording_is_off():
    worker = DecodeWorker(None, None, None, None, _CountingRecorder(), None, None)
    router, worker.router = Pipe()
    worker.dispatch(m.SetAudit(m.CONTROL_ROOM, False))
    assert router.recv() == m.AuditSet(m.CONTROL_ROOM, False)
    worker.dispatch(m.GetAuditStats(m.CONTROL_ROOM))
    assert router.recv() == m.AuditStats(m.CONTROL_ROOM, (("recorded_events", 5), ("writer_cpu_ns_total", 7)))


# ---- WorkerLink: replies matched by type and transfer id --------------------------------------------------


async def _link_scenario():
    ours, theirs = Pipe()
    link = WorkerLink("prefill", ours)
    admission = link.expect(7, m.Admitted, m.Rejected)
    other_room = link.expect(8, m.Admitted, m.Rejected)
    response = link.expect(7, m.Response)
    theirs.send(m.Response(9, 200, "not ours", 1, None, "length", None))  # no waiter: dropped
    theirs.send(m.Rejected(7, 400, "field 'prompt': too long"))
    got = await asyncio.wait_for(admission, 5)
    assert got == m.Rejected(7, 400, "field 'prompt': too long")
    assert not other_room.done() and not response.done()
    theirs.send(m.Response(7, 200, "hi", 2, None, "length", None))
    assert (await asyncio.wait_for(response, 5)).text == "hi"
    # Something the router does not take: every waiter fails at once and the link is down.
    theirs.send(_Unknown())
    with pytest.raises(m.ProtocolError, match="router \\(from the prefill worker\\): no handler .*_Unknown"):
        await asyncio.wait_for(other_room, 5)
    assert not link.alive
    with pytest.raises(WorkerDown):
        link.send(m.Abort(8))
    link.close()
    theirs.close()


def test_link_matches_replies_by_type_and_room_and_fails_on_an_unknown_message():
    asyncio.run(_link_scenario())


async def _link_down_scenario():
    ours, theirs = Pipe()
    link = WorkerLink("decode", ours)
    with pytest.raises(ValueError, match="kinds"):
        link.expect(7, m.DecodeRequest)  # not a reply: nothing would ever resolve it
    waiting = link.expect(7, m.Response)
    theirs.close()
    with pytest.raises(WorkerDown, match="decode worker is down"):
        await asyncio.wait_for(waiting, 5)
    link.close()


def test_link_fails_waiters_when_the_worker_goes_away_and_refuses_non_reply_kinds():
    asyncio.run(_link_down_scenario())
