"""The scheduler process's loop (scheduler/process.py ``SchedulerLoop.run``) over the real
scheduler and model runner, its sockets replaced by recording ones: the order in which a step's
tokens and the next step leave it. And the worker process's KV pool, written once before
serving (engine/worker/process.py ``prefault_pool``)."""

from __future__ import annotations

import os
from collections import deque
from itertools import pairwise

import numpy as np
import pytest
import torch
import zmq

from engine.contracts.protocol import Shutdown, TokenOutputs, decode, encode, unpack_ids
from engine.contracts.sampling_params import SamplingParams
from engine.contracts.worker_messages import ForwardBatch
from engine.worker.process import PREFAULT_ENV, prefault_pool
from scheduler.process import SchedulerLoop
from scheduler.refill import RefillWait
from tests.test_scheduler import Harness, hf_greedy, hf_model, model_dir  # noqa: F401


class _Socket:
    """A socket whose sends go to ``sent`` (with its name) and whose receives come from
    ``queued``; ``on_send`` answers a send (the worker's step)."""

    def __init__(self, name: str, sent: list, on_send=None) -> None:
        self.name, self.sent, self.on_send = name, sent, on_send
        self.queued: deque[bytes] = deque()

    def send(self, data: bytes) -> None:
        self.sent.append((self.name, decode(data)))
        if self.on_send is not None:
            self.on_send(data)

    def recv(self, flags: int = 0) -> bytes:
        if not self.queued:
            raise zmq.Again()
        return self.queued.popleft()


class _Poller:
    def __init__(self, *socks: _Socket) -> None:
        self.socks = socks

    def poll(self, timeout=None) -> list:
        ready = [(s, zmq.POLLIN) for s in self.socks if s.queued]
        assert ready or timeout is not None, "the loop would block with nothing to receive"
        return ready


def _loop(h: Harness) -> tuple[SchedulerLoop, list]:
    """A SchedulerLoop over ``h``'s scheduler whose worker answers each batch at once, and
    the log of what it sent."""
    sent: list = []
    loop = SchedulerLoop.__new__(SchedulerLoop)
    loop.sched, loop.refill = h.sched, RefillWait(0.0)
    loop.aborts, loop.checked, loop.last_stats, loop.next_stats = [], True, None, 0.0
    loop.publisher = loop.kv_events = None
    loop.inbox = _Socket("inbox", sent)
    loop.from_worker = _Socket("from_worker", sent)

    def run_step(data: bytes) -> None:
        loop.from_worker.queued.append(encode(h.worker.step(decode(data))))

    loop.to_worker = _Socket("worker", sent, run_step)
    loop.to_tokenizers = [_Socket("tokenizer", sent)]
    loop.poller = _Poller(loop.inbox, loop.from_worker)
    return loop, sent


def test_a_steps_tokens_leave_before_the_next_step_is_sent(model_dir, hf_model):  # noqa: F811
    h = Harness(model_dir, overlap_schedule="off")
    loop, sent = _loop(h)
    prompts = {"a": [11, 22, 33, 44, 55], "b": [12, 23, 34, 45, 56, 67]}
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for rid, prompt in prompts.items():
        h.add(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}

    def record(data: bytes) -> None:
        for out in decode(data).outputs:
            tokens[out.rid] += unpack_ids(out.token_ids).tolist()
        if all(len(ids) == 4 for ids in tokens.values()):
            loop.inbox.queued.append(encode(Shutdown()))

    loop.to_tokenizers[0].on_send = record
    loop.run()
    order = [(name, msg) for name, msg in sent if name in ("worker", "tokenizer")]
    batches = [i for i, (name, msg) in enumerate(order) if isinstance(msg, ForwardBatch)]
    assert len(batches) == 4  # the prefill and three decode steps
    # between two steps, the first one's tokens went out before the second was sent
    for first, second in pairwise(batches):
        between = [msg for name, msg in order[first + 1:second] if name == "tokenizer"]
        assert any(isinstance(m, TokenOutputs) and m.outputs and m.result_at for m in between)
    for rid, prompt in prompts.items():
        assert tokens[rid] == hf_greedy(hf_model, prompt, 4), rid
    h.assert_idle_clean()


