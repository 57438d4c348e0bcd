"""kvtrail.kernels: see docs/architecture.md.

The integrity primitives that let the serving path prove what it read, each with a pure-torch
reference and a fast path (numba on CPU, Triton on CUDA) that give identical results:

- per-page digests and an order-binding request digest over a paged KV layout (``mixing`` defines
  them), read in place without gathering the pages;
- SGLang 0.5.23's KV checksum (``--disaggregation-enable-kv-checksum``): Adler-32 of every
  (buffer, page) item, equal to ``zlib.adler32`` of the concatenated bytes (``adler``);
- page ownership tags (``tags.PageTags``): a generation per page, checked before attention reads.

Start from ``registry.get_backend(device, kind)`` and ``layout.KvLayout``. Importing this package
imports nothing: numba, Triton and CUDA load only when a backend that needs them is asked for.
"""
