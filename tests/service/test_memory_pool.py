"""``kvtrail serve`` takes Arrow's buffers from the C library's allocator unless the operator names a pool
(``ARROW_DEFAULT_MEMORY_POOL``), and chooses before it opens the store."""

from __future__ import annotations

import pyarrow as pa
import pytest

from kvtrail.service import server


@pytest.fixture
def pool_kept():
    """The process's Arrow pool as it was, put back after the test."""
    before = pa.default_memory_pool()
    yield before
    pa.set_memory_pool(before)


def test_the_service_takes_the_system_pool_when_none_is_named(monkeypatch, pool_kept):
    monkeypatch.delenv("ARROW_DEFAULT_MEMORY_POOL", raising=False)
    pa.set_memory_pool(pa.mimalloc_memory_pool())
    assert server.service_memory_pool() == "system"
    assert pa.default_memory_pool().backend_name == "system"
    # buffers made after the choice come from that pool
    arr = pa.array(range(10_000))
    assert pa.default_memory_pool().bytes_allocated() >= arr.nbytes


@pytest.mark.parametrize("named", ["mimalloc", "jemalloc"])
def test_a_pool_the_operator_names_is_kept(monkeypatch, pool_kept, named):
    if named not in pa.supported_memory_backends():
        pytest.skip(f"this pyarrow has no {named}")
    monkeypatch.setenv("ARROW_DEFAULT_MEMORY_POOL", named)
    pa.set_memory_pool(getattr(pa, f"{named}_memory_pool")())
    assert server.service_memory_pool() == named
    assert pa.default_memory_pool().backend_name == named


def test_run_service_chooses_the_pool_before_it_opens_the_store(monkeypatch, pool_kept, tmp_path):
    monkeypatch.delenv("ARROW_DEFAULT_MEMORY_POOL", raising=False)
    pa.set_memory_pool(pa.mimalloc_memory_pool())
    seen = []

    class Stop(Exception):
        pass

    def open_state(*args, **kwargs):
        seen.append(pa.default_memory_pool().backend_name)
        raise Stop

    monkeypatch.setattr(server, "open_state", open_state)
    with pytest.raises(Stop):
        server.run_service(tmp_path / "a.duckdb")
    assert seen == ["system"]
