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

import json
import logging
import os
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.checkpoints.quantized import QUANTIZER_VERSION
from engine.contracts.disk_blocks import block_tokens, fingerprint, window_name
from engine.contracts.disk_cache import DiskStore
from engine.contracts.engine_config import EngineConfig
from engine.contracts.protocol import unpack_ids
from engine.contracts.worker_messages import DiskLoad, DiskSave, HostLoad
from engine.worker.draft_tiers import DraftBlocks
from engine.worker.kv_pool import KVPool

if TYPE_CHECKING:
    from engine.worker.draft import DraftModel
    from engine.worker.runner import ModelRunner

logger = logging.getLogger("radixserve.worker")

MAX_PENDING_BYTES = 256 << 20  # snapshots waiting to be written, at most
FLUSH_SECONDS = 30.0  # how long shutting down waits for the saves still queued
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".json")
# A block's payload (the pool's pages) and the code computing it: raised when either changes,
# which moves every store to a directory of its own (3: weight formats in the identity; 4: which
# layers keep their KV in sliding pages, stored apart in window files; 5: a draft model's KV and
# slot record after the model's, engine/worker/draft_tiers.py).
KV_LAYOUT_VERSION = 5

# Every EngineConfig option, by whether it changes a KV block's bytes (a test holds every option
# to one of the two). These do; the identity holds each as the worker resolved it, under:
IN_IDENTITY = {
    "model": "weights", "quantization": "weight_formats", "dtype": "dtype",
    "kv_cache_dtype": "kv_dtype", "page_size": "page_size", "tp_size": "tp_size",
    "load_format": "load_format", "seed": "seed",
    # the batch-invariant kernels' KV is the same bits however it was batched; a fast server's
    # differs from it by rounding, which would break a deterministic server's hits
    "deterministic": "deterministic",
    # whether (and for which layers) the sliding-window layers' KV is held apart: a block then
    # holds the full layers' KV only, its window file the sliding layers'
    "sliding_kv_ratio": "sliding_layers",
    # a draft model's KV (and its record of it) follows the model's in each block: its
    # checkpoint, shapes and weight formats (its other keys change no byte of a block)
    "speculative_config": "draft",
}
# These do not, for the reason given.
NOT_IN_IDENTITY = {
    **dict.fromkeys((
        "num_pages", "kv_cache_gb", "mem_fraction", "num_host_pages", "host_cache_gb",
        "cache_write_policy", "eviction_policy", "disk_cache_dir", "disk_cache_gb",
        "max_pinned_tokens"), "how much is kept, and where"),
    **dict.fromkeys((
        "device", "attention_backend", "flashinfer_decode_backend", "enable_cuda_graph",
        "cuda_graph_max_bs", "worker_threads", "max_running_requests", "max_prefill_tokens",
        "chunked_prefill_size", "overlap_schedule", "preemption_mode",
        "linear_form", "resident_weights_gb"),
        "kernels and step shapes: KV differs by rounding at most, as batching already makes "
        "it (the dtypes they run in are in the identity)"),
    **dict.fromkeys(("enable_lora", "lora_modules", "max_loras", "max_lora_rank"),
                    "an adapter's blocks hash apart by its content (lora_namespace)"),
    **dict.fromkeys((
        "served_model_name", "policy", "max_waiting_requests", "refill_wait_ms", "context_len",
        "max_sessions",
        "session_ttl", "tokenizer_workers", "kv_events_endpoint", "kv_events_block_size",
        "dp_size", "dp_policy", "dp_cache_threshold", "dp_balance_abs", "dp_balance_rel",
        "nnodes", "node_rank", "dist_init_addr", "allow_special_tokens_in_content",
        "chat_template", "log_level"),
        "names, prompts' rendering, scheduling, processes and logs: not what a token's KV is"),
}


def open_tier_io(c: EngineConfig, runner: ModelRunner,
                 draft: DraftModel | None = None) -> TierIO | None:
    """The I/O thread ``c``'s tiers need over ``runner``'s pool and ``draft``'s (None without a
    host or a disk tier), with the disk tier's store in the directory of this model, draft and
    layout (its fingerprint: ``identity``)."""
    store = None
    if c.disk_cache_dir is not None:
        ident = identity(c, runner, draft)
        store = DiskStore(c.disk_cache_dir, fingerprint(ident), int(c.disk_cache_gb * 2**30),
                          ident)
    elif not runner.num_host_cache_pages or c.tp_size > 1:
        return None  # under tensor parallel the host tier loads in the step, on every rank
    return TierIO(store, runner.pool, block_tokens(c.page_size), draft)


