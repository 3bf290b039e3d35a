"""The draft model's vocabulary (``--speculative-config``'s ``draft_vocab_size``): the token
ids its drafts are picked from, a subset of the vocabulary, so that its LM head reads only
those rows of the matrix (frequency-ranked draft vocabularies, as FR-Spec: a byte-pair
tokenizer's low ids are its first merges, roughly its most frequent tokens).

    subset   ids [0, size)  +  ``extra``: ids at or above ``size`` that the draft has read in
                               the sequences it drafted for (a prompt's identifiers, the chat
                               template's special tokens), the latest ``MAX_EXTRA`` of them

The target verifies every draft, so greedy output is the target's whatever the subset, and
sampled output keeps the target's distribution: a draft is the argmax over the subset, a point
mass on a token in it (engine/worker/draft.py). A draft whose next token lies outside the
subset proposes another one, which the target rejects; that costs acceptance, not output.

Where the LM head is held in blocks (a GGUF), its first ``size`` rows are read by the block
kernel and the extra rows, widened once to float32, by one small product (the columns
``size ..``); a dense head computes every logit and keeps the subset's columns. The 0.5B
Qwen2.5-Coder's tied 151,936 x 896 Q8_0 head is about a third of what its decode step reads.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.worker.model.quant import QuantizedLinear

# the ids outside [0, size) read most recently that the subset keeps, at most
MAX_EXTRA = 1024


class DraftVocab:
    """The subset of ``model``'s (the draft's LlamaForCausalLM) vocabulary its drafts come
    from: ``size`` first ids and the extra ones ``read`` records. With a head in blocks, the
    model's LM head is replaced by this (its logits: the subset's columns, in the order of
    ``ids``)."""

    def __init__(self, model: torch.nn.Module, size: int) -> None:
        self.size = size
        self.extra = np.zeros(0, np.int64)  # in the order read, oldest first
        self._columns: torch.Tensor | None = None  # ``ids`` as a tensor, once asked for
        self._extra_rows = torch.zeros(0, model.config.hidden_size)
        head = model.quantized.get("lm_head")
        self._head = head.first_rows(size) if isinstance(head, QuantizedLinear) else None
        self._full = head
        if self._head is not None:
            model.quantized["lm_head"] = self

    @property
    def fast(self) -> bool:
        """Whether the model's logits are the subset's columns already (a head in blocks)."""
        return self._head is not None

    def read(self, ids: np.ndarray) -> None:
        """Tokens the draft computed: those at or above ``size`` join the subset (the
        latest ``MAX_EXTRA``)."""
        outside = np.unique(np.asarray(ids, np.int64)[np.asarray(ids) >= self.size])
        new = outside[~np.isin(outside, self.extra)]
        if not len(new):
            return
        self.extra = np.concatenate([self.extra, new])[-MAX_EXTRA:]
        self._columns = None
        if self._head is not None:  # widen the new rows only; the oldest drop out as the ids
            rows = self._full.rows_dense(torch.from_numpy(new), torch.float32)
            self._extra_rows = torch.cat([self._extra_rows, rows])[-MAX_EXTRA:]

    def ids(self, device: torch.device | None = None) -> torch.Tensor:
        """The token id of each of the subset's logits columns (on ``device``)."""
        if self._columns is None or device is not None and self._columns.device != device:
            self._columns = torch.cat([torch.arange(self.size),
                                       torch.from_numpy(self.extra)]).to(device)
        return self._columns

    @property
    def nbytes(self) -> int:
        return self._full.nbytes

    def bytes_by_format(self) -> dict[str, int]:
        """The blocks' bytes: the whole head's (its rows past the subset stay loaded)."""
        return self._full.bytes_by_format()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head over the subset (float32 rows ``x``): the first ``size`` logits from
        the blocks, the extra ones beside them."""
        out = self._head(x)
        if len(self.extra):
            out = torch.cat([out, x @ self._extra_rows.T], dim=1)
        return out

    def columns(self, logits: torch.Tensor) -> torch.Tensor:
        """The subset's columns of the draft's ``logits`` (all of them from a dense head)."""
        if self.fast:
            return logits
        return logits.index_select(1, self.ids(logits.device))
