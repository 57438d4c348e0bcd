"""Real ``python -m sglang.launch_server`` processes on CPU for the real-server tests (test-only).

Each server serves the tiny random-weight model of :mod:`tests.sglang.tinymodel` on 127.0.0.1 with the flags a
CPU needs (``--device cpu --attention-backend torch_native --disable-cuda-graph --skip-server-warmup
--grammar-backend none``), kvtrail's plugin recording into its own store file. ``PYTHONPATH`` carries this
clone and the test-only shims (``tests/sglang/shims``: vLLM's RoPE function SGLang falls back to on a CPU-only
machine); the shim module fails loudly at import when SGLang no longer reaches it (see ``check_shims``).
Servers are stopped by pid (SIGTERM, or SIGKILL), never by name.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHIMS = Path(__file__).resolve().parent / "shims"
CPU_FLAGS = [
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--disable-cuda-graph",
    "--skip-server-warmup",
    "--grammar-backend",
    "none",
    "--host",
    "127.0.0.1",
]
# a PD pair: Mooncake over loopback TCP (no RDMA here), no overlap schedule (it records a torch.cuda.Event)
PD_ENV = {"MC_FORCE_TCP": "1", "MC_LOG_LEVEL": "ERROR"}
PD_FLAGS = ["--disaggregation-transfer-backend", "mooncake", "--disable-overlap-schedule"]


def check_shims() -> None:
    """Each shim stands in for something SGLang really reaches: fail loudly when it no longer does."""
    from sglang.srt.layers.rotary_embedding import base

    source = Path(base.__file__).read_text()
    assert "from vllm._custom_ops import rotary_embedding" in source, (
        "SGLang's RotaryEmbedding no longer falls back to vllm._custom_ops.rotary_embedding: "
        "remove or update the test-only shim tests/sglang/shims/vllm"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Http:
    """A process of this test serving HTTP on 127.0.0.1 (``port``), with its log file (``log``)."""

    port: int
    log: Path

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def generate(
        self, text: str, tenant: str, max_new_tokens: int = 4, timeout: float = 120, **more
    ) -> tuple[int, dict]:
        """POST /generate; (HTTP status, body), or (0, {}) when no answer came in ``timeout`` (the client hangs up)."""
        body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens}, "extra_key": tenant, **more}
        req = urllib.request.Request(
            self.url("/generate"), data=json.dumps(body).encode(), headers={"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}")
        except (TimeoutError, urllib.error.URLError):
            return 0, {}

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class Server(_Http):
    """One launch_server process; ``db`` its store file."""

    def __init__(self, model: Path, db: Path, node: str, log: Path, *extra: str, env: dict | None = None):
        self.port = free_port()
        self.db, self.node, self.log = db, node, log
        env_all = dict(os.environ)
        env_all.update(
            PYTHONPATH=os.pathsep.join([str(SHIMS), str(ROOT)]),
            HF_HUB_OFFLINE="1",
            KVTRAIL_DB=str(db),
            KVTRAIL_NODE=node,
            KVTRAIL_CLUSTER="real-sglang",
            KVTRAIL_FLUSH_INTERVAL_S="0.2",
        )
        env_all.update(env or {})  # the caller's own (a PYTHONPATH of the caller's shell is replaced above)
        args = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), *CPU_FLAGS]
        args += ["--port", str(self.port), *extra]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(args, env=env_all, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=log.parent)
        self.ready_s: float | None = None

    def wait_ready(self, timeout: float = 420) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.node} exited {self.proc.returncode}:\n{self.tail()}")
            try:  # /v1/models, not /health: SGLang's /health runs a generation (a health-check request)
                with urllib.request.urlopen(self.url("/v1/models"), timeout=2) as r:
                    if r.status == 200:
                        self.ready_s = time.monotonic() - self.started
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise AssertionError(f"{self.node} not ready in {timeout} s:\n{self.tail()}")

    def wait_committed(self, since: float, quiet: float = 2.0, timeout: float = 60, db: Path | None = None) -> float:
        """After a request sent at ``since`` (``time.time()``) was answered: wait until the store file ``db``
        (the server's by default; or its WAL) changed after ``since`` and then rested ``quiet`` seconds, counted
        from this call at the earliest: the recorder's writer (it wakes every 0.2 s) committed what the node
        recorded. DuckDB keeps the file locked, so another process cannot read it to check. Returns the seconds
        waited.

        A fixed sleep is not enough on a loaded machine: the scheduler's busy loop and the other tests' processes
        can starve the writer's thread past a second."""
        t0, called = time.monotonic(), time.time()
        db = self.db if db is None else db
        files = (db, db.with_name(db.name + ".wal"))
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.node} exited {self.proc.returncode}:\n{self.tail()}")
            changed = max((f.stat().st_mtime for f in files if f.exists()), default=0.0)
            if changed > since and time.time() - max(changed, called) >= quiet:
                return time.monotonic() - t0
            time.sleep(0.1)
        raise AssertionError(f"{self.node}: its store did not change and rest in {timeout} s:\n{self.tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 90) -> float:
        """Signal the launcher (by pid) and wait for it and its children; returns the seconds it took."""
        t0 = time.monotonic()
        children = _children(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        finally:
            for pid in children:  # what the launcher left behind (the test started them): by pid
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        return time.monotonic() - t0


def _children(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Router(_Http):
    """SGLang's router in front of a PD pair (``python -m sglang_router.launch_router --pd-disaggregation``): it
    gives each request a bootstrap room and sends it to both servers; its worker health checks (``/health``,
    every ``health_s`` seconds) run SGLang's health-check generation on each server (fake bootstrap host,
    room 0). Stopped by pid."""

    def __init__(self, prefill: Server, bootstrap_port: int, decode: Server, log: Path, health_s: int = 2):
        self.port = free_port()
        self.log = log
        args = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
        args += ["--prefill", prefill.url(""), str(bootstrap_port), "--decode", decode.url("")]
        args += ["--host", "127.0.0.1", "--port", str(self.port), "--health-check-interval-secs", str(health_s)]
        self.proc = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=log.parent)
        self.started = time.monotonic()

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"router exited {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise AssertionError(f"router not ready in {timeout} s:\n{self.tail()}")

    def generate(self, text: str, tenant: str, max_new_tokens: int = 4, timeout: float = 120, **more):
        """As the servers' ``generate``; a 503 while the router has not yet admitted its workers (its own /health
        answers before its first worker check) is asked again, for up to a minute."""
        deadline = time.monotonic() + 60
        while True:
            status, body = super().generate(text, tenant, max_new_tokens, timeout, **more)
            if status != 503 or time.monotonic() > deadline:
                return status, body
            time.sleep(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


def get(url: str, timeout: float = 60) -> int:
    """GET ``url``; its HTTP status (0: no answer)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code
    except (TimeoutError, urllib.error.URLError):
        return 0
