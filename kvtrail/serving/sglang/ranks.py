"""Which scheduler process records, and under which node name: SGLang's own parallel state.

SGLang 0.5.23's ``Scheduler`` keeps no rank attributes of its own; every rank is read from the process's
runtime context (``sglang.srt.runtime_context.get_parallel()``), which the launcher publishes before the
scheduler is built. A rank that was never written there raises; one whose width is 1 is 0 all the same.

* Attention-TP ranks > 0, attention-CP ranks > 0 and pipeline stages > 0 hold copies of the page tables
  attention-TP rank 0 allocates (SGLang's own metrics and KV events come from that rank only): only
  (pp 0, attention-CP 0, attention-TP 0) records.
* Each data-parallel pool is its own node: with DP attention one pool per attention-DP rank, with DP
  replicas one per ``dp_rank``; the producer is ``<node>-dp<N>`` whenever there is more than one.
* Context parallelism (attention CP or decode CP wider than 1) shards what one page holds across ranks:
  the recording rank's page ids are still the allocator's, but the node is declared as running a mode
  the plugin does not audit (``node_config``'s config_source).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Placement:
    """Where this scheduler process sits in SGLang's parallel layout, as far as recording cares."""

    records: bool  # this process is the one recording its pool
    pool: int | None  # its data-parallel pool (None: the node has one)
    why: str = ""  # why it does not record, or what could not be read
    unaudited: tuple[str, ...] = field(default=())

    def node(self, base: str) -> str:
        return base if self.pool is None else f"{base}-dp{self.pool}"


# The ranks that must be 0 in the recording process (the others hold copies of its page tables).
_RECORDING_RANKS = (
    ("pp_rank", "pp_size", "pipeline stage"),
    ("attn_cp_rank", "attn_cp_size", "attention-CP rank"),
    ("attn_tp_rank", "attn_tp_size", "attention-TP rank"),
)


def _read(parallel: Any, name: str) -> Any:
    try:
        return getattr(parallel, name)
    except (RuntimeError, ValueError, AttributeError, AssertionError):  # not written here, nothing published
        # (0.5.19 reads a rank from its live group and asserts when the group was never built)
        return None


def _rank(parallel: Any, rank: str, size: str) -> int | None:
    """A rank from the parallel state; 0 where it was never written but its width is 1; None: unknown."""
    value = _read(parallel, rank)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    width = _read(parallel, size)
    return 0 if width == 1 else None


def placement(parallel: Any = None) -> Placement:
    """This process's :class:`Placement` from SGLang's runtime context (``parallel``: its ParallelContext)."""
    if parallel is None:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
    unaudited = []
    cp = _read(parallel, "attn_cp_size") or 1
    if cp > 1:
        unaudited.append(f"context parallelism attn_cp_size={cp}")
    if _read(parallel, "dcp_enabled"):
        unaudited.append(f"decode context parallelism dcp_size={_read(parallel, 'dcp_size')}")
    for rank, size, what in _RECORDING_RANKS:
        value = _rank(parallel, rank, size)
        if value is None:
            return Placement(
                False,
                None,
                f"{what} unknown ({rank} not in SGLang's parallel state, {size}={_read(parallel, size)})",
                tuple(unaudited),
            )
        if value != 0:
            return Placement(False, None, f"{what} {value}: rank 0 records", tuple(unaudited))
    pool = None
    if (_read(parallel, "attn_dp_size") or 1) > 1:
        pool = _rank(parallel, "attn_dp_rank", "attn_dp_size")
        if pool is None:
            return Placement(False, None, "attention-DP rank unknown", tuple(unaudited))
    elif (_read(parallel, "num_dp_ranks") or 1) > 1:
        pool = _read(parallel, "dp_rank")
        if not isinstance(pool, int):
            return Placement(False, None, "data-parallel rank unknown", tuple(unaudited))
    return Placement(True, pool, "", tuple(unaudited))
