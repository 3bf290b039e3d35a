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
    # Plain lists, then one array each: a decode entry is a handful of ints, and per-entry
    # numpy calls would cost more than the values (256 decodes: 8 ms -> 1 ms per step).
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    page_indices: list[int] = []
    indptr = [0]
    extend_lens: list[int] = []
    seq_lens: list[int] = []
    logits_rows: list[int] = []
    sampling: list[RowSampling] = []
    for entry in entries:
        seq = entry.seq
        start, end = seq.computed, seq.computed + entry.extend
        table = seq.pages[: -(-end // page_size)]
        if entry.extend == 1:
            input_ids.append(seq.tokens[start])
            positions.append(start)
            slots.append(table[start // page_size] * page_size + start % page_size)
        else:
            pos = np.arange(start, end)
            input_ids.extend(seq.tokens[start:end])
            positions.extend(range(start, end))
            slots.extend((np.asarray(table)[pos // page_size] * page_size
                          + pos % page_size).tolist())
        page_indices.extend(table)
        indptr.append(len(page_indices))
        extend_lens.append(entry.extend)
        seq_lens.append(end)
        if entry.samples:
            logits_rows.extend([len(input_ids) - 1] * entry.samples)
            sampling.extend(sampling_rows(entry))
    return ForwardBatch(
        batch_id=batch_id,
        input_ids=_ints(input_ids),
        positions=_ints(positions),
        extend_lens=_ints(extend_lens),
        seq_lens=_ints(seq_lens),
        page_indptr=_ints(indptr),
        page_indices=_ints(page_indices),
        out_slots=_ints(slots),
        logits_rows=_ints(logits_rows),
        sampling=sampling,
        copies=_pack(work.copies),
        swap_out=_pack(work.swap_out),
        swap_in=_pack(work.swap_in),
    )


def _ints(values: list[int]) -> bytes:
    return np.array(values, dtype=np.int32).tobytes()
