"""Hook wrappers that never raise into SGLang: the recording part of a hook is guarded and counted.

A hook body receives the scheduler process's :class:`~kvtrail.serving.sglang.session.Session`; while
there is none (recording off, another TP rank, or before the node configuration hook ran) the
wrappers only call through.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from kvtrail.serving.sglang.session import Session


class Holder(Protocol):
    session: Session | None


def after(holder: Holder, name: str, body: Callable[..., None]) -> Callable[..., None]:
    """An AFTER hook ``(result, *args, **kwargs)`` that records and leaves the result alone."""

    def hook(result: Any, *args: Any, **kwargs: Any) -> None:
        s = holder.session
        if s is None:
            return None
        try:
            body(s, result, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - never raise into SGLang; counted, reported as a gap
            s.resolver.count_failure(name, exc)
        return None

    hook.__qualname__ = f"kvtrail.{name}"
    hook.__kvtrail_body__ = body  # type: ignore[attr-defined]  # what Target.expects reads
    return hook


def before(holder: Holder, name: str, body: Callable[..., None]) -> Callable[..., None]:
    """A BEFORE hook ``(*args, **kwargs)`` that records and leaves the arguments alone."""

    def hook(*args: Any, **kwargs: Any) -> None:
        s = holder.session
        if s is None:
            return None
        try:
            body(s, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - never raise into SGLang; counted, reported as a gap
            s.resolver.count_failure(name, exc)
        return None

    hook.__qualname__ = f"kvtrail.{name}"
    hook.__kvtrail_body__ = body  # type: ignore[attr-defined]  # what Target.expects reads
    return hook


def around(
    holder: Holder, name: str, pre: Callable[..., Any], post: Callable[..., None] | None = None
) -> Callable[..., Any]:
    """An AROUND hook: ``pre(s, *args)`` returns a token, the original runs, ``post(s, token, result)``.

    The original's own exceptions propagate unchanged (``post`` still runs, with result None); only the
    recording parts are guarded.
    """

    def hook(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        s = holder.session
        if s is None:
            return original(*args, **kwargs)
        token = None
        try:
            token = pre(s, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - never raise into SGLang; counted, reported as a gap
            s.resolver.count_failure(name, exc)
        result = None
        try:
            result = original(*args, **kwargs)
        finally:  # post also runs when the original raised (it clears per-call state), with result None
            if post is not None:
                try:
                    post(s, token, result)
                except Exception as exc:  # noqa: BLE001 - never raise into SGLang; counted, reported as a gap
                    s.resolver.count_failure(name, exc)
        return result

    hook.__qualname__ = f"kvtrail.{name}"
    hook.__kvtrail_body__ = pre  # type: ignore[attr-defined]  # what Target.expects reads
    return hook
