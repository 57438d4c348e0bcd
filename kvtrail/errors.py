"""The small error hierarchy that user and wire input errors are raised with.

Internal invariants use ``assert``; anything that came from outside (a CLI flag, an event on the
wire, a file) raises a :class:`KvtrailError` subclass naming the offending field. The CLI turns these
into exit code 2 and one line; the HTTP service turns them into 4xx JSON.
"""

from __future__ import annotations


class KvtrailError(Exception):
    """Base class of every error kvtrail raises for bad input or state."""

    http_status = 400


class ValidationError(KvtrailError, ValueError):
    """An event (or a batch of them) broke the event model.

    ``event`` is the position of the offending event in its batch (or ``None`` for batch-level
    problems), ``kind`` its kind, ``line`` its line in the JSON-lines file it came from (when known),
    ``field`` the field at fault (its name in the event schema), ``reason`` a short human explanation.
    ``events``: the positions, ascending, of every event of the batch that breaks the same rule on its
    own (``event`` first), where the check could tell; else ``(event,)``. ``reason`` quotes the first.
    """

    def __init__(
        self,
        field: str,
        reason: str,
        *,
        event: int | None = None,
        kind: str | None = None,
        line: int | None = None,
        events: tuple[int, ...] | None = None,
    ):
        self.field = field
        self.reason = reason
        self.event = event
        self.kind = kind
        self.line = line
        if events is None or event is None or not events or events[0] != event:
            events = () if event is None else (event,)
        self.events = events
        where = f"event {event}" if event is not None else "batch"
        if kind:
            where += f" ({kind})"
        super().__init__(f"{where}: field '{field}': {reason}" + (f"; at line {line}" if line is not None else ""))

    def at_lines(self, lines: list[int]) -> ValidationError:
        """The same error naming its event's input line; ``lines[i]`` is the line number of event ``i``."""
        if self.event is None or self.line is not None or not 0 <= self.event < len(lines):
            return self
        return ValidationError(
            self.field, self.reason, event=self.event, kind=self.kind, line=lines[self.event], events=self.events
        )

    def moved(self, rows) -> ValidationError:
        """The same error for the batch a part of it came from: event ``i`` of the part is event ``rows[i]``
        of the batch (``rows``: a sequence of ints, such as a range or an integer array)."""
        if self.event is None:
            return self
        if not 0 <= self.event < len(rows):
            return ValidationError(self.field, self.reason, kind=self.kind, line=self.line)
        return ValidationError(
            self.field,
            self.reason,
            event=int(rows[self.event]),
            kind=self.kind,
            line=self.line,
            events=tuple(int(rows[i]) for i in self.events if 0 <= i < len(rows)),
        )

    def to_dict(self) -> dict:
        return {
            "event": self.event,
            "kind": self.kind,
            "field": self.field,
            "reason": self.reason,
            "events": list(self.events),
        }


class StoreError(KvtrailError):
    """The audit store cannot do what was asked (missing file, wrong schema, bad argument)."""


class ChainError(KvtrailError):
    """The tamper-evidence chain could not be verified or signed."""
