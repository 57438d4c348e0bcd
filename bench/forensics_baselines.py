"""The baselines and the floor bench_forensics.py sets beside kvtrail (each runs in a part's process).

Baselines answer "which requests read a page whose last write was another request's, or nobody's"
with one DuckDB query over every page of ``kv_read`` and ``kv_written`` (``page_runs`` expanded with
``generate_series``). That question knows nothing of prefix-cache hits, fresh growth pages or
transfers, so on the fleet history it is an easier, different question; each part's answer is
counted against the history's ground truth, which says whether it answered the same one.

  naive-text  the per-page ASOF join on the store's text keys (cluster, node, request_id): a first try
  naive-int   the same ASOF join after mapping node and request to dense integers (what a competent
              user writes: the 30-50 M per-page rows then carry 4-byte keys, not strings)
  window      the same question as a window function over the union of write and read pages:
              last_value(writer) IGNORE NULLS OVER (PARTITION BY node, page ORDER BY time, writes first)

The floor is what any engine must do at least: read the events' columns the replay needs and the
window's ``page_runs``, both ordered, and expand every run to its pages with a compiled loop that
writes each page once. kvtrail's time over the floor's is how far it is from this machine's limit.
"""

from __future__ import annotations

import duckdb
import numpy as np

_PAGE_ROWS_TEXT = """
pe AS (SELECT e.producer_id, e.seq, e.wall_ns, e.kind, e.request_id, p.cluster, p.node
       FROM events e JOIN producers p USING (producer_id) WHERE e.kind IN ('kv_read', 'kv_written')),
pages AS (SELECT pe.cluster, pe.node, pe.wall_ns, pe.kind, pe.request_id,
                 unnest(generate_series(r.page_start, r.page_start + r.num_pages - 1)) AS page
          FROM pe JOIN page_runs r ON r.producer_id = pe.producer_id AND r.seq = pe.seq AND r.list = 0)
"""
NAIVE_TEXT_SQL = f"""
WITH {_PAGE_ROWS_TEXT},
reads AS (SELECT * FROM pages WHERE kind = 'kv_read'),
writes AS (SELECT * FROM pages WHERE kind = 'kv_written')
SELECT count(*) AS read_pages,
       count(*) FILTER (w.request_id IS DISTINCT FROM r.request_id) AS foreign_pages,
       list(DISTINCT r.request_id) FILTER (w.request_id IS DISTINCT FROM r.request_id) AS recipients
FROM reads r ASOF LEFT JOIN writes w
  ON r.cluster = w.cluster AND r.node = w.node AND r.page = w.page AND r.wall_ns >= w.wall_ns
"""
# Integer keys first: node by (cluster, node), request by its id's rank; recipients come back as numbers
# and are named by _REQUEST_NAMES, inside the timed part.
_PAGE_ROWS_INT = """
nodes AS (SELECT producer_id, dense_rank() OVER (ORDER BY cluster, node)::INTEGER AS node_no FROM producers),
reqs AS (SELECT request_id, dense_rank() OVER (ORDER BY request_id)::INTEGER AS req_no
         FROM (SELECT DISTINCT request_id FROM events
               WHERE kind IN ('kv_read', 'kv_written') AND request_id IS NOT NULL)),
pe AS (SELECT n.node_no, e.producer_id, e.seq, e.wall_ns, e.kind = 'kv_read' AS is_read, q.req_no
       FROM events e JOIN nodes n USING (producer_id) LEFT JOIN reqs q USING (request_id)
       WHERE e.kind IN ('kv_read', 'kv_written')),
pages AS (SELECT pe.node_no, pe.wall_ns, pe.is_read, pe.req_no,
                 unnest(generate_series(r.page_start, r.page_start + r.num_pages - 1))::INTEGER AS page
          FROM pe JOIN page_runs r ON r.producer_id = pe.producer_id AND r.seq = pe.seq AND r.list = 0)
"""
NAIVE_INT_SQL = f"""
WITH {_PAGE_ROWS_INT},
reads AS (SELECT * FROM pages WHERE is_read),
writes AS (SELECT * FROM pages WHERE NOT is_read)
SELECT count(*) AS read_pages,
       count(*) FILTER (w.req_no IS DISTINCT FROM r.req_no) AS foreign_pages,
       list(DISTINCT r.req_no) FILTER (w.req_no IS DISTINCT FROM r.req_no) AS recipients
FROM reads r ASOF LEFT JOIN writes w ON r.node_no = w.node_no AND r.page = w.page AND r.wall_ns >= w.wall_ns
"""
WINDOW_SQL = f"""
WITH {_PAGE_ROWS_INT},
lv AS (SELECT is_read, req_no,
              last_value(CASE WHEN NOT is_read THEN req_no END IGNORE NULLS) OVER (
                  PARTITION BY node_no, page ORDER BY wall_ns, is_read
                  ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS writer
       FROM pages)
SELECT count(*) FILTER (is_read) AS read_pages,
       count(*) FILTER (is_read AND writer IS DISTINCT FROM req_no) AS foreign_pages,
       list(DISTINCT req_no) FILTER (is_read AND writer IS DISTINCT FROM req_no) AS recipients
FROM lv
"""
_REQUEST_NAMES = """
SELECT request_id FROM (SELECT request_id, dense_rank() OVER (ORDER BY request_id)::INTEGER AS req_no
                        FROM (SELECT DISTINCT request_id FROM events
                              WHERE kind IN ('kv_read', 'kv_written') AND request_id IS NOT NULL))
WHERE list_contains(?, req_no)
"""
BASELINES = {"naive-text": NAIVE_TEXT_SQL, "naive-int": NAIVE_INT_SQL, "window": WINDOW_SQL}

