"""The package's layout rules, read from the source (every import, including ones inside functions).

- the layout follows the data path: ``audit`` (the store) and ``forensics`` (the judge) never import
  ``serving`` (the reference stack), so they work beside any serving engine;
- floors: stored (``audit``) < judged (``forensics``) < the model (``model``, which judges by its
  properties) < asked (``answers``) < the faces < the ``kvtrail`` command (``cli``); no import runs back up
  a floor, and no import circle, between modules or packages;
- the faces (``report``, ``service``, ``dashboards``, ``alerts``, ``preflight``) import no other face,
  except what a face hands out as it is (``HANDED_OUT``); only ``kvtrail/cli`` imports click; the
  dashboards run no SQL;
- the judge's engines (``replay``, ``sql``) are private to ``kvtrail/forensics/``, whose surface stays
  at most 25 names; the lake's storage is ``audit/lake``, its fan-out ``forensics/lake``;
- modules stay readable (the house style's size limit).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kvtrail"
FORENSICS_SUBPACKAGES = ("replay", "sql")
FLOORS = {
    "kvtrail.audit": 1,
    "kvtrail.forensics": 2,
    "kvtrail.model": 2.5,  # judges by the model's properties, beside the findings engines
    "kvtrail.answers": 3,
    "kvtrail.report": 4,
    "kvtrail.service": 4,
    "kvtrail.dashboards": 4,
    "kvtrail.alerts": 4,
    "kvtrail.preflight": 4,
    "kvtrail.witness": 4,
    "kvtrail.cli": 5,
}
FACES = tuple(p for p, f in FLOORS.items() if f == 4)
# what one face hands out through another, whole: the disclosure document and the metrics' exposition
HANDED_OUT = {
    ("kvtrail.service", "kvtrail.report"): "POST /v1/reports writes the disclosure report on a snapshot",
    ("kvtrail.service", "kvtrail.alerts"): "GET /metrics serves the alerts' exposition of the store",
    ("kvtrail.dashboards", "kvtrail.report"): "the Report view writes the report; the views draw its charts",
}
MAX_FORENSICS_NAMES = 25
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The kvtrail module an import names (a module, or the package holding a name), or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    tree = ast.parse(MODULES[module].read_text())
    is_package = MODULES[module].name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(anchor[: len(anchor) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for t in targets:
            if t.startswith("kvtrail"):
                r = _resolve(t)
                if r is not None and r != module:
                    out.add(r)
    return out


GRAPH = {m: _imports(m) for m in MODULES}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of the graph, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def _package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def test_the_graph_sees_the_imports():
    assert "kvtrail.forensics.questions" in GRAPH["kvtrail.forensics"]
    assert "kvtrail.audit.store" in GRAPH["kvtrail.forensics.questions"]


@pytest.mark.parametrize("judge", ["kvtrail.audit", "kvtrail.forensics", "kvtrail.model"])
def test_store_and_judge_do_not_depend_on_the_serving_stack(judge):
    bad = sorted(
        f"{m} -> {t}" for m, ts in GRAPH.items() if _package(m) == judge for t in ts if _package(t) == "kvtrail.serving"
    )
    assert not bad, bad


def test_no_import_circle_between_modules():
    assert _cycle(GRAPH) is None, " -> ".join(_cycle(GRAPH) or [])


def test_no_import_circle_between_packages():
    packages: dict[str, set[str]] = {}
    for m, ts in GRAPH.items():
        packages.setdefault(_package(m), set()).update(_package(t) for t in ts if _package(t) != _package(m))
    assert _cycle(packages) is None, " -> ".join(_cycle(packages) or [])


def test_forensics_subpackages_are_private_to_forensics():
    private = tuple(f"kvtrail.forensics.{s}" for s in FORENSICS_SUBPACKAGES)
    bad = sorted(
        f"{m} -> {t}"
        for m, ts in GRAPH.items()
        if not m.startswith("kvtrail.forensics")
        for t in ts
        if t.startswith(private)
    )
    assert not bad, bad


def test_modules_stay_readable():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_sql_engine_is_independent_of_the_replay_engine():
    # the two engines cross-check each other: neither may reuse the other's code
    pairs = [
        ("kvtrail.forensics.sql", "kvtrail.forensics.replay"),
        ("kvtrail.forensics.replay", "kvtrail.forensics.sql"),
    ]
    bad = sorted(
        f"{m} -> {t}" for a, b in pairs for m, ts in GRAPH.items() if m.startswith(a) for t in ts if t.startswith(b)
    )
    assert not bad, bad


def _documented_modules() -> set[str]:
    """Modules docs/architecture.md lists: ``- `name.py` ...`` lines under ``## kvtrail/<folder>/`` headings."""
    doc = (ROOT.parent / "docs" / "architecture.md").read_text()
    out: set[str] = set()
    folder: str | None = None
    for line in doc.splitlines():
        if line.startswith("## "):
            head = line[3:].split(" ")[0].strip("`")
            folder = head if head.startswith("kvtrail") and head.endswith("/") else None
        elif folder and line.startswith("- `"):
            names = line.split(" — ")[0].split("`")[1::2]  # `a.py` / `b.py` — what they hold
            out.update(folder + name for name in names if name.endswith(".py"))
    return out


