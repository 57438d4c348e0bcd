"""The backend registry: names, errors, and imports that stay lazy."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvtrail.kernels.layout import KernelError
from kvtrail.kernels.registry import available_backends, get_backend, supported_backends


def test_names():
    assert supported_backends() == ["cpu", "cpu/reference", "cuda", "cuda/reference"]
    assert {"cpu", "cpu/reference"} <= set(available_backends())
    assert get_backend("cpu").name == "cpu"
    assert get_backend(torch.device("cpu"), "reference").name == "reference"
    assert get_backend("cpu") is get_backend("cpu")  # one instance per device and kind


@pytest.mark.parametrize(
    "device, kind, field",
    [
        ("tpu", "fast", "device"),
        ("meta", "fast", "device"),
        (3.5, "fast", "device"),
        ("cpu", "turbo", "kind"),
    ],
)
def test_errors_name_the_field_and_the_supported_backends(device, kind, field):
    with pytest.raises(KernelError) as err:
        get_backend(device, kind)
    assert err.value.field == field
    assert "cpu, cpu/reference, cuda, cuda/reference" in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_without_a_device_lists_what_is_available():
    with pytest.raises(KernelError, match="CUDA is not available here; available backends: cpu, cpu/reference"):
        get_backend("cuda")


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys\nprint(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return set(out.split())


def test_imports_stay_lazy():
    mods = _modules_after("import kvtrail.kernels")
    assert not {"numba", "triton", "torch"} & mods
    mods = _modules_after(
        "from kvtrail.kernels import registry, tags, layout, reference, mixing, adler\n"
        "ref = registry.get_backend('cpu', 'reference')\n"
        "t = tags.PageTags(4)\n"
        "t.verify([1], t.allocate([1]), ref)"
    )
    assert "numba" not in mods and "triton" not in mods
    assert "kvtrail.kernels.cpu" not in mods
    mods = _modules_after("from kvtrail.kernels.registry import get_backend\nget_backend('cpu')")
    assert "numba" in mods and "triton" not in mods
