"""merge_runs, entry planning, and real Mooncake writes between this process and a spawned peer."""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtrail.serving.transfer import (
    QUEUE_ENV,
    PoolBuffer,
    TransferConfig,
    TransferEngineHandle,
    TransferError,
    merge_runs,
    plan_entries,
)

PAGES = 1024  # pool pages per buffer, plus the padding page 0
ITEM = 512  # bytes per page: page_size 4 x 2 heads x head_dim 32 x bf16
NUM_BUFFERS = 4  # 2 layers x (K, V), in the pool's order K0 K1 V0 V1
PEER_IDLE_S = 60  # a peer nobody talks to for this long exits by itself
REPLY_S = 30


def reference_runs(src, dst):
    runs = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def fragmented(rng, count, mean_run):
    """``count`` distinct pages of 1..PAGES, in shuffled runs of about ``mean_run`` pages."""
    cuts = np.flatnonzero(rng.random(PAGES - 1) < 1 / mean_run) + 1
    blocks = np.split(np.arange(1, PAGES + 1), cuts)
    return np.concatenate([blocks[i] for i in rng.permutation(len(blocks))])[:count]


# --- merge_runs -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "src, dst, runs",
    [
        ([], [], []),
        ([5], [9], [(5, 9, 1)]),
        ([1, 2, 3, 4], [10, 11, 12, 13], [(1, 10, 4)]),
        ([1, 2, 3, 4], [10, 11, 20, 21], [(1, 10, 2), (3, 20, 2)]),  # dst breaks
        ([1, 2, 7, 8], [10, 11, 12, 13], [(1, 10, 2), (7, 12, 2)]),  # src breaks
        ([4, 3, 2], [1, 2, 3], [(4, 1, 1), (3, 2, 1), (2, 3, 1)]),  # descending is never a run
        ([3, 3], [1, 2], [(3, 1, 1), (3, 2, 1)]),  # a repeated source page
        ([0, 1], [0, 1], [(0, 0, 2)]),
    ],
)
def test_merge_runs_cases(src, dst, runs):
    assert merge_runs(src, dst) == runs
    assert merge_runs(np.array(src, dtype=np.int32), np.array(dst, dtype=np.int64)) == runs


def test_merge_runs_int32_limit_does_not_wrap():
    top = 2**31 - 1
    assert merge_runs(np.array([top - 1, top], np.int32), np.array([0, 1], np.int32)) == [(top - 1, 0, 2)]
    wrapped = merge_runs(np.array([top, -top - 1], np.int32), np.array([0, 1], np.int32))
    assert wrapped == [(top, 0, 1), (-top - 1, 1, 1)]


@pytest.mark.parametrize("src, dst", [([1, 2], [1]), ([[1, 2]], [[1, 2]]), ([1.0], [2.0]), ([True], [False])])
def test_merge_runs_rejects_bad_lists(src, dst):
    with pytest.raises(ValueError):
        merge_runs(src, dst)


run_lists = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(1, 6)), max_size=30)


@given(run_lists)
def test_merge_runs_matches_reference(spec):
    src = [s + i for s, _, n in spec for i in range(n)]
    dst = [d + i for _, d, n in spec for i in range(n)]
    runs = merge_runs(src, dst)
    assert runs == reference_runs(src, dst)
    assert [s + i for s, _, n in runs for i in range(n)] == src
    assert [d + i for _, d, n in runs for i in range(n)] == dst
    for (s1, d1, n1), (s2, d2, _) in zip(runs, runs[1:]):
        assert not (s2 == s1 + n1 and d2 == d1 + n1), "adjacent runs should have been merged"


# --- plan_entries -----------------------------------------------------------------------------------

SRC = [PoolBuffer(0x10000, 8 * 64, 64), PoolBuffer(0x20000, 8 * 64, 64)]
DST = [(0x90000, 16 * 64, 64), (0xA0000, 16 * 64, 64)]


