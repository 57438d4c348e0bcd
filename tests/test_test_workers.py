"""`scripts/test-workers.py`: how many pytest workers the test command starts."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "test-workers.py"
tw = runpy.run_path(str(SCRIPT))
AFFINITY = len(os.sched_getaffinity(0))


def _meminfo(tmp_path: Path, gib: float) -> str:
    p = tmp_path / "meminfo"
    p.write_text(f"MemTotal:       99999999 kB\nMemAvailable:   {int(gib * (1 << 20))} kB\n")
    return str(p)


def _cpu_max(tmp_path: Path, text: str) -> str:
    p = tmp_path / "cpu.max"
    p.write_text(text)
    return str(p)


def test_a_cgroup_quota_caps_the_cores_and_max_leaves_the_affinity(tmp_path):
    assert tw["cores"](_cpu_max(tmp_path, "100000 100000\n")) == 1
    assert tw["cores"](_cpu_max(tmp_path, "150000 100000\n")) == min(AFFINITY, 2)  # a part of a core counts
    assert tw["cores"](_cpu_max(tmp_path, "max 100000\n")) == AFFINITY
    assert tw["cores"](str(tmp_path / "absent")) == AFFINITY
    assert tw["cores"](_cpu_max(tmp_path, "garbage\n")) == AFFINITY


def test_memory_caps_the_workers_at_one_per_3_gib_and_never_below_one(tmp_path):
    free = _cpu_max(tmp_path, "max 100000\n")
    assert tw["workers"](free, _meminfo(tmp_path, 7)) == min(AFFINITY, 2)
    assert tw["workers"](free, _meminfo(tmp_path, 1)) == 1
    assert tw["workers"](free, _meminfo(tmp_path, 1000)) == AFFINITY
    assert tw["workers"](free, str(tmp_path / "absent")) == AFFINITY


def test_the_script_prints_one_positive_number():
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, check=True).stdout
    assert int(out) >= 1 and out.strip() == out.rstrip("\n")
