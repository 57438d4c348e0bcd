"""The running dashboard in a real headless browser: Debian's chromium driven by Playwright (never a
downloaded browser). ``kvtrail dashboard`` serves the seeded store on loopback; each view must show its
key text and no Streamlit exception box; a screenshot of each lands in build/screenshots/."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlencode

import pytest

from kvtrail import forensics as fx
from kvtrail.timeutil import format_utc

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "build" / "screenshots"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
START_TIMEOUT_S = 120.0
VIEW_TIMEOUT_MS = 120_000
BANNER = "kvtrail dashboard listening on http://127.0.0.1:"
# Each view and a text it shows only once its data is on the page.
VIEWS = {
    "Fleet": "have a KV pool smaller than the context they advertise",
    "Findings": "Counts by code",
    "Affected responses": "Reserved vs sent vs landed",
    "Exposure": "Exploitation assessment",
    "Transfers": "length mismatches (F2)",
    "Report": "Generate report",
}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed (scripts/bootstrap.sh test installs it)"
    ),
]


def _first_line(proc: subprocess.Popen, timeout_s: float) -> str:
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    threading.Thread(target=lambda: lines.put(proc.stdout.readline() if proc.stdout else ""), daemon=True).start()
    try:
        return lines.get(timeout=timeout_s).strip()
    except queue.Empty:
        raise AssertionError(f"no banner within {timeout_s:g} s") from None


@pytest.fixture(scope="module")
def served(seeded):
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtrail", "dashboard", "--db", str(seeded), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        line = _first_line(proc, START_TIMEOUT_S)
        assert line.startswith(BANNER), line
        yield line.rsplit(" ", 1)[1]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _open(page, url: str, text: str) -> None:
    page.goto(url)
    page.get_by_text(text).first.wait_for(timeout=VIEW_TIMEOUT_MS)
    # the script has finished its run once the "running" indicator is gone
    page.wait_for_function("() => !document.querySelector('[data-testid=stStatusWidget]')", timeout=VIEW_TIMEOUT_MS)
    page.wait_for_timeout(1500)  # charts draw after the data arrives


def test_every_view_renders_in_chromium(served, seeded, window):
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    span = {"from": format_utc(window.from_ns), "to": format_utc(window.to_ns + 999)}
    victim = fx.ask_affected(seeded, window).rows["request_id"][0]
    started = time.monotonic()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1800})
            for view, text in VIEWS.items():
                _open(page, f"{served}/?{urlencode({'view': view, **span})}", text)
                assert page.locator("[data-testid=stException]").count() == 0, view
                assert page.get_by_role("heading", name=view.split()[0]).count() >= 1, view
                page.screenshot(path=str(SHOTS / f"{view.lower().replace(' ', '-')}.png"))
                if view == "Report":  # the uploader states incident.yaml's limit, not Streamlit's 200MB
                    limit = page.locator("[data-testid=stFileUploaderDropzoneInstructions]").inner_text()
                    assert "1MB per file" in limit and "200MB" not in limit, limit
            _open(
                page,
                f"{served}/?{urlencode({'view': 'Affected responses', 'request': victim, **span})}",
                "Reserved vs sent vs landed",
            )
            timeline = page.locator("[data-testid=stVegaLiteChart]").first
            timeline.wait_for(timeout=VIEW_TIMEOUT_MS)
            assert page.locator("[data-testid=stException]").count() == 0
            timeline.screenshot(path=str(SHOTS / "page-ownership-timeline.png"))
        finally:
            browser.close()
    assert {f.name for f in SHOTS.iterdir()} >= {
        "fleet.png",
        "findings.png",
        "affected-responses.png",
        "exposure.png",
        "transfers.png",
        "report.png",
        "page-ownership-timeline.png",
    }
    assert time.monotonic() - started < 600
