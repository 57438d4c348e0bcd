"""Relay: recorders in other processes send their batches to the one process that owns the store.

DuckDB lets one process write a database file. In a multi-process deployment (the reference PD
stack: router, prefill and decode workers) each worker's :class:`~kvtrail.audit.recorder.Recorder`
uses a :class:`RelaySink`, which ships every batch as an Arrow IPC stream over a local socket to a
:class:`RelayServer` thread in the store-owning process and waits for the commit. The batch format is
the bulk wire format of the event model, so the HTTP ingest service can accept the same bytes.
"""

from __future__ import annotations

import logging
import queue
import secrets
import socket
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener

import pyarrow as pa
import pyarrow.compute as pc

from kvtrail.audit.batch import read_ipc, write_ipc
from kvtrail.audit.events import Producer
from kvtrail.audit.store import AppendResult, AuditStore
from kvtrail.audit.validate import PRODUCER_NAMES, producer_id
from kvtrail.errors import StoreError, ValidationError

log = logging.getLogger("kvtrail.audit")
# Replies, one per batch: ("ok", events, page_events, runs, [(producer_id, batch_no), ...]),
# ("invalid", field, reason, event, kind, events) when the store refused the batch (nothing of it stored;
# events: every event breaking the same rule, as ValidationError.events),
# ("error", message) when the store failed.
Reply = tuple


class RelayServer:
    """Accepts batches from RelaySinks on 127.0.0.1 (port chosen by the OS) and appends them to a store.

    Appends are serialised through one lock: the store's connection has one writer at a time.
    """

    def __init__(self, store: AuditStore, *, authkey: bytes | None = None, coalesce_s: float = 0.05):
        self.store = store
        self.coalesce_s = coalesce_s
        self._queue: queue.Queue = queue.Queue()
        self._committer = threading.Thread(target=self._commit_loop, name="kvtrail-relay-commit", daemon=True)
        self._committer.start()
        self.authkey = authkey or secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=self.authkey)
        self.address = self._listener.address
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._conns: list[Connection] = []
        self._closed = False
        self._accepter = threading.Thread(target=self._accept, name="kvtrail-relay-accept", daemon=True)
        self._accepter.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except AuthenticationError as exc:
                # A peer with the wrong key is refused; the relay keeps serving the others.
                log.warning("kvtrail relay: refused a connection: %s", exc)
                continue
            except (OSError, EOFError):
                if self._closed:
                    return
                continue
            self._conns.append(conn)
            t = threading.Thread(target=self._serve, args=(conn,), name="kvtrail-relay", daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, conn: Connection) -> None:
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                return
            try:
                table = read_ipc(data)
            except ValidationError as exc:
                self._reply(conn, ("invalid", exc.field, exc.reason, exc.event, exc.kind, exc.events))
                continue
            self._queue.put((table, conn))

    def _commit_loop(self) -> None:
        """One committer: batches that arrive within ``coalesce_s`` of each other share a transaction."""
        while True:
            first = self._queue.get()
            if first is None:
                return
            group = [first]
            deadline = time.monotonic() + self.coalesce_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    item = self._queue.get(timeout=left)
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)
                    break
                group.append(item)
            self._commit_group(group)

    def _commit_group(self, group: list) -> None:
        if len(group) > 1:
            try:
                with self._lock:
                    res = self.store.append(pa.concat_tables([t for t, _ in group], promote_options="permissive"))
            except ValidationError:
                pass  # some batch in the group is bad: commit them one by one so only it is refused
            except Exception as exc:  # noqa: BLE001 - reported to every sender, which counts the loss
                log.exception("kvtrail relay: append failed")
                for _, conn in group:
                    self._reply(conn, ("error", f"{type(exc).__name__}: {exc}"))
                return
            else:
                committed = dict(res.batches)
                for table, conn in group:
                    batches = [(pid, committed[pid]) for pid in _producer_ids(table)]
                    pages = int(pc.sum(pc.list_value_length(table.column("pages"))).as_py() or 0)
                    self._reply(conn, ("ok", table.num_rows, pages, 0, batches))
                return
        for table, conn in group:
            reply: Reply
            try:
                with self._lock:
                    res = self.store.append(table)
                reply = ("ok", res.num_events, res.num_page_events, res.num_runs, list(res.batches))
            except ValidationError as exc:
                reply = ("invalid", exc.field, exc.reason, exc.event, exc.kind, exc.events)
            except Exception as exc:  # noqa: BLE001 - reported to the sender, which counts the loss
                log.exception("kvtrail relay: append failed")
                reply = ("error", f"{type(exc).__name__}: {exc}")
            self._reply(conn, reply)

    @staticmethod
    def _reply(conn: Connection, reply: Reply) -> None:
        try:
            conn.send(reply)
        except (OSError, EOFError):
            pass

    def close(self) -> None:
        self._closed = True
        self._queue.put(None)
        self._committer.join(10)
        try:
            # Wake the blocking accept() so its thread can end.
            Client(self.address, authkey=self.authkey).close()
        except OSError:
            pass
        self._listener.close()
        # Shut the sockets down first: a serving thread blocked in recv then sees end-of-stream, where
        # closing the connection under it would pull its handle away mid-read.
        for c in self._conns:
            _shutdown(c)
        for t in self._threads:
            t.join(5)
        for c in self._conns:
            c.close()
        self._accepter.join(5)


def _shutdown(conn: Connection) -> None:
    try:
        with socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # closed already, or the peer hung up: nothing left to wake


def _producer_ids(table: pa.Table) -> list[int]:
    """Ids of the producers in a batch, in order of first appearance (none for an empty batch)."""
    names = list(PRODUCER_NAMES)
    keys = table.select(names).group_by(names, use_threads=False).aggregate([])
    return [producer_id(Producer(**row)) for row in keys.to_pylist()]


class RelaySink:
    """A recorder sink that forwards batches to a RelayServer and returns its commit result.

    Used by exactly one writer thread, like any sink. Raises ValidationError when the store rejected
    the batch (so the writer isolates the bad event) and StoreError when the relay or its store failed.
    """

    def __init__(self, address: tuple[str, int], authkey: bytes):
        host, port = address  # any pair: a tuple, or a list after a round trip through JSON
        try:
            self._conn = Client((host, port), authkey=authkey)
        except OSError as exc:
            raise StoreError(f"relay: cannot connect to {address}: {exc}") from None
        except AuthenticationError:
            raise StoreError(f"relay: {address} refused the authkey") from None

    def append(self, table) -> AppendResult:
        try:
            self._conn.send_bytes(write_ipc(table))
            reply = self._conn.recv()
        except (OSError, EOFError) as exc:
            raise StoreError(f"relay: connection lost: {exc}") from None
        if reply[0] == "ok":
            _, events, pages, runs, batches = reply
            return AppendResult(events, pages, runs, tuple(tuple(b) for b in batches))
        if reply[0] == "invalid":
            _, field, reason, event, kind, events = reply
            raise ValidationError(field, reason, event=event, kind=kind, events=tuple(events))
        raise StoreError(f"relay: store failed: {reply[1]}")

    def close(self) -> None:
        self._conn.close()
