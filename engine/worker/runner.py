"""The model runner: weights, the KV pool and an attention backend, one ``forward`` per step.

Memory contract: the runner owns the device KV pages (``pool.kv``) and the host pages
(``pool.host``: swap preemption's ``num_host_pages``, then the prefix cache's host tier,
``num_host_cache_pages`` from ``host_cache_gb``) but decides nothing about them. Each ``BatchInput`` says which pages to swap
out / in and which partial pages to copy (done first, in that order), which slot each new
token's KV goes to, and which pages every sequence reads. A page's contents stay until a later
batch overwrites them.

Tensor parallel (``tp`` given): the model is this rank's share, the pool holds this rank's KV
heads of the same page numbers (so the page count is agreed by all ranks: the smallest any can
hold), and ``forward`` returns logits on rank 0 only.

A step's index arrays reach the device in one copy (engine/worker/staging.py). With CUDA graphs
(``enable_cuda_graph``, the flashinfer backend, no tensor parallel) decode steps of up to
``cuda_graph_max_bs`` sequences replay graphs captured at start (engine/worker/cuda_graphs.py);
asking for them gives the pool one scratch page past ``num_pages`` for the padding rows
(and one past the sliding pages under ``--sliding-kv-ratio``).
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch

from engine.checkpoints.quant_formats import BITS
from engine.contracts.engine_config import EngineConfig
from engine.contracts.lora import LoraAdapterInfo, parse_lora_modules
from engine.contracts.step import BatchInput
from engine.worker.attention import make_backend
from engine.worker.cpu_kernels import quant_ops
from engine.worker.cuda_graphs import DecodeGraphs
from engine.worker.distributed import TensorParallel
from engine.worker.kv_pool import KVPool, sliding_layers
from engine.worker.kv_quant import resolve_kv_dtype
from engine.worker.lora_pool import LoraPool
from engine.worker.model.config import ModelConfig
from engine.worker.model.loader import load_model
from engine.worker.model.lora import load_adapter
from engine.worker.staging import HostStaging

logger = logging.getLogger(__name__)

_CPU_DEFAULT_KV_BYTES = 1 << 30
# A CPU step of a model under SMALL_MODEL_BYTES of weights and under SMALL_STEP_FLOPS (2 x
# parameters x tokens) runs on one thread: its ops (~20 us GEMMs) gain nothing from a second,
# and a worker spinning on every core slows the scheduler, tokenizer and frontend beside it.
# Served on 2 cores, the demo model (10 MB; a batch-8 decode is 0.08 GFLOP) reaches its first
# token in 0.78x / 0.82x the time (shared prefixes / multi-turn) at req/s 1.06x / 1.01x against
# always two threads. Bigger models keep every thread on every step: reading their weights is
# bandwidth-bound, and a second thread adds bandwidth (SmolLM2-135M, 270 MB, batch-1 decode:
# 43.9 ms on one thread, 28.7 on two).
SMALL_MODEL_BYTES = 32 << 20
SMALL_STEP_FLOPS = 1e9
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16}


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512_BF16 or AMX, from the kernel's CPU
    flags). There bf16 matmuls run at about twice fp32's speed and move half the bytes; on
    other CPUs bf16 is emulated and slower than fp32."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None`` means bfloat16 on CUDA and on CPUs with native bf16, float32 on other CPUs."""
    if dtype is None:
        native = device.type == "cuda" or cpu_has_native_bf16()
        return torch.bfloat16 if native else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


