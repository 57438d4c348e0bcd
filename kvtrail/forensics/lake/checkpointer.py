"""The export's page-state pass: a node's checkpoints at each hour boundary, from its store's events.

:func:`write_checkpoints` is what :func:`kvtrail.audit.lake.export.export_lake` calls for each node an export
touched. It resumes from the node's latest checkpoint at or before the hour of its first new event (or
from an empty state at the node's first hour), replays the node's events from the store hour by hour
(the replay engine's own page rules, without the cross-node joins) and writes the state at the start of
every later hour that has events, replacing the checkpoints an earlier export wrote for those hours.
"""

from __future__ import annotations

import duckdb

from kvtrail.audit.lake.export import LakeWriter
from kvtrail.audit.lake.fs import LakeFS
from kvtrail.audit.lake.manifest import Manifest
from kvtrail.audit.lake.partition import Partition
from kvtrail.audit.store import read_events
from kvtrail.forensics.lake import checkpoint
from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.forensics.replay.engine import ReplayEngine
from kvtrail.forensics.replay.source import store_batches

# The per-node codes: a checkpoint replay needs the page state only, not the cross-node joins.
POOL_CODES = ("F1", "F5", "F6", "F7", "F8", "F10")


def _node_hours(doc: Manifest, key: tuple[str, str]) -> set[int]:
    return {f.part[1] for f in doc.files.values() if f.table == "events" and f.part[0] == key}


def feed_node_hour(con: duckdb.DuckDBPyConnection, engine: ReplayEngine, part: Partition) -> None:
    """Replay the partition's events of the store (or catalog) ``con`` into ``engine``."""
    where = "cluster = ? AND node = ? AND wall_ns >= ? AND wall_ns < ?"
    params = [part.cluster, part.node, part.start_ns, part.end_ns]
    if engine.fast_path is not None:
        for batch in store_batches(con, where, params):
            engine.feed_batch(batch)
    else:
        engine.feed(read_events(con, where, params))


def write_checkpoints(
    con: duckdb.DuckDBPyConnection,
    lake: LakeFS,
    w: LakeWriter,
    key: tuple[str, str],
    first_new: int,
    producer_ids: dict,
) -> int:
    """Write node ``key``'s checkpoints from hour ``first_new`` on (see the module doc); returns how many."""
    doc = w.doc
    hours = sorted(_node_hours(doc, key))
    have = {f.part[1]: rel for rel, f in doc.files.items() if f.table == "checkpoint" and f.part[0] == key}
    start = max((h for h in have if h <= first_new), default=hours[0])
    engine = ReplayEngine(producer_ids, ForensicsPolicy(), codes=POOL_CODES)
    if start in have:
        checkpoint.restore(lake.read(have[start]), engine.state)
    written = 0
    for hour in [h for h in hours if h >= start]:
        part = Partition(key[0], key[1], hour)
        if hour != start or start not in have:
            data = checkpoint.capture(engine.state, key, part.start_ns)
            old = have.get(hour)
            rel = f"{part.path('events')}/_checkpoint-E{doc.export_no:06d}.ckpt"
            w.put(rel, data, table="checkpoint", rows=0, cluster=key[0], node=key[1], hour=hour)
            if old is not None and old != rel:
                del doc.files[old]
                lake.delete(old)
            written += 1
        feed_node_hour(con, engine, part)
    return written
