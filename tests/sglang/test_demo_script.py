"""scripts/sglang-pd-demo.sh (docs/sglang.md) shows a user what the real PD test checks: its commands (printed by
--dry-run) start the servers and the router as the test helpers do."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from tests.sglang.realserver import CPU_FLAGS, PD_ENV, PD_FLAGS

ROOT = Path(__file__).resolve().parents[2]


def _commands(tmp_path) -> dict[str, list[str]]:
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "sglang-pd-demo.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin", "KVTRAIL_DEMO_DIR": str(tmp_path), "KVTRAIL_PYTHON": "judge-python"},
    ).stdout
    cmds: dict[str, list[str]] = {}
    for line in out.splitlines():
        name, _, cmd = line.partition(":")
        cmds.setdefault(name.strip(), []).append(cmd.strip())
    return cmds


def _has(argv: list[str], flags: list[str]) -> bool:
    return any(argv[i : i + len(flags)] == flags for i in range(len(argv)))


def test_the_demo_starts_prefill_decode_and_the_router_as_the_real_pd_test_does(tmp_path):
    cmds = _commands(tmp_path)
    prefill, decode = (shlex.split(cmds[n][0]) for n in ("prefill", "decode"))
    for argv, mode in ((prefill, "prefill"), (decode, "decode")):
        assert _has(argv, ["-m", "sglang.launch_server"]) and _has(argv, CPU_FLAGS) and _has(argv, PD_FLAGS)
        assert _has(argv, ["--disaggregation-mode", mode])
        assert {f"{k}={v}" for k, v in PD_ENV.items()} <= set(argv)
        assert f"KVTRAIL_DB={tmp_path}/pd-{mode}.duckdb" in argv and f"KVTRAIL_NODE=pd-{mode}" in argv
        shims = next(a for a in argv if a.startswith("PYTHONPATH="))
        assert shims == f"PYTHONPATH={ROOT}/tests/sglang/shims:{ROOT}"
    assert _has(prefill, ["--max-total-tokens", "2048"]) and _has(decode, ["--max-total-tokens", "4096"])
    assert _has(decode, ["--disaggregation-decode-retraction-backup", "cpu_tensor"])
    bootstrap = prefill[prefill.index("--disaggregation-bootstrap-port") + 1]
    router = shlex.split(cmds["router"][0])
    assert _has(router, ["-m", "sglang_router.launch_router", "--pd-disaggregation"])
    assert _has(router, ["--prefill", f"http://127.0.0.1:{prefill[prefill.index('--port') + 1]}", bootstrap])
    assert _has(router, ["--decode", f"http://127.0.0.1:{decode[decode.index('--port') + 1]}"])
    # the judgement: prefill's record merged into decode's, then forensics, as the 0.5.19 test does
    judge = [shlex.split(c) for c in cmds["judge"]]
    assert [c[:5] for c in judge] == [["judge-python", "-m", "kvtrail", "audit", "export"]] + [
        ["judge-python", "-m", "kvtrail", "audit", "import"],
        ["judge-python", "-m", "kvtrail", "forensics", "findings"],
    ]
    assert judge[0][-1] == judge[1][-1] == f"{tmp_path}/prefill-export"
