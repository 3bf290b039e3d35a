"""The draft model of ``--speculative-config '{"model": ...}'``: a smaller model of the target's
tokenizer, run in the model worker beside the target, proposing the drafts that the target's
verify step checks (scheduler/speculation.py).

Its KV lives in a pool of its own that holds the SAME page numbers as the target's::

    page 17   target pool: K and V of positions 34..35, the target's layers
              draft pool:  K and V of positions 34..35, the draft's layers

so the scheduler's pages, the radix tree, eviction, salts, LoRA namespaces and rollbacks act on
both at once, a prefix the target has cached is cached for the draft, and the pool's budget
counts both per page (``ModelRunner``'s ``draft_page_bytes``). The invariant: wherever a
sequence's target KV is computed, its draft KV is too. Before the target's forward, the draft
runs the same step (``_mirror``: the page moves, prefill chunks, decodes, verifies of the
cache's drafts), except for the sequences it drafts for (``BatchInput.draft_lens``)::

    the step's tokens   t  _  _  _         t: the last sampled token; _: placeholders
    draft forwards      t->d0 d0->d1 d1->d2  (the first inside the mirror, then one decode each)
    target's verify     t  d0 d1 d2        placeholders filled; the unused ones padding

Drafts are the draft's argmax (a point mass: the verify step's rule then keeps the target's
distribution, scheduler/speculation.py). A sequence's drafts end once the draft's probability
of its next token falls under ``draft_min_token_prob`` (the first is always proposed: its
forward runs anyway). After the sampler (``settle``), a sequence that accepted every draft,
the last of which the draft never ran (its KV missing), leaves that draft ``behind``: the next
step's draft forward runs it first, so the invariant holds before any forward reads the KV.
The scheduler reads the drafts from the result (``BatchResult.draft_ids``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import torch

from engine.contracts.engine_config import EngineConfig
from engine.contracts.protocol import pack_ids
from engine.contracts.step import BatchInput, StepBuilder
from engine.contracts.worker_messages import BatchResult
from engine.worker.kv_pool import KVPool
from engine.worker.kv_quant import resolve_kv_dtype
from engine.worker.model.config import ModelConfig

logger = logging.getLogger("radixserve.worker")


def draft_checkpoint(c: EngineConfig) -> str | None:
    """The draft model's checkpoint directory (a .gguf converted once), or None without one;
    ValueError with a sentence for a draft whose tokenizer is not the target's."""
    spec = c.speculative()
    if spec is None or spec.model is None:
        return None
    from engine.checkpoints.model_source import resolve_model

    path = resolve_model(spec.model).path
    check_same_vocabulary(c.model, path)
    return path


def draft_page_bytes(c: EngineConfig, draft_dir: str | None) -> int:
    """What the draft's KV adds to each page of the pool (0 without a draft)."""
    if draft_dir is None:
        return 0
    from engine.worker.runner import resolve_dtype

    mc = ModelConfig.from_dir(draft_dir)
    device = torch.device(c.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    kv_dtype = resolve_kv_dtype(c.kv_cache_dtype, resolve_dtype(c.dtype, device))
    return KVPool.bytes_per_page(num_layers=mc.num_layers, page_size=c.page_size,
                                 num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                                 dtype=kv_dtype)


def _vocabulary(model_dir: str) -> dict[str, int] | None:
    """The token -> id map of ``model_dir``'s tokenizer.json (added tokens included), or None
    when it has none."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    vocab = dict(raw.get("model", {}).get("vocab") or {})
    vocab.update({t["content"]: t["id"] for t in raw.get("added_tokens", [])})
    return vocab


def check_same_vocabulary(target_dir: str, draft_dir: str) -> None:
    """ValueError with a sentence unless both models read one vocabulary: the same tokenizer
    (token -> id) and the same number of embedding rows."""
    target, draft = ModelConfig.from_dir(target_dir), ModelConfig.from_dir(draft_dir)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model has {draft.vocab_size} token ids but the model has "
                         f"{target.vocab_size}: a draft must share the model's tokenizer")
    ours, theirs = _vocabulary(target_dir), _vocabulary(draft_dir)
    if ours != theirs:
        differ = "one has no tokenizer.json" if ours is None or theirs is None else (
            f"{len(set(ours.items()) ^ set(theirs.items()))} tokens differ")
        raise ValueError(f"the draft model's tokenizer is not the model's ({differ}): a "
                         "draft must share the model's tokenizer")


# Tokens a sequence's draft KV may lag its target KV by (decodes and verifies of the cache's
# drafts, run later as part of one draft forward) before its step's draft forward runs them.
MAX_BEHIND = 32


@dataclass
class _Drafting:
    """One step's sequences the draft drafts for (in batch order: where each sits in the step
    and what the draft proposed) and those whose draft forward waits (``deferred``: index,
    first logits row, the tokens already behind)."""

    seqs: list[int] = field(default_factory=list)  # their index in the step
    first_rows: list[int] = field(default_factory=list)  # their first logits row
    drafts: list[list[int]] = field(default_factory=list)
    forwards: list[int] = field(default_factory=list)  # draft forwards each ran (t included)
    deferred: list[tuple[int, int, list[int]]] = field(default_factory=list)


@dataclass
class _Behind:
    """A sequence's tokens whose target KV is kept and whose draft KV is not computed yet:
    from ``position`` on, with the sequence's pages as its last step listed them."""

    tokens: list[int]
    position: int
    pages: np.ndarray

    @property
    def end(self) -> int:
        return self.position + len(self.tokens)


