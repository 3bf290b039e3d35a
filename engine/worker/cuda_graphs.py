"""Decode steps as CUDA graphs, one per batch-size bucket.

At small batches a decode step is bound by kernel launches (hundreds per step), not by the GPU.
``DecodeGraphs`` captures the model's forward once per bucket of batch sizes at start-up, over
fixed device buffers; a decode step of B sequences then copies its inputs into those buffers,
plans the bucket's CUDA-graph-safe FlashInfer wrappers on the real page tables and replays the
graph, one launch for the whole step.

Padding: a step of B < bucket sequences is filled to the bucket with padding sequences of one
token each. They read and write only the pool's scratch page (a page past the ``num_pages``
the scheduler sees, so it never holds anyone's KV), and their logits rows are dropped. With
sliding pages of their own (``--sliding-kv-ratio``) the padding rows' sliding page is the
sliding pool's scratch page (past its ``num_sliding_pages``), and the sliding layers' slots
sit in a fixed buffer of their own beside ``out_slots``.

Which steps run as graphs: decode steps (every sequence adds one token) of at most the largest
bucket, sampling each sequence once in order, whose page lists fit the page-index buffer. Anything
else (prefill, mixed steps, larger batches) runs eagerly as before.

``capture=False`` runs the same padded, fixed-buffer forward without capturing a graph: that is
how the padding and buffer logic is tested on CPU (capture itself needs CUDA).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from engine.contracts.step import BatchInput

logger = logging.getLogger("radixserve.cuda_graphs")


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to 256 (every 64 beyond), capped at ``max_batch``, which is
    always a bucket."""
    sizes = [1, 2, 4, 8, *range(16, 257, 16), *range(320, max_batch + 1, 64)]
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


def pad_decode(batch: BatchInput, bucket: int, scratch_page: int, page_size: int,
               swa_scratch_page: int | None = None) -> BatchInput:
    """``batch`` (a decode step) with ``bucket - num_seqs`` padding sequences appended: one
    token at position 0 in the scratch page (and in the sliding pool's, ``swa_scratch_page``,
    where the sliding layers have pages of their own)."""
    pad = bucket - batch.num_seqs
    if pad == 0:
        return batch
    ones = np.ones(pad, dtype=np.int32)
    last = int(batch.page_indptr[-1])
    scratch_slot = scratch_page * page_size
    sliding = {}
    if swa_scratch_page is not None:
        sliding = dict(
            swa_page_indices=np.concatenate([batch.swa_page_indices, swa_scratch_page * ones]),
            swa_out_slots=np.concatenate([batch.swa_out_slots,
                                          swa_scratch_page * page_size * ones]))
    return BatchInput(
        **sliding,
        input_ids=np.concatenate([batch.input_ids, 0 * ones]),
        positions=np.concatenate([batch.positions, 0 * ones]),
        extend_lens=np.concatenate([batch.extend_lens, ones]),
        seq_lens=np.concatenate([batch.seq_lens, ones]),
        page_indptr=np.concatenate([batch.page_indptr,
                                    last + np.arange(1, pad + 1, dtype=np.int32)]),
        page_indices=np.concatenate([batch.page_indices, scratch_page * ones]),
        out_slots=np.concatenate([batch.out_slots, scratch_slot * ones]),
    )