def test_the_pool_is_written_before_serving(model_dir, monkeypatch):  # noqa: F811
    h = Harness(model_dir)
    pool = h.worker.runner.pool
    # A pool the size of the default CPU one would cost the test a second: a fresh one of
    # 64 MiB stands in for it, never written, as the pool's own (engine/worker/kv_pool.py).
    pages = _fresh_pages(64 << 20)
    pool.kv = torch.from_numpy(pages).view(torch.float32)
    before = _resident_pages(pages)
    assert prefault_pool(h.worker.runner) == pool.kv.numel() * 4 + pool.swa.numel() * 4
    assert _resident_pages(pages) - before >= 0.99 * len(pages) // 4096
    assert not pool.kv.any()  # written, still zeros
    monkeypatch.setenv(PREFAULT_ENV, "0")
    assert prefault_pool(h.worker.runner) == 0


def _fresh_pages(nbytes: int) -> np.ndarray:
    """Zeros no process has written: an anonymous mapping of its own. (calloc may hand back
    memory the allocator already holds, resident and cleared, depending on what ran before.)"""
    import mmap

    return np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)


def _resident_pages(buffer: np.ndarray) -> int:
    """Pages of ``buffer`` in memory (mincore)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    start = buffer.ctypes.data // mmap.PAGESIZE * mmap.PAGESIZE
    length = buffer.ctypes.data + buffer.nbytes - start
    pages = -(-length // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        pytest.fail(f"mincore failed: errno {ctypes.get_errno()}")
    return sum(v & 1 for v in vec)


def test_a_tensor_parallel_rank_writes_its_pool_before_it_is_ready(monkeypatch) -> None:
    """Ranks 1..N-1 hold their share of every page too, and rank 0 waits for them at every
    step's collectives: each writes its CPU pool before it reports ready, as rank 0 does."""
    from types import SimpleNamespace

    from engine.worker import tp_rank

    pages = _fresh_pages(16 << 20)
    pool = SimpleNamespace(kv=torch.from_numpy(pages).view(torch.float32),
                           swa=torch.zeros(0))
    resident_at_ready: list[int] = []

    class Control:
        def connect(self, address: str) -> None:
            pass

        def send(self, data: bytes) -> None:
            resident_at_ready.append(_resident_pages(pages))

    monkeypatch.setattr(tp_rank, "start_tensor_parallel", lambda config, rank: None)
    monkeypatch.setattr(tp_rank, "make_runner", lambda config, tp: SimpleNamespace(pool=pool))
    monkeypatch.setattr(tp_rank, "follow", lambda runner, tp: None)
    spec = SimpleNamespace(index=1, config=None, endpoints=SimpleNamespace(control="x"))
    tp_rank.run(spec, SimpleNamespace(socket=lambda kind: Control()))
    assert resident_at_ready[0] >= 0.99 * len(pages) // 4096


def test_a_pool_larger_than_the_memory_left_is_refused_with_a_sentence(monkeypatch) -> None:
    """Written at start, a pool beyond the memory available would get the worker killed
    with no word of why: it is refused before a page is written, naming the sizes."""
    from types import SimpleNamespace

    from engine.worker import process

    pages = _fresh_pages(8 << 20)
    runner = SimpleNamespace(pool=SimpleNamespace(kv=torch.from_numpy(pages).view(torch.float32),
                                                  swa=torch.zeros(0)))
    monkeypatch.setattr(process, "available_memory", lambda: 4 << 20)
    before = _resident_pages(pages)
    with pytest.raises(ValueError, match=r"takes 0\.01 GiB but 0\.00 GiB .* --kv-cache-gb"):
        prefault_pool(runner)
    assert _resident_pages(pages) - before < len(pages) // 4096 // 2  # nothing written
    monkeypatch.setattr(process, "available_memory", lambda: 16 << 20)
    assert prefault_pool(runner) == len(pages)


def test_the_memory_available_is_read_from_the_kernel() -> None:
    from engine.worker.process import available_memory

    available = available_memory()
    assert available is not None and 0 < available <= os.sysconf("SC_PAGE_SIZE") * os.sysconf(
        "SC_PHYS_PAGES")
