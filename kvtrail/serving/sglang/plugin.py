"""The SGLang plugin's entry point (group ``sglang.srt.plugins``) and its per-process state.

SGLang's ``load_plugins()`` calls :func:`register` once in every process (engine, each scheduler,
detokenizer, DP controller). With kvtrail's environment set (``KVTRAIL_URL`` + ``KVTRAIL_TOKEN``, or
``KVTRAIL_DB``), it registers the hooks of :mod:`~kvtrail.serving.sglang.targets`; recording starts in
a scheduler process once its pools exist, on attention-TP rank 0 only (SGLang's parallel state:
:mod:`~kvtrail.serving.sglang.ranks`), and in the HTTP (tokenizer)
process at its first finished request (the client's status). Right after the registry applied
the hooks, every target is checked: one that was not patched is warned about loudly (on stderr: in the
scheduler, plugins load before logging is configured) and named in the node's configuration event.
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path
from typing import Any

from kvtrail.audit.configs import HOOKS_MISSING, NOT_AUDITED
from kvtrail.audit.events import Producer
from kvtrail.audit.recorder import Recorder, RecorderConfig
from kvtrail.serving.sglang import canary, checksum, frontend, lifecycle, memory, modes, ranks, senders, transfer
from kvtrail.serving.sglang import targets as T
from kvtrail.serving.sglang.config import PluginConfig
from kvtrail.serving.sglang.guard import after, around, before
from kvtrail.serving.sglang.resolver import logger
from kvtrail.serving.sglang.session import Session, instance_id

ROLES = {"prefill": "prefill", "decode": "decode", "null": "unified"}
PLUGIN: Plugin | None = None  # the process's plugin, set by register()


class Plugin:
    """The hooks of one process and, in a recording scheduler process, its :class:`Session`."""

    def __init__(self, config: PluginConfig, version: str | None = None):
        self.config = config
        self.version = version or _sglang_version()  # the SGLang release: which targets it has (T.SPANS)
        self.session: Session | None = None
        self.missing: list[str] = []
        self.unaudited: list[str] = []
        self.frontend: Session | None = None  # the HTTP (tokenizer) process's session, started at its first response
        self._frontend_tried = False
        self.refusals: Session | None = None  # where the HTTP process records no responses: its refusals' session
        self._refusals_tried = False
        self._scheduler: Any = None
        self._started: set[int] = set()  # the schedulers (ids) a start was tried for
        self._place_unaudited: list[str] = []  # what the parallel layout leaves unaudited (ranks.placement)
        self._intake = before(self, "handle_generate_request", lifecycle.on_generate_request)
        self.targets = [t for t in self._targets() if T.applies(t.path, self.version)]

    def _targets(self) -> list[T.Target]:
        return [
            T.Target(T.NODE_CONFIG, "AFTER", self._on_scheduler_ready),
            T.Target(T.INTAKE, "BEFORE", self._on_intake),
            T.Target(T.ALLOC_EXTEND, "AFTER", after(self, "alloc_for_extend", memory.on_extend)),
            T.Target(T.ALLOC_PREALLOC, "AFTER", after(self, "alloc_for_decode_prealloc", memory.on_prealloc)),
            T.Target(T.ALLOC_DECODE, "AFTER", after(self, "alloc_for_decode", memory.on_decode)),
            T.Target(T.RELEASE, "AROUND", around(self, "release_kv_cache", memory.release_pre, memory.release_post)),
            T.Target(T.PAGE_RETURN, "BEFORE", before(self, "_release_page_ids", memory.pages_returned)),
            T.Target(T.TOKEN_RETURN, "BEFORE", before(self, "TokenToKVPoolAllocator.free", memory.tokens_returned)),
            T.Target(T.SEND, "AROUND", around(self, "CommonKVSender.send", transfer.send_pre, transfer.send_post)),
            T.Target(
                T.MOONCAKE_SEND, "AROUND", around(self, "MooncakeKVSender.send", transfer.send_pre, transfer.send_post)
            ),
            T.Target(T.SET_BUF, "AFTER", self._on_set_buf),
            T.Target(T.SET_CHECKSUM, "AFTER", after(self, "set_kv_checksum", transfer.on_set_kv_checksum)),
            T.Target(T.COMMIT, "AROUND", self._on_commit),
            T.Target(T.SET_ABORT, "BEFORE", before(self, "set_finish_with_abort", lifecycle.on_set_finish_with_abort)),
            T.Target(T.PREPARE_ABORT, "BEFORE", before(self, "prepare_abort", lifecycle.on_prepare_abort)),
            T.Target(T.STREAM, "BEFORE", before(self, "stream_output", lifecycle.on_stream_output)),
            T.Target(T.RETRACT, "AROUND", around(self, "release_req", memory.retract_pre, memory.retract_post)),
            T.Target(T.GROUP_PAGES, "BEFORE", before(self, "free_page_ids", memory.group_free_pages)),
            T.Target(
                T.GROUP_PAGED_TOKENS,
                "BEFORE",
                before(self, "PagedTokenToKVPoolAllocator.free", memory.group_free_tokens),
            ),
            T.Target(
                T.GROUP_END, "AROUND", around(self, "free_group_end", memory.group_end_pre, memory.group_end_post)
            ),
            T.Target(
                T.GROUP_PAGED_END,
                "AROUND",
                around(self, "PagedTokenToKVPoolAllocator.free_group_end", memory.group_end_pre, memory.group_end_post),
            ),
            T.Target(
                T.VERIFY, "AROUND", around(self, "_verify_kv_checksums", checksum.verify_pre, checksum.verify_post)
            ),
            T.Target(T.COMPUTE, "AFTER", after(self, "KvChecksumComputer.compute", checksum.on_compute)),
            T.Target(T.MISMATCH, "BEFORE", before(self, "_handle_kv_checksum_mismatch", checksum.on_mismatch)),
            T.Target(T.CANARY, "AFTER", after(self, "_format_violation", canary.on_violation)),
            T.Target(T.HTTP_OUTCOME, "AROUND", frontend.outcome_hook(self.frontend_session)),
            T.Target(T.HTTP_REFUSAL, "AROUND", frontend.refusal_hook(self.refusal_session)),
            T.Target(T.SHUTDOWN, "BEFORE", self._on_shutdown),
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
            _warn(
                f"kvtrail: WARNING: {len(self.missing)} SGLang hook target(s) were not patched, the audit "
                f"record has holes: {', '.join(self.missing)}"
            )
            if self.session is not None:
                self._record_config(self.session, self._scheduler)
        return self.missing

    # ---- hooks that are not plain recorders ----------------------------------------------------------

    def _on_scheduler_ready(self, _result: Any, scheduler: Any) -> None:
        self.ensure_started(scheduler)

    def _on_intake(self, scheduler: Any, *args: Any, **kwargs: Any) -> None:
        # A scheduler whose pools exist starts recording at its first request at the latest, whichever
        # way it was built (a harness that never ran init_disaggregation).
        if self.session is None and getattr(scheduler, "token_to_kv_pool_allocator", None) is not None:
            self.ensure_started(scheduler)
        self._intake(scheduler, *args, **kwargs)

    def ensure_started(self, scheduler: Any) -> None:
        """Start recording in this scheduler process once (its pools exist); a failure is loud, not fatal."""
        if self.session is not None or id(scheduler) in self._started:
            return
        self._started.add(id(scheduler))
        try:
            self.start(scheduler)
        except Exception as exc:  # noqa: BLE001 - a plugin failure must not stop SGLang; loud instead
            _warn(f"kvtrail: WARNING: recording not started: {type(exc).__name__}: {exc}")

    def _on_shutdown(self, _scheduler: Any, *_: Any, **__: Any) -> None:
        """SGLang's clean shutdown reached this scheduler (ShutdownReq): flush and close the recorder while the
        process still runs, so the record ends clean (the process is killed soon after; a SIGKILL never gets here)."""
        s, self.session = self.session, None
        if s is not None:
            try:
                s.close()
            except Exception as exc:  # noqa: BLE001 - never raise into SGLang; loud instead
                _warn(f"kvtrail: WARNING: recorder not closed at shutdown: {type(exc).__name__}: {exc}")

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
        if (
            self.config.enforce_length
            and reserved is not None
            and covered != reserved
            and (covered is not None or not transfer.exempt(decode_req.req))
        ):
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
        """Start recording in this scheduler process; the node configuration event.

        Only the process SGLang's parallel state places at attention-TP rank 0 (and attention-CP rank 0,
        pipeline stage 0) records, as ``<node>-dp<N>`` where the node has several data-parallel pools
        (:mod:`~kvtrail.serving.sglang.ranks`), each pool into its own file where the sink is a store file
        (:func:`pool_store`). ``sink`` overrides the configured store or service (an object with ``append``,
        as for Recorder).
        """
        place = ranks.placement()
        if not place.records:
            if "unknown" in place.why:  # not an ordinary non-zero rank: say why nothing is recorded
                _warn(f"kvtrail: WARNING: this scheduler records nothing: {place.why}")
            return None
        role = _role(scheduler)
        node = place.node(self.config.node)  # each DP pool is its own node
        producer = Producer(self.config.cluster, node, role, "sglang", self.version, instance_id())
        sink = self.config.sink if sink is None else sink
        if place.pool is not None and _store_file(sink):
            sink = pool_store(sink, place.pool)  # each pool's scheduler is its own process: one writer a file
        recorder = Recorder(sink, producer, RecorderConfig(flush_interval_s=self.config.flush_interval_s))
        self._scheduler = scheduler
        # the scheduler records the outcomes where the HTTP process will not (nor can: its hook is missing)
        here = (
            modes.responses_in_scheduler(scheduler.server_args) or _store_file(sink) or T.HTTP_OUTCOME in self.missing
        )
        self.session = Session(
            recorder, int(scheduler.page_size), role, self.config.enforce_length, records_responses=here
        )
        self._place_unaudited = list(place.unaudited)
        self.unaudited = self._unaudited(scheduler, role)
        if self.unaudited:
            _warn(
                f"kvtrail: WARNING: this node runs SGLang modes the plugin does not audit, the record has "
                f"holes: {', '.join(self.unaudited)}"
            )
        self._record_config(self.session, scheduler)
        return self.session

    def start_frontend(self, tokenizer_manager: Any, sink: Any = None) -> Session | None:
        """Start recording responses in the HTTP (tokenizer) process; None on a prefill server (its responses
        go to the router), where the schedulers record them (:func:`modes.responses_in_scheduler`), and with a
        store file (``KVTRAIL_DB``: DuckDB has one writer, the scheduler's)."""
        mode = str(getattr(getattr(tokenizer_manager, "disaggregation_mode", None), "value", "null"))
        role = ROLES.get(mode, "unified")
        sink = self.config.sink if sink is None else sink
        if (
            role == "prefill"
            or _store_file(sink)
            or modes.responses_in_scheduler(getattr(tokenizer_manager, "server_args", None))
        ):
            return None
        producer = Producer(self.config.cluster, self.config.node, role, "sglang", self.version, instance_id())
        recorder = Recorder(sink, producer, RecorderConfig(flush_interval_s=self.config.flush_interval_s))
        page_size = int(getattr(getattr(tokenizer_manager, "server_args", None), "page_size", None) or 1)
        self.frontend = Session(recorder, page_size, role)
        atexit.register(self._close_frontend)  # the HTTP process exits normally after a clean shutdown
        return self.frontend

    def _close_frontend(self) -> None:
        for s in (self.frontend, self.refusals):
            if s is not None:
                s.close()
        self.frontend = self.refusals = None

    def start_refusals(self, tokenizer_manager: Any, sink: Any = None) -> Session:
        """Start recording the requests the HTTP process refuses, where it records no responses (a prefill
        server; a store file, whose one writer is the scheduler: the refusals go to their own file beside it,
        :func:`refusal_store`). Only refusals are recorded here: nothing of them reaches a scheduler."""
        mode = str(getattr(getattr(tokenizer_manager, "disaggregation_mode", None), "value", "null"))
        role = ROLES.get(mode, "unified")
        sink = self.config.sink if sink is None else sink
        if _store_file(sink):
            sink = refusal_store(sink)
        producer = Producer(self.config.cluster, self.config.node, role, "sglang", self.version, instance_id())
        recorder = Recorder(sink, producer, RecorderConfig(flush_interval_s=self.config.flush_interval_s))
        page_size = int(getattr(getattr(tokenizer_manager, "server_args", None), "page_size", None) or 1)
        self.refusals = Session(recorder, page_size, role)
        atexit.register(self._close_frontend)
        return self.refusals

    def refusal_session(self, tokenizer_manager: Any) -> Session | None:
        """The session a refusal of the HTTP process is recorded in: the responses' session where there is one,
        else the refusals' own, started at the first refusal."""
        s = self.frontend_session(tokenizer_manager)
        if s is not None:
            return s
        if self.refusals is None and not self._refusals_tried:
            self._refusals_tried = True
            try:
                self.start_refusals(tokenizer_manager)
            except Exception as exc:  # noqa: BLE001 - a plugin failure must not stop SGLang; loud instead
                _warn(f"kvtrail: WARNING: refusal recording not started: {type(exc).__name__}: {exc}")
        return self.refusals

    def frontend_session(self, tokenizer_manager: Any) -> Session | None:
        """The HTTP process's session, started once at its first finished request."""
        if self.frontend is None and not self._frontend_tried:
            self._frontend_tried = True
            try:
                self.start_frontend(tokenizer_manager)
            except Exception as exc:  # noqa: BLE001 - a plugin failure must not stop SGLang; loud instead
                _warn(f"kvtrail: WARNING: response recording not started: {type(exc).__name__}: {exc}")
        return self.frontend

    def _unaudited(self, scheduler: Any, role: str) -> list[str]:
        """The modes of this scheduler the record does not cover; a prefill node's transfer backend among them
        when no patched hook sees its sender's sends (judged against the hook check as it stands now)."""
        out = [*modes.unaudited(scheduler), *self._place_unaudited]
        checksum_on = bool(getattr(scheduler.server_args, "disaggregation_enable_kv_checksum", False))
        if checksum_on and not any(t.path in T.CHECKSUM_TARGETS for t in self.targets):
            out.append(f"KV checksum of sglang {self.version} (another shape than 0.5.23's: no digests)")
        hooked = {t.path for t in self.targets}
        gap = senders.backend_gap(_backend(scheduler), self.missing, hooked=hooked) if role == "prefill" else None
        return out + [gap] if gap else out

    def _record_config(self, s: Session, scheduler: Any) -> None:
        self.unaudited = self._unaudited(scheduler, s.role)
        args = scheduler.server_args
        pool_tokens = int(scheduler.max_total_num_tokens)
        source = "sglang-plugin; " + ((HOOKS_MISSING + ",".join(self.missing)) if self.missing else "hooks all patched")
        if self.unaudited:  # read back by kvtrail.audit.configs.unaudited_paths (metrics, preflight)
            source += "; " + NOT_AUDITED + ",".join(self.unaudited)
        s.recorder.node_config(
            pool_tokens=pool_tokens,
            pool_pages=pool_tokens // s.page_size,
            page_size=s.page_size,
            context_tokens=int(scheduler.model_config.context_len),
            max_running_requests=getattr(scheduler, "max_running_requests", None),
            checksum_enabled=bool(getattr(args, "disaggregation_enable_kv_checksum", False)),
            canary_enabled=str(getattr(args, "kv_canary", "none") or "none") != "none",
            deferred_release=_deferred_release(role=s.role),
            config_source=source,
        )

    def stop(self) -> None:
        for s in (self.session, self.frontend, self.refusals):
            if s is not None:
                s.close()
        self.session = self.frontend = self.refusals = None


def _role(scheduler: Any) -> str:
    """The scheduler's role: its disaggregation mode (set by init_disaggregation), else its server args'."""
    mode = getattr(getattr(scheduler, "disaggregation_mode", None), "value", None)
    if mode is None:
        mode = getattr(getattr(scheduler, "server_args", None), "disaggregation_mode", None) or "null"
    return ROLES.get(str(mode), "unified")


def _backend(scheduler: Any) -> str:
    """The PD transfer backend (``--disaggregation-transfer-backend``) this scheduler uses."""
    backend = getattr(getattr(scheduler, "transfer_backend", None), "value", None)
    if backend is None:
        backend = getattr(getattr(scheduler, "server_args", None), "disaggregation_transfer_backend", None)
    return str(backend or "mooncake")


def refusal_store(db: str | os.PathLike) -> str:
    """The store file of an HTTP process's refusals beside the node's (``KVTRAIL_DB``, whose one writer is the
    scheduler): ``node.duckdb`` -> ``node.http.duckdb``."""
    return _beside(db, "http")


def pool_store(db: str | os.PathLike, pool: int) -> str:
    """The store file of data-parallel pool ``pool`` of a node with several (``KVTRAIL_DB``): each pool is
    recorded by its own scheduler process, and a DuckDB file has one writer: ``node.duckdb`` ->
    ``node.dp1.duckdb``."""
    return _beside(db, f"dp{pool}")


def _beside(db: str | os.PathLike, tag: str) -> str:
    """A store file beside ``db`` for one more writing process: ``node.duckdb`` -> ``node.<tag>.duckdb``."""
    p = Path(db)
    return str(p.with_name(f"{p.stem}.{tag}{p.suffix}"))


def _store_file(sink: Any) -> bool:
    """Whether the sink is a local store file (one writing process: the scheduler records the responses)."""
    return isinstance(sink, (str, os.PathLike)) and not str(sink).startswith(("http://", "https://"))


def _warn(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)  # schedulers load plugins before their logging is configured
    logger.warning(msg)


def _deferred_release(role: str) -> bool | None:
    if role != "decode":
        return None
    value = os.environ.get("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", "true").strip().lower()
    return value not in ("0", "false", "no", "off")


def _sglang_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:  # no SGLang here (a check of the targets): the newest release's targets
        return "unknown"


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
