"""``kvtrail dashboard``: the Streamlit app on loopback, read-only, on a store file or a running service.

It runs ``streamlit run`` on :mod:`kvtrail.dashboards.app` in a child process, passing the source in the
environment (a token never shows in a process list), waits until the app answers its health check, and
prints ``kvtrail dashboard listening on http://127.0.0.1:PORT`` as its first line of stdout (Streamlit's
own output goes to stderr). SIGINT or SIGTERM stops the app and exits 0.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click
import httpx

from kvtrail.errors import KvtrailError

BANNER = "kvtrail dashboard listening on {url}"
# How the app learns its source (the script Streamlit runs takes no arguments of ours).
ENV_DB, ENV_URL, ENV_TOKEN = "KVTRAIL_DASHBOARD_DB", "KVTRAIL_DASHBOARD_URL", "KVTRAIL_DASHBOARD_TOKEN"
HOST = "127.0.0.1"


@dataclass(frozen=True)
class DashboardConfig:
    """How the dashboard is served."""

    port: int = 0  # 0: a free port the OS picks
    start_timeout_s: float = 90.0
    stop_timeout_s: float = 10.0


_DEFAULTS = DashboardConfig()


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def streamlit_command(port: int) -> list[str]:
    app = Path(__file__).with_name("app.py")
    return [sys.executable, "-m", "streamlit", "run", str(app), "--server.address", HOST, "--server.port", str(port),
            "--server.headless", "true", "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
            "--global.developmentMode", "false", "--client.toolbarMode", "viewer", "--theme.base", "light"]


def source_env(db: str | None, url: str | None, token: str | None) -> dict[str, str]:
    if bool(db) == bool(url):
        raise KvtrailError("--db: give a store file (--db PATH) or a service (--url URL --token T), one of them")
    if url and not token:
        raise KvtrailError("--token: required with --url (or KVTRAIL_TOKEN)")
    env = {k: v for k, v in os.environ.items() if k not in (ENV_DB, ENV_URL, ENV_TOKEN)}
    if db:
        env[ENV_DB] = str(Path(db).resolve())
    else:
        env.update({ENV_URL: url or "", ENV_TOKEN: token or ""})
    return env


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise KvtrailError(f"dashboard: streamlit exited with code {proc.returncode} before it served")
        try:
            if httpx.get(f"{url}/_stcore/health", timeout=2.0).text.strip() == "ok":
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise KvtrailError(f"dashboard: no answer from {url} within {timeout_s:g} s")


@click.command()
@click.option("--db", type=click.Path(dir_okay=False), help="Audit store to read (opened read-only per page load).")
@click.option("--url", envvar="KVTRAIL_URL", help="A running kvtrail service to read through its API.")
@click.option("--token", envvar="KVTRAIL_TOKEN", help="Bearer token for --url (a tenant token sees its tenant only).")
@click.option("--port", default=_DEFAULTS.port, show_default=True, type=click.IntRange(0, 65535),
              help="Port on 127.0.0.1; 0 lets the OS pick one (the first line of output names it).")
def dashboard(db: str | None, url: str | None, token: str | None, port: int) -> None:
    """Serve the read-only dashboard (Fleet, Findings, Affected responses, Exposure, Transfers, Report) on loopback.

    The first line of output is `kvtrail dashboard listening on http://127.0.0.1:PORT`. SIGINT or SIGTERM stops it.
    """
    from kvtrail.signals import interrupt_on_stop_signals

    env = source_env(db, url, token)
    port = port or free_port()
    address = f"http://{HOST}:{port}"
    proc = subprocess.Popen(streamlit_command(port), env=env, stdout=sys.stderr, stderr=sys.stderr,
                            stdin=subprocess.DEVNULL)
    try:
        with interrupt_on_stop_signals():
            try:
                wait_healthy(proc, address, _DEFAULTS.start_timeout_s)
                click.echo(BANNER.format(url=address))
                sys.stdout.flush()
                code = proc.wait()
                if code:
                    raise SystemExit(1)
            except KeyboardInterrupt:
                pass
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(_DEFAULTS.stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
