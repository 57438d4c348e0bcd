"""The recorder contract: what serving code may call on a recorder, and what a recorder writes into.

:class:`AuditRecorder` lists the public recording methods with their exact signatures. The
in-process :class:`~kvtrail.audit.recorder.Recorder`, the switched-off
:class:`~kvtrail.audit.recorder.NullRecorder` and engine plugins implement it, so serving code
depends on this module only. :func:`contract_problems` checks an implementation method by method
(``isinstance`` on a runtime-checkable protocol only checks that the names exist).

:class:`Sink` is what the recorder's writer thread commits batches to: the audit store, or a relay
to the process that owns it.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from numpy.typing import ArrayLike

from kvtrail.audit.events import RequestRef

if TYPE_CHECKING:
    import pyarrow as pa

# Page ids, digests or block hashes: an ndarray, a list/tuple/range of ints, or a CPU tensor.
PageIds = ArrayLike


@runtime_checkable
class AuditRecorder(Protocol):
    """The recording API serving code calls. No method raises into the caller; ``stats`` reports losses."""

    def node_config(
        self,
        *,
        pool_tokens: int,
        pool_pages: int,
        page_size: int,
        context_tokens: int,
        max_running_requests: int | None = None,
        checksum_enabled: bool | None = None,
        canary_enabled: bool | None = None,
        deferred_release: bool | None = None,
        page_tags: bool | None = None,
        config_source: str | None = None,
        release_timeout_ns: int | None = None,
        transfer_batch_max_pages: int | None = None,
    ) -> None: ...

    def request_received(self, req: RequestRef, prompt_tokens: int, max_new_tokens: int | None = None) -> None: ...

    def pages_allocated(
        self, req: RequestRef, pages: PageIds, purpose: str, block_hashes: PageIds | None = None
    ) -> None: ...

    def pages_freed(self, req: RequestRef | None, pages: PageIds, reason: str) -> None: ...

    def kv_written(
        self,
        req: RequestRef,
        pages: PageIds,
        token_start: int,
        token_end: int,
        source: str,
        page_digests: PageIds | None = None,
        digest_algo: str | None = None,
        block_hashes: PageIds | None = None,
    ) -> None: ...

    def kv_read(
        self, req: RequestRef, pages: PageIds, page_digests: PageIds | None = None, digest_algo: str | None = None
    ) -> None: ...

    def transfer_reserved(self, req: RequestRef, pages: PageIds, num_tokens: int) -> None: ...

    def transfer_sent(
        self,
        req: RequestRef,
        pages: PageIds,
        dst_pages: PageIds,
        num_tokens: int,
        is_last_chunk: bool,
        digest: int | None = None,
        digest_algo: str | None = None,
        digest_tokens: int | None = None,
    ) -> None: ...

    def transfer_received(
        self,
        req: RequestRef,
        pages: PageIds,
        num_tokens: int,
        status: str,
        digest: int | None = None,
        digest_algo: str | None = None,
        digest_tokens: int | None = None,
    ) -> None: ...

    def request_aborted(
        self, req: RequestRef, stage: str, reason: str, http_status: int, prompt_tokens: int | None = None
    ) -> None: ...

    def response_sent(
        self,
        req: RequestRef,
        http_status: int,
        prompt_tokens: int,
        completion_tokens: int,
        latency_ns: int,
        ttft_ns: int | None = None,
        finish_reason: str | None = None,
        spec_verify_steps: int | None = None,
        spec_accepted_drafts: int | None = None,
        spec_proposed_drafts: int | None = None,
    ) -> None: ...

    def kv_canary_violation(
        self,
        pages: PageIds,
        canary_slot: int,
        canary_tag: str,
        canary_reason: str,
        canary_position: int | None = None,
    ) -> None: ...

    def events_lost(self, reason: str, events: int, pages: int, detail: str) -> None:
        """Record that ``events`` events (``pages`` page-events) the caller meant to record were lost.

        For losses the recorder cannot see itself, e.g. a serving hook that failed before it could call
        the recorder; ``reason`` is one of the ``gap_reason`` values (``hook_error`` for those).
        """
        ...

    def flush(self, timeout: float | None = None) -> bool:
        """Block until everything recorded before the call is committed; False if ``timeout`` passed first."""
        ...

    def close(self, timeout: float | None = 30.0) -> None:
        """Flush and release what the recorder holds (its writer thread, its sink)."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters for metrics and reports (recorded, dropped, committed)."""
        ...


class AppendOutcome(Protocol):
    """What a sink reports for one committed batch."""

    @property
    def num_events(self) -> int: ...

    @property
    def num_page_events(self) -> int: ...

    @property
    def batches(self) -> tuple[tuple[int, int], ...]: ...


class Sink(Protocol):
    """Where a recorder's writer commits batches. ``append`` raises ValidationError for a batch the
    store refuses (nothing of it is stored) and any other exception for a failed store. A sink with
    a ``close`` method is closed when the writer stops."""

    def append(self, table: pa.Table) -> AppendOutcome: ...


CONTRACT_METHODS: tuple[str, ...] = (
    "node_config",
    "request_received",
    "pages_allocated",
    "pages_freed",
    "kv_written",
    "kv_read",
    "transfer_reserved",
    "transfer_sent",
    "transfer_received",
    "request_aborted",
    "response_sent",
    "kv_canary_violation",
    "events_lost",
    "flush",
    "close",
    "stats",
)


def _parameter_problem(expected: inspect.Parameter, got: inspect.Parameter | None) -> str | None:
    if got is None:
        return f"parameter {expected.name!r} is missing"
    if got.kind != expected.kind:
        return f"parameter {expected.name!r} is {got.kind.description}, expected {expected.kind.description}"
    if expected.default is not inspect.Parameter.empty and got.default != expected.default:
        shown = "no default" if got.default is inspect.Parameter.empty else f"default {got.default!r}"
        return f"parameter {expected.name!r} has {shown}, expected default {expected.default!r}"
    return None


def contract_problems(impl: Any) -> list[str]:
    """Why ``impl`` (a class or an instance) does not implement :class:`AuditRecorder`; empty if it does.

    Every contract method must exist with the contract's parameters: same names in the same order,
    same kinds, the same defaults. Extra trailing parameters are allowed only with a default.
    """
    problems = []
    for name in CONTRACT_METHODS:
        method = getattr(impl, name, None)
        if not callable(method):
            problems.append(f"{name}: missing")
            continue
        expected = list(inspect.signature(getattr(AuditRecorder, name)).parameters.values())[1:]  # drop self
        params = list(inspect.signature(method).parameters.values())
        if isinstance(impl, type):  # unbound function of a class: drop self
            params = params[1:]
        got = {p.name: p for p in params}
        order = [p.name for p in params]
        for i, exp in enumerate(expected):
            problem = _parameter_problem(exp, got.get(exp.name))
            if problem is None and exp.kind is not inspect.Parameter.KEYWORD_ONLY and order.index(exp.name) != i:
                problem = f"parameter {exp.name!r} is not at position {i}"
            if problem:
                problems.append(f"{name}: {problem}")
        known = {p.name for p in expected}
        for p in params:
            if (
                p.name not in known
                and p.default is inspect.Parameter.empty
                and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
            ):
                problems.append(f"{name}: extra parameter {p.name!r} has no default")
    return problems