class DraftModel:
    """The draft's runner (weights and a pool of the target's page numbers) and its drafting.

    Between steps it holds, by the slot of the last one, each sequence's tokens whose draft KV
    is not computed (``behind``): a decode's or a cache-draft verify's kept tokens (the draft
    forward of a step the draft does not draft in would cost it more than they are worth, up
    to ``MAX_BEHIND`` tokens) and an accepted last draft the draft never ran. The sequence's
    next draft forward runs them first, as more tokens of its row; before a step with page
    moves, and for sequences not in a step, they run on their own first (``flush``: their
    pages are unchanged until the step's moves and writes), so no forward of the draft reads
    KV that it has not computed."""

    def __init__(self, c: EngineConfig, draft_dir: str, num_pages: int) -> None:
        from engine.worker.runner import ModelRunner

        spec = c.speculative()
        self.min_prob = spec.draft_min_token_prob
        config = msgspec.structs.replace(
            c, model=draft_dir, num_pages=num_pages, kv_cache_gb=None, host_cache_gb=0.0,
            enable_lora=False, lora_modules=[], enable_cuda_graph=False,
            speculative_config=None)
        self.runner = ModelRunner(config)
        self.page_size = c.page_size
        self._step: _Drafting | None = None
        self.behind: dict[int, _Behind] = {}

    def propose(self, step: BatchInput) -> None:
        """Run the draft over ``step`` (page moves included), but for the decodes and
        verifies it defers, and fill its placeholders with the drafts of the sequences its
        ``draft_lens`` names."""
        drafting = self._step = _Drafting()
        moves = bool(len(step.copies) or len(step.swap_out) or len(step.swap_in))
        if moves or not step.num_seqs:
            self.flush()
        behind, self.behind = self.behind, {}
        starts = np.cumsum(step.extend_lens) - step.extend_lens
        rows = step.resolved_logits_rows()
        draft_lens = step.draft_lens if len(step.draft_lens) else np.zeros(step.num_seqs, int)
        builder = StepBuilder(self.page_size)
        for i in range(step.num_seqs):
            k = int(draft_lens[i])
            pages, cached, ids = self._seq(step, starts, i)
            ids = ids[: len(ids) - k]
            key = self._slot(pages, cached - 1) if cached else -1
            late = behind.pop(key, None)
            if late is not None and late.end != cached:
                behind[key], late = late, None  # another sequence's (not in this step)
            lagging = late.tokens if late is not None else []
            first = int(np.searchsorted(rows, starts[i]))
            private = np.array_equal(rows[first : first + len(ids)],
                                     np.arange(starts[i], starts[i] + len(ids)))
            if not k and not moves and private and len(lagging) + len(ids) <= MAX_BEHIND:
                drafting.deferred.append((i, first, lagging))  # a decode or a verify
                continue
            builder.add(pages, cached - len(lagging), lagging + ids, samples=int(k > 0))
            if k:
                drafting.seqs.append(i)
                drafting.first_rows.append(first)
        self.behind = behind  # their sequences are not in this step: before its moves
        self.flush()
        if len(drafting.deferred) == step.num_seqs and not moves:
            return  # every sequence deferred, no page moves: nothing runs
        logits = self.runner.forward(builder.finish(step.copies, step.swap_out, step.swap_in))
        if drafting.seqs:
            self._draft(step, starts, draft_lens, drafting, logits)

    def _draft(self, step: BatchInput, starts: np.ndarray, draft_lens: np.ndarray,
               drafting: _Drafting, logits: torch.Tensor) -> None:
        """The drafts from the mirror's logits on, one decode step of the draft at a time,
        into the step's placeholders."""
        tokens, sure = self._pick(logits)
        drafting.drafts = [[t] for t in tokens]  # the first draft: always proposed
        drafting.forwards = [1] * len(tokens)
        active = [n for n, ok in enumerate(sure) if ok and draft_lens[drafting.seqs[n]] > 1]
        while active:
            builder = StepBuilder(self.page_size)
            for n in active:
                pages, cached, _ = self._seq(step, starts, drafting.seqs[n])
                made = drafting.drafts[n]
                builder.add(pages, cached + len(made), made[-1:])
                drafting.forwards[n] += 1
            tokens, sure = self._pick(self.runner.forward(builder.finish()))
            still = []
            for n, token, ok in zip(active, tokens, sure, strict=True):
                if not ok:
                    continue  # unsure: this draft and any after it are not proposed
                drafting.drafts[n].append(token)
                if len(drafting.drafts[n]) < draft_lens[drafting.seqs[n]]:
                    still.append(n)
            active = still
        step.input_ids = step.input_ids.copy()  # a received step's arrays are read-only
        for n, i in enumerate(drafting.seqs):
            made, k = drafting.drafts[n], int(draft_lens[i])
            first = int(starts[i] + step.extend_lens[i]) - k
            step.input_ids[first : first + k] = made + made[-1:] * (k - len(made))

    def flush(self) -> None:
        """Run every sequence's tokens ``behind``, on their own."""
        if self.behind:
            builder = StepBuilder(self.page_size)
            for late in self.behind.values():
                builder.add(late.pages, late.position, late.tokens, samples=0)
            self.behind = {}
            self.runner.forward(builder.finish())

    def settle(self, step: BatchInput, sampled: np.ndarray, result: BatchResult) -> None:
        """After the sampler: the drafts into ``result``; what the target kept of the deferred
        decodes and verifies, and an accepted last draft the draft never ran, ``behind``."""
        drafting, self._step = self._step, None
        if drafting is None:
            return
        starts = np.cumsum(step.extend_lens) - step.extend_lens
        for i, first, lagging in drafting.deferred:
            pages, cached, ids = self._seq(step, starts, i)
            agree = sampled[first : first + len(ids) - 1] == np.asarray(ids[1:])
            kept = 1 + (int(agree.argmin()) if not agree.all() else len(agree))
            self._leave(pages, cached - len(lagging), lagging + ids[:kept])
        for n, i in enumerate(drafting.seqs):
            made, first = drafting.drafts[n], drafting.first_rows[n]
            if drafting.forwards[n] > len(made) or not np.array_equal(
                    sampled[first : first + len(made)], made):
                continue  # a draft rejected, or the draft ran past its last one
            pages, cached, _ = self._seq(step, starts, i)
            self._leave(pages, cached + len(made), made[-1:])
        if drafting.seqs:
            result.draft_counts = np.array([len(d) for d in drafting.drafts],
                                           np.int32).tobytes()
            result.draft_ids = pack_ids([t for d in drafting.drafts for t in d])

    def _leave(self, pages: np.ndarray, position: int, tokens: list[int]) -> None:
        self.behind[self._slot(pages, position + len(tokens) - 1)] = _Behind(
            tokens, position, pages.copy())

    def _slot(self, pages: np.ndarray, position: int) -> int:
        return int(pages[position // self.page_size]) * self.page_size + position % self.page_size

    @staticmethod
    def _seq(step: BatchInput, starts: np.ndarray, i: int):
        """Sequence ``i`` of ``step``: its pages, its cached length and its new ids."""
        pages = step.page_indices[step.page_indptr[i] : step.page_indptr[i + 1]]
        extend = int(step.extend_lens[i])
        ids = step.input_ids[starts[i] : starts[i] + extend].tolist()
        return pages, int(step.seq_lens[i]) - extend, ids

    def _pick(self, logits: torch.Tensor) -> tuple[list[int], list[bool]]:
        """Each row's argmax and whether the draft's probability of it reaches
        ``min_prob`` (one copy to the host)."""
        best, token = torch.softmax(logits.float(), dim=-1).max(dim=-1)
        host = torch.stack([token.double(), best.double()]).cpu().numpy()
        return host[0].astype(np.int64).tolist(), (host[1] >= self.min_prob).tolist()
