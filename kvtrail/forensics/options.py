"""``ReportOptions``: what decides a report's numbers (recorded in its manifest so they can be recomputed)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtrail.forensics.analysis import Exclusions, ProbeRules


@dataclass(frozen=True)
class ReportOptions:
    """What decides the report's numbers (recorded in the manifest so they can be recomputed)."""

    from_ns: int
    to_ns: int
    exclusions: Exclusions = field(default_factory=Exclusions)
    baseline_from_ns: int | None = None  # default: a period as long as the window, right before it
    baseline_to_ns: int | None = None
    long_prompt_tokens: int | None = None  # default: the smallest prefill pool in the window
    rules: ProbeRules = field(default_factory=ProbeRules)

    @property
    def baseline(self) -> tuple[int, int]:
        lo = self.baseline_from_ns if self.baseline_from_ns is not None else 2 * self.from_ns - self.to_ns
        return lo, self.baseline_to_ns if self.baseline_to_ns is not None else self.from_ns

    def to_dict(self) -> dict:
        r = self.rules
        return {
            "from_ns": self.from_ns,
            "to_ns": self.to_ns,
            "exclusions": self.exclusions.to_dict(),
            "baseline_from_ns": self.baseline_from_ns,
            "baseline_to_ns": self.baseline_to_ns,
            "long_prompt_tokens": self.long_prompt_tokens,
            "rules": {
                "burst_minutes": r.burst_minutes,
                "burst_count": r.burst_count,
                "rate_ratio": r.rate_ratio,
                "min_long_requests": r.min_long_requests,
            },
        }

    @classmethod
    def from_dict(cls, d: dict) -> ReportOptions:
        return cls(
            d["from_ns"],
            d["to_ns"],
            Exclusions.from_dict(d["exclusions"]),
            d["baseline_from_ns"],
            d["baseline_to_ns"],
            d["long_prompt_tokens"],
            ProbeRules(**d["rules"]),
        )
