"""``RemoteSource``: the dashboard against a running ``kvtrail serve``, through its query API.

Every table comes from the route the CLI's ``--url`` uses (the same forensics functions on the service's
store), so the numbers are the ones a store file would give. An operator token sees every view; a
tenant token only its own affected responses and whether its data was read (the service reduces the
rest to counts and refuses what a tenant may not ask). A request's page ownership timeline comes from
``/v1/requests/{id}/pages`` (the same ``dashboards.pages`` function on the service's store; for a tenant,
other requests, tenants and nodes as pseudonyms).
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace
from typing import Any

import httpx
import polars as pl

from kvtrail import forensics as fx
from kvtrail.answers import pages
from kvtrail.answers.ask import ServiceAnswers, window_params
from kvtrail.answers.client import Client
from kvtrail.answers.store import SourceError, Thresholds
from kvtrail.answers.text import coverage_lines
from kvtrail.answers.transfers import SCHEMA as TRANSFER_SCHEMA
from kvtrail.errors import KvtrailError
from kvtrail.timeutil import format_utc

TENANT_SPAN_NS = 7 * 86_400 * 10**9  # a tenant cannot see node configurations: its default window


class RemoteSource:
    """A kvtrail service at ``url``, asked with one token; ``role`` is operator or tenant."""

    def __init__(self, url: str, token: str | None, *, transport: httpx.BaseTransport | None = None):
        self.client = Client(url, token, transport=transport)
        self.answers = ServiceAnswers(url, token, client=self.client)  # the questions, asked as the CLI asks them
        self.label = f"service {self.client.url}"
        self._answers: dict[fx.Window, Any] | None = None  # one render's affected answers (see rendering)
        try:
            self._nodes = self.client.table("/v1/nodes", {})[0]
            self.role = "operator"
        except KvtrailError as exc:
            if "answered 403" not in str(exc):
                raise SourceError("invalid", str(exc)) from None
            self._nodes = pl.DataFrame()
            self.role = "tenant"

    def rendering(self) -> RemoteSource:
        """This source for one render of a view: a copy that keeps the affected answers it is given during
        the render, so the view's coverage warnings and its rows come from one request where they ask the
        same window. The next render asks the service again: no answer outlives a render (new events, a
        revoked token)."""
        view = copy.copy(self)
        view._answers = {}
        return view

    def _affected(self, w: fx.Window) -> Any:
        if self._answers is None:
            return self.answers.affected(w)
        if w not in self._answers:
            self._answers[w] = self.answers.affected(w)
        return self._answers[w]

    @staticmethod
    def _params(w: fx.Window, tenant_ok: bool = True) -> dict[str, Any]:
        return {
            "from": format_utc(w.from_ns) if w.from_ns is not None else None,
            "to": format_utc(w.to_ns) if w.to_ns is not None else None,
            "node": w.node,
            "tenant": w.tenant if tenant_ok else None,
        }

    def bounds(self) -> tuple[int, int] | None:
        now = time.time_ns()
        if self.role == "tenant" or self._nodes.is_empty():
            return now - TENANT_SPAN_NS, now
        return int(self._nodes["effective_from_ns"].min()), now  # type: ignore[arg-type]

    def events_in(self, w: fx.Window) -> int:
        return 1  # the service does not say; every view has its own empty state

    def choices(self) -> tuple[list[str], list[str]]:
        if self.role == "tenant":
            return [], []
        return sorted(set(self._nodes["node"])), []

    def fleet(self, w: fx.Window) -> pl.DataFrame:
        rows = self.client.table("/v1/nodes", self._params(w, tenant_ok=False))[0]
        gaps = self.client.table("/v1/coverage", {})[0]
        missing = gaps.group_by("node").agg(pl.col("unexplained").sum()) if len(gaps) else None
        rows = rows.with_columns(pl.lit(None, pl.Int64).alias("recorder_dropped_events"))  # no route says
        if missing is None:
            return rows.with_columns(pl.lit(0, pl.Int64).alias("unexplained_gap_events"))
        return rows.join(missing.rename({"unexplained": "unexplained_gap_events"}), on="node", how="left").with_columns(
            pl.col("unexplained_gap_events").fill_null(0)
        )

    def counts(self, w: fx.Window) -> None:
        """No route serves the per-minute aggregates: the views count the rows they are sent."""
        return None

    def found(self, w: fx.Window) -> tuple[list[fx.Finding], str]:
        return [], f"the service at {self.client.url}"

    def coverage(self, w: fx.Window) -> list[str]:
        """As :meth:`StoreSource.coverage`, from the service's answer; a tenant's answers carry none (its
        warnings would name other requests)."""
        if self.role == "tenant":
            return []
        answer = self._affected(fx.Window(w.from_ns, w.to_ns))
        return coverage_lines(answer.gaps, answer.warnings)

    def findings(self, w: fx.Window) -> pl.DataFrame:
        return self.answers.findings(w).rows

    def affected(self, w: fx.Window) -> pl.DataFrame:
        rows = self._affected(w if self.role != "tenant" else replace(w, tenant=None)).rows
        if self.role == "tenant":  # victims come as counts: the view's columns, without other tenants' ids
            rows = rows.with_columns(
                pl.lit(None, pl.Utf8).alias("tenant_id"), pl.lit([], pl.List(pl.Utf8)).alias("victim_tenants")
            )
        return rows

    def exposure(self, w: fx.Window) -> pl.DataFrame:
        if self.role == "tenant":
            r = self.client.document("/v1/exposure", self._params(w, tenant_ok=False))
            return pl.DataFrame(
                [
                    {
                        "recipient_tenant": "(other tenants)",
                        "victim_tenant": r["tenant_id"],
                        "responses": r["reading_responses"],
                        "pages": r["pages"],
                        "victim_requests": len(r["my_requests_read"]),
                    }
                ]
                if r["exposed"]
                else [],
                schema={
                    "recipient_tenant": pl.Utf8,
                    "victim_tenant": pl.Utf8,
                    "responses": pl.Int64,
                    "pages": pl.Int64,
                    "victim_requests": pl.Int64,
                },
            )
        return self.answers.exposure(w).rows

    def thresholds(self, w: fx.Window) -> Thresholds:
        if self.role == "tenant":
            return Thresholds(pl.DataFrame(), "The threshold analysis is for operators.")
        answer = self.answers.thresholds(w)
        return Thresholds(answer.rows, (answer.notes or ("",))[0])

    def exploitation(self, w: fx.Window) -> pl.DataFrame:
        # The service's own probe defaults (the dashboard sets no baseline or threshold of its own).
        return self.answers.answer("/v1/exploitation", window_params(w)).rows

    def transfers(self, w: fx.Window) -> pl.DataFrame:
        rows = self.client.table("/v1/transfers", self._params(w))[0]
        if rows.is_empty():
            return pl.DataFrame(schema=TRANSFER_SCHEMA)
        return rows.select(list(TRANSFER_SCHEMA)).cast(TRANSFER_SCHEMA)  # type: ignore[arg-type]

    def request(self, request_id: str, w: fx.Window, tenant: str | None = None) -> pages.RequestDetail:
        """One request's page ownership timeline, tokens and digests, TTFT (``/v1/requests/{id}/pages``;
        ``tenant``: whose request of that id, when two tenants' requests share it)."""
        params = self._params(w, tenant_ok=False)
        if self.role == "tenant":
            params["node"] = None
        else:
            params["tenant"] = tenant
        return pages.detail_from_document(self.client.request_pages(request_id, params))

    def report(self, w: fx.Window, context_yaml: bytes | None) -> tuple[bytes, dict, str]:
        body = {
            "from": format_utc(w.from_ns),
            "to": format_utc(w.to_ns),
            "context_yaml": context_yaml.decode("utf-8") if context_yaml is not None else None,
        }
        data, counts = self.client.report(body)
        return (
            data,
            counts,
            (
                "written by the service on a snapshot of its store: check it with "
                "'kvtrail forensics verify-report DIR --db STORE' against the store"
            ),
        )
