"""A worker that dies fails what the router expected of it with WorkerDown; what no request awaits any more
(its request already failed on the other worker) leaves no 'Future exception was never retrieved' log."""

from __future__ import annotations

import asyncio
import gc
import logging
from multiprocessing import Pipe

import pytest

from kvtrail.serving.link import WorkerDown, WorkerLink
from kvtrail.serving.messages import Admitted, Rejected, Response


def test_a_dead_workers_unawaited_futures_log_nothing(caplog):
    router_end, worker_end = Pipe()
    link = WorkerLink("decode", router_end)

    async def scenario() -> None:
        awaited = link.expect(7, Admitted, Rejected)
        for room in (8, 9, 10, 11):  # four requests whose other half failed first: never awaited
            link.expect(room, Response)
        worker_end.close()  # the worker is killed
        with pytest.raises(WorkerDown):
            await asyncio.wait_for(awaited, 10)
        await asyncio.sleep(0.05)  # the reader failed every waiter

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(scenario())
        gc.collect()
    link.close()
    assert not link.alive
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
