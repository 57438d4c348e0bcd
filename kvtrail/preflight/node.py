"""What preflight learns about one node (one DP rank of one source): the fields of a ``node_config``.

Every value is None until a source states it: a node whose pool or context cannot be established is
never given a number, and the check reports it as unknown.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class NodeConfig:
    """One node's configuration as its sources state it; ``notes`` say where values came from."""

    source: str
    rank: str | None = None  # e.g. "TP0", "DP1 TP0"; None for a single GPU or where no rank is printed
    role: str | None = None  # "prefill" | "decode" | None (not a PD node, or not stated)
    pool_tokens: int | None = None
    context_tokens: int | None = None
    page_size: int | None = None
    version: str | None = None
    max_running_requests: int | None = None
    checksum_enabled: bool | None = None
    canary_enabled: bool | None = None
    deferred_release: bool | None = None
    release_timeout_ns: int | None = None
    transfer_batch_max_pages: int | None = None
    unaudited: tuple[str, ...] | None = None  # paths kvtrail's SGLang plugin does not audit (preflight.coverage)
    config_source: str = ""
    notes: tuple[str, ...] = ()
    node: str | None = None  # the node's name as the operator gave it (--node); None: named after the source

    @property
    def is_empty(self) -> bool:
        """No configuration value at all (the source said nothing recognisable about this node)."""
        return all(getattr(self, f) is None for f in _VALUES)

    def merged(self, other: NodeConfig) -> NodeConfig:
        """This node with ``other``'s values where this one has none; two pools that differ keep the
        smaller (the check must not pass on the larger one) and say so."""
        changes: dict[str, Any] = {}
        notes = list(self.notes) + [n for n in other.notes if n not in self.notes]
        for name in _VALUES:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine is None and theirs is not None:
                changes[name] = theirs
            elif name == "pool_tokens" and theirs is not None and mine is not None and theirs != mine:
                changes[name] = min(mine, theirs)
                notes.append(f"sources disagree on the pool ({mine} vs {theirs} tokens): the smaller is used")
        if other.config_source and other.config_source not in self.config_source.split("+"):
            changes["config_source"] = "+".join(s for s in (self.config_source, other.config_source) if s)
        return replace(self, **changes, notes=tuple(notes))


_VALUES = tuple(
    f.name for f in fields(NodeConfig) if f.name not in ("source", "rank", "role", "config_source", "notes", "node")
)
