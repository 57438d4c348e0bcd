"""The plugin as SGLang loads it: entry-point discovery, every hook target patched, missing targets reported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_load_plugins_finds_the_entry_point_and_patches_every_target(plugin):
    from sglang.srt.disaggregation import decode, prefill
    from sglang.srt.mem_cache import allocation, common
    from sglang.srt.plugins.hook_registry import HookRegistry

    assert plugin.missing == []
    paths = [t.path for t in plugin.targets]
    # 0.5.23: every target but Mooncake's own send (it runs the hooked CommonKVSender.send there)
    assert len(paths) == len(plugin._targets()) - 1 == 27 and set(paths) <= HookRegistry._patched
    assert hasattr(allocation.alloc_for_extend, "__wrapped__")
    # the registry re-binds `from X import Y` copies: decode.py and prefill.py call the hooked release
    assert decode.release_kv_cache is common.release_kv_cache is prefill.release_kv_cache
    assert hasattr(decode.release_kv_cache, "__wrapped__")


def test_a_renamed_target_is_reported_not_silent(tmp_path):
    # A fresh process: SGLang loads the plugin after Req.set_finish_with_abort "was renamed" in this build.
    db = tmp_path / "audit.duckdb"
    code = textwrap.dedent("""
        import warnings; warnings.filterwarnings("ignore")
        from sglang.srt.managers.schedule_batch import Req
        Req.set_finish_with_abort_v2 = Req.set_finish_with_abort
        del Req.set_finish_with_abort
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from kvtrail.serving.sglang import plugin
        from tests.sglang.world import Node, publish
        publish()  # the runtime context the launcher publishes: the ranks the plugin reads
        plugin.PLUGIN.start(Node("decode").scheduler)
        plugin.PLUGIN.stop()
        print("missing:", plugin.PLUGIN.missing)
    """)
    env = dict(os.environ, KVTRAIL_DB=str(db), KVTRAIL_NODE="d0", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    target = "sglang.srt.managers.schedule_batch.Req.set_finish_with_abort"
    assert f"missing: ['{target}']" in run.stdout
    assert "hook target(s) were not patched" in run.stderr and target in run.stderr
    from tests.conftest import stored_events

    configs = [e for e in stored_events(db) if e["kind"] == "node_config"]
    assert len(configs) == 1 and configs[0]["config_source"] == f"sglang-plugin; hooks missing: {target}"


def test_docs_name_every_hook_target(plugin):
    doc = (ROOT / "docs" / "sglang.md").read_text()
    undocumented = [t.path for t in plugin.targets if ".".join(t.path.split(".")[-2:]) not in doc]
    assert undocumented == [], "hook targets missing from docs/sglang.md"
