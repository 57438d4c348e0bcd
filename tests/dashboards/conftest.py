"""Fixtures of the dashboard tests: one seeded fleet store (planted bugs, two pools below their context),
a copy whose findings were persisted, and the window both cover."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvtrail import forensics as fx
from kvtrail.cli import main

SIM = [
    "--seed",
    "7",
    "--nodes",
    "2",
    "--hours",
    "0.1",
    "--rate",
    "1",
    "--plants-per-hour",
    "30",
    "--tenants",
    "5",
    "--prefill-pool-tokens",
    "200000",
    "--decode-pool-tokens",
    "600000",
    "--context-tokens",
    "400000",
]
APP = Path(__file__).resolve().parents[2] / "kvtrail" / "dashboards" / "app.py"


@pytest.fixture(scope="session")
def seeded(tmp_path_factory) -> Path:
    """A simulated store: 2 prefill nodes (pool 200,000 < context 400,000) and 2 decode nodes."""
    db = tmp_path_factory.mktemp("dash") / "fleet.duckdb"
    assert main(["simulate", "--db", str(db), *SIM]) == 0
    return db


@pytest.fixture(scope="session")
def persisted(seeded: Path, tmp_path_factory) -> Path:
    """A copy of the seeded store whose findings ``forensics findings --save`` kept."""
    db = tmp_path_factory.mktemp("dash-saved") / "saved.duckdb"
    shutil.copy(seeded, db)
    assert (
        main(
            [
                "forensics",
                "findings",
                "--db",
                str(db),
                "--save",
                "--out",
                str(db.with_suffix(".json")),
                "--format",
                "json",
            ]
        )
        == 0
    )
    return db


@pytest.fixture(scope="session")
def window(seeded: Path) -> fx.Window:
    """The whole span of the seeded store."""
    with fx.open_store(seeded) as con:
        lo, hi = con.execute("SELECT min(min_wall_ns), max(max_wall_ns) FROM batches").fetchall()[0]
    return fx.Window(int(lo), int(hi))
