"""``kvtrail dashboard``: the Streamlit app on loopback, read-only, on a store file or a running service.

It runs ``streamlit run`` on :mod:`kvtrail.dashboards.app` in a child process (:mod:`kvtrail.dashboards.launch`),
waits until the app answers its health check, and prints ``kvtrail dashboard listening on
http://127.0.0.1:PORT`` as its first line of stdout (Streamlit's own output goes to stderr). SIGINT or
SIGTERM stops the app and exits 0.
"""

from __future__ import annotations

import subprocess
import sys

import click

from kvtrail.dashboards.launch import (
    BANNER,
    ENV_DB,
    ENV_TOKEN,
    ENV_URL,
    HOST,
    DashboardConfig,
    free_port,
    require_extra,
    source_env,
    streamlit_command,
    wait_healthy,
)

__all__ = ["ENV_DB", "ENV_TOKEN", "ENV_URL", "dashboard", "free_port", "source_env", "streamlit_command"]

_DEFAULTS = DashboardConfig()


@click.command()
@click.option("--db", type=click.Path(dir_okay=False), help="Audit store to read (opened read-only per page load).")
@click.option("--url", envvar="KVTRAIL_URL", help="A running kvtrail service to read through its API.")
@click.option("--token", envvar="KVTRAIL_TOKEN", help="Bearer token for --url (a tenant token sees its tenant only).")
@click.option(
    "--port",
    default=_DEFAULTS.port,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="Port on 127.0.0.1; 0 lets the OS pick one (the first line of output names it).",
)
def dashboard(db: str | None, url: str | None, token: str | None, port: int) -> None:
    """Serve the read-only dashboard (Fleet, Findings, Affected responses, Exposure, Transfers, Report) on loopback.

    The first line of output is `kvtrail dashboard listening on http://127.0.0.1:PORT`. SIGINT or SIGTERM stops it.
    """
    from kvtrail.signals import interrupt_on_stop_signals

    env = source_env(db, url, token)
    require_extra()
    port = port or free_port()
    address = f"http://{HOST}:{port}"
    proc = subprocess.Popen(
        streamlit_command(port), env=env, stdout=sys.stderr, stderr=sys.stderr, stdin=subprocess.DEVNULL
    )
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
