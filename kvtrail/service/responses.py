"""How the query API returns a table: JSON (the CLI's ``--format json``), CSV or Parquet, with what the CLI
prints on stderr (coverage gaps, notes, warnings, exclusions) in the ``X-Kvtrail-Answer`` header.

The header holds compact JSON (ASCII only); Parquet also carries it in the file's schema metadata
(key ``kvtrail.answer``), where no header size limit cuts it; ``--url`` clients (:mod:`kvtrail.answers.client`)
read that.
"""

from __future__ import annotations

import io
import json

import polars as pl
import pyarrow.parquet as pq
from fastapi import Response

from kvtrail.answers.client import ANSWER_HEADER, META_KEY
from kvtrail.answers.tables import json_text
from kvtrail.forensics import Answer
from kvtrail.outputs import csv_frame

PARQUET = "application/vnd.apache.parquet"
MAX_HEADER_CHARS = 8000
FORMATS = ("json", "csv", "parquet")

TABLE_CONTENT = {
    "text/csv": {"schema": {"type": "string"}},
    PARQUET: {"schema": {"type": "string", "format": "binary"}},
}


def answer_meta(answer: Answer | None, *, tenant: bool) -> dict:
    """What the CLI would print beside the rows. A tenant learns only how many events are missing,
    never from which nodes, and no notes or warnings (they name other requests)."""
    if answer is None:
        return {}
    gaps = answer.gaps
    if tenant:
        return {"missing_events": int(gaps["unexplained"].sum()) if len(gaps) else 0}
    excluded = answer.excluded
    reasons: list[list] = []
    if len(excluded) and {"excluded_by", "reason"} <= set(excluded.columns):
        counted = excluded.group_by("excluded_by", "reason").len().sort("excluded_by", "reason")
        reasons = [list(r) for r in counted.iter_rows()]
    return {
        "gaps": gaps.to_dicts(),
        "notes": list(answer.notes),
        "warnings": list(answer.warnings),
        "excluded_count": len(excluded),
        "excluded": reasons,
        "summary": answer.summary,
    }


def _compact(meta: dict) -> str:
    return json.dumps(meta, ensure_ascii=True, separators=(",", ":"), default=str)


def table_response(df: pl.DataFrame, fmt: str, meta: dict, headers: dict[str, str] | None = None) -> Response:
    """``df`` in ``fmt`` with ``meta`` in the answer header (a shortened form when it is too long)."""
    text = _compact(meta)
    out = dict(headers or {})
    out[ANSWER_HEADER] = (
        text
        if len(text) <= MAX_HEADER_CHARS
        else _compact({"truncated": True, "excluded_count": meta.get("excluded_count", 0)})
    )
    if fmt == "json":
        return Response(json_text(df), media_type="application/json", headers=out)
    if fmt == "csv":
        return Response(csv_frame(df).write_csv(), media_type="text/csv", headers=out)
    assert fmt == "parquet", f"unknown format {fmt}"
    table = df.to_arrow()
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), META_KEY: text.encode()})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return Response(buf.getvalue(), media_type=PARQUET, headers=out)