def identity(c: EngineConfig, runner: ModelRunner, draft: DraftModel | None = None) -> dict:
    """Everything that changes a KV block's bytes, as this worker resolved it (the fingerprint
    of the disk tier's directory): the code's KV layout, the model's shapes, its weights
    (``checkpoint_identity``) and the format each is served in (``weight_formats``), random
    weights' seed, the dtypes, the page size, the tensor-parallel split, which layers keep
    their KV in sliding pages (none without ``--sliding-kv-ratio``) and the draft model whose
    KV the blocks hold too (none without one). Every option is in ``IN_IDENTITY`` or
    ``NOT_IN_IDENTITY``."""
    split = [i for i, s in enumerate(runner.pool.sliding_layers) if s]
    return {
        "kv_layout": KV_LAYOUT_VERSION, **_model_identity(c.model, runner),
        "vocab_size": runner.config.vocab_size, "load_format": c.load_format,
        "seed": c.seed if c.load_format == "dummy" else None,
        "dtype": str(runner.dtype), "kv_dtype": str(runner.kv_dtype), "page_size": c.page_size,
        "tp_size": c.tp_size, "deterministic": c.deterministic, "sliding_layers": split or None,
        "draft": (_model_identity(draft.checkpoint, draft.runner)
                  if draft is not None else None),
    }


def _model_identity(model_dir: str, runner: ModelRunner) -> dict:
    """One model's part of ``identity``: its shapes, weights and their formats."""
    mc = runner.config
    formats = weight_formats(runner.model)
    return {
        "architecture": mc.architecture, "num_layers": mc.num_layers,
        "num_kv_heads": runner.model.plan.num_kv_heads, "head_dim": mc.head_dim,
        "weights": checkpoint_identity(model_dir),
        "weight_formats": formats,
        # int8 and int4 blocks are this engine's own quantization of the weights
        "quantizer": QUANTIZER_VERSION if set(formats.values()) & {"int8", "int4"} else None,
    }


def checkpoint_identity(model_dir: str) -> dict:
    """A converted GGUF's content hash (engine/checkpoints/gguf.py hashes the whole file: a copy
    converted anywhere is the same model) and its converter's version; any other checkpoint's
    weight and config files by name, size and modification time."""
    path = os.path.realpath(model_dir)
    source = os.path.join(path, "source.json")
    if os.path.isfile(source):
        with open(source) as f:
            converted = json.load(f)
        return {"gguf_sha256": converted["sha256"],
                "converter": converted["converter_version"]}
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, name) for name in os.listdir(path) if name.endswith(_WEIGHT_SUFFIXES))
    return {"files": [[os.path.basename(file), st.st_size, st.st_mtime_ns]
                      for file, st in ((file, os.stat(file)) for file in files)]}


def weight_formats(model: torch.nn.Module) -> dict[str, str]:
    """The block format each quantized weight is served in, by module and weight name: what
    ``--quantization`` resolved to (under auto a GGUF's own blocks, unless the kernels that
    read them are missing and they were widened); dense weights are ``--dtype``'s."""
    return {f"{path}.{name}".lstrip("."): blocks.format
            for path, module in model.named_modules()
            for name, blocks in getattr(module, "quantized", {}).items()}


