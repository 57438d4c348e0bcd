"""Cell text for a terminal: ids and values from producers printed as plain text, shortened without
cutting a number, lists as counts or short joins (:mod:`kvtrail.answers.tables` lays them out)."""

from __future__ import annotations

from collections.abc import Iterable

from rich.cells import cell_len

ELLIPSIS = "…"


def printable(value: object) -> str:
    """``value`` as one line of plain text: control, format and separator characters (ESC, newline,
    bidi overrides) written as ``\\xNN`` / ``\\uNNNN`` escapes, so a hostile id cannot drive the terminal."""
    text = "" if value is None else str(value)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)


def coverage_lines(gaps, warnings: Iterable[str]) -> list[str]:
    """What an answer says of the record it could not see, a printable line each: its coverage gaps (a frame
    of ``coverage_gaps``' columns) in one line, then its integrity and coverage warnings."""
    out = []
    if len(gaps):
        nodes = ", ".join(printable(n) for n in gaps["node"].to_list()[:5])
        out.append(
            f"coverage gap: {int(gaps['unexplained'].sum())} events missing from {len(gaps)} producer(s) without "
            f"a recorder_gap explaining them ({nodes}); answers may be incomplete"
        )
    return out + [printable(text) for text in warnings]


def _escape(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _json_escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x10000:
        return f"\\u{code:04x}"
    code -= 0x10000  # a UTF-16 surrogate pair, as JSON spells characters past the BMP
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def terminal_text(text: str, *, json: bool = False) -> str:
    """A file form (CSV, JSON) made safe to print to a terminal: line breaks kept, every other control,
    format or separator character escaped; ``json``: as ``\\uNNNN``, which keeps the text valid JSON
    meaning the same (such characters can only stand inside its strings)."""
    escape = _json_escape if json else _escape
    return "\n".join(
        line if line.isprintable() else "".join(ch if ch.isprintable() else escape(ch) for ch in line)
        for line in text.split("\n")
    )


def shorten(text: str, max_chars: int, *, middle: bool = False) -> str:
    """``text`` cut to ``max_chars`` with an ellipsis at the end (``middle``: between head and tail,
    which keeps the distinguishing end of an id)."""
    if len(text) <= max_chars:
        return text
    if not middle:
        return text[: max_chars - 1] + ELLIPSIS
    head = (max_chars - 1) // 2 + (max_chars - 1) % 2
    return text[:head] + ELLIPSIS + text[len(text) - (max_chars - 1 - head) :]


def shorten_items(text: str, max_chars: int) -> str:
    """A joined list (``a,b,c``) cut to ``max_chars`` between items, never inside one: ``a,b +1``."""
    if cell_len(text) <= max_chars:
        return text
    parts = text.split(",")
    for keep in range(len(parts) - 1, 0, -1):
        head = ",".join(parts[:keep]) + f" +{len(parts) - keep}"
        if cell_len(head) <= max_chars:
            return head
    return (
        f"{len(parts)} items"
        if len(parts) > 1 and cell_len(f"{len(parts)} items") <= max_chars
        else (shorten(text, max_chars))
    )


def items(value: object) -> list:
    """The items of a list cell (a scalar is one item; None: none)."""
    if value is None:
        return []
    return list(value) if isinstance(value, Iterable) and not isinstance(value, str) else [value]
