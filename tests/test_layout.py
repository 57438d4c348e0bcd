"""The package's layout rules, read from the source (every import, including ones inside functions).

- the layout follows the data path: ``audit`` (the store) and ``forensics`` (the judge) never import
  ``serving`` (the reference stack), so they work beside any serving engine;
- no import circle, neither between modules nor between packages;
- ``kvtrail.forensics`` is the public API: nothing outside ``kvtrail/forensics/`` imports its subpackages;
- modules stay readable (the house style's size limit).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kvtrail"
FORENSICS_SUBPACKAGES = ("replay", "sql", "analysis", "report")
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
                return stack[stack.index(m):] + [m]
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


@pytest.mark.parametrize("judge", ["kvtrail.audit", "kvtrail.forensics"])
def test_store_and_judge_do_not_depend_on_the_serving_stack(judge):
    bad = sorted(f"{m} -> {t}" for m, ts in GRAPH.items() if _package(m) == judge
                 for t in ts if _package(t) == "kvtrail.serving")
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
    bad = sorted(f"{m} -> {t}" for m, ts in GRAPH.items() if not m.startswith("kvtrail.forensics")
                 for t in ts if t.startswith(private))
    assert not bad, bad


def test_modules_stay_readable():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_sql_engine_is_independent_of_the_replay_engine():
    # the two engines cross-check each other: neither may reuse the other's code
    pairs = [("kvtrail.forensics.sql", "kvtrail.forensics.replay"),
             ("kvtrail.forensics.replay", "kvtrail.forensics.sql")]
    bad = sorted(f"{m} -> {t}" for a, b in pairs for m, ts in GRAPH.items() if m.startswith(a)
                 for t in ts if t.startswith(b))
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