class TierIO:
    """``store``: the disk tier's (None: the host tier's loads only); ``draft``: a draft
    model whose KV and record travel with the model's (engine/worker/draft_tiers.py)."""

    def __init__(self, store: DiskStore | None, pool: KVPool, block_tokens: int,
                 draft: DraftModel | None = None) -> None:
        self.store, self.pool = store, pool
        self.block_tokens = block_tokens
        self.pages_per_block = block_tokens // pool.page_size
        kv, swa = pool.kv, pool.swa
        # A block's bytes: its pages one after another, each page every layer's K and V (the
        # full layers' only, with sliding pages of their own); a window file's: the same for
        # the sliding layers.
        self.block_shape = (self.pages_per_block, kv.shape[0], kv.shape[1], *kv.shape[3:])
        self.model_bytes = int(np.prod(self.block_shape)) * kv.element_size()
        # with a draft model, its part of the payload after the model's
        self.draft = DraftBlocks(draft, self.pages_per_block) if draft is not None else None
        self.payload_bytes = self.model_bytes + (self.draft.payload_bytes if draft else 0)
        self.window_shape = (self.pages_per_block, swa.shape[0], swa.shape[1], *swa.shape[3:])
        self.window_bytes = int(np.prod(self.window_shape)) * swa.element_size()
        self._cond = threading.Condition()
        self._loads: deque[DiskLoad | HostLoad] = deque()
        self._saves: deque[tuple[str, memoryview]] = deque()  # a block's or a window's file
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
        """Copy the named blocks' pages (and their windows' sliding pages) out now (the step's
        page writes come after) and queue them for writing."""
        if not saves or self.store is None or not self.store.writing:
            return  # off, or waiting out a full disk: no copy for a write that would not run
        files = self._copy_out(self.pool.kv, [(s.name, s.pages) for s in saves if s.pages],
                               self.draft)
        files += self._copy_out(self.pool.swa, [(window_name(s.name), s.swa)
                                                for s in saves if s.swa])
        with self._cond:
            for i, (name, data) in enumerate(files):
                if self._pending_bytes + len(data) > MAX_PENDING_BYTES:
                    # the disk writes slower than the cache fills: these blocks stay unsaved
                    # (a later commit of the same prefix offers them again)
                    logger.debug("disk tier: %d file saves dropped, %d bytes queued",
                                 len(files) - i, self._pending_bytes)
                    break
                self._saves.append((name, data))
                self._pending_bytes += len(data)
            self._cond.notify()

    def _copy_out(self, pool: torch.Tensor, named: list[tuple[str, bytes]],
                  draft: DraftBlocks | None = None) -> list[tuple[str, memoryview]]:
        """Each named file's pages of ``pool`` ([L, 2, pages, ...]) as its bytes, in one copy
        (then ``draft``'s part of each file after them)."""
        if not named:
            return []
        pages = np.concatenate([unpack_ids(p) for _, p in named]).astype(np.int64)
        index = torch.from_numpy(pages).to(self.pool.device)
        # [pages, L, 2, ...] in one copy (synchronous): each file is a run of its rows
        rows = pool.index_select(2, index).movedim(2, 0).contiguous().cpu().view(torch.uint8)
        rows = rows.numpy().reshape(len(named), -1)
        if draft is not None:
            rows = np.concatenate([rows, draft.copy_out(pages, len(named))], axis=1)
        return [(name, memoryview(rows[i])) for i, (name, _) in enumerate(named)]  # views

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

    def flush(self, timeout: float) -> None:
        """Until every save queued so far is written (or tried) or ``timeout`` seconds pass."""
        with self._cond:
            self._cond.wait_for(lambda: not (self._saves or self._busy), timeout)

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
                    self._pending_bytes -= len(job[1])
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
        """The blocks, one after another until one is missing or fails its checks (or its
        window file does, where the load names sliding pages for its pages), into the pages."""
        started = time.perf_counter()
        pages = unpack_ids(job.pages).astype(np.int64)
        swa = unpack_ids(job.swa).astype(np.int64) if job.swa else None
        per, store = self.pages_per_block, self.store
        blocks, windows, targets, drafts = [], [], [], []
        for k, name in enumerate(job.names):
            payload = store.read(name, self.block_tokens, self.payload_bytes)
            mine = swa[k * per : (k + 1) * per] if swa is not None else np.empty(0)
            window = None
            if payload is not None and (mine >= 0).any():
                window = store.read(window_name(name), self.block_tokens, self.window_bytes)
                if window is None:
                    payload = None
            if payload is None:
                break
            model = payload[: self.model_bytes]
            blocks.append(torch.frombuffer(model, dtype=self.pool.kv.dtype)
                          .view(self.block_shape))
            drafts.append(payload[self.model_bytes :])
            if window is not None:
                rows = torch.frombuffer(window, dtype=self.pool.swa.dtype).view(self.window_shape)
                windows.append(rows[torch.from_numpy(np.flatnonzero(mine >= 0))])
                targets.append(mine[mine >= 0])
        event = None
        if blocks:
            data = torch.cat(blocks).movedim(0, 2)  # [L, 2, pages, ...]
            event = self._place(self.pool.kv, pages[: len(blocks) * per], data)
            if self.draft is not None:
                event = self.draft.place(drafts, pages[: len(blocks) * per], self._place)
        if windows:
            event = self._place(self.pool.swa, np.concatenate(targets),
                                torch.cat(windows).movedim(0, 2)) or event
        self.load_seconds += time.perf_counter() - started
        self._report(job.load_id, len(blocks), event)

    def _copy_from_host(self, job: HostLoad) -> None:
        """Host-tier pages (locked in the tree while this runs) into the request's own."""
        host = torch.from_numpy(unpack_ids(job.host_pages).astype(np.int64))
        data = self.pool.host.index_select(2, host)
        pages = unpack_ids(job.pages).astype(np.int64)
        event = self._place(self.pool.kv, pages, data)
        if self.draft is not None:  # the stream runs in order: its event covers both
            event = self.draft.from_host(host, pages, self._place)
        self._report(job.load_id, 1, event)

    def _place(self, pool: torch.Tensor, pages: np.ndarray,
               data: torch.Tensor) -> torch.cuda.Event | None:
        """``data`` ([L, 2, pages, ...], on the CPU) into ``pages`` of ``pool`` (the full or the
        sliding pages); on CUDA through pinned memory on this thread's stream, with the event
        that says when it has run (the stream runs in order: the last event covers both)."""
        index = torch.from_numpy(pages)
        with torch.inference_mode():
            if self.stream is None:
                pool.index_copy_(2, index, data)
                return None
            with torch.cuda.stream(self.stream):
                device_data = data.pin_memory().to(self.pool.device, non_blocking=True)
                pool.index_copy_(2, index.to(self.pool.device), device_data)
                event = torch.cuda.Event()
                event.record(self.stream)
            return event

    def _report(self, load_id: int, blocks: int, event) -> None:
        with self._cond:
            self._done.append((load_id, blocks, event))
            self._cond.notify_all()