def test_architecture_doc_lists_every_module_once_and_only_real_ones():
    real = {str(p.relative_to(ROOT.parent)) for p in MODULES.values() if p.name != "__init__.py"}
    documented = _documented_modules()
    assert sorted(real - documented) == [], "modules missing from docs/architecture.md"
    assert sorted(documented - real) == [], "docs/architecture.md lists modules that do not exist"


def test_no_import_runs_back_up_a_floor():
    bad = sorted(
        f"{m} -> {t}"
        for m, ts in GRAPH.items()
        for t in ts
        if _package(m) in FLOORS and _package(t) in FLOORS and FLOORS[_package(t)] > FLOORS[_package(m)]
    )
    assert not bad, bad


def test_no_face_imports_another_face():
    bad = sorted(
        f"{m} -> {t}"
        for m, ts in GRAPH.items()
        for t in ts
        if _package(m) in FACES
        and _package(t) in FACES
        and _package(m) != _package(t)
        and (_package(m), _package(t)) not in HANDED_OUT
    )
    assert not bad, bad


def test_only_the_cli_imports_click():
    def imports_click(path: Path) -> bool:
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(n == "click" or n.startswith("click.") for n in names):
                return True
        return False

    bad = sorted(m for m, p in MODULES.items() if _package(m) != "kvtrail.cli" and imports_click(p))
    assert not bad, bad


def test_the_dashboards_run_no_sql():
    # the views ask kvtrail.answers; neither a DuckDB connection nor a query string is theirs
    bad = []
    for m, p in MODULES.items():
        if _package(m) != "kvtrail.dashboards":
            continue
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                bad += [f"{m} imports {n}" for n in names if n.split(".")[0] == "duckdb"]
            elif isinstance(node, ast.Attribute) and node.attr in ("execute", "sql", "query"):
                bad.append(f"{m}:{node.lineno} calls .{node.attr}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "SELECT " in node.value.upper():
                bad.append(f"{m}:{node.lineno} holds a query")
    assert not bad, bad


def test_the_forensics_surface_stays_small():
    tree = ast.parse(MODULES["kvtrail.forensics"].read_text())
    names = next(
        ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)
    )
    assert 0 < len(names) <= MAX_FORENSICS_NAMES, (len(names), names)


def test_one_lake_folder_per_layer():
    storage = {m.rsplit(".", 1)[1] for m in MODULES if m.startswith("kvtrail.audit.lake.")}
    fan_out = {m.rsplit(".", 1)[1] for m in MODULES if m.startswith("kvtrail.forensics.lake.")}
    assert {"export", "verify", "manifest", "partition", "fs", "catalog"} <= storage
    assert {"executor", "task", "merge", "checkpoint"} <= fan_out
    assert not any(m.startswith("kvtrail.lake") for m in MODULES)
    # the storage knows nothing of the judge: an export takes its checkpoint writer as an argument
    bad = sorted(
        f"{m} -> {t}"
        for m, ts in GRAPH.items()
        if m.startswith("kvtrail.audit.lake")
        for t in ts
        if not t.startswith(("kvtrail.audit", "kvtrail.errors", "kvtrail.timeutil")) and t != "kvtrail"
    )
    assert not bad, bad
