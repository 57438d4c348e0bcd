"""How ``kvtrail dashboard`` runs the app: ``streamlit run`` on :mod:`kvtrail.dashboards.app` in a child
process on loopback, the source passed in the environment (a token never shows in a process list), and
the wait until the app answers its health check."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvtrail.errors import KvtrailError

BANNER = "kvtrail dashboard listening on {url}"
# How the app learns its source (the script Streamlit runs takes no arguments of ours).
ENV_DB, ENV_URL, ENV_TOKEN = "KVTRAIL_DASHBOARD_DB", "KVTRAIL_DASHBOARD_URL", "KVTRAIL_DASHBOARD_TOKEN"
HOST = "127.0.0.1"
# The app's one uploader takes incident.yaml, which the report reads up to 1 MiB
# (kvtrail.report.context.MAX_FILE_BYTES); Streamlit's default says "200MB per file".
MAX_UPLOAD_MB = 1


@dataclass(frozen=True)
class DashboardConfig:
    """How the dashboard is served."""

    port: int = 0  # 0: a free port the OS picks
    start_timeout_s: float = 90.0
    stop_timeout_s: float = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


# What the app imports that the base install lacks: all of it comes with the `dashboard` extra.
EXTRA_MODULES = ("streamlit", "altair")


def require_extra() -> None:
    """KvtrailError naming the extra to install when the app's packages are missing (Streamlit would only say
    'No module named streamlit' and exit 1)."""
    missing = [m for m in EXTRA_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise KvtrailError(
            f"dashboard: {', '.join(missing)} not installed; install the dashboard extra: "
            "pip install -e '.[dashboard]' in a clone (or pip install 'kvtrail[dashboard]')"
        )


def streamlit_command(port: int) -> list[str]:
    app = Path(__file__).with_name("app.py")
    # -P: the current directory does not go first on the app's sys.path. Started from a clone's parent,
    # the clone's folder (also named kvtrail) would shadow the installed package.
    return [
        sys.executable,
        "-P",
        "-m",
        "streamlit",
        "run",
        str(app),
        "--server.address",
        HOST,
        "--server.port",
        str(port),
        "--server.headless",
        "true",
        "--browser.gatherUsageStats",
        "false",
        "--server.fileWatcherType",
        "none",
        "--global.developmentMode",
        "false",
        "--client.toolbarMode",
        "viewer",
        "--theme.base",
        "light",
        "--server.maxUploadSize",
        str(MAX_UPLOAD_MB),
    ]


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
