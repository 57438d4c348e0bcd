"""The disclosure PDF's layout, as far as its text shows it: on a 20-tenant store, no table header is split
inside a word, no tenant id is split across lines or cut, no table is wider than a page can hold, and the
charts' legends say what their colours mean."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from kvtrail.audit.batch import from_dicts
from kvtrail.audit.store import AuditStore
from kvtrail.cli import main
from kvtrail.forensics import Window, ask_findings, ask_thresholds
from kvtrail.report import charts
from kvtrail.report.render import header_words
from tests.forensics.incident_fixture import W0, Incident
from tests.forensics.restart_fixture import WINDOW

TENANTS = [f"tenant-{i:02d}-example-corp" for i in range(20)]

pytestmark = pytest.mark.skipif(shutil.which("pdftotext") is None, reason="needs pdftotext (poppler-utils)")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """20 tenants; tenant i+1's over-long prompt reads tenant i's pages (and never-written ones), then every
    other tenant's reads tenant 0's (a list of 19 tenant ids in one cell)."""
    base = tmp_path_factory.mktemp("layout")
    inc = Incident()
    for i, tenant in enumerate(TENANTS):
        inc.request(1 + 2 * i, tenant, 100)
        inc.request(2 + 2 * i, TENANTS[(i + 1) % len(TENANTS)], 200)
    inc.request(50, TENANTS[0], 100)
    for i, tenant in enumerate(TENANTS[1:]):
        inc.request(50.5 + i / 2, tenant, 200)  # an over-long prompt writes one page: 2..7 stay tenant 0's
    with AuditStore(base / "fleet.duckdb") as store:
        store.append(from_dicts(inc.events))
    out = base / "out"
    assert main(["forensics", "report", "--db", str(base / "fleet.duckdb"), *WINDOW, "--out", str(out)]) == 0
    text = subprocess.run(
        ["pdftotext", "-raw", str(out / "report.pdf"), "-"], capture_output=True, text=True, check=True
    ).stdout
    return base / "fleet.duckdb", out, " ".join(text.split())


def _md_tables(md: str) -> list[list[str]]:
    """The header cells of every table in report.md, unescaped."""
    lines = md.splitlines()
    return [
        [c.strip().replace("\\_", "_").replace("\\\\", "\\") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        for line, nxt in zip(lines, lines[1:])
        if nxt.startswith("|---|")
    ]


def test_no_header_is_split_inside_a_word(made):
    _, out, text = made
    headers = {h for table in _md_tables((out / "report.md").read_text()) for h in table}
    for h in headers:
        assert " ".join(header_words(h).split()) in text, h
    assert {"pool_covers_context", "max_unaffected_prompt_tokens", "same_tenant_responses"} <= headers


def test_tenant_ids_are_whole(made):
    _, _, text = made
    shown = set(re.findall(r"tenant-[\w\-…]*", text))  # tenant ids, and request ids made of them
    broken = {s for s in shown if not re.fullmatch(r"tenant-\d\d-example-corp(-\d+)?", s)}
    assert not broken, sorted(broken)[:5]
    assert set(TENANTS) <= shown


def test_no_table_is_wider_than_a_page(made):
    _, out, text = made
    md = (out / "report.md").read_text()
    assert max(len(t) for t in _md_tables(md)) <= 9
    section = md[md.index("## Exposure by recipient tenant") :]
    assert len(_md_tables(section)[0]) == 4
    assert "| tenant-01-example-corp | tenant-00-example-corp: 2 / 12 |  | 2 / 12 |" in section
    assert (
        "| tenant-05-example-corp | tenant-00-example-corp: 1 / 6; tenant-04-example-corp: 1 / 6 |  | 2 / 12 |"
        in section
    )
    exposed = md[md.index("## Exposed tenants") :]
    assert ", ".join(TENANTS[1:]) in exposed  # all 19 in the Markdown; the PDF keeps whole ids (above)
    assert "other tenants' data read (tenant: responses / pages)" in text


def test_legends_say_what_the_colours_mean(made):
    db, _, _ = made
    pool = charts.pool_vs_context(ask_thresholds(db, Window(W0, W0 + 3_600 * 10**9)).rows).to_dict()
    found = ask_findings(db, Window(W0, W0 + 3_600 * 10**9)).rows
    timeline = charts.foreign_reads_timeline(found).to_dict()
    domains = [
        pool["layer"][0]["encoding"]["color"]["scale"]["domain"],
        timeline["encoding"]["color"]["scale"]["domain"],
    ]
    assert domains == [[charts.BELOW, charts.COVERS], ["foreign read (F1, F5)", "other finding"]]
