"""Every SGLang release the plugin supports, read from its wheel: each hook target of that release exists, with
a signature the hook binds to. Runs in the main environment (no SGLang installed): ``pip download --no-deps``
fetches each wheel once into kvtrail's cache folder (``${XDG_CACHE_HOME:-~/.cache}/kvtrail/wheels``), and the
source is read with ``ast``, never imported."""

from __future__ import annotations

import ast
import inspect
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from kvtrail.serving.sglang import targets as T
from kvtrail.serving.sglang.config import PluginConfig
from kvtrail.serving.sglang.plugin import Plugin

NETWORK = re.compile(
    r"NewConnectionError|ConnectionError|Max retries exceeded|Temporary failure in name resolution|"
    r"Network is unreachable|Read timed out|ConnectTimeout|Name or service not known",
)


def wheel_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtrail" / "wheels"


def wheel(version: str) -> Path:
    """SGLang ``version``'s wheel, downloaded once; the test skips only when the registry is unreachable."""
    cache = wheel_cache()
    found = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    # Into a folder of this call's own, then renamed into the cache whole: a test on another worker reading
    # the cache at the same time sees no wheel or a complete one, never a part.
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as part:
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                f"sglang=={version}",
                "-d",
                part,
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        for got in Path(part).glob(f"sglang-{version}-*.whl"):
            os.replace(got, cache / got.name)
    found = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if run.returncode != 0 or not found:
        if NETWORK.search(run.stdout + run.stderr):
            pytest.skip(f"the package registry is unreachable: sglang=={version}'s wheel not downloaded")
        raise AssertionError(f"pip download sglang=={version} failed:\n{run.stdout}\n{run.stderr}")
    return found[0]


def definition(zf: zipfile.ZipFile, path: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The function a dotted target path names in the wheel's source (module, then classes), or None."""
    parts = path.split(".")
    names = set(zf.namelist())
    for i in range(len(parts) - 1, 0, -1):
        for f in ("/".join(parts[:i]) + ".py", "/".join(parts[:i]) + "/__init__.py"):
            if f in names:
                node: ast.AST = ast.parse(zf.read(f))
                for name in parts[i:]:
                    body = getattr(node, "body", [])
                    hits = [
                        n
                        for n in body
                        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name
                    ]
                    if not hits:
                        return None
                    node = hits[-1]  # the last definition wins, as at import
                return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
    return None


def calls(args: ast.arguments) -> list[tuple[list[str], dict[str, str]]]:
    """The ways SGLang can call a function with these parameters: everything positional, only what is required,
    the optional ones by keyword (with two extra positionals for ``*args``)."""
    pos = [a.arg for a in args.posonlyargs + args.args]
    required = pos[: len(pos) - len(args.defaults)]
    optional = pos[len(pos) - len(args.defaults) :]
    kw_all = {a.arg: a.arg for a in args.kwonlyargs}
    kw_req = {a.arg: a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is None}
    extra = ["*1", "*2"] if args.vararg else []
    return [
        (pos + extra, kw_all),
        (required, kw_req),
        (required, {**{n: n for n in optional}, **kw_all}),
    ]


def problems(fn: ast.FunctionDef | ast.AsyncFunctionDef, expects: inspect.Signature) -> list[str]:
    out = []
    for args, kwargs in calls(fn.args):
        try:
            expects.bind(*args, **kwargs)
        except TypeError as exc:
            out.append(f"called as ({', '.join([*args, *(f'{k}=' for k in kwargs)])}): {exc}")
    return out


@pytest.mark.parametrize("version", T.RELEASES)
def test_every_hook_target_of_the_release_exists_with_a_signature_its_hook_binds(version):
    plugin = Plugin(PluginConfig(sink="unused.duckdb", node="n", cluster="c"), version=version)
    with zipfile.ZipFile(wheel(version)) as zf:
        missing, unbound = [], []
        for t in plugin.targets:
            fn = definition(zf, t.path)
            if fn is None:
                missing.append(t.path)
                continue
            unbound += [f"{t.path}: {p}" for p in problems(fn, t.expects())]
        # a target the table leaves out of this release is absent from it, or left out for its stated reason
        left_out = {}
        for path in T.SPANS:
            fn = definition(zf, path)
            if not T.applies(path, version) and fn is not None:
                left_out[path] = "super().send" in ast.unparse(fn) if path == T.MOONCAKE_SEND else None
    assert not missing, f"sglang {version}: hook targets missing from the wheel: {missing}"
    assert not unbound, f"sglang {version}: hooks that cannot take SGLang's call:\n" + "\n".join(unbound)
    for path, delegates in left_out.items():
        if path == T.MOONCAKE_SEND:  # Mooncake's send runs the hooked CommonKVSender.send
            assert delegates, f"sglang {version}: MooncakeKVSender.send does not call super().send, and is not hooked"
        else:  # 0.5.21-0.5.22's KV checksum (another shape): named as not audited where it is on
            assert path in T.CHECKSUM_TARGETS and version in ("0.5.21", "0.5.22"), (version, path)


def test_the_check_fails_on_a_signature_the_hook_cannot_take():
    """0.5.19's release_kv_cache(req, tree_cache, is_insert=True) against a hook that wants 0.5.23's keyword-only
    ``checkpoint``: the check must name it (the bug the real 0.5.19 server showed at every release)."""
    fn = ast.parse("def release_kv_cache(req, tree_cache, is_insert=True): pass").body[0]
    assert isinstance(fn, ast.FunctionDef)

    def old_hook(s, req, tree_cache, *, checkpoint):
        return None

    wants_checkpoint = inspect.Signature(list(inspect.signature(old_hook).parameters.values())[1:])
    assert problems(fn, wants_checkpoint)
    release = next(
        t for t in Plugin(PluginConfig("x.duckdb", "n", "c"), version="0.5.19").targets if t.path == T.RELEASE
    )
    assert problems(fn, release.expects()) == []


def test_the_release_table_is_what_each_release_gets():
    def paths(v):
        return {t.path for t in Plugin(PluginConfig("x.duckdb", "n", "c"), version=v).targets}

    assert T.MOONCAKE_SEND in paths("0.5.19") and T.MOONCAKE_SEND not in paths("0.5.23")
    assert not set(T.CHECKSUM_TARGETS) & paths("0.5.22") and set(T.CHECKSUM_TARGETS) <= paths("0.5.23")
    assert T.GROUP_PAGES not in paths("0.5.19") and T.GROUP_PAGES in paths("0.5.20")
    assert paths("0.6.0") == paths("0.5.23") == paths("unknown")  # newer or unknown: the newest table, checked
