"""The SGLang plugin's entry point (group ``sglang.srt.plugins``) and its per-process state.

SGLang's ``load_plugins()`` calls :func:`register` once in every process (engine, each scheduler,
detokenizer, DP controller). With kvtrail's environment set (``KVTRAIL_URL`` + ``KVTRAIL_TOKEN``, or
``KVTRAIL_DB``), it registers the hooks of :mod:`~kvtrail.serving.sglang.targets`; recording starts in
a scheduler process once its pools exist, on attention-TP rank 0 only. Right after the registry applied
the hooks, every target is checked: one that was not patched is warned about loudly (on stderr: in the
scheduler, plugins load before logging is configured) and named in the node's configuration event.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from kvtrail.audit.events import Producer
from kvtrail.audit.recorder import Recorder, RecorderConfig
from kvtrail.serving.sglang import lifecycle, memory, transfer
from kvtrail.serving.sglang import targets as T
from kvtrail.serving.sglang.config import PluginConfig
from kvtrail.serving.sglang.guard import after, around, before
from kvtrail.serving.sglang.resolver import logger
from kvtrail.serving.sglang.session import Session, instance_id

ROLES = {"prefill": "prefill", "decode": "decode", "null": "unified"}
PLUGIN: Plugin | None = None  # the process's plugin, set by register()


class Plugin:
    """The hooks of one process and, in a recording scheduler process, its :class:`Session`."""

    def __init__(self, config: PluginConfig):
        self.config = config
        self.session: Session | None = None
        self.missing: list[str] = []
        self._scheduler: Any = None
        self.targets = self._targets()

    def _targets(self) -> list[T.Target]:
        return [
            T.Target(T.NODE_CONFIG, "AFTER", self._on_scheduler_ready),
            T.Target(T.ALLOC_EXTEND, "AFTER", after(self, "alloc_for_extend", memory.on_extend)),
            T.Target(T.ALLOC_PREALLOC, "AFTER", after(self, "alloc_for_decode_prealloc", memory.on_prealloc)),
            T.Target(T.ALLOC_DECODE, "AFTER", after(self, "alloc_for_decode", memory.on_decode)),
            T.Target(T.RELEASE, "AROUND", around(self, "release_kv_cache", memory.release_pre, memory.release_post)),
            T.Target(T.PAGE_RETURN, "BEFORE", before(self, "_release_page_ids", memory.pages_returned)),
            T.Target(T.TOKEN_RETURN, "BEFORE", before(self, "TokenToKVPoolAllocator.free", memory.tokens_returned)),
            T.Target(T.SEND, "AROUND", around(self, "CommonKVSender.send", transfer.send_pre, transfer.send_post)),
            T.Target(T.SET_BUF, "AFTER", self._on_set_buf),
            T.Target(T.SET_CHECKSUM, "AFTER", after(self, "set_kv_checksum", transfer.on_set_kv_checksum)),
            T.Target(T.COMMIT, "AROUND", self._on_commit),
            T.Target(T.SET_ABORT, "BEFORE", before(self, "set_finish_with_abort", lifecycle.on_set_finish_with_abort)),
            T.Target(T.PREPARE_ABORT, "BEFORE", before(self, "prepare_abort", lifecycle.on_prepare_abort)),
            T.Target(T.STREAM, "BEFORE", before(self, "stream_output", lifecycle.on_stream_output)),
        ]

    # ---- installation ------------------------------------------------------------------------------

    def install(self, registry: Any, hook_types: Any) -> None:
        """Register every hook, and the check that runs right after the registry applies them."""
        for t in self.targets:
            registry.register(t.path, t.hook, getattr(hook_types, t.hook_type))
        raw = registry.__dict__["apply_hooks"]

        def apply_then_check(cls: Any) -> None:
            try:
                raw.__func__(cls)
            finally:
                cls.apply_hooks = raw  # once: later calls are the registry's own
                self.check(cls._patched)

        registry.apply_hooks = classmethod(apply_then_check)

    def check(self, patched: set[str]) -> list[str]:
        """Every target the registry did not patch: warned about loudly, named in the configuration event."""
        self.missing = T.unpatched(self.targets, patched)
        if self.missing:
            msg = (f"kvtrail: WARNING: {len(self.missing)} SGLang hook target(s) were not patched, the audit "
                   f"record has holes: {', '.join(self.missing)}")
            print(msg, file=sys.stderr, flush=True)
            logger.warning(msg)
            if self.session is not None:
                self._record_config(self.session, self._scheduler)
        return self.missing

    # ---- hooks that are not plain recorders ----------------------------------------------------------

    def _on_scheduler_ready(self, _result: Any, scheduler: Any) -> None:
        try:
            self.start(scheduler)
        except Exception as exc:  # noqa: BLE001 - a plugin failure must not stop SGLang; loud instead
            print(f"kvtrail: WARNING: recording not started: {type(exc).__name__}: {exc}", file=sys.stderr)

    def _on_set_buf(self, _result: Any, buffers: Any, req: Any) -> None:
        # Every prefill TP rank writes the slot, so every decode rank decides alike.
        try:
            transfer.write_covered(buffers, req)
        except Exception as exc:  # noqa: BLE001 - never raise into SGLang; counted
            if self.session is not None:
                self.session.resolver.count_failure("MetadataBuffers.set_buf", exc)

    def _on_commit(self, original: Any, queue: Any, decode_req: Any) -> Any:
        s, covered, reserved = self.session, None, None
        try:
            covered = transfer.read_covered(queue, decode_req)
            reserved = transfer.reserved_tokens(decode_req.req)
        except Exception as exc:  # noqa: BLE001 - never raise into SGLang; counted
            if s is not None:
                s.resolver.count_failure("_commit_transfer_to_req", exc)
        if self.config.enforce_length and covered is not None and reserved is not None and covered != reserved:
            transfer.abort_mismatch(queue, decode_req, covered, reserved)
            if s is not None:
                transfer.record_landed(s, decode_req, covered, "mismatch")
            return None
        result = original(queue, decode_req)
        if s is not None:
            try:
                status = "aborted" if memory.is_aborted(decode_req.req) else "ok"
                transfer.record_landed(s, decode_req, covered, status)
            except Exception as exc:  # noqa: BLE001 - never raise into SGLang; counted
                s.resolver.count_failure("_commit_transfer_to_req", exc)
        return result

    # ---- the recording session -----------------------------------------------------------------------

    def start(self, scheduler: Any, sink: Any = None) -> Session | None:
        """Start recording in this scheduler process (attention-TP rank 0 only); the node configuration event.

        ``sink`` overrides the configured store or service (an object with ``append``, as for Recorder).
        """
        if int(getattr(scheduler, "attn_tp_rank", getattr(scheduler, "tp_rank", 0)) or 0) != 0:
            return None
        mode = getattr(getattr(scheduler, "disaggregation_mode", None), "value", "null")
        role = ROLES.get(str(mode), "unified")
        dp_rank = getattr(scheduler, "dp_rank", None)
        node = self.config.node + (f"-dp{dp_rank}" if dp_rank else "")  # each DP rank has its own pool
        producer = Producer(self.config.cluster, node, role, "sglang", _sglang_version(), instance_id())
        recorder = Recorder(self.config.sink if sink is None else sink, producer,
                            RecorderConfig(flush_interval_s=self.config.flush_interval_s))
        self._scheduler = scheduler
        self.session = Session(recorder, int(scheduler.page_size), role, self.config.enforce_length)
        self._record_config(self.session, scheduler)
        return self.session

    def _record_config(self, s: Session, scheduler: Any) -> None:
        args = scheduler.server_args
        pool_tokens = int(scheduler.max_total_num_tokens)
        source = "sglang-plugin; hooks " + (("missing: " + ",".join(self.missing)) if self.missing else "all patched")
        s.recorder.node_config(
            pool_tokens=pool_tokens, pool_pages=pool_tokens // s.page_size, page_size=s.page_size,
            context_tokens=int(scheduler.model_config.context_len),
            max_running_requests=getattr(scheduler, "max_running_requests", None),
            checksum_enabled=bool(getattr(args, "disaggregation_enable_kv_checksum", False)),
            canary_enabled=str(getattr(args, "kv_canary", "none") or "none") != "none",
            deferred_release=_deferred_release(role=s.role), config_source=source)

    def stop(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


def _deferred_release(role: str) -> bool | None:
    if role != "decode":
        return None
    value = os.environ.get("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", "true").strip().lower()
    return value not in ("0", "false", "no", "off")


def _sglang_version() -> str:
    from importlib.metadata import version

    return version("sglang")


def register() -> None:
    """The entry point SGLang calls with no arguments: install the hooks when kvtrail's environment is set."""
    global PLUGIN
    config = PluginConfig.from_env()
    if config is None:
        logger.info("kvtrail: KVTRAIL_URL / KVTRAIL_DB not set; the SGLang plugin records nothing")
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    PLUGIN = Plugin(config)
    PLUGIN.install(HookRegistry, HookType)
