"""The questions API (``kvtrail.forensics.ask_*``): one function per question, the same answers as the
building blocks they compose, from a store's path or an open connection."""

from __future__ import annotations

import duckdb
import polars as pl
import pytest

from kvtrail import forensics as fx
from kvtrail.errors import KvtrailError
from kvtrail.forensics.analysis import exposure_links, exposure_matrix, threshold_sentence
from kvtrail.forensics.options import ReportOptions
from kvtrail.forensics.questions import affected_with_exclusions, exploitation_for, findings, findings_of
from tests.forensics.incident_fixture import RESEARCHER_KEY, W0, W1, build

EXCL = fx.Exclusions(
    tenants=(("internal-qa", "provider's own tests"),), api_key_ids=((RESEARCHER_KEY, "researcher's reproduction"),)
)
W = fx.Window(W0, W1)


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    path = tmp_path_factory.mktemp("ask") / "incident.duckdb"
    build(path)
    return path


@pytest.fixture(scope="module")
def con(db):
    c = duckdb.connect(str(db), read_only=True)
    yield c
    c.close()


def test_affected_from_a_path_equals_the_building_blocks(db, con):
    answer = fx.ask_affected(db, W, exclusions=EXCL)
    kept, dropped, _ = affected_with_exclusions(con, W, EXCL)
    assert answer.rows.equals(kept) and answer.excluded.equals(dropped)
    assert (len(answer.rows), len(answer.excluded)) == (13, 7)
    assert answer.gaps.is_empty()


def test_findings_leave_out_excluded_accounts_and_keep_the_replayed_findings(con):
    everything = fx.ask_findings(con, W)
    answer = fx.ask_findings(con, W, exclusions=EXCL)
    assert len(answer.rows) + len(answer.excluded) == len(everything.rows) > 0
    assert "internal-qa" not in set(answer.rows["tenant_id"].drop_nulls())
    assert len(answer.found) == len(findings_of(con, W))
    only_f1 = fx.ask_findings(con, W, codes=("F1",))
    assert set(only_f1.rows["code"]) == {"F1"}
    with pytest.raises(KvtrailError, match="--code: unknown finding code 'F99'"):
        fx.ask_findings(con, W, codes=("F99",))


def test_exposure_and_thresholds_match_the_analyses(con):
    kept, _, _ = affected_with_exclusions(con, W, EXCL)
    links = exposure_links(findings(con, W), set(kept["request_id"]))
    assert fx.ask_exposure(con, W, exclusions=EXCL).rows.equals(exposure_matrix(links))
    th = fx.ask_thresholds(con, W, exclusions=EXCL)
    assert th.summary["affected"] == 13 and th.notes == (threshold_sentence(th.summary),)
    assert set(th.rows.columns) >= {"node", "pool_tokens", "context_tokens", "affected"}


def test_node_configurations_and_exploitation(con):
    nodes = fx.ask_node_configurations(con, W).rows
    assert not nodes.is_empty() and not nodes["pool_covers_context"].all()
    exp = fx.ask_exploitation(con, ReportOptions(W0, W1, EXCL))
    df, long_tokens = exploitation_for(con, ReportOptions(W0, W1, EXCL))
    assert exp.rows.equals(df) and exp.summary["long_prompt_tokens"] == long_tokens
    assert exp.notes[0].startswith("over-long: more than")


def test_missing_store_and_unknown_tenant_name_the_flag(tmp_path, con):
    with pytest.raises(KvtrailError, match="--db: store not found"):
        fx.ask_affected(tmp_path / "nope.duckdb", W)
    with pytest.raises(KvtrailError, match="--tenant: unknown tenant 'nobody'"):
        fx.ask_affected(con, fx.Window(W0, W1, tenant="nobody"))
    assert isinstance(fx.ask_affected(con, fx.Window(W0, W1, tenant="globex")).rows, pl.DataFrame)
