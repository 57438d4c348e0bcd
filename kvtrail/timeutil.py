"""UTC time parsing and formatting for CLI flags and reports (nanoseconds since the Unix epoch)."""

from __future__ import annotations

from datetime import datetime, timezone

from kvtrail.errors import KvtrailError


def parse_utc(text: str, *, field: str = "time") -> int:
    """Parse an ISO 8601 time (``2026-09-09T13:22:00Z``, ``2026-09-09 13:22``, ``2026-09-09``) as UTC ns.

    A time without an offset is taken as UTC; an explicit offset is honoured.
    """
    raw = text.strip()
    try:
        dt = datetime.fromisoformat(raw.replace("Z", "+00:00") if raw.endswith("Z") else raw)
    except ValueError:
        raise KvtrailError(f"{field}: {text!r} is not an ISO 8601 time (e.g. 2026-09-09T13:22:00Z)") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    seconds = int(dt.timestamp())
    return seconds * 1_000_000_000 + dt.microsecond * 1_000


def format_utc(ns: int | None) -> str:
    """Format UTC ns as ``YYYY-MM-DDTHH:MM:SS.ffffffZ`` (empty string for None)."""
    if ns is None:
        return ""
    dt = datetime.fromtimestamp(ns // 1_000_000_000, tz=timezone.utc)
    return dt.strftime("%Y-%m-%dT%H:%M:%S") + f".{(ns % 1_000_000_000) // 1000:06d}Z"
