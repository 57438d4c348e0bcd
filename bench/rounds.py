"""Rounds for the benchmarks: methods alternate within each round, and a goal is judged on its worst round.

A benchmark runs every method once per round, the first method rotating from round to round, so noise
on a shared machine (another process taking a core for a few seconds) hits the methods alike and
shows up as spread instead of as a ratio. Per method it prints min / median / max over the rounds;
ratios are taken within a round (both sides saw the same machine) and a goal is PASS only when its
worst round clears it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

MIN_ROUNDS = 5


@dataclass(frozen=True)
class Spread:
    """min / median / max of one figure over the rounds."""

    min: float
    median: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        assert values, "a spread needs at least one round"
        return cls(min(values), statistics.median(values), max(values))

    def text(self, scale: float = 1.0, fmt: str = ".2f") -> str:
        return f"{self.min * scale:{fmt}} / {self.median * scale:{fmt}} / {self.max * scale:{fmt}}"

    def as_dict(self) -> dict[str, float]:
        return {"min": self.min, "median": self.median, "max": self.max}


def rotated(methods: Sequence[str], round_no: int) -> list[str]:
    """The methods in the order round ``round_no`` runs them: the first one rotates."""
    k = round_no % len(methods) if methods else 0
    return list(methods[k:]) + list(methods[:k])


def check_rounds(rounds: int) -> int:
    """``rounds`` from the command line (at least 1; Verdict.word says when there are too few for a verdict)."""
    if rounds < 1:
        raise ValueError(f"--rounds: must be at least 1, got {rounds}")
    return rounds


def per_round_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """numerator[i] / denominator[i] for each round i (e.g. the baseline's time over kvtrail's: its speed-up)."""
    assert len(numerator) == len(denominator), "ratios pair the same rounds"
    return [n / d for n, d in zip(numerator, denominator)]


@dataclass(frozen=True)
class Verdict:
    """A goal judged on its worst round: ``worst`` is the least favourable round's figure."""

    goal: str
    worst: float
    passed: bool
    rounds: int

    @property
    def word(self) -> str:
        if self.rounds < MIN_ROUNDS:
            return f"{'PASS' if self.passed else 'MISS'} (only {self.rounds} rounds: no verdict)"
        return "PASS" if self.passed else "MISS"


def at_least(goal: str, per_round: Sequence[float], threshold: float) -> Verdict:
    """PASS when every round's figure is >= threshold (the worst round is the smallest)."""
    worst = min(per_round)
    return Verdict(goal, worst, worst >= threshold, len(per_round))


def at_most(goal: str, per_round: Sequence[float], threshold: float) -> Verdict:
    """PASS when every round's figure is <= threshold (the worst round is the largest)."""
    worst = max(per_round)
    return Verdict(goal, worst, worst <= threshold, len(per_round))
