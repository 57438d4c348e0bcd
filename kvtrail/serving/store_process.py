"""The stack's store process: it owns the audit store and the relay that every recorder of the stack commits through.

DuckDB lets one process write a database file, and a commit costs milliseconds of CPU (validation, the
hash chain, one insert per event kind). In its own process that cost stays off the serving processes:
the router and the workers keep only their recorders' own work (the hot path and each writer's batch),
as in production, where the kvtrail service is the store's writer. The router holds one pipe to it: the
relay's address comes back at start, reads (SQL, rows back: tests and benchmarks inspect a running
stack) and the stop request go over it. A process that loses the pipe (the router was killed) closes
the relay and the store cleanly and exits.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

from kvtrail.errors import KvtrailError
from kvtrail.signals import ignore_stop_signals

_START_TIMEOUT_S = 60.0
_REPLY_TIMEOUT_S = 60.0


def store_main(db_path: str, conn: Connection) -> None:
    """Process entry point (spawned by :class:`StoreProcess`): open the store, serve the relay until stopped."""
    ignore_stop_signals()  # like the workers: the router stops this process last, after every flush
    from kvtrail.audit.relay import RelayServer
    from kvtrail.audit.store import AuditStore

    try:
        store = AuditStore(db_path)
    except Exception as exc:  # noqa: BLE001 - reported to the router, which fails the stack's start
        conn.send(("failed", f"{type(exc).__name__}: {exc}" if not isinstance(exc, KvtrailError) else str(exc)))
        return
    relay = RelayServer(store)
    conn.send(("ready", relay.address, relay.authkey))
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return  # the router is gone: nothing will ask again (finally closes what is open)
            if msg[0] == "stop":
                return
            conn.send(_query(store, msg[1], msg[2]))
    finally:
        relay.close()
        store.close()
        try:
            conn.send(("stopped",))
        except OSError:
            pass


def _query(store, sql: str, params: list) -> tuple:
    cur = store.cursor()
    try:
        return ("rows", cur.execute(sql, params).fetchall())
    except Exception as exc:  # noqa: BLE001 - a failed read is the caller's error, raised on its side
        return ("error", f"{type(exc).__name__}: {exc}")
    finally:
        cur.close()


class StoreProcess:
    """The router's handle on the store process: start, the relay's address, reads, stop."""

    def __init__(self, db_path: str | Path):
        self.db_path = Path(db_path)
        self.address: tuple[str, int] | None = None
        self.authkey: bytes | None = None
        self._proc: BaseProcess | None = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()  # one request on the pipe at a time

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def alive(self) -> bool:
        """Whether the store process is running (the router answers nothing it could not record otherwise)."""
        return self._proc is not None and self._proc.is_alive()

    @property
    def exitcode(self) -> int | None:
        """How the store process ended (a kill by signal ``n`` reads ``-n``); None while it runs."""
        return None if self._proc is None else self._proc.exitcode

    def start(self) -> "StoreProcess":
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=store_main, args=(str(self.db_path), child), name="kvtrail-store", daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        if not parent.poll(_START_TIMEOUT_S):
            raise KvtrailError(f"the store process did not start within {_START_TIMEOUT_S:.0f} s")
        try:
            msg = parent.recv()
        except EOFError:
            raise KvtrailError(f"the store process exited during start (exit code {self._proc.exitcode})") from None
        if msg[0] != "ready":
            raise KvtrailError(msg[1])
        _, (host, port), self.authkey = msg
        self.address = (host, port)
        return self

    def query(self, sql: str, params=()) -> list[tuple]:
        """Rows of a read on the store, run by the store process (on its own cursor)."""
        with self._lock:
            conn = self._conn
            if conn is None:
                raise KvtrailError("the store process is not running")
            try:
                conn.send(("query", sql, list(params)))
                if not conn.poll(_REPLY_TIMEOUT_S):
                    raise KvtrailError(f"the store process did not answer within {_REPLY_TIMEOUT_S:.0f} s")
                reply = conn.recv()
            except (EOFError, OSError) as exc:
                raise KvtrailError(f"the store process is gone: {exc}") from None
        if reply[0] == "error":
            raise KvtrailError(f"store query failed: {reply[1]}")
        return reply[1]

    def cursor(self) -> "StoreCursor":
        """A DB-API-like cursor whose reads the store process answers (``execute``, ``fetchall``, ``fetchone``)."""
        return StoreCursor(self)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Close the relay and the store (after every recorder has flushed) and end the process."""
        conn, proc = self._conn, self._proc
        self._conn = None
        if conn is not None:
            with self._lock:
                try:
                    conn.send(("stop",))
                    if conn.poll(timeout_s):
                        conn.recv()
                except (EOFError, OSError):
                    pass  # it ended already: the join below collects it
                conn.close()
        if proc is not None:
            proc.join(timeout_s)
            if proc.is_alive():  # only our own child, by its handle
                proc.kill()
                proc.join(5)
            self._proc = None


class StoreCursor:
    """The rows of one read through the store process, held until fetched."""

    def __init__(self, owner: StoreProcess):
        self._owner = owner
        self._rows: list[tuple] = []

    def execute(self, sql: str, params=()) -> "StoreCursor":
        self._rows = self._owner.query(sql, params)
        return self

    def fetchall(self) -> list[tuple]:
        rows, self._rows = self._rows, []
        return rows

    def fetchone(self) -> tuple | None:
        return self._rows.pop(0) if self._rows else None

    def close(self) -> None:
        self._rows = []