def test_plan_entries_one_entry_per_buffer_and_run():
    plan = plan_entries(SRC, DST, [1, 2, 3, 6], [10, 11, 4, 5])
    assert plan.num_pages == 4 and plan.num_runs == 3 and plan.num_entries == 6
    assert plan.src_addrs.tolist() == [
        0x10000 + 64,
        0x10000 + 192,
        0x10000 + 384,
        0x20000 + 64,
        0x20000 + 192,
        0x20000 + 384,
    ]
    assert plan.dst_addrs.tolist() == [
        0x90000 + 640,
        0x90000 + 256,
        0x90000 + 320,
        0xA0000 + 640,
        0xA0000 + 256,
        0xA0000 + 320,
    ]
    assert plan.lengths.tolist() == [128, 64, 64] * 2
    assert plan.num_bytes == 4 * 64 * 2


def test_plan_entries_empty():
    plan = plan_entries(SRC, DST, [], [])
    assert plan.num_entries == 0 and plan.num_bytes == 0 and plan.num_pages == 0


@pytest.mark.parametrize(
    "src_pages, dst_pages, field",
    [
        ([8], [1], "src_pages: page 8"),  # src holds pages 0..7
        ([1], [16], "dst_pages: page 16"),
        ([-1], [1], "src_pages: page -1"),
        ([1, 2], [3, 3], "dst_pages: a destination page appears more than once"),
        ([1, 2], [3], "dst_pages: has 1 pages"),
    ],
)
def test_plan_entries_refuses_before_sending(src_pages, dst_pages, field):
    with pytest.raises(ValueError, match=field):
        plan_entries(SRC, DST, src_pages, dst_pages)


def test_plan_entries_checks_buffers():
    with pytest.raises(ValueError, match="item_len 32 differs"):
        plan_entries(SRC, [DST[0], (0xA0000, 1024, 32)], [1], [1])
    with pytest.raises(ValueError, match="has 1 buffers, src_bufs 2"):
        plan_entries(SRC, DST[:1], [1], [1])
    with pytest.raises(ValueError, match=r"dst_bufs\[1\]"):
        plan_entries(SRC, [DST[0], (0, 1024, 64)], [1], [1])


def test_pool_buffer_of_numpy_and_torch():
    torch = pytest.importorskip("torch")
    t = torch.zeros((9, 4, 2, 32), dtype=torch.bfloat16)
    assert PoolBuffer.of(t) == (t.data_ptr(), 9 * 512, 512)
    a = np.zeros((9, 64), np.uint8)
    assert PoolBuffer.of(a) == (a.ctypes.data, 576, 64)
    with pytest.raises(ValueError):
        PoolBuffer.of(t[:, :2])  # not contiguous


# --- configuration and environment (no engine is built) ----------------------------------------------


def test_config_refuses_bad_values():
    with pytest.raises(ValueError, match="transfer_timeout_s"):
        TransferConfig(transfer_timeout_s=2)
    with pytest.raises(ValueError, match="host"):
        TransferConfig(host="127.0.0.1:20000")
    with pytest.raises(ValueError, match="max_batch_entries"):
        TransferConfig(max_batch_entries=0)


@pytest.mark.parametrize(
    "var, value, config, field",
    [
        ("MC_LOG_DIR", "logs", TransferConfig(), "MC_LOG_DIR"),
        ("MC_LOG_LEVEL", "error", TransferConfig(), "MC_LOG_LEVEL"),
        (QUEUE_ENV, "512", TransferConfig(max_batch_entries=1024), "max_batch_entries"),
    ],
)
def test_environment_checked_before_the_engine(monkeypatch, var, value, config, field):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=field):
        TransferEngineHandle(config)


