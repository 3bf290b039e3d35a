"""Verify rows a step need not compute: a sequence's last drafts that the draft model never
made (it stopped early, engine/worker/draft.py) or that its grammar does not keep
(engine/worker/grammar_drafts.py). ``without_drafts`` drops them from the model's step before
the forward (their tokens, pages and logits rows); ``widened`` puts the sampler's output back
at the step's rows, the dropped ones holding zeros. Their samples are never read (a
verification accepts at most the drafts it verified), nor their KV (past the kept tokens)."""

from __future__ import annotations

from dataclasses import fields, replace

import msgspec
import numpy as np

from engine.contracts.step import BatchInput


def without_drafts(step: BatchInput, unused: np.ndarray,
                   page_size: int) -> tuple[BatchInput, np.ndarray]:
    """``step`` without each sequence's last ``unused`` new tokens and their logits rows, and
    which of its logits rows the new step keeps."""
    ends = np.cumsum(step.extend_lens)
    tokens = np.ones(step.num_tokens, bool)
    for i in np.flatnonzero(unused).tolist():
        tokens[ends[i] - unused[i] : ends[i]] = False
    rows = step.resolved_logits_rows()
    keep = np.flatnonzero(tokens[rows])
    seq_lens = step.seq_lens - unused
    needed = -(-seq_lens // page_size)
    pages = np.concatenate([np.arange(a, a + n) for a, n in
                            zip(step.page_indptr[:-1].tolist(), needed.tolist(), strict=True)])
    per_token = ("input_ids", "positions", "out_slots") + (
        ("swa_out_slots",) if len(step.swa_out_slots) else ())
    draft_lens = (np.maximum(step.draft_lens - unused, 0) if len(step.draft_lens)
                  else step.draft_lens)
    return msgspec.structs.replace(
        step, **{name: np.asarray(getattr(step, name))[tokens] for name in per_token},
        extend_lens=(step.extend_lens - unused).astype(np.int32),
        seq_lens=seq_lens.astype(np.int32),
        page_indptr=np.concatenate([[0], np.cumsum(needed)]).astype(np.int32),
        page_indices=step.page_indices[pages],
        swa_page_indices=(step.swa_page_indices[pages] if len(step.swa_page_indices)
                          else step.swa_page_indices),
        logits_rows=((np.cumsum(tokens) - 1)[rows[keep]]).astype(np.int32),
        draft_lens=draft_lens.astype(np.int32)), keep


def widened(out, keep: np.ndarray | None, num_rows: int):
    """The sampler's ``out`` of a step ``without_drafts`` made (its ``keep``) at the full
    step's ``num_rows`` logits rows: the rows it dropped hold zeros."""
    if keep is None:
        return out
    wide = {}
    for f in fields(out):
        value = getattr(out, f.name)
        if isinstance(value, np.ndarray):
            full = np.zeros((num_rows, *value.shape[1:]), value.dtype)
            full[keep] = value
            value = full
        wide[f.name] = value
    return replace(out, **wide)


def kept_rows(rows: list[int], allowed, keep: np.ndarray | None, num_rows: int):
    """The constrained ``rows`` (of the full step) and their ``allowed`` masks, as the step
    that keeps logits rows ``keep`` numbers them (the dropped ones left out)."""
    if keep is None:
        return rows, allowed
    position = np.full(num_rows, -1, np.int64)
    position[keep] = np.arange(len(keep))
    at = position[np.asarray(rows, np.int64)]
    picked = np.flatnonzero(at >= 0)
    return at[picked].tolist(), allowed[picked]
