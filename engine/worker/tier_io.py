"""The worker's I/O thread for the prefix cache's tiers: the disk tier's saves (``--disk-cache-dir``:
the blocks the scheduler names, their pages copied out at the start of the step that carries
them, before anything can overwrite them) and every load into a waiting request's own pages
(scheduler/loads.py): disk blocks read from their files, and host-tier pages copied over
(``--host-cache-gb``), so that none ever holds up a step.

A load runs while other requests' steps run: the scheduler keeps the loading request out of
every batch until a later ``BatchResult.loads_ended`` reports what arrived (``finished``); a
disk block that is missing or fails its checks (engine/contracts/disk_cache.py) ends its load
there, and the request computes the rest. On CUDA the copy into the pages runs on a stream of
its own and is reported only once that stream has finished it. Saves wait behind loads (a
request waits for a load, nobody for a save) and are dropped, not queued without bound, when
the disk falls more than ``MAX_PENDING_BYTES`` behind.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.contracts.disk_blocks import block_tokens, fingerprint
from engine.contracts.disk_cache import DiskStore
from engine.contracts.engine_config import EngineConfig
from engine.contracts.protocol import DiskLoad, DiskSave, HostLoad, unpack_ids
from engine.worker.kv_pool import KVPool

if TYPE_CHECKING:
    from engine.worker.runner import ModelRunner

logger = logging.getLogger("radixserve.worker")

MAX_PENDING_BYTES = 256 << 20  # snapshots waiting to be written, at most
FLUSH_SECONDS = 30.0  # how long shutting down waits for the saves still queued
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".json")


def open_tier_io(c: EngineConfig, runner: ModelRunner) -> TierIO | None:
    """The I/O thread ``c``'s tiers need over ``runner``'s pool (None without a host or a disk
    tier), with the disk tier's store in the directory of this model and layout (its
    fingerprint: ``identity``)."""
    store = None
    if c.disk_cache_dir is not None:
        ident = identity(c, runner)
        store = DiskStore(c.disk_cache_dir, fingerprint(ident), int(c.disk_cache_gb * 2**30),
                          ident)
    elif not runner.num_host_cache_pages or c.tp_size > 1:
        return None  # under tensor parallel the host tier loads in the step, on every rank
    return TierIO(store, runner.pool, block_tokens(c.page_size))


def identity(c: EngineConfig, runner: ModelRunner) -> dict:
    """What KV bytes depend on: the model (its shapes and its checkpoint files' names, sizes
    and modification times; random weights' seed), the dtypes, the page size and the
    tensor-parallel layout."""
    mc = runner.config
    path = os.path.realpath(c.model)
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, name) for name in os.listdir(path) if name.endswith(_WEIGHT_SUFFIXES))
    stats = [(os.path.basename(file), os.stat(file)) for file in files]
    weights = [[name, st.st_size, st.st_mtime_ns] for name, st in stats]
    return {
        "format": 2, "architecture": mc.architecture, "num_layers": mc.num_layers,
        "num_kv_heads": runner.model.plan.num_kv_heads, "head_dim": mc.head_dim,
        "vocab_size": mc.vocab_size, "weights": weights, "load_format": c.load_format,
        "seed": c.seed if c.load_format == "dummy" else None,
        "dtype": str(runner.dtype), "kv_dtype": str(runner.kv_dtype), "page_size": c.page_size,
        "tp_size": c.tp_size,
    }


class TierIO:
    """``store``: the disk tier's (None: the host tier's loads only)."""

    def __init__(self, store: DiskStore | None, pool: KVPool, block_tokens: int) -> None:
        self.store, self.pool = store, pool
        self.block_tokens = block_tokens
        self.pages_per_block = block_tokens // pool.page_size
        kv = pool.kv
        # A block's bytes: its pages one after another, each page every layer's K and V.
        self.page_shape = (kv.shape[0], kv.shape[1], *kv.shape[3:])
        self.block_shape = (self.pages_per_block, *self.page_shape)
        self.payload_bytes = int(np.prod(self.block_shape)) * kv.element_size()
        self._cond = threading.Condition()
        self._loads: deque[DiskLoad | HostLoad] = deque()
        self._saves: deque[tuple[str, memoryview]] = deque()
        self._pending_bytes = 0
        self._done: list[tuple[int, int, torch.cuda.Event | None]] = []
        self._busy = False
        self._closed = False
        self.stream = torch.cuda.Stream(pool.device) if pool.device.type == "cuda" else None
        self.load_seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="tier-io", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------- the step's
    def save(self, saves: list[DiskSave]) -> None:
        """Copy the named blocks' pages out now (the step's page writes come after) and queue
        them for writing."""
        if not saves or self.store is None or not self.store.writing:
            return  # off, or waiting out a full disk: no copy for a write that would not run
        pages = np.concatenate([unpack_ids(s.pages) for s in saves]).astype(np.int64)
        index = torch.from_numpy(pages).to(self.pool.device)
        # [pages, L, 2, ...] in one copy (synchronous): each block is a run of its rows
        data = self.pool.kv.index_select(2, index).movedim(2, 0).contiguous().cpu()
        rows = data.view(torch.uint8).numpy()
        per_block = self.pages_per_block
        with self._cond:
            for i, s in enumerate(saves):
                if self._pending_bytes + self.payload_bytes > MAX_PENDING_BYTES:
                    # the disk writes slower than the cache fills: these blocks stay unsaved
                    # (a later commit of the same prefix offers them again)
                    logger.debug("disk tier: %d block saves dropped, %d bytes queued",
                                 len(saves) - i, self._pending_bytes)
                    break
                block = rows[i * per_block : (i + 1) * per_block].reshape(-1)  # a view
                self._saves.append((s.name, memoryview(block)))
                self._pending_bytes += self.payload_bytes
            self._cond.notify()

    def load(self, loads: list[DiskLoad | HostLoad]) -> None:
        if loads:
            with self._cond:
                self._loads.extend(loads)
                self._cond.notify()

    def never_started(self, loads: list[DiskLoad | HostLoad]) -> None:
        """Loads of a batch that failed before they began: ended, with nothing."""
        for job in loads:
            self._report(job.load_id, 0, None)

    def finished(self) -> list[tuple[int, int]]:
        """Loads that have ended since the last call: (load id, blocks in the pages)."""
        with self._cond:
            # Each copy's event is queried once: a copy ending between two queries would leave
            # its load in neither list.
            ended = [event is None or event.query() for _, _, event in self._done]
            ready = [d for d, done in zip(self._done, ended, strict=True) if done]
            self._done = [d for d, done in zip(self._done, ended, strict=True) if not done]
        return [(load_id, blocks) for load_id, blocks, _ in ready]

    def wait(self, timeout: float) -> None:
        """Until a load has ended or ``timeout`` seconds pass (a step that only polls)."""
        end = time.monotonic() + timeout
        with self._cond:
            while not self._done and (self._loads or self._busy):
                left = end - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    def close(self, timeout: float = FLUSH_SECONDS) -> None:
        """Write what is queued (for at most ``timeout`` seconds), then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._loads or self._saves or self._closed):
                    self._cond.wait()
                if self._loads:
                    job, kind = self._loads.popleft(), "load"
                elif self._saves:
                    job, kind = self._saves.popleft(), "save"
                    self._pending_bytes -= self.payload_bytes
                else:
                    return
                self._busy = True
            try:
                if kind == "save":
                    self.store.write(job[0], self.block_tokens, job[1])
                elif isinstance(job, HostLoad):
                    self._copy_from_host(job)
                else:
                    self._read_into_pages(job)
            except Exception:  # the thread must outlive any one job
                logger.exception("a prefix cache tier's %s failed", kind)
                if kind == "load":
                    self._report(job.load_id, 0, None)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _read_into_pages(self, job: DiskLoad) -> None:
        started = time.perf_counter()
        pages = unpack_ids(job.pages).astype(np.int64)
        blocks = []
        for name in job.names:
            payload = self.store.read(name, self.block_tokens, self.payload_bytes)
            if payload is None:
                break
            blocks.append(torch.frombuffer(payload, dtype=self.pool.kv.dtype)
                          .view(self.block_shape))
        event = None
        if blocks:
            data = torch.cat(blocks).movedim(0, 2)  # [L, 2, pages, ...]
            event = self._place(pages[: len(blocks) * self.pages_per_block], data)
        self.load_seconds += time.perf_counter() - started
        self._report(job.load_id, len(blocks), event)

    def _copy_from_host(self, job: HostLoad) -> None:
        """Host-tier pages (locked in the tree while this runs) into the request's own."""
        host = torch.from_numpy(unpack_ids(job.host_pages).astype(np.int64))
        data = self.pool.host.index_select(2, host)
        self._report(job.load_id, 1, self._place(unpack_ids(job.pages).astype(np.int64), data))

    def _place(self, pages: np.ndarray, data: torch.Tensor) -> torch.cuda.Event | None:
        """``data`` ([L, 2, pages, ...], on the CPU) into device ``pages``; on CUDA through pinned
        memory on this thread's stream, with the event that says when it has run."""
        index = torch.from_numpy(pages)
        with torch.inference_mode():
            if self.stream is None:
                self.pool.kv.index_copy_(2, index, data)
                return None
            with torch.cuda.stream(self.stream):
                device_data = data.pin_memory().to(self.pool.device, non_blocking=True)
                self.pool.kv.index_copy_(2, index.to(self.pool.device), device_data)
                event = torch.cuda.Event()
                event.record(self.stream)
            return event

    def _report(self, load_id: int, blocks: int, event) -> None:
        with self._cond:
            self._done.append((load_id, blocks, event))
            self._cond.notify_all()
