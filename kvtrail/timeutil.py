"""UTC time parsing and formatting for CLI flags and reports (nanoseconds since the Unix epoch)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from kvtrail.errors import KvtrailError

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
# Times are int64 ns everywhere (store, frames, report.json); int64 ends on 2262-04-11, and a report adds
# deadlines (72 h) to the times it is given, so the latest accepted instant keeps a margin below that.
LATEST_UTC = datetime(2262, 1, 1, tzinfo=timezone.utc)


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
    return utc_ns(dt, field=field)


def utc_ns(dt: datetime, *, field: str = "time") -> int:
    """An aware datetime as UTC ns since the epoch, exactly (no float); KvtrailError naming ``field`` when it
    falls outside what kvtrail can represent (1970-01-01 up to, not including, 2262-01-01)."""
    assert dt.tzinfo is not None, "utc_ns needs an aware datetime"
    if not _EPOCH <= dt < LATEST_UTC:
        raise KvtrailError(
            f"{field}: {dt.isoformat()} is outside the times kvtrail can represent "
            f"(1970-01-01 to {LATEST_UTC.date().isoformat()})"
        )
    return (dt - _EPOCH) // timedelta(microseconds=1) * 1_000


def format_utc(ns: int | None) -> str:
    """Format UTC ns as ``YYYY-MM-DDTHH:MM:SS.ffffffZ`` (empty string for None)."""
    if ns is None:
        return ""
    dt = datetime.fromtimestamp(ns // 1_000_000_000, tz=timezone.utc)
    return dt.strftime("%Y-%m-%dT%H:%M:%S") + f".{(ns % 1_000_000_000) // 1000:06d}Z"
