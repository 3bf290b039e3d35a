"""Turn a planned step into a ForwardBatch message (packed int32 arrays, see engine/batch.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from engine.protocol import ForwardBatch, RowSampling
from scheduler.kv import StepWork

if TYPE_CHECKING:
    from scheduler.scheduler import Entry


def _pack(rows: list[tuple[int, ...]]) -> bytes:
    return np.asarray(rows, dtype=np.int32).tobytes() if rows else b""


def build_batch(batch_id: int, entries: list[Entry], work: StepWork, page_size: int,
                sampling_rows: Callable[[Entry], list[RowSampling]]) -> ForwardBatch:
    input_ids, positions, slots, tables = [], [], [], []
    extend_lens = np.empty(len(entries), dtype=np.int32)
    seq_lens = np.empty(len(entries), dtype=np.int32)
    logits_rows: list[int] = []
    sampling: list[RowSampling] = []
    offset = 0
    for i, entry in enumerate(entries):
        seq = entry.seq
        start, end = seq.computed, seq.computed + entry.extend
        pos = np.arange(start, end, dtype=np.int32)
        table = np.asarray(seq.pages[: -(-end // page_size)], dtype=np.int32)
        input_ids.append(np.asarray(seq.tokens[start:end], dtype=np.int32))
        positions.append(pos)
        slots.append(table[pos // page_size] * page_size + pos % page_size)
        tables.append(table)
        extend_lens[i], seq_lens[i] = entry.extend, end
        offset += entry.extend
        if entry.samples:
            logits_rows.extend([offset - 1] * entry.samples)
            sampling.extend(sampling_rows(entry))
    indptr = np.zeros(len(entries) + 1, dtype=np.int32)
    np.cumsum([len(t) for t in tables], out=indptr[1:])
    return ForwardBatch(
        batch_id=batch_id,
        input_ids=np.concatenate(input_ids).tobytes(),
        positions=np.concatenate(positions).tobytes(),
        extend_lens=extend_lens.tobytes(),
        seq_lens=seq_lens.tobytes(),
        page_indptr=indptr.tobytes(),
        page_indices=np.concatenate(tables).tobytes(),
        out_slots=np.concatenate(slots).astype(np.int32).tobytes(),
        logits_rows=np.asarray(logits_rows, dtype=np.int32).tobytes(),
        sampling=sampling,
        copies=_pack(work.copies),
        swap_out=_pack(work.swap_out),
        swap_in=_pack(work.swap_in),
    )
