"""Turn a planned step into a ForwardBatch message: the step's arrays through
``engine.contracts.step.StepBuilder`` (the one builder), plus each sampled row's parameters."""

from __future__ import annotations

import msgspec
import numpy as np

from engine.contracts.protocol import pack_ids
from engine.contracts.sampling_params import SEED_LIMIT
from engine.contracts.step import StepBuilder
from engine.contracts.worker_messages import ForwardBatch, RowSampling
from radix.sliding import SlidingKV
from scheduler.kv import StepWork
from scheduler.planner import Entry


def build_batch(batch_id: int, entries: list[Entry], work: StepWork, page_size: int,
                released_grammars: list[str] | None = None,
                sliding: SlidingKV | None = None) -> ForwardBatch:
    """The step's message; with ``sliding``, its sliding-window layers' pages beside the full
    layers' (read from the pages' state now: what the step reads is held until it ran)."""
    builder = StepBuilder(page_size)
    sampling: list[RowSampling] = []
    prompt_rows: list[int] = []
    prompt_targets: list[int] = []
    top_n, offset = 0, 0
    for entry in entries:
        seq = entry.seq
        start = seq.computed
        new_ids = seq.tokens[start : start + entry.extend - len(entry.drafts)] + entry.drafts
        builder.add(seq.pages, start, new_ids, entry.samples, num_drafts=len(entry.drafts),
                    lora_id=seq.req.lora_id, model_drafts=entry.model_drafts)
        if entry.samples:
            sampling.extend(sampling_rows(entry))
        req = seq.req
        if req.wants_prompt_logprobs and seq.index == 0 and not req.forked:
            # position p's logits give prompt token p + 1's logprob
            positions = range(max(start, req.prompt_logits_done),
                              min(start + entry.extend, req.prompt_len - 1))
            entry.prompt_rows = len(positions)
            prompt_rows.extend(offset + p - start for p in positions)
            prompt_targets.extend(seq.tokens[p + 1] for p in positions)
            top_n = max(top_n, req.params.prompt_logprobs)
        offset += entry.extend
    step = builder.finish(work.copies, work.swap_out, work.swap_in)
    if sliding is not None and step.num_seqs:
        step.swa_page_indices, step.swa_out_slots, step.swa_copies = sliding.step_tables(
            step.page_indices, step.out_slots, step.copies)
    if work.swa_swap_out or work.swa_swap_in:
        step.swa_swap_out = np.array(work.swa_swap_out, dtype=np.int32).reshape(-1, 2)
        step.swa_swap_in = np.array(work.swa_swap_in, dtype=np.int32).reshape(-1, 2)
    return ForwardBatch(batch_id=batch_id, step=step, sampling=sampling,
                        released_grammars=released_grammars or [],
                        prompt_rows=pack_ids(prompt_rows), prompt_targets=pack_ids(prompt_targets),
                        prompt_top_n=top_n if prompt_rows else 0)


def sampling_rows(entry: Entry) -> list[RowSampling]:
    """The sampling parameters of ``entry``'s logits rows. A verify's rows are one sample's
    next outputs (scheduler/speculation.py): each drawn as that output would be without
    drafts, with the sample's seed and its own step index."""
    seq, req = entry.seq, entry.seq.req
    params = req.params
    if req.is_beam:
        params = msgspec.structs.replace(params, logprobs=2 * params.beam_width,
                                         temperature=0.0)
    history = pack_ids(seq.tokens) if req.has_penalties else b""
    rows = []
    verify = bool(entry.drafts)
    for i in range(entry.samples):
        sample, step = (0, i) if verify else (i, 0)
        row_params = params
        if params.seed is not None and (seq.index or sample):
            # Parallel samples of a seeded request need distinct, reproducible seeds; they
            # wrap to stay uint64, what the wire (and the sampler's mixing) carries.
            seed = (params.seed + seq.index + sample) % SEED_LIMIT
            row_params = msgspec.structs.replace(params, seed=seed)
        key = f"{req.rid}#{seq.index + sample}" if params.structured_outputs is not None else ""
        rows.append(RowSampling(row_params, seq.num_outputs + step, req.prompt_len, history, key))
    return rows
