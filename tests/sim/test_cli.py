"""``kvtrail simulate``: flag defaults come from FleetConfig; a store's history decides where a run goes."""

from __future__ import annotations

import json

import click

from kvtrail.cli import cli, main
from kvtrail.cli.simulate import simulate
from kvtrail.sim.fleet import FleetConfig, config_defaults
from kvtrail.timeutil import format_utc

FLAGS = [
    "--nodes",
    "2",
    "--hours",
    "0.0005",
    "--rate",
    "20",
    "--prefill-pool-tokens",
    "16384",
    "--decode-pool-tokens",
    "69632",
    "--context-tokens",
    "65536",
    "--max-new-tokens",
    "1024",
    "--bugs",
    "none",
]


def test_simulate_is_a_root_command_and_its_defaults_are_the_configs():
    assert cli.get_command(click.Context(cli), "simulate") is simulate
    defaults = config_defaults()
    checked = 0
    for param in simulate.params:
        assert isinstance(param, click.Option)
        field = {"rate": "rate_per_s"}.get(param.name or "", param.name or "")
        if field in defaults and param.default is not None and not param.is_flag:
            want = ",".join(defaults[field]) if field == "bugs" else defaults[field]
            assert param.default == want, param.name
            checked += 1
    assert checked >= 15 and defaults["seed"] == FleetConfig().seed


def test_nodes_conflicts_with_explicit_node_counts(tmp_path, capsys):
    db = str(tmp_path / "n.duckdb")
    assert main(["simulate", "--db", db, "--nodes", "2", "--decode-nodes", "3"]) == 2
    assert "--nodes: give either --nodes or --decode-nodes" in capsys.readouterr().err


def test_append_starts_after_the_last_event_and_a_run_is_never_stored_twice(tmp_path, capsys):
    db = str(tmp_path / "a.duckdb")
    assert main(["simulate", "--db", db, *FLAGS]) == 0
    first = json.loads((tmp_path / "a.duckdb.truth.json").read_text())["window"]
    capsys.readouterr()
    second_truth = tmp_path / "second.json"
    assert main(["simulate", "--db", db, *FLAGS, "--append", "--truth", str(second_truth)]) == 0
    second = json.loads(second_truth.read_text())["window"]
    assert second["from_ns"] == (first["to_ns"] // 10**9 + 1) * 10**9
    assert f"{format_utc(second['from_ns'])} .." in capsys.readouterr().out
    # the first run again, appended: same seed and start, so refused
    again = ["simulate", "--db", db, *FLAGS, "--append", "--start", first["from"], "--truth", str(tmp_path / "x")]
    assert main(again) == 2
    err = capsys.readouterr().err
    assert "--start: cluster 'fleet-sim' already holds the run with seed 0 starting at" in err
    assert not (tmp_path / "x").exists()