class ModelRunner:
    """Everything one step needs on this device, built from the engine's options.

    Reads from ``EngineConfig``: ``model``, ``load_format``, ``seed``, ``device``, ``dtype``
    (the weights); ``page_size``, ``num_pages`` / ``kv_cache_gb`` / ``mem_fraction``,
    ``num_host_pages``, ``host_cache_gb``, ``kv_cache_dtype`` (the pool); ``attention_backend``, ``flashinfer_decode_backend`` (the
    attention); ``enable_cuda_graph``, ``cuda_graph_max_bs`` (decode graphs); ``enable_lora``,
    ``lora_modules``, ``max_loras``, ``max_lora_rank`` (the adapters' pool); ``deterministic``
    (batch-invariant attention and products). Its defaults
    are the config's: the runner declares none of its own.
    """

    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None, *,
                 draft_page_bytes: int = 0) -> None:
        """``draft_page_bytes``: what a draft model's KV adds to each page (its pool holds the
        same page numbers, engine/worker/draft.py); the pool's budget counts both."""
        if config.page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {config.page_size}")
        torch.manual_seed(config.seed)
        self.tp = tp
        self.device = tp.device if tp else torch.device(
            config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype)
        self.graph_max_batch = config.cuda_graph_max_bs if config.enable_cuda_graph else 0
        self._load_model(config)
        self._make_lora_pool(config)
        self._make_pool(config, draft_page_bytes)
        # FlashInfer's plans over the sliding layers' own pages are checked against
        # tests/fake_flashinfer.py only: auto takes torch with them until a GPU run checks them
        backend = ("torch" if self.num_sliding_pages and config.attention_backend == "auto"
                   else config.attention_backend)
        self.attention = make_backend(
            backend, self.pool, num_heads=self.model.plan.num_heads,
            num_kv_heads=self.model.plan.num_kv_heads, head_dim=self.config.head_dim,
            sliding_windows=self.config.sliding_windows, scale=self.config.attention_scale,
            decode_backend=config.flashinfer_decode_backend, graph_max_batch=self.graph_max_batch,
            deterministic=config.deterministic)
        self.attention_backend = self.attention.name
        self.staging = HostStaging(self.device)
        self.transfer_seconds = 0.0  # the last forward's swaps, write-downs and loads
        self._written_down = 0.0  # seconds of write-downs run ahead of the next forward
        self.graphs = self._capture_graphs() if self.graph_max_batch > 0 else None

    def _load_model(self, c: EngineConfig) -> None:
        """The weights (this rank's share under tensor parallel), prepacked, and what the
        step-size heuristics read from them."""
        self.config = ModelConfig.from_dir(c.model)
        self.model = load_model(c.model, device=self.device, dtype=self.dtype,
                                config=self.config, tp=self.tp, load_format=c.load_format,
                                seed=c.seed, quantization=c.quantization,
                                linear_form="blocks" if c.deterministic else c.linear_form,
                                resident_bytes=int(c.resident_weights_gb * 2**30))
        self._flops_per_token = 2 * self.config.num_params
        self.model.prepack()
        if c.deterministic:
            self.model.pin_row_order()
        # Bytes of this rank's weights by format (a decode step reads nearly all of them).
        self.weight_formats = self.model.weight_bytes()
        self.weight_bytes = sum(self.weight_formats.values())
        self._small_model = self.weight_bytes < SMALL_MODEL_BYTES
        self._max_threads = self._threads = torch.get_num_threads()
        blocks = (f" (blocks read by the {quant_ops().quant_linear_isa()} kernels)"
                  if set(self.weight_formats) & set(BITS) else "")
        logger.info("weights: %s%s", ", ".join(f"{name} {size / 2**20:.1f} MiB"
                                               for name, size in self.weight_formats.items()),
                    blocks)

    def _make_lora_pool(self, c: EngineConfig) -> None:
        """``lora``: the LoRA adapters' pool with every ``--lora-modules`` adapter in it (ids
        from 1, in the order given), or None without ``--enable-lora``."""
        self.lora: LoraPool | None = None
        if not c.enable_lora:
            return
        self.lora = LoraPool(self.config, c.max_loras, c.max_lora_rank, self.device, self.dtype,
                             self.model.plan)
        for lora_id, (name, path) in enumerate(parse_lora_modules(c.lora_modules), start=1):
            self.load_lora(lora_id, name, path)

    def load_lora(self, lora_id: int, name: str, path: str) -> LoraAdapterInfo:
        """Read the PEFT adapter at ``path`` (this rank's share of it) into the pool as
        ``lora_id`` (ValueError with a sentence if it does not fit the model or
        --max-lora-rank)."""
        weights = load_adapter(name, path, self.config, self.lora.max_rank, self.model.plan)
        return self.lora.add(lora_id, weights, path)

    def _make_pool(self, c: EngineConfig, draft_page_bytes: int = 0) -> None:
        """The KV pool, sized by ``num_pages``, ``kv_cache_gb`` or ``mem_fraction`` (the
        first given), agreed by every tensor-parallel rank."""
        self.page_size, self.num_host_pages = c.page_size, c.num_host_pages
        mc, plan = self.config, self.model.plan
        self.sliding_layers, self.sliding_window = sliding_layers(mc.sliding_windows,
                                                                  c.sliding_kv_ratio)
        num_sliding = sum(self.sliding_layers)
        page_bytes, sliding_bytes = (
            KVPool.bytes_per_page(num_layers=n, page_size=c.page_size,
                                  num_kv_heads=plan.num_kv_heads, head_dim=mc.head_dim,
                                  dtype=self.kv_dtype)
            for n in (mc.num_layers - num_sliding, num_sliding))
        self.num_pages, how = self._size_pool(
            page_bytes + draft_page_bytes + math.ceil(c.sliding_kv_ratio * sliding_bytes),
            c.num_pages, c.kv_cache_gb, c.mem_fraction)
        # a host page pays for its share of the windows' host pages too (radix/host.py), and
        # for the draft model's KV of its positions (its host pages have the same numbers)
        host_page_bytes = (page_bytes + draft_page_bytes
                           + math.ceil(c.sliding_kv_ratio * sliding_bytes))
        self.num_host_cache_pages = int(c.host_cache_gb * 2**30) // host_page_bytes
        if self.tp is not None:
            self.num_pages = self.tp.agree_min(self.num_pages)
            self.num_host_cache_pages = self.tp.agree_min(self.num_host_cache_pages)
        # from the pages every rank agreed on: each rank's sliding pool has the same pages
        self.num_sliding_pages = self._sliding_pages(c, sliding_bytes)
        # the host tier's pages for its nodes' windows: the device pool's share
        self.num_host_cache_sliding_pages = (int(c.sliding_kv_ratio * self.num_host_cache_pages)
                                             if self.num_sliding_pages else 0)
        if c.host_cache_gb and not self.num_host_cache_pages:
            raise ValueError(f"--host-cache-gb {c.host_cache_gb} holds no page of "
                             f"{host_page_bytes} bytes; give at least "
                             f"{host_page_bytes / 2**30:.6f}")
        self.kv_cache_bytes = (self.num_pages * (page_bytes + draft_page_bytes)
                               + self.num_sliding_pages * sliding_bytes)
        logger.info("KV cache: %s, %d pages of %d tokens = %d tokens (%.2f GiB, %s) on %s, "
                    "%d host pages for swaps, %d for the host cache tier (%.2f GiB)",
                    str(self.kv_dtype).removeprefix("torch."), self.num_pages,
                    c.page_size, self.num_pages * c.page_size, self.kv_cache_bytes / 2**30, how,
                    self.device, c.num_host_pages, self.num_host_cache_pages,
                    self.num_host_cache_pages * host_page_bytes / 2**30)
        # With CUDA graphs, a scratch page past the pages the scheduler sees (and one past the
        # sliding pages, where there are any): the graphs' padding rows write and read it, and
        # nothing else does.
        self.scratch_page = self.num_pages if self.graph_max_batch > 0 else None
        self.swa_scratch_page = (self.num_sliding_pages
                                 if self.scratch_page is not None and self.num_sliding_pages
                                 else None)
        self.pool = KVPool(
            num_layers=mc.num_layers, num_pages=self.num_pages + (self.scratch_page is not None),
            page_size=c.page_size, num_kv_heads=plan.num_kv_heads, head_dim=mc.head_dim,
            dtype=self.dtype, device=self.device,
            num_host_pages=c.num_host_pages + self.num_host_cache_pages, kv_dtype=self.kv_dtype,
            sliding_layers=self.sliding_layers,
            num_sliding_pages=self.num_sliding_pages + (self.swa_scratch_page is not None),
            # swap preemption moves a sequence's sliding pages with its full ones, and the
            # host tier keeps its nodes' windows
            num_host_sliding_pages=(c.num_host_pages + self.num_host_cache_sliding_pages
                                    if self.num_sliding_pages else 0))

    def _sliding_pages(self, c: EngineConfig, sliding_bytes: int) -> int:
        """The sliding layers' own pages under ``--sliding-kv-ratio`` (0: none), enough for
        a prompt chunk and its window at least."""
        if not sliding_bytes:
            return 0
        pages = int(c.sliding_kv_ratio * self.num_pages)
        least = -(-(c.chunked_prefill_size + self.sliding_window) // c.page_size) + 2
        if pages < least:
            raise ValueError(f"--sliding-kv-ratio {c.sliding_kv_ratio} gives the sliding layers "
                             f"{pages} pages, fewer than one prompt chunk and its window need "
                             f"({least}); give a larger ratio or pool, or a smaller "
                             "--chunked-prefill-size")
        logger.info("sliding-window layers: %d pages of their own (window %d)", pages,
                    self.sliding_window)
        return pages

    def _capture_graphs(self) -> DecodeGraphs | None:
        """Decode graphs up to ``graph_max_batch``, or None (with the reason logged) where
        they cannot run; a bucket that fails to capture is skipped alone (cuda_graphs.py)."""
        why_not = self._why_no_graphs()
        if why_not:
            logger.warning("CUDA graphs off: %s; decode runs eagerly", why_not)
            return None
        try:
            with torch.inference_mode():
                graphs = DecodeGraphs(self, self.graph_max_batch)
        except Exception as exc:  # a failure outside any one bucket leaves eager decode
            logger.warning("CUDA graphs off: capture failed (%s: %s); decode runs eagerly",
                           type(exc).__name__, exc)
            return None
        if not graphs.buckets:
            logger.warning("CUDA graphs off: no batch size could be captured; decode runs "
                           "eagerly")
            return None
        return graphs

    def _set_threads(self, batch: BatchInput) -> None:
        """On CPU, a step too small to gain from parallel threads (a small model's, with few
        tokens) runs on one, leaving the other cores to the scheduler, tokenizer and frontend
        processes."""
        if self.device.type != "cpu" or self._max_threads == 1 or not self._small_model:
            return
        small = batch.num_tokens * self._flops_per_token < SMALL_STEP_FLOPS
        threads = 1 if small else self._max_threads
        if threads != self._threads:
            torch.set_num_threads(threads)
            self._threads = threads

    def _why_no_graphs(self) -> str | None:
        if self.device.type != "cuda":
            return f"the model runs on {self.device}"
        if not self.attention.supports_cuda_graph:
            return f"the {self.attention.name} attention backend cannot be captured"
        if self.tp is not None:
            return "not captured under tensor parallel"
        return None

    def _size_pool(self, page_bytes: int, num_pages: int | None, kv_cache_gb: float | None,
                   mem_fraction: float) -> tuple[int, str]:
        if num_pages is not None:
            chosen, how = num_pages, "num_pages"
        elif kv_cache_gb is not None:
            chosen, how = int(kv_cache_gb * 2**30) // page_bytes, f"kv_cache_gb={kv_cache_gb}"
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # mem_fraction bounds weights + KV together; what is left stays for activations.
            budget = free - int(total * (1.0 - mem_fraction))
            chosen = max(budget, 0) // page_bytes
            how = f"mem_fraction={mem_fraction} of device memory"
        else:
            chosen, how = _CPU_DEFAULT_KV_BYTES // page_bytes, "CPU default of 1 GiB"
        if chosen < 1:
            raise ValueError(f"the KV cache gets no pages ({how}, {page_bytes} bytes per page); "
                             "give num_pages, a larger kv_cache_gb or a larger mem_fraction")
        return chosen, how

    def check(self, batch: BatchInput) -> None:
        """Raise ValueError, before anything runs, for a batch this runner cannot run."""
        batch.validate(self.page_size, self.num_pages,
                       self.num_host_pages + self.num_host_cache_pages,
                       num_sliding_pages=self.num_sliding_pages,
                       num_sliding_host_pages=self.pool.host_swa.shape[2])
        if not batch.num_seqs:
            return  # page moves only
        if len(batch.lora_ids):
            if self.lora is None:
                raise ValueError("the step names LoRA adapters but the engine runs without "
                                 "--enable-lora")
            self.lora.check(batch.lora_ids)
        longest = int(batch.seq_lens.max())
        if longest > self.config.max_context_len:
            raise ValueError(f"a sequence reaches {longest} tokens but the model's context is "
                             f"{self.config.max_context_len}")
        if self.tp is not None and len(batch.input_ids) and not (
                0 <= int(batch.input_ids.min()) and int(batch.input_ids.max())
                < self.config.vocab_size):
            # Unsharded, the embedding lookup refuses these; sharded, it would read zeros.
            raise ValueError(f"input ids must be from 0 to {self.config.vocab_size - 1}")

    def write_down(self, batch: BatchInput) -> None:
        """Run ``batch``'s copies to host pages now (``forward`` then finds none): what a
        disk load is about to overwrite must be read first (and so for the sliding pages)."""
        if len(batch.swap_out) or len(batch.swa_swap_out):
            self.check(batch)
            started = time.perf_counter()
            with torch.inference_mode():
                self.pool.swap_out(batch.swap_out)
                self.pool.swap_out(batch.swa_swap_out, sliding=True)
            self._written_down = time.perf_counter() - started
            batch.swap_out, batch.swa_swap_out = batch.swap_out[:0], batch.swa_swap_out[:0]

    @torch.inference_mode()
    def forward(self, batch: BatchInput, *, checked: bool = False) -> torch.Tensor | None:
        """Run the batch's swaps and copies, then the model; float32 logits [rows, vocab] for
        ``batch.logits_rows`` (default: each sequence's last new token); under tensor parallel
        on rank 0 only, None on the others and for a batch of no sequences (page moves only).
        ``checked``: ``check`` has passed already.

        Nothing here waits for the device (swaps aside): the caller reads the logits back once
        per step, as the sampler does, before the next ``forward``. That wait is what lets the
        next step's planning (FlashInfer's ``plan`` rewrites its pinned plan buffer) reuse host
        memory the previous step's copies read. On CUDA with graphs, the logits of a graph step
        are a view of the graph's output, which its next replay overwrites."""
        if not checked:
            self.check(batch)
        self.transfer_seconds, self._written_down = self._written_down, 0.0
        if len(batch.swap_out) or len(batch.swap_in) or len(batch.swa_swap_out) or len(
                batch.swa_swap_in):
            started = time.perf_counter()
            self.pool.swap_out(batch.swap_out)
            self.pool.swap_out(batch.swa_swap_out, sliding=True)
            self.pool.swap_in(batch.swap_in)
            self.pool.swap_in(batch.swa_swap_in, sliding=True)
            self.transfer_seconds += time.perf_counter() - started
        self.pool.copy_pages(batch.copies)
        self.pool.copy_sliding(batch.swa_copies)
        if not batch.num_seqs:
            return None  # a step that only moves pages
        self._set_threads(batch)
        lora = (self.lora.prepare(batch.lora_ids, batch.extend_lens)
                if self.lora is not None else None)
        # graphs are captured without adapters: a step with one runs eagerly
        bucket = (self.graphs.bucket_for(batch)
                  if self.graphs is not None and lora is None else None)
        if bucket is not None:
            return self.graphs.run(batch, bucket)
        input_ids, positions, rows, out_slots, *staged = self.staging.stage(
            [batch.input_ids.astype(np.int64), batch.positions.astype(np.int64),
             batch.resolved_logits_rows(), batch.out_slots.astype(np.int64),
             *self.attention.staged_arrays(batch)])
        self.attention.plan(batch, out_slots.on_device, staged=staged)
        return self.model(input_ids.on_device, positions.on_device, self.attention,
                          rows.on_device, lora)
