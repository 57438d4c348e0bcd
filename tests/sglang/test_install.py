"""``pip install "kvtrail[sglang]"`` into SGLang 0.5.23's environment moves nothing, and what it installs records
without the judge's heavy dependencies (numba, polars, ...). Runs in the 0.5.23 environment scripts/sglang-env.sh
builds: its installed set, pinned (``pip freeze``), is the constraint the dry run must satisfy unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = {"numba", "llvmlite", "polars", "polars-runtime-32", "fpdf2", "rich", "click", "torch"}
NEWEST = tuple(int(x) for x in version("sglang").split(".")[:3]) >= (0, 5, 23)
pytestmark = pytest.mark.skipif(not NEWEST, reason="the install is checked against sglang 0.5.23's pins")


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def test_installing_the_sglang_extra_changes_no_installed_version(tmp_path):
    frozen = subprocess.run(
        [sys.executable, "-m", "pip", "list", "--format=freeze", "--exclude", "kvtrail", "--exclude", "pip"]
        + ["--exclude", "setuptools", "--exclude", "wheel"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    pins = {_norm(line.split("==")[0]): line.split("==")[1] for line in frozen.splitlines() if "==" in line}
    assert pins.get("sglang") == version("sglang") and "torch" in pins
    constraints = tmp_path / "sglang-pins.txt"
    constraints.write_text(frozen)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--quiet",
            "--report",
            "-",
            "-c",
            str(constraints),
            f"{ROOT}[sglang]",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, f"the dry run cannot keep SGLang's pins:\n{run.stderr[-3000:]}"
    report = json.loads(run.stdout)
    planned = {_norm(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}
    kvtrail = planned.pop("kvtrail")
    changed = {n: (pins[n], v) for n, v in planned.items() if n in pins}
    assert not changed, f"installed versions it would change: {changed}"
    added = set(planned) - set(pins)  # new packages only (here: cryptography, which signs the recorder's batches)
    assert not added & HEAVY, f"it would add the judge's dependencies: {sorted(added & HEAVY)}"
    # what the extra asks for at all: no heavy dependency of the judge
    [meta] = [i["metadata"] for i in report["install"] if _norm(i["metadata"]["name"]) == "kvtrail"]
    needs = [r for r in meta.get("requires_dist", []) if "extra ==" not in r or 'extra == "sglang"' in r]
    names = {_norm(r.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip()) for r in needs}
    assert names and not names & HEAVY, names
    assert kvtrail == "0.1.0" or kvtrail


def test_the_recording_path_imports_none_of_the_judges_dependencies(tmp_path):
    """The plugin and the recorder, run with numba, polars, click, ... made unimportable: a store file is written."""
    code = f"""
import sys
for name in {sorted(m.replace("-", "_") for m in HEAVY | {"yaml", "tqdm", "prometheus_client", "fpdf"})!r}:
    sys.modules[name] = None  # importing it raises ImportError
from kvtrail.audit.events import Producer
from kvtrail.audit.recorder import Recorder
from kvtrail.serving.sglang.plugin import Plugin
from kvtrail.serving.sglang.config import PluginConfig
plugin = Plugin(PluginConfig(sink={str(tmp_path / "x.duckdb")!r}, node="n", cluster="c"))
rec = Recorder({str(tmp_path / "x.duckdb")!r}, Producer("c", "n", "decode", "sglang", plugin.version, "i"))
rec.node_config(pool_tokens=64, pool_pages=64, page_size=1, context_tokens=64, max_running_requests=1,
                checksum_enabled=False, canary_enabled=False, deferred_release=None, config_source="t")
assert rec.flush(30)
rec.close()
print("recorded", len(plugin.targets))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0 and "recorded" in run.stdout, run.stderr[-3000:]
    import duckdb

    con = duckdb.connect(str(tmp_path / "x.duckdb"), read_only=True)
    try:
        tables = [r[0] for r in con.execute("select table_name from information_schema.tables").fetchall()]
        assert tables
    finally:
        con.close()


def test_the_command_without_the_judge_extra_names_it(tmp_path):
    # A node with the base install (the recording path) has no click: the `kvtrail` script says which
    # extra it needs, exit 2, and no traceback.
    code = (
        "import sys; sys.modules['click'] = None\nfrom kvtrail.cli import main\nraise SystemExit(main(['--version']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "kvtrail[judge]" in proc.stderr and "is not installed" in proc.stderr
    assert "Traceback" not in proc.stderr
