"""Which backend runs the integrity kernels on which device, imported only when first asked for.

``get_backend("cpu")`` is the numba CPU backend, ``get_backend("cpu", "reference")`` the pure-torch
reference, ``get_backend("cuda")`` the CUDA backend (Triton kernels when Triton imports, torch ops
otherwise). Nothing here imports numba, Triton or initialises CUDA until that backend is requested,
so a CPU-only install never touches Triton.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Protocol

import torch

from kvtrail.kernels.layout import KernelError, KvLayout, PageIds

# (device type, kind) -> "module:Class"; the module is imported on first use
_BACKENDS: dict[tuple[str, str], str] = {
    ("cpu", "fast"): "kvtrail.kernels.cpu:CpuBackend",
    ("cpu", "reference"): "kvtrail.kernels.reference:ReferenceBackend",
    ("cuda", "fast"): "kvtrail.kernels.cuda:CudaBackend",
    ("cuda", "reference"): "kvtrail.kernels.reference:ReferenceBackend",
}
KINDS = ("fast", "reference")


class Backend(Protocol):
    """What every backend offers; results are identical across backends for the same input."""

    name: str
    device: torch.device

    def page_digests(self, layout: KvLayout, page_ids: PageIds) -> torch.Tensor: ...

    def request_digest(self, layout: KvLayout, page_ids: PageIds) -> int: ...

    def adler32(self, layout: KvLayout, page_ids: PageIds) -> int: ...

    def verify_tags(self, table: torch.Tensor, page_ids: PageIds, held_tags: PageIds) -> torch.Tensor: ...


def supported_backends() -> list[str]:
    """Every backend name, as ``get_backend`` accepts it: ``device`` or ``device/kind``."""
    return [dev if kind == "fast" else f"{dev}/{kind}" for dev, kind in _BACKENDS]


def available_backends() -> list[str]:
    """The supported backends this machine can run (CUDA ones only with a CUDA device)."""
    return [name for name in supported_backends() if not name.startswith("cuda") or torch.cuda.is_available()]


def get_backend(device: torch.device | str = "cpu", kind: str = "fast") -> Backend:
    """The backend for ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``, a ``torch.device``) and ``kind``."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise KernelError(
            "device", f"{device!r} is not a device; supported backends: {', '.join(supported_backends())}"
        ) from None
    if kind not in KINDS:
        raise KernelError(
            "kind",
            f"{kind!r} is not a kind ({', '.join(KINDS)}); supported backends: {', '.join(supported_backends())}",
        )
    if (dev.type, kind) not in _BACKENDS:
        raise KernelError(
            "device", f"no {kind} backend for {dev.type!r}; supported backends: {', '.join(supported_backends())}"
        )
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise KernelError(
            "device",
            f"{dev} asked for, but CUDA is not available here; available backends: {', '.join(available_backends())}",
        )
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return _load(str(dev), kind)


@lru_cache(maxsize=None)
def _load(device: str, kind: str) -> Backend:
    module, cls = _BACKENDS[(torch.device(device).type, kind)].split(":")
    return getattr(importlib.import_module(module), cls)(device)
