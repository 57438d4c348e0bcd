"""What a long command is doing, on a terminal: counts and rate on stderr, and nothing at all when stderr
is not a terminal (a pipe, a file, a CI log), so the output other programs read never changes."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvtrail.forensics.progress import watching


def on_terminal() -> bool:
    """Whether progress is shown: stderr is a terminal."""
    return sys.stderr.isatty()


class Ticker:
    """A running count on stderr (tqdm: count, rate, elapsed) with lines written above it; inert off a
    terminal."""

    def __init__(self, bar: Any | None):
        self.bar = bar

    @property
    def shown(self) -> bool:
        """Whether this ticker writes anything (stderr is a terminal)."""
        return self.bar is not None

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def note(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)


@contextmanager
def ticking(desc: str, unit: str = "events") -> Iterator[Ticker]:
    """A :class:`Ticker` for the block: ``desc: 1.23M events [00:10, 123k events/s]`` while it runs, then
    one line with the count, the time and the rate."""
    if not on_terminal():
        yield Ticker(None)
        return
    from tqdm import tqdm

    t0 = time.perf_counter()
    with tqdm(desc=desc, unit=unit, unit_scale=True, file=sys.stderr, leave=False, dynamic_ncols=True) as bar:
        yield Ticker(bar)
        done = bar.n
    elapsed = time.perf_counter() - t0
    # Nothing counted (a service or a lake's workers did the work): the time alone.
    line = (
        f"{done:,} {unit} in {elapsed:.1f} s ({done / max(elapsed, 1e-9):,.0f} {unit}/s)"
        if done
        else f"done in {elapsed:.1f} s"
    )
    print(f"{desc}: {line}", file=sys.stderr, flush=True)


@contextmanager
def replaying(desc: str) -> Iterator[Ticker]:
    """A ticker counting the events the replay reads inside the block."""
    with ticking(desc) as ticker, watching(ticker.update):
        yield ticker


@contextmanager
def step(text: str) -> Iterator[None]:
    """``text ...`` on stderr before the block and ``done in N s`` after it (on a terminal only)."""
    if not on_terminal():
        yield
        return
    print(f"{text} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    yield
    print(f"{text}: done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
