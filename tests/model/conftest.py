"""The reference stack's runs the model is checked against, recorded once per session per mode: the
incident traffic and the late-write fault (an abort mid-transfer), each in its own store."""

from __future__ import annotations

import asyncio

import pytest


@pytest.fixture(scope="session", params=["vulnerable", "patched"])
def stack_runs(request, tmp_path_factory):
    """(mode, [the incident's store, the late write's store])."""
    from kvtrail.serving.config import Faults, StackConfig
    from kvtrail.serving.stack import Stack
    from tests.serving.test_stack import FAULT_CFG, _two_requests, incident_traffic, prompt
    from tests.serving.test_stack import SMALL as STACK_SMALL

    mode = request.param
    tmp = tmp_path_factory.mktemp(f"stack-{mode}")
    db = tmp / "incident.duckdb"
    with Stack(StackConfig.incident(mode=mode, **STACK_SMALL), db) as st:
        incident_traffic(st.url)
    late = tmp / "late.duckdb"
    with Stack(StackConfig(mode=mode, faults=Faults(late_write=True), **FAULT_CFG), late) as st:
        size = 300 if mode == "vulnerable" else 200
        asyncio.run(
            _two_requests(
                st.url,
                ("acme", prompt("acme", size * 16)),
                ("globex", prompt("globex", size * 16)),
                0.2,
                first_headers={"x-kvtrail-abort-after-ms": "50"},
                after_first=mode == "vulnerable",  # its pages are free by then: both do not fit at once
            )
        )
    return mode, [db, late]
