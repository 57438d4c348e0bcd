"""What the model is checked with: the protocol's variants and the bounds of one check.

A variant is a set of protocol choices (frozen), so the four named variants are four rows of one table:
SGLang before 0.5.20 (``vulnerable``), the fixed protocol (``patched``) and the reference stack's two
modes (``stack-vulnerable``, ``stack-patched``), whose differences from SGLang are the stack's own: one
transfer call for all of a request's pages, no prefix cache, lowest-first reuse, no release timeout on
an abort (decode waits for prefill's answer), a timed quarantine after a failed transfer, and page
ownership tags before reads in patched mode.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtrail.errors import KvtrailError

REUSE_POLICIES = ("any", "lowest", "lifo")


@dataclass(frozen=True)
class Variant:
    """One protocol: every choice the transitions read."""

    name: str
    doc: str
    reject_long: bool  # a prompt over the prefill pool is rejected before bootstrap (else: placeholder admitted)
    check_length: bool  # decode commits only when transferred == reserved
    deferred_release: bool  # an aborted request's pages wait for prefill's drain answer
    release_timeout: bool  # ... or for the release timeout (taken only once the drain bound has passed)
    chunked: bool  # one write per page, posted one by one (else one call posts every page at once)
    prefix_cache: bool  # prefill shares a sealed first page within a tenant's namespace
    page_tags: bool  # decode checks ownership tags before it reads (a foreign page is not attended)
    quarantine_failed: bool  # a failed transfer's pages are held until its writes have drained
    reuse: str  # default page reuse order: any (nondeterministic), lowest (first free id), lifo


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant(
            "vulnerable",
            "SGLang before 0.5.20: placeholder admitted, no length check, immediate release on abort",
            reject_long=False,
            check_length=False,
            deferred_release=False,
            release_timeout=False,
            chunked=True,
            prefix_cache=True,
            page_tags=False,
            quarantine_failed=False,
            reuse="any",
        ),
        Variant(
            "patched",
            "rejected before bootstrap, transferred == reserved at commit, deferred release with a drain bound",
            reject_long=True,
            check_length=True,
            deferred_release=True,
            release_timeout=True,
            chunked=True,
            prefix_cache=True,
            page_tags=False,
            quarantine_failed=True,
            reuse="any",
        ),
        Variant(
            "stack-vulnerable",
            "the reference stack in vulnerable mode (kvtrail/serving: one transfer call, lowest-first reuse)",
            reject_long=False,
            check_length=False,
            deferred_release=False,
            release_timeout=False,
            chunked=False,
            prefix_cache=False,
            page_tags=False,
            quarantine_failed=False,
            reuse="lowest",
        ),
        Variant(
            "stack-patched",
            "the reference stack in patched mode (deferred release on prefill's answer, quarantine, page tags)",
            reject_long=True,
            check_length=True,
            deferred_release=True,
            release_timeout=False,
            chunked=False,
            prefix_cache=False,
            page_tags=True,
            quarantine_failed=True,
            reuse="lowest",
        ),
    )
}


@dataclass(frozen=True)
class Bounds:
    """How big one check is: requests in the run, pages per pool, pages (chunks) per request's transfer."""

    requests: int = 3
    pages: int = 3
    chunks: int = 2
    reuse: str | None = None  # None: the variant's own order

    def __post_init__(self):
        for name, low, high in (("requests", 1, 6), ("pages", 1, 8), ("chunks", 1, 4)):
            value = getattr(self, name)
            if not isinstance(value, int) or not low <= value <= high:
                raise KvtrailError(f"--{name}: {value!r} must be an integer from {low} to {high}")
        if self.pages < self.chunks:
            raise KvtrailError(f"--pages: {self.pages} must be at least --chunks ({self.chunks}): a request must fit")
        if self.reuse is not None and self.reuse not in REUSE_POLICIES:
            raise KvtrailError(f"--reuse: {self.reuse!r} is not one of {', '.join(REUSE_POLICIES)}")

    def as_dict(self, variant: Variant) -> dict:
        return {
            "requests": self.requests,
            "pages": self.pages,
            "chunks": self.chunks,
            "reuse": self.reuse or variant.reuse,
        }


def variant(name: str) -> Variant:
    """The variant of this name; the error names the supported ones."""
    try:
        return VARIANTS[name]
    except KeyError:
        raise KvtrailError(f"--variant: {name!r} is not one of {', '.join(VARIANTS)}") from None