class DecodeGraphs:
    """The captured buckets (``buckets``, ascending; a bucket whose capture failed is left out,
    with a log line naming it) and their graphs over fixed buffers. The graphs' memory pool
    and outputs live as long as this object; a replay overwrites its bucket's output."""

    def __init__(self, runner, max_batch: int, *, capture: bool = True) -> None:
        self.runner = runner
        self.buckets = bucket_sizes(max_batch)
        self.max_batch = self.buckets[-1]
        self.capture = capture
        device = runner.device
        self.input_ids = torch.zeros(self.max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_batch, dtype=torch.int64, device=device)
        self.out_slots = torch.zeros(self.max_batch, dtype=torch.int64, device=device)
        self.swa_scratch_page = runner.swa_scratch_page
        self.swa_out_slots = (None if self.swa_scratch_page is None else
                              torch.zeros(self.max_batch, dtype=torch.int64, device=device))
        self.rows = torch.arange(self.max_batch, dtype=torch.int64, device=device)
        runner.attention.prepare_graphs(self.max_batch)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._memory: tuple[object, torch.cuda.Stream] | None = None  # graph pool, stream
        if capture:
            self._capture_all()

    def bucket_for(self, batch: BatchInput) -> int | None:
        """The bucket this step runs in as a graph, or None to run it eagerly."""
        if (not self.buckets or batch.num_seqs > self.buckets[-1] or not batch.is_decode
                or not np.array_equal(batch.resolved_logits_rows(), np.arange(batch.num_seqs))
                or not self.runner.attention.graph_fits(batch)):
            return None
        return next(b for b in self.buckets if b >= batch.num_seqs)

    @torch.inference_mode()
    def run(self, batch: BatchInput, bucket: int, *, eager: bool = False) -> torch.Tensor:
        """Float32 logits [num_seqs, vocab] of a step ``bucket_for`` accepted. ``eager``: the
        same padded step over the same buffers and plan, run op by op instead of replayed (what
        the graph must reproduce bit for bit: scripts/check_cuda_graphs.py)."""
        runner = self.runner
        padded = pad_decode(batch, bucket, runner.scratch_page, runner.page_size,
                            self.swa_scratch_page)
        sliding = self.swa_out_slots is not None
        ids, positions, slots, *staged = runner.staging.stage(
            [padded.input_ids.astype(np.int64), padded.positions.astype(np.int64),
             padded.out_slots.astype(np.int64),
             *([padded.swa_out_slots.astype(np.int64)] if sliding else []),
             *runner.attention.staged_arrays(padded)])
        self.input_ids[:bucket].copy_(ids.on_device)
        self.positions[:bucket].copy_(positions.on_device)
        self.out_slots[:bucket].copy_(slots.on_device)
        if sliding:
            self.swa_out_slots[:bucket].copy_(staged.pop(0).on_device)
        runner.attention.plan(padded, self.out_slots[:bucket], staged=staged, graph=True,
                              swa_out_slots=self._swa_slots(bucket))
        if self.capture and not eager:
            graph, logits = self._graphs[bucket]
            graph.replay()
        else:
            logits = self._forward(bucket)
        return logits[: batch.num_seqs]

    def _swa_slots(self, bucket: int) -> torch.Tensor | None:
        return None if self.swa_out_slots is None else self.swa_out_slots[:bucket]

    def _forward(self, bucket: int) -> torch.Tensor:
        return self.runner.model(self.input_ids[:bucket], self.positions[:bucket],
                                 self.runner.attention, self.rows[:bucket])

    def _capture_all(self) -> None:
        """Capture every bucket, largest first (the smaller ones reuse its memory pool). A
        bucket that fails (out of memory, a kernel that cannot be captured) is left out alone:
        its steps run in the next larger bucket, or eagerly."""
        start = time.perf_counter()
        for bucket in reversed(self.buckets):
            try:
                self._graphs[bucket] = self._capture(bucket)
            except Exception as exc:  # any failure leaves this bucket out, alone
                logger.warning("CUDA graph for batch size %d not captured (%s: %s); its steps "
                               "run in the next larger bucket, or eagerly", bucket,
                               type(exc).__name__, exc)
        self.buckets = [b for b in self.buckets if b in self._graphs]
        logger.info("captured decode CUDA graphs for %d batch sizes (%s) in %.1f s",
                    len(self.buckets), ", ".join(map(str, self.buckets)) or "none",
                    time.perf_counter() - start)

    def _capture(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """One bucket's graph and its output, after two eager runs on the capture stream
        (kernel selection, lazy allocations)."""
        runner = self.runner
        if self._memory is None:
            self._memory = (torch.cuda.graph_pool_handle(), torch.cuda.Stream(runner.device))
        pool, stream = self._memory
        none = np.zeros(0, dtype=np.int32)
        empty = BatchInput(input_ids=none, positions=none, extend_lens=none, seq_lens=none,
                           page_indptr=np.zeros(1, dtype=np.int32), page_indices=none,
                           out_slots=none)
        padded = pad_decode(empty, bucket, runner.scratch_page, runner.page_size,
                            self.swa_scratch_page)
        self.out_slots[:bucket].fill_(runner.scratch_page * runner.page_size)
        if self.swa_out_slots is not None:
            self.swa_out_slots[:bucket].fill_(self.swa_scratch_page * runner.page_size)
        self.input_ids.zero_()
        self.positions.zero_()
        runner.attention.plan(padded, self.out_slots[:bucket], graph=True,
                              swa_out_slots=self._swa_slots(bucket))
        stream.wait_stream(torch.cuda.current_stream(runner.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(bucket)
        torch.cuda.current_stream(runner.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            logits = self._forward(bucket)
        torch.cuda.synchronize(runner.device)
        return graph, logits
