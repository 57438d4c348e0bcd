"""``kvtrail dashboard``: registered, one source exactly, the source passed in the environment."""

from __future__ import annotations

from pathlib import Path

import click
import pytest

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


def test_the_app_imports_the_installed_package_from_a_clones_parent(tmp_path):
    """Started from the folder that holds the clone (itself named kvtrail), the app's interpreter must not
    take that folder for the package (every view showed "cannot import name '__version__'")."""
    import os
    import subprocess

    (tmp_path / "kvtrail" / "docs").mkdir(parents=True)  # the clone as seen from its parent: no __init__.py
    cmd = dash.streamlit_command(8501)
    interpreter = cmd[: cmd.index("-m")]
    probe = "from kvtrail import __version__; print(__version__)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the package as installed
    launched = subprocess.run([*interpreter, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    if "No module named 'kvtrail'" in launched.stderr:
        pytest.skip("kvtrail is not installed in this interpreter (pip install -e .)")
    assert launched.returncode == 0, launched.stderr
    plain = subprocess.run([interpreter[0], "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert "cannot import name '__version__'" in plain.stderr  # what the app met without -P
    from kvtrail import __version__

    assert launched.stdout.strip() == __version__


def test_a_missing_extra_is_named_in_one_line_exit_2(monkeypatch, capsys, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "streamlit" else real(name, *a))
    store = tmp_path / "s.duckdb"
    assert main(["dashboard", "--db", str(store)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "streamlit not installed" in err[0] and "pip install -e '.[dashboard]'" in err[0]


def test_the_uploader_limit_is_the_incident_files():
    from kvtrail.report.context import MAX_FILE_BYTES

    cmd = dash.streamlit_command(8501)
    assert int(cmd[cmd.index("--server.maxUploadSize") + 1]) << 20 == MAX_FILE_BYTES
