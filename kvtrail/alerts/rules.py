"""The alert rules shipped in the package: where the file is, which alerts and metrics it names."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import yaml

RULES_FILE = "rules.yml"
_METRIC = re.compile(r"\bkvtrail_[a-z0-9_]+")


def rules_path() -> Path:
    """The rule file inside the installed package (pass it to Prometheus' ``rule_files``)."""
    return Path(str(resources.files("kvtrail.alerts").joinpath(RULES_FILE)))


def _rules() -> list[dict]:
    doc = yaml.safe_load(rules_path().read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def rule_names() -> list[str]:
    """Every alert the file defines, in file order."""
    return [r["alert"] for r in _rules() if "alert" in r]


def rule_metrics() -> set[str]:
    """Every kvtrail sample name the rules' expressions read."""
    return {m for r in _rules() for m in _METRIC.findall(r["expr"])}
