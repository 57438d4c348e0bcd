"""The SGLang plugin's tests run in the environments scripts/sglang-env.sh builds (the real sglang 0.5.23, 0.5.19)."""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import pytest

# test_release_wheels.py reads every release's wheel without SGLang, test_demo_script.py checks a script's commands:
# they run in the main environment only.
WITHOUT_SGLANG = {"test_release_wheels.py", "test_demo_script.py"}
if importlib.util.find_spec("sglang") is None:
    # The main .venv has no SGLang: these run in the SGLang environments scripts/sglang-env.sh builds (the test
    # command runs them on 0.5.23 and 0.5.19).
    collect_ignore = [p.name for p in Path(__file__).parent.glob("test_*.py") if p.name not in WITHOUT_SGLANG]
else:
    collect_ignore = sorted(WITHOUT_SGLANG)
    from importlib.metadata import version

    if tuple(int(x) for x in version("sglang").split(".")[:3]) < (0, 5, 23):
        # An older release (0.5.19, the incident's): the test written for every release runs; the others drive
        # 0.5.23's own API (its KV checksum, runtime context, paged allocator on CPU) and run on 0.5.23.
        EVERY_RELEASE = {"test_incident_by_release.py", "test_real_pd.py"}
        collect_ignore += [p.name for p in Path(__file__).parent.glob("test_*.py") if p.name not in EVERY_RELEASE]


class SharedStore:
    """One AuditStore both simulated nodes' recorders commit to (their writer threads take turns)."""

    def __init__(self, path):
        from kvtrail.audit.store import AuditStore

        self.store = AuditStore(path)
        self.lock = threading.Lock()

    def append(self, table):
        with self.lock:
            return self.store.append(table)


def start_node(plugin, scheduler, sink, node: str):
    """plugin.start for one node of a PD pair, under its own node name (prefill and decode pools are apart)."""
    import dataclasses

    base = plugin.config
    plugin.config = dataclasses.replace(base, node=node)
    try:
        return plugin.start(scheduler, sink=sink)
    finally:
        plugin.config = base


def on_node(plugin, session) -> None:
    """Make ``session`` the plugin's current node (its resolver drained first)."""
    session.resolver.drain()
    plugin.session = session


@pytest.fixture
def checksum_pd(plugin, tmp_path):
    """A prefill and a decode node with SGLang's KV checksum on, one shared store, and the decode HTTP process's
    frontend: (plugin, sessions, prefill, decode, tokenizer, db, close). ``close(check=True)`` first drains every
    session's resolver and asserts each recorder flushed with no failure."""
    from tests.sglang.pd import tokenizer
    from tests.sglang.world import Node

    store = SharedStore(tmp_path / "audit.duckdb")
    pnode, dnode = Node("prefill", checksum=True), Node("decode", checksum=True)
    sessions = [
        start_node(plugin, pnode.scheduler, store, "sg-prefill"),
        start_node(plugin, dnode.scheduler, store, "sg-decode"),
    ]
    tm = tokenizer("decode")
    sessions.append(plugin.start_frontend(tm, sink=store))
    plugin.session = None
    closed = []

    def close(check: bool = False) -> None:
        plugin.session = plugin.frontend = None
        if not closed:
            closed.append(True)
            if check:
                for s in sessions:
                    s.resolver.drain()
                    assert s.recorder.flush(30) and s.resolver.failures == {}, s.resolver.failures
            for s in sessions:
                s.close()
            store.store.close()

    yield plugin, sessions, pnode, dnode, tm, tmp_path / "audit.duckdb", close
    close()


@pytest.fixture(scope="session")
def plugin(tmp_path_factory):
    """kvtrail's plugin, loaded by SGLang's own load_plugins() from the installed entry point."""
    import os

    from sglang.srt.plugins import load_plugins

    os.environ["KVTRAIL_DB"] = str(tmp_path_factory.mktemp("sg") / "unused.duckdb")
    os.environ["KVTRAIL_NODE"], os.environ["KVTRAIL_CLUSTER"] = "sg-node", "sg-test"
    try:
        load_plugins()
    finally:
        for k in ("KVTRAIL_DB", "KVTRAIL_NODE", "KVTRAIL_CLUSTER"):
            os.environ.pop(k, None)
    from kvtrail.serving.sglang import plugin as mod

    assert mod.PLUGIN is not None, "load_plugins() did not call kvtrail's entry point"
    mod.PLUGIN._frontend_tried = True  # tests start the HTTP process's session themselves, on their own stores
    mod.PLUGIN._refusals_tried = True
    from tests.sglang.world import publish

    publish()
    return mod.PLUGIN
