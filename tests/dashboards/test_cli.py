"""``kvtrail dashboard``: registered, one source exactly, the source passed in the environment."""

from __future__ import annotations

from pathlib import Path

import click

from kvtrail.cli import cli, main
from kvtrail.cli import dashboard as dash


def test_dashboard_is_a_root_command():
    assert cli.get_command(click.Context(cli), "dashboard") is dash.dashboard
    assert {p.name for p in dash.dashboard.params} == {"db", "url", "token", "port"}


def test_one_source_exactly(capsys):
    assert main(["dashboard"]) == 2
    assert "give a store file (--db PATH) or a service" in capsys.readouterr().err
    assert main(["dashboard", "--db", "x.duckdb", "--url", "http://127.0.0.1:1", "--token", "t"]) == 2
    assert main(["dashboard", "--url", "http://127.0.0.1:1"]) == 2
    assert "--token: required" in capsys.readouterr().err


def test_the_source_travels_in_the_environment_not_the_command_line(tmp_path):
    env = dash.source_env(None, "http://127.0.0.1:9", "kvt_secret")
    assert env[dash.ENV_URL] == "http://127.0.0.1:9" and env[dash.ENV_TOKEN] == "kvt_secret"
    assert "kvt_secret" not in " ".join(dash.streamlit_command(8501))
    env = dash.source_env(str(tmp_path / "s.duckdb"), None, None)
    assert Path(env[dash.ENV_DB]).is_absolute() and dash.ENV_URL not in env
    cmd = dash.streamlit_command(8501)
    assert cmd[cmd.index("--server.address") + 1] == "127.0.0.1"
    assert dash.free_port() > 0
