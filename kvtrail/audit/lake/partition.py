"""A lake partition: one node's events of one UTC hour, and where its files and checkpoint live.

``events/cluster=C/node=N/date=YYYY-MM-DD/hour=HH/`` holds the partition's event files (every column
of the store's ``events`` view), ``page_runs/...`` (same partition path) their page runs, and the
events folder the checkpoint ``_checkpoint-E<export>.ckpt`` (``.npz`` before checkpoint format 3): the node's
page state at the hour's start.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timezone

HOUR_NS = 3_600_000_000_000
_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")


def check_name(field: str, value: str) -> str:
    if not _NAME_RE.fullmatch(value):
        raise ValueError(
            f"{field}: {value!r} cannot be a partition directory (only letters, digits, '.', '_' and '-' are allowed)"
        )
    return value


def hour_of(wall_ns: int) -> int:
    """Hours since the epoch (UTC) of a time in ns."""
    return wall_ns // HOUR_NS


@dataclass(frozen=True, order=True)
class Partition:
    """(cluster, node, hour since the epoch): the unit of the lake's layout and of the fan-out."""

    cluster: str
    node: str
    hour: int

    @property
    def start_ns(self) -> int:
        return self.hour * HOUR_NS

    @property
    def end_ns(self) -> int:
        return (self.hour + 1) * HOUR_NS

    def path(self, table: str) -> str:
        t = datetime.fromtimestamp(self.hour * 3600, timezone.utc)
        return f"{table}/cluster={self.cluster}/node={self.node}/date={t:%Y-%m-%d}/hour={t:%H}"

    def label(self) -> str:
        t = datetime.fromtimestamp(self.hour * 3600, timezone.utc)
        return f"{self.cluster}/{self.node} {t:%Y-%m-%dT%H}"