def test_import_does_not_load_mooncake():
    code = (
        "import sys, kvtrail.serving, kvtrail.serving.transfer; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('mooncake', 'torch')]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- one engine in this process ----------------------------------------------------------------------


def test_handle_lifecycle():
    buf = np.zeros(4096, np.uint8)
    handle = TransferEngineHandle()
    host, _, port = handle.session_id.rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0
    handle.register([(buf.ctypes.data, buf.nbytes)])
    handle.register([(buf.ctypes.data, buf.nbytes)])  # already registered: skipped
    assert handle.registered == ((buf.ctypes.data, 4096),)
    with pytest.raises(TransferError, match="overlaps") as exc:
        handle.register([(buf.ctypes.data + 1024, 1024)])
    assert exc.value.rc == -7
    handle.unregister_all()
    handle.unregister_all()
    assert handle.registered == ()
    handle.register([(buf.ctypes.data, buf.nbytes)])  # registering again after unregistering works
    handle.close()
    handle.close()
    assert handle.registered == ()
    with pytest.raises(TransferError, match="closed"):
        handle.write_pages("127.0.0.1:1", [(buf.ctypes.data, 4096, 64)], [(buf.ctypes.data, 4096, 64)], [1], [1])
    with pytest.raises(ValueError, match="peer_session"):
        handle.write_plan("127.0.0.1", plan_entries(SRC, DST, [1], [1]))


# --- two processes -----------------------------------------------------------------------------------


def _peer_main(conn, log_path, seed):
    """The spawned decode side: a pool of NUM_BUFFERS numpy buffers filled with seeded bytes."""
    os.dup2(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), 2)  # glog writes to fd 2
    handle = TransferEngineHandle(TransferConfig(transfer_timeout_s=5))
    rng = np.random.default_rng(seed)
    bufs = [rng.integers(0, 256, (PAGES + 1) * ITEM, dtype=np.uint8) for _ in range(NUM_BUFFERS)]
    specs = [PoolBuffer(b.ctypes.data, b.nbytes, ITEM) for b in bufs]
    handle.register(specs)
    conn.send((handle.session_id, specs))
    try:
        while conn.poll(PEER_IDLE_S):
            cmd = conn.recv()
            if cmd == "dump":
                conn.send([b.tobytes() for b in bufs])
            elif cmd == "unregister":
                handle.unregister_all()
                handle.unregister_all()
                conn.send(handle.registered)
            elif cmd == "exit":
                handle.close()
                conn.send("bye")
                return
    except EOFError:  # the test process went away
        pass
    handle.close()


class Peer:
    """A spawned peer process and the pipe to it."""

    def __init__(self, tmp_path, seed):
        ctx = mp.get_context("spawn")
        self.log = tmp_path / f"peer-{seed}.log"
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer_main, args=(child, str(self.log), seed), daemon=True)
        self.proc.start()
        child.close()
        self.session, self.bufs = self._reply()

    def _reply(self):
        if not self.conn.poll(REPLY_S):
            raise AssertionError(f"peer did not answer; its stderr:\n{self.log.read_text()}")
        return self.conn.recv()

    def ask(self, cmd):
        self.conn.send(cmd)
        return self._reply()

    def pages(self) -> list[np.ndarray]:
        return [np.frombuffer(b, np.uint8).reshape(PAGES + 1, ITEM) for b in self.ask("dump")]

    def stop(self):
        if self.proc.is_alive():
            try:
                self.conn.send("exit")
            except OSError:
                pass
            self.proc.join(REPLY_S)
        if self.proc.is_alive():  # our own child only, by its Process object
            self.proc.kill()
            self.proc.join(REPLY_S)


