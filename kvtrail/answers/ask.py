"""The one way to ask: :class:`Answers`, with one implementation per source of an audit record.

- :class:`StoreAnswers`: a store file, opened read-only per question (a store a running service holds
  is one line suggesting ``--url``);
- :class:`ServiceAnswers`: a running ``kvtrail serve``, its tables turned back into the same
  :class:`~kvtrail.forensics.Answer` a store's question returns;
- :class:`LakeAnswers`: an audit lake, its partition tasks on an executor (in-process or Dask).

:func:`open_answers` makes the choice once, from the flags every face shares (``--db``, ``--url`` /
``--token``, ``--lake`` with ``--scheduler`` / ``--workers``). The same question asked of the three
sources returns the same rows (``tests/answers/test_sources.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Protocol, TypeVar

import polars as pl

from kvtrail.answers.client import Client
from kvtrail.answers.spec import COVERAGE, TENANT_EXPOSURE
from kvtrail.errors import KvtrailError, StoreError
from kvtrail.forensics import (
    Answer,
    Exclusions,
    ForensicsPolicy,
    ReportOptions,
    Window,
    ask_affected,
    ask_exploitation,
    ask_exposure,
    ask_findings,
    ask_thresholds,
)
from kvtrail.forensics.engine_signals import SignalPolicy
from kvtrail.forensics.lake.executor import DaskExecutor, Executor, LocalExecutor
from kvtrail.forensics.lake.questions import (
    Lake,
    ask_lake_affected,
    ask_lake_exploitation,
    ask_lake_exposure,
    ask_lake_findings,
    ask_lake_thresholds,
    open_lake,
)
from kvtrail.forensics.questions import require_store
from kvtrail.timeutil import format_utc

T = TypeVar("T")
NO_EXCLUSIONS = Exclusions()
DEFAULT_POLICY = ForensicsPolicy()
DEFAULT_SIGNALS = SignalPolicy()


class Answers(Protocol):
    """The questions every face asks, whatever the source; each returns an :class:`Answer`."""

    kind: str  # "store", "service" or "lake"

    def findings(
        self,
        w: Window,
        *,
        codes: tuple[str, ...] = (),
        exclusions: Exclusions = NO_EXCLUSIONS,
        engine: str = "replay",
        policy: ForensicsPolicy = DEFAULT_POLICY,
        signals: SignalPolicy = DEFAULT_SIGNALS,
    ) -> Answer: ...

    def affected(self, w: Window, *, exclusions: Exclusions = NO_EXCLUSIONS) -> Answer: ...

    def exposure(self, w: Window, *, exclusions: Exclusions = NO_EXCLUSIONS) -> Answer: ...

    def thresholds(self, w: Window, *, exclusions: Exclusions = NO_EXCLUSIONS) -> Answer: ...

    def exploitation(self, w: Window, options: ReportOptions) -> Answer: ...


def hint_service(fn: Callable[[], T]) -> T:
    """``fn()`` on a store file; a store a running process holds (the service) is one line suggesting ``--url``."""
    try:
        return fn()
    except StoreError as exc:
        if "in use by another process" not in str(exc):
            raise
        raise KvtrailError(
            f"{exc}; if a kvtrail service holds it, ask the service instead: "
            "--url URL --token TOKEN (or KVTRAIL_URL/KVTRAIL_TOKEN)"
        ) from None


class StoreAnswers:
    """The questions asked of a store file (read-only, one connection per question)."""

    kind = "store"

    def __init__(self, db: str):
        self.db = db

    def findings(
        self,
        w: Window,
        *,
        codes: tuple[str, ...] = (),
        exclusions: Exclusions = NO_EXCLUSIONS,
        engine: str = "replay",
        policy: ForensicsPolicy = DEFAULT_POLICY,
        signals: SignalPolicy = DEFAULT_SIGNALS,
    ) -> Answer:
        return hint_service(
            lambda: ask_findings(
                self.db, w, codes=codes, engine=engine, policy=policy, exclusions=exclusions, signals=signals
            )
        )

    def affected(self, w: Window, *, exclusions: Exclusions = NO_EXCLUSIONS) -> Answer:
        return hint_service(lambda: ask_affected(self.db, w, exclusions=exclusions))

    def exposure(self, w: Window, *, exclusions: Exclusions = NO_EXCLUSIONS) -> Answer:
        return hint_service(lambda: ask_exposure(self.db, w, exclusions=exclusions))

    def thresholds(self, w: Window, *, exclusions: Exclusions = NO_EXCLUSIONS) -> Answer:
        return hint_service(lambda: ask_thresholds(self.db, w, exclusions=exclusions))

    def exploitation(self, w: Window, options: ReportOptions) -> Answer:
        require_store(self.db)
        return hint_service(lambda: ask_exploitation(self.db, options, w))


def window_params(w: Window, excl: Exclusions | None = None) -> dict:
    """The HTTP parameters of a window (times as ISO UTC, which the service parses back to the same
    microsecond) and of exclusions."""
    params: dict = {
        "from": format_utc(w.from_ns) if w.from_ns is not None else None,
        "to": format_utc(w.to_ns) if w.to_ns is not None else None,
        "tenant": w.tenant,
        "node": w.node,
    }
    if excl is not None:
        for name, pairs in (
            ("exclude_tenant", excl.tenants),
            ("exclude_api_key", excl.api_key_ids),
            ("exclude_request", excl.request_ids),
        ):
            params[name] = [f"{k}={v}" for k, v in pairs]
    return params


class ServiceAnswers:
    """The questions asked of a running service: its tables as the same :class:`Answer` a store returns."""

    kind = "service"

    def __init__(self, url: str, token: str | None, client: Client | None = None):
        self.client = client or Client(url, token)

    def answer(self, path: str, params: dict) -> Answer:
        rows, meta = self.client.table(path, params)
        gaps = pl.DataFrame(meta.get("gaps", []), schema=COVERAGE.schema)
        excluded = pl.DataFrame(
            [{"excluded_by": by, "reason": why} for by, why, n in meta.get("excluded", []) for _ in range(int(n))],
            schema={"excluded_by": pl.Utf8, "reason": pl.Utf8},
        )
        return Answer(
            rows, excluded, gaps, tuple(meta.get("notes", ())), tuple(meta.get("warnings", ())), meta.get("summary", {})
        )

    def findings(
        self,
        w: Window,
        *,
        codes: tuple[str, ...] = (),
        exclusions: Exclusions = NO_EXCLUSIONS,
        engine: str = "replay",
        policy: ForensicsPolicy = DEFAULT_POLICY,
        signals: SignalPolicy = DEFAULT_SIGNALS,
    ) -> Answer:
        if signals != DEFAULT_SIGNALS:
            raise KvtrailError("--spec-min-accept-rate: not with --url (ask a store or a lake for it)")
        return self.answer(
            "/v1/findings",
            {
                **window_params(w, exclusions),
                "code": list(codes),
                "engine": engine,
                "latency_factor": policy.latency_factor,
                "allow_tenant_cache_sharing": policy.allow_tenant_cache_sharing or None,
            },
        )

    def affected(self, w: Window, *, exclusions: Exclusions = NO_EXCLUSIONS) -> Answer:
        return self.answer("/v1/affected", window_params(w, exclusions))

    def exposure(self, w: Window, *, exclusions: Exclusions = NO_EXCLUSIONS) -> Answer:
        answer = self.answer("/v1/exposure", window_params(w, exclusions))
        if "recipient_tenant" in answer.rows.columns:
            return answer
        # A tenant's token: whether its own data was read, as one row of counts (spec.TENANT_EXPOSURE).
        rows = answer.rows.select([pl.col(c.name).cast(c.dtype) for c in TENANT_EXPOSURE.columns])
        return replace(answer, rows=rows)

    def thresholds(self, w: Window, *, exclusions: Exclusions = NO_EXCLUSIONS) -> Answer:
        return self.answer("/v1/thresholds", window_params(w, exclusions))

    def exploitation(self, w: Window, options: ReportOptions) -> Answer:
        r = options.rules
        probe = {
            "baseline_from": format_utc(options.baseline_from_ns) if options.baseline_from_ns is not None else None,
            "baseline_to": format_utc(options.baseline_to_ns) if options.baseline_to_ns is not None else None,
            "long_prompt_tokens": options.long_prompt_tokens,
            "burst_minutes": r.burst_minutes,
            "burst_count": r.burst_count,
        }
        return self.answer("/v1/exploitation", {**window_params(w, options.exclusions), **probe})


class LakeAnswers:
    """The questions asked of an audit lake (opened once), each fanned out on ``executor``."""

    kind = "lake"

    def __init__(self, lake: Lake, executor: Executor):
        self.lake = lake
        self.executor = executor

    def findings(
        self,
        w: Window,
        *,
        codes: tuple[str, ...] = (),
        exclusions: Exclusions = NO_EXCLUSIONS,
        engine: str = "replay",
        policy: ForensicsPolicy = DEFAULT_POLICY,
        signals: SignalPolicy = DEFAULT_SIGNALS,
    ) -> Answer:
        return ask_lake_findings(
            self.lake,
            w,
            codes=codes,
            policy=policy,
            exclusions=exclusions,
            executor=self.executor,
            engine=engine,
            signals=signals,
        )

    def affected(self, w: Window, *, exclusions: Exclusions = NO_EXCLUSIONS) -> Answer:
        return ask_lake_affected(self.lake, w, exclusions=exclusions, executor=self.executor)

    def exposure(self, w: Window, *, exclusions: Exclusions = NO_EXCLUSIONS) -> Answer:
        return ask_lake_exposure(self.lake, w, exclusions=exclusions, executor=self.executor)

    def thresholds(self, w: Window, *, exclusions: Exclusions = NO_EXCLUSIONS) -> Answer:
        return ask_lake_thresholds(self.lake, w, exclusions=exclusions, executor=self.executor)

    def exploitation(self, w: Window, options: ReportOptions) -> Answer:
        return ask_lake_exploitation(self.lake, options, w, executor=self.executor)


@contextmanager
def lake_executor(scheduler: str | None, workers: int | None) -> Iterator[Executor]:
    """The executor the flags ask for (in-process without either), closed after."""
    if scheduler is not None and workers is not None:
        raise KvtrailError("--scheduler: give either --scheduler or --workers")
    executor = DaskExecutor(scheduler, workers) if scheduler is not None or workers is not None else LocalExecutor()
    try:
        yield executor
    finally:
        executor.close()


@contextmanager
def open_answers(
    db: str | None = None,
    url: str | None = None,
    token: str | None = None,
    lake: str | None = None,
    scheduler: str | None = None,
    workers: int | None = None,
) -> Iterator[Answers]:
    """The source the flags name, chosen once: a lake (``--lake``), else a service (``--url``), else the
    store file (``--db``)."""
    if lake is None:
        if scheduler is not None or workers is not None:
            raise KvtrailError("--scheduler/--workers: only with --lake")
        if url:
            yield ServiceAnswers(url, token)
        elif db is not None:
            yield StoreAnswers(db)
        else:
            raise KvtrailError("--db: give a store file, --url URL or --lake DIR|URL")
        return
    if url:
        raise KvtrailError("--lake: give either --lake or --url")
    with lake_executor(scheduler, workers) as executor, open_lake(lake) as opened:
        yield LakeAnswers(opened, executor)
