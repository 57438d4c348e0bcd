"""What one running service holds: the store (its one write connection), the write lock, the ingest
writer and the live judge. The HTTP routes receive a :class:`ServiceState`; queries read through
:meth:`ServiceState.cursor`; the ingest writer and the other writers of shared tables (tokens, access log)
hold ``write_lock``, the live judge writes its own tables (findings, aggregates) on its own cursor.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from kvtrail.alerts.otel import OtelExport
from kvtrail.audit.chain import Signer
from kvtrail.audit.store import DEFAULT_CHECKPOINT, AuditStore, CheckpointPolicy
from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.service import tokens
from kvtrail.service.auth import VerifiedTokens
from kvtrail.service.committer import Committer
from kvtrail.service.config import DEFAULT_JUDGE_HORIZON_S
from kvtrail.service.judge import POLL_INTERVAL_S, Judge
from kvtrail.service.judged import AnswerCache, SharedSnapshots
from kvtrail.service.limits import QueryLimiter, QueryLimits


@dataclass
class ServiceState:
    """The store a service owns and the threads that write it. Made by :func:`open_state`."""

    db_path: Path
    store: AuditStore  # the one write connection; only the committer appends batches
    write_lock: threading.Lock
    judge: Judge
    committer: Committer
    answers: AnswerCache = field(default_factory=AnswerCache)  # answers on judged snapshots (judged.py)
    snapshots: SharedSnapshots = field(default_factory=SharedSnapshots)  # judged snapshots (judged.py)
    verified: VerifiedTokens = field(default_factory=VerifiedTokens)  # tokens checked recently (auth.py)
    limiter: QueryLimiter = field(default_factory=QueryLimiter)  # queries running and waiting per token
    started_ns: int = field(default_factory=time.time_ns)
    checkpoint_signer: Signer | None = None  # signs GET /v1/audit/checkpoint (serve --signing-key)
    closed: bool = False
    export: OtelExport | None = None  # the judge's results to OpenTelemetry (kvtrail.alerts.otel), when asked

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A fresh connection to the store's database, for one request (close it when done)."""
        return self.store.cursor()

    def close(self, timeout_s: float = 30.0) -> None:
        """Commit the batches still queued, judge them, then checkpoint and close the store (and send what the
        OpenTelemetry export still holds)."""
        if self.closed:
            return
        self.closed = True
        self.committer.close(timeout_s)
        self.judge.close(timeout_s)
        with self.write_lock:
            self.store.close()
        if self.export is not None:  # after the store: a receiver that is down never delays its checkpoint
            self.export.close(timeout_s)


def open_state(
    db_path: str | Path,
    *,
    tokens_file: str | Path | None = None,
    policy: ForensicsPolicy = ForensicsPolicy(),
    checkpoint: CheckpointPolicy = DEFAULT_CHECKPOINT,
    judge_interval_s: float = POLL_INTERVAL_S,
    export: OtelExport | None = None,
    query_limits: QueryLimits | None = None,
    memory_limit_mb: int | None = None,
    judge_horizon_s: int = DEFAULT_JUDGE_HORIZON_S,
) -> ServiceState:
    """Open (or create) the store at ``db_path`` for writing and start the committer and the judge.

    ``export``: where the judge's results go as OpenTelemetry (closed with the state). ``memory_limit_mb``:
    DuckDB's buffer pool for the database (every cursor shares it; None leaves DuckDB's default).
    ``judge_horizon_s``: history time after its newest event that the judge forgets a request no page names.
    Raises StoreError naming the path when another process holds the store, and ValueError for a bad
    token file (then the store is closed again).
    """
    path = Path(db_path)
    store = AuditStore(path, checkpoint=checkpoint)
    lock = threading.Lock()
    try:
        with lock:
            if memory_limit_mb is not None:
                store.con.execute(f"SET memory_limit = '{int(memory_limit_mb)}MB'")
            tokens.ensure_tables(store.con)
            if tokens_file is not None:
                tokens.load_token_file(store.con, tokens_file)
    except BaseException:
        store.close()
        raise
    judge = Judge(
        store.cursor,
        policy=policy,
        poll_interval_s=judge_interval_s,
        horizon_ns=judge_horizon_s * 1_000_000_000,
        on_judged=None if export is None else export.judged,
    )
    committer = Committer(store, lock, on_commit=judge.notify)
    judge.notify()  # judge what the store already holds
    return ServiceState(path, store, lock, judge, committer, export=export, limiter=QueryLimiter(query_limits))
