"""Where the workers' stderr goes: native writes to fd 2 into the log beside the store, Python's own
``sys.stderr`` to the original stream; and the stack reads back the current run's last lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvtrail.serving.config import StackConfig
from kvtrail.serving.stack import _LOG_START_MARK, Stack, worker_log_path

_CHILD = """
import os, sys
from pathlib import Path
from kvtrail.serving.worker import route_native_stderr
route_native_stderr(Path(sys.argv[1]))
os.write(2, b"E1201 native engine line\\n")  # what glog does: straight to the file descriptor
print("python warning line", file=sys.stderr)
"""


def test_native_stderr_goes_to_the_log_and_python_stderr_stays(tmp_path: Path) -> None:
    log = tmp_path / "x.duckdb.workers.log"
    log.write_text("earlier line\n")
    done = subprocess.run([sys.executable, "-c", _CHILD, str(log)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "python warning line\n"
    assert log.read_text() == "earlier line\nE1201 native engine line\n"  # appended, not truncated


def test_log_tail_is_the_current_runs_last_lines(tmp_path: Path) -> None:
    db = tmp_path / "x.duckdb"
    stack = Stack(StackConfig(), db)
    assert stack.worker_log_path == worker_log_path(db) == tmp_path / "x.duckdb.workers.log"
    assert stack.worker_log_tail() == [] and stack.failed_workers() == {}
    lines = [f"{_LOG_START_MARK} run 1", "old failure", f"{_LOG_START_MARK} run 2"]
    lines += [f"line {i}" for i in range(30)]
    stack.worker_log_path.write_text("\n".join(lines) + "\n")
    assert stack.worker_log_tail(5) == [f"line {i}" for i in range(25, 30)]
    assert "old failure" not in stack.worker_log_tail(100)
    assert stack.worker_log_tail(100)[0] == "line 0"
