"""One spec per question: the frames the questions answer with, the service's response models and the
CLI's table columns all say what :mod:`kvtrail.answers.spec` says."""

from __future__ import annotations

import polars as pl
import pytest

from kvtrail.answers import spec, tables, tenancy, transfers
from kvtrail.forensics import (
    ReportOptions,
    Window,
    ask_affected,
    ask_exploitation,
    ask_exposure,
    ask_findings,
    ask_node_configurations,
    ask_thresholds,
)
from kvtrail.forensics.questions import findings_of
from kvtrail.service import models
from tests.forensics.incident_fixture import W0, W1, build

W = Window(W0, W1)
QUESTIONS = {
    "findings": lambda db, w: ask_findings(db, w),
    "affected": lambda db, w: ask_affected(db, w),
    "exposure": lambda db, w: ask_exposure(db, w),
    "thresholds": lambda db, w: ask_thresholds(db, w),
    "exploitation": lambda db, w: ask_exploitation(db, ReportOptions(w.from_ns or W0, w.to_ns or W1), w),
    "nodes": lambda db, w: ask_node_configurations(db, w),
}


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("spec") / "incident.duckdb"
    build(path)
    return str(path)


@pytest.mark.parametrize("name", sorted(QUESTIONS))
@pytest.mark.parametrize("w", [W, Window(W0, W0 + 1)], ids=["incident", "empty"])
def test_each_question_answers_with_its_spec(db, name, w):
    answer = QUESTIONS[name](db, w)
    assert dict(answer.rows.schema) == spec.SPECS[name].schema
    assert dict(answer.gaps.schema) == spec.COVERAGE.schema
    if w == W:
        assert len(answer.rows), name


def test_the_derived_tables_follow_their_specs(db):
    affected = ask_affected(db, W).rows
    assert dict(tenancy.tenant_affected(affected, "globex").schema) == spec.TENANT_AFFECTED.schema
    import duckdb

    con = duckdb.connect(db, read_only=True)
    try:
        rows = transfers.mismatches(con, findings_of(con, W), W)
    finally:
        con.close()
    assert len(rows) and dict(rows.schema) == spec.TRANSFERS.schema


@pytest.mark.parametrize("name", sorted(models.TABLE_MODELS))
def test_each_response_model_is_its_spec(name):
    model, s = models.TABLE_MODELS[name], spec.SPECS[name]
    assert tuple(model.model_fields) == s.names
    assert [f.description for f in model.model_fields.values()] == [c.doc for c in s.columns]
    assert model.__doc__ == s.doc
    # a row of the spec's frame validates against the model, and the model refuses a field it does not have
    row = {c: None for c in s.names}
    model.model_validate(row)
    with pytest.raises(ValueError):
        model.model_validate({**row, "not_a_column": 1})


def test_a_column_of_a_type_no_model_knows_is_refused():
    with pytest.raises(TypeError, match="no JSON type"):
        models.row_model("Bad", spec.AnswerSpec("bad", "bad", (spec.Col("x", pl.List(pl.Float32), "x"),)))


@pytest.mark.parametrize("view", tables.VIEWS, ids=lambda v: v.spec.name)
def test_the_cli_columns_show_the_spec_columns(view):
    shown = {s for c in view.columns for s in c.sources}
    assert shown and shown <= set(view.spec.names), shown - set(view.spec.names)


def test_every_column_is_documented_and_tenant_columns_exist():
    for s in spec.SPECS.values():
        assert s.doc and all(c.doc for c in s.columns), s.name
        assert len(set(s.names)) == len(s.names), s.name
    # what a tenant may see of its own affected responses is what its own table holds
    assert set(spec.AFFECTED.tenant_names) <= set(spec.TENANT_AFFECTED.names)
    assert "victim_tenants" not in spec.TENANT_AFFECTED.names


def test_a_tenants_exposure_is_the_services_document():
    assert spec.TENANT_EXPOSURE.names == tuple(models.TenantExposure.model_fields)
    assert all(c.tenant for c in spec.TENANT_EXPOSURE.columns)


def test_each_answer_finds_its_table_view():
    assert len({v.spec.names for v in tables.VIEWS}) == len(tables.VIEWS)  # a frame's columns name one view
    tenant_rows = pl.DataFrame(schema=spec.TENANT_AFFECTED.schema)
    assert tables.view_for(tenant_rows, tables.AFFECTED) is tables.TENANT_AFFECTED
    assert tables.view_for(pl.DataFrame(schema=spec.AFFECTED.schema), tables.AFFECTED) is tables.AFFECTED
    tenant_exposure = pl.DataFrame(schema=spec.TENANT_EXPOSURE.schema)
    assert tables.view_for(tenant_exposure, tables.EXPOSURE) is tables.TENANT_EXPOSURE