@pytest.fixture(scope="module")
def sender():
    handle = TransferEngineHandle(TransferConfig(transfer_timeout_s=5))
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def src(sender):
    """The prefill side: torch bf16 buffers shaped like the pool, filled with random bytes."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(7)
    tensors = [
        torch.randint(0, 256, ((PAGES + 1) * ITEM,), dtype=torch.uint8, generator=gen)
        .view(torch.bfloat16)
        .reshape(PAGES + 1, 4, 2, 32)
        for _ in range(NUM_BUFFERS)
    ]
    specs = [PoolBuffer.of(t) for t in tensors]
    sender.register(specs)
    return specs, [t.view(torch.uint8).reshape(PAGES + 1, ITEM).numpy() for t in tensors]


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
    p = Peer(tmp_path_factory.mktemp("peer"), seed=1)
    yield p
    p.stop()


def check_written(before, after, src_bytes, src_pages, dst_pages):
    for k in range(NUM_BUFFERS):
        np.testing.assert_array_equal(after[k][dst_pages], src_bytes[k][src_pages])
        untouched = np.ones(PAGES + 1, bool)
        untouched[dst_pages] = False
        np.testing.assert_array_equal(after[k][untouched], before[k][untouched])


@pytest.mark.slow
def test_scattered_pages_land_exactly(sender, src, peer):
    specs, src_bytes = src
    rng = np.random.default_rng(3)
    src_pages, dst_pages = fragmented(rng, 300, 8), fragmented(rng, 300, 8)
    before = peer.pages()
    result = sender.write_pages(peer.session, specs, peer.bufs, src_pages, dst_pages)
    check_written(before, peer.pages(), src_bytes, src_pages, dst_pages)
    runs = len(merge_runs(src_pages, dst_pages))
    assert 300 > runs > 300 / 8  # both sides fragmented, so runs are shorter than either side's
    assert (result.num_pages, result.num_runs, result.num_entries) == (300, runs, NUM_BUFFERS * runs)
    assert result.num_batches == 1 and result.num_bytes == NUM_BUFFERS * 300 * ITEM
    assert sender.is_peer_alive(peer.session)


@pytest.mark.slow
def test_more_than_1024_entries_are_split_into_batches(sender, src, peer):
    specs, src_bytes = src
    rng = np.random.default_rng(4)
    src_pages, dst_pages = rng.permutation(np.arange(1, PAGES + 1))[:700], fragmented(rng, 700, 2)
    before = peer.pages()
    result = sender.write_pages(peer.session, specs, peer.bufs, src_pages, dst_pages)
    check_written(before, peer.pages(), src_bytes, src_pages, dst_pages)
    assert result.num_entries == NUM_BUFFERS * len(merge_runs(src_pages, dst_pages)) > 2048
    assert result.num_batches == math.ceil(result.num_entries / 1024)


@pytest.mark.slow
def test_dead_peer_fails_fast(sender, src, tmp_path):
    specs, _ = src
    peer = Peer(tmp_path, seed=2)
    sender.write_pages(peer.session, specs, peer.bufs, [1, 2], [3, 4])  # the peer has been in contact
    peer.proc.kill()
    peer.proc.join(REPLY_S)
    t0 = time.monotonic()
    assert not sender.is_peer_alive(peer.session)
    for _ in range(3):
        with pytest.raises(TransferError, match="unknown subset written") as exc:
            sender.write_pages(peer.session, specs, peer.bufs, [1, 2], [3, 4])
        assert (exc.value.op, exc.value.batch, exc.value.entries_done, exc.value.peer) == ("write", 0, 0, peer.session)
    assert time.monotonic() - t0 < 10


@pytest.mark.slow
def test_shutdown_unregisters_and_the_peer_exits_cleanly(sender, src, tmp_path):
    specs, _ = src
    peer = Peer(tmp_path, seed=3)
    try:
        before = peer.pages()
        assert peer.ask("unregister") == ()
        with pytest.raises(TransferError, match="unknown subset written"):
            sender.write_pages(peer.session, specs, peer.bufs, [1, 2, 3], [1, 2, 3])
        for b, a in zip(before, peer.pages()):
            np.testing.assert_array_equal(a, b)  # the receiver refused every entry
        assert peer.ask("exit") == "bye"
        peer.proc.join(REPLY_S)
        assert peer.proc.exitcode == 0
    finally:
        peer.stop()
