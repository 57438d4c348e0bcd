"""A test-only SGLang plugin for PD on a CPU machine (entry point group ``sglang.srt.plugins``, found on the
real-server tests' ``PYTHONPATH``, never installed).

Mooncake's sender declares ``supports_host_tensor_indices``, so prefill stages its page indices in pinned host
memory with a CUDA event (``RuntimeError: Found no NVIDIA driver`` on CPU); without it prefill hands plain
indices. Fails loudly when prefill still reads the attribute but the sender no longer has it.
"""


def register() -> None:
    from pathlib import Path

    from sglang.srt.disaggregation import prefill

    if "supports_host_tensor_indices" not in Path(prefill.__file__).read_text():
        return  # this release's prefill stages no host indices (0.5.19): nothing to turn off
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

    if "supports_host_tensor_indices" not in vars(MooncakeKVSender):
        raise AssertionError(
            "MooncakeKVSender.supports_host_tensor_indices is gone: update tests/sglang/shims/kvtrail_sglang_test_shims"
        )
    MooncakeKVSender.supports_host_tensor_indices = False
