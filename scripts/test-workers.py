"""How many pytest-xdist workers `scripts/bootstrap.sh test` starts: one per core this process may use.

The cores are those it may run on (its CPU affinity), fewer where a cgroup v2 quota (``cpu.max``) allows
fewer (a container shown every core of its host), and at most one per 3 GiB of available memory (a worker
starts servers, a browser and stores of its own). Prints a number, at least 1.
"""

from __future__ import annotations

import math
import os

GIB = 1 << 30
MEMORY_PER_WORKER = 3 * GIB


def cores(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    n = len(os.sched_getaffinity(0))
    try:
        with open(cpu_max) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota to read: the affinity stands
    return n


def available_memory(meminfo: str = "/proc/meminfo") -> int | None:
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def workers(cpu_max: str = "/sys/fs/cgroup/cpu.max", meminfo: str = "/proc/meminfo") -> int:
    n = cores(cpu_max)
    mem = available_memory(meminfo)
    if mem is not None:
        n = min(n, mem // MEMORY_PER_WORKER)
    return max(1, n)


if __name__ == "__main__":
    print(workers())