# The event columns the replay reads for page events, in its order; the floor reads them too.
FLOOR_EVENTS_SQL = (
    "SELECT producer_id, seq, wall_ns, kind, request_id, transfer_id, tenant_id, purpose, "
    "free_reason, source, token_start, token_end, num_pages, num_dst_pages FROM events "
    "ORDER BY wall_ns, producer_id, seq"
)
FLOOR_RUNS_SQL = "SELECT page_start, num_pages FROM page_runs ORDER BY producer_id, seq, list, pos"


def baseline(con: duckdb.DuckDBPyConnection, name: str) -> dict:
    """One baseline query; its read pages, foreign pages and the ids of the requests it calls affected."""
    row = con.execute(BASELINES[name]).fetchone()
    assert row is not None, "an aggregate query returns one row"
    read_pages, foreign, recipients = row
    recipients = [r for r in (recipients or []) if r is not None]
    if name != "naive-text":
        recipients = [r[0] for r in con.execute(_REQUEST_NAMES, [recipients]).fetchall()]
    return {"read_pages": read_pages, "f1_pages": foreign, "affected_ids": recipients}


def _expand_runs_py(starts: np.ndarray, lengths: np.ndarray, out: np.ndarray) -> int:
    k = 0
    for i in range(len(starts)):
        s = starts[i]
        for j in range(lengths[i]):
            out[k] = s + j
            k += 1
    return k


def compiled_expand():
    """The run expansion compiled (and compiled now, so that a caller's clock does not see numba)."""
    import numba

    fn = numba.njit(nogil=True)(_expand_runs_py)
    fn(np.ones(1, np.int32), np.ones(1, np.int32), np.zeros(1, np.int32))
    return fn


def floor(con: duckdb.DuckDBPyConnection, expand) -> dict:
    """Read the event columns and the runs, ordered, and write every page of every run once."""
    ev = con.sql(FLOOR_EVENTS_SQL).to_arrow_table()
    runs = con.sql(FLOOR_RUNS_SQL).to_arrow_table()
    starts = runs.column("page_start").to_numpy()
    lengths = runs.column("num_pages").to_numpy()
    pages = np.empty(int(lengths.sum(dtype=np.int64)), np.int32)
    n = expand(starts, lengths, pages)
    assert n == len(pages), "every page of every run was written"
    return {"events_read": ev.num_rows, "pages_expanded": n}
