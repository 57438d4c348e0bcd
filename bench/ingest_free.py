"""``kvtrail-free``: kvtrail's store with its own work per batch already done, the bound on a faster kvtrail.

The method asks how close any implementation of kvtrail's append could come to ``limit-kinds`` if its own
computation cost nothing. Before the rounds, untimed, one real store takes every batch and keeps what its
Python computed for each: the checked and grouped batch, the producers' parts, the request numbers, the
``page_runs`` rows and the chained digests. In a round the method hands those to the same store code that
writes them (``AuditStore._write``): the same inserts into the kind tables, the request dictionary,
``page_runs`` and ``batches``, the same transaction, the transparency log's frontier and the same
checkpoint policy. Only the validation, request numbering, run encoding and SHA-256 are left out.

Each round's store is checked after its timing: ``verify_store`` recomputes every digest from the rows
it holds, so a round that stored anything other than what kvtrail stores fails the run.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from kvtrail.audit import chain, commitrows
from kvtrail.audit.store import AuditStore, CheckpointPolicy
from kvtrail.audit.validate import ValidatedBatch, sort_batch
from kvtrail.audit.verify import verify_store


@dataclass(frozen=True)
class _Done:
    """What kvtrail's Python computed for one batch of a fresh store."""

    vb: ValidatedBatch
    seq: np.ndarray
    parts: list[commitrows.Part]
    numbers: tuple
    runs: commitrows.Runs
    digests: list[tuple[bytes, bytes | None]]


class Precomputed:
    """Every batch's computation, made once by a real store fed the same batches from empty."""

    def __init__(self, path: str, batches: list[pa.Table], policy: CheckpointPolicy) -> None:
        self.done: list[_Done] = []
        with AuditStore(path, checkpoint=policy) as store:
            known = _KnownNumbers(store)
            store.requests = known
            for b in batches:
                vb, check = sort_batch(b, store._state)
                check()
                seq = vb.table.column("seq").to_numpy(zero_copy_only=False).astype(np.uint64, copy=False)
                parts = commitrows.cut(vb, seq, store._chain)
                runs = commitrows.encode(vb, parts, seq)
                digests = commitrows.digests(parts, runs, seq, None)
                numbers = known.store_numbers.number(vb.table)
                known.next = numbers  # numbered once: _write takes these
                store._write(vb, seq, parts, _ready(runs), _ready(digests))
                self.done.append(_Done(vb, seq, parts, numbers, runs, digests))


def _ready(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class _KnownNumbers:
    """A store's request numbering that returns the numbers already made for the batch it is given."""

    def __init__(self, store: AuditStore) -> None:
        self.store_numbers = store.requests
        self.next: tuple | None = None

    def number(self, t: pa.Table) -> tuple:
        assert self.next is not None, "kvtrail-free: numbers asked for a batch it was not handed"
        out, self.next = self.next, None
        return out

    def remember(self, new: dict) -> None:
        self.store_numbers.remember(new)


class KvtrailFreeSink:
    """``AuditStore``'s writes of each batch, its own computation taken from :class:`Precomputed`."""

    name = "kvtrail-free"

    def __init__(self, path: str, pre: Precomputed, policy: CheckpointPolicy) -> None:
        self.path = path
        self.pre = pre
        self.store = AuditStore(path, checkpoint=policy)
        self.numbers = _KnownNumbers(self.store)
        self.store.requests = self.numbers  # type: ignore[assignment]

    def policy_checkpoints(self) -> tuple[int, float]:
        return self.store.checkpoints, self.store.checkpoint_s

    def append(self, i: int, batch: pa.Table, pid: int) -> None:
        d = self.pre.done[i]
        for part in d.parts:  # the parts chain from this store's heads, or the run is not measuring kvtrail
            assert self.store._chain.get(part.pid, (-1, chain.GENESIS)) == (part.batch_no - 1, part.prev), (
                "kvtrail-free: batches fed out of the order they were precomputed in"
            )
        self.numbers.next = d.numbers
        self.store._write(d.vb, d.seq, d.parts, _ready(d.runs), _ready(d.digests))

    def checkpoint(self) -> None:
        self.store.checkpoint()

    def close(self) -> None:
        self.store.close()
        report = verify_store(self.path)
        if not report.ok or report.batches_checked == 0:
            raise SystemExit(f"kvtrail-free: the store it wrote does not verify: {report.problems[:3]}")
