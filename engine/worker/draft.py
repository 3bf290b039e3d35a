"""The draft model of ``--speculative-config '{"model": ...}'``: a smaller model of the target's
tokenizer, run in the model worker beside the target, proposing the drafts that the target's
verify step checks (scheduler/speculation.py).

Its KV lives in a pool of its own that holds the SAME page numbers as the target's::

    page 17   target pool: K and V of positions 34..35, the target's layers
              draft pool:  K and V of positions 34..35, the draft's layers (where computed)

so the scheduler's pages, the radix tree, eviction, salts, LoRA namespaces and rollbacks act on
both at once, and the pool's budget counts both per page (``ModelRunner``'s
``draft_page_bytes``). The draft computes KV only for the sequences it drafts for: a step's
other sequences (prefill chunks, decodes, verifies of the cache's drafts, every sequence while
drafting does not pay) cost it nothing. ``DraftSlots`` records, per slot, the token the
target's KV there is of and whether the draft's KV there is of it too; a drafting sequence's
first draft forward starts at its first slot without the draft's KV (the tokens read back
from the record: a prompt, the steps it sat out, an accepted last draft the draft never ran,
a prefix the tree matched that the draft never computed), so no draft forward reads KV it
has not computed, and a prefix the draft did compute is cached for it as for the target::

    the step's tokens   t  _  _  _         t: the last sampled token; _: placeholders
    draft forwards      [missing..]t->d0  d0->d1  d1->d2   (the first catches up, then decodes)
    target's verify     t  d0 d1 d2        placeholders filled; those of drafts not made
                                           dropped from the step (``unused``)

Drafts are the draft's argmax over its vocabulary (its first ``draft_vocab_size`` ids and the
ids of the text it read, engine/worker/draft_vocab.py): a point mass, so the verify step's
rule keeps the target's distribution (scheduler/speculation.py). A sequence's drafts end
once the draft's probability of its next token falls under ``draft_min_token_prob`` (the
first is always proposed: its forward runs anyway). The scheduler reads the drafts from the
result (``BatchResult.draft_ids``).
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
from engine.contracts.speculative import DEFAULT_DRAFT_VOCAB_SIZE
from engine.contracts.step import BatchInput, StepBuilder
from engine.contracts.worker_messages import BatchResult
from engine.worker.draft_vocab import DraftVocab
from engine.worker.grammar_drafts import Guide
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
    draft_vocab_size(spec.draft_vocab_size, ModelConfig.from_dir(path).vocab_size)
    return path


def draft_vocab_size(given: int | None, vocab: int) -> int:
    """The ids the draft's drafts come from (``draft_vocab_size``; engine/worker/draft_vocab.py):
    ``given``, or DEFAULT_DRAFT_VOCAB_SIZE where not given; 0 where that is the whole
    vocabulary of ``vocab`` ids. ValueError with a sentence for more ids than it has."""
    if given is not None and given > vocab:
        raise ValueError(f"--speculative-config: draft_vocab_size {given} exceeds the draft "
                         f"model's vocabulary of {vocab} token ids (0 drafts from all of them)")
    size = DEFAULT_DRAFT_VOCAB_SIZE if given is None else given
    return 0 if size >= vocab else size


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


# The most tokens of one sequence that one forward of the draft computes when it catches up
# (the KV of a prompt, or of the steps it sat out): a longer run takes several forwards.
CATCH_UP_CHUNK = 512


class DraftSlots:
    """Per slot of the pool's pages: the token whose KV the model's pool holds there and
    whether the draft's pool holds that token's KV too (``ok``). Every step writes the model's
    slots; the draft's only for the sequences it drafts for. Page moves carry the record with
    the KV (a page swapped out or written down to the host tier keeps its record in
    ``host_tokens`` / ``host_ok``; the tiers' loads beside the steps and disk blocks carry it
    too: engine/worker/draft_tiers.py), so a prefix the radix tree matches tells the draft
    which of its slots it still has to compute, and from which tokens.

    A page's host copy may be older than the draft's KV of it (a write-through policy copies a
    prompt down when it is cached, before the sequence drafts): ``host_of`` names, per device
    page, the host page holding a copy of the model's KV there (written down or loaded from),
    until the model writes the page again or the host page is written over (each write-down
    counts one more ``host_writes`` of its host page); the draft's KV computed later into such
    a page goes to its host copy too (``written``)."""

    def __init__(self, num_pages: int, page_size: int, num_host_pages: int = 0) -> None:
        self.page_size = page_size
        self.tokens = np.zeros(num_pages * page_size, np.int32)
        self.ok = np.zeros(num_pages * page_size, bool)
        self.host_tokens = np.zeros(num_host_pages * page_size, np.int32)
        self.host_ok = np.zeros(num_host_pages * page_size, bool)
        self.host_of = np.full(num_pages, -1, np.int64)
        self.host_writes = np.zeros(num_host_pages, np.int64)
        self._writes_seen = np.zeros(num_pages, np.int64)  # host_writes when host_of was set

    def page_slots(self, pages: np.ndarray) -> np.ndarray:
        """Every slot of ``pages``, page after page."""
        return (np.asarray(pages, np.int64)[:, None] * self.page_size
                + np.arange(self.page_size)).reshape(-1)

    def move(self, step: BatchInput) -> None:
        """The step's swaps, then its copies (the order the runners move the KV in)."""
        size = self.page_size
        out = np.asarray(step.swap_out).reshape(-1, 2)
        back = np.asarray(step.swap_in).reshape(-1, 2)
        self.copied_down(out)
        self.host_writes[out[:, 1]] += 1  # copies of other device pages there are gone
        self.copy_on_host(out[:, 0], out[:, 1])
        host, device = self.page_slots(back[:, 0]), self.page_slots(back[:, 1])
        self.tokens[device], self.ok[device] = self.host_tokens[host], self.host_ok[host]
        self.copy_on_host(back[:, 1], back[:, 0])
        self.host_of[np.asarray(step.copies).reshape(-1, 3)[:, 1]] = -1
        for src, dst, n in np.asarray(step.copies).tolist():
            self.tokens[dst * size : dst * size + n] = self.tokens[src * size : src * size + n]
            self.ok[dst * size : dst * size + n] = self.ok[src * size : src * size + n]

    def slots(self, pages: np.ndarray, start: int, end: int) -> np.ndarray:
        """The slots of positions ``[start, end)`` of a sequence with ``pages``."""
        positions = np.arange(start, end)
        return np.asarray(pages, np.int64)[positions // self.page_size] * self.page_size + (
            positions % self.page_size)

    def first_missing(self, pages: np.ndarray, cached: int) -> int:
        """The first of a sequence's ``cached`` positions whose draft KV is not computed
        (``cached``: none)."""
        ok = self.ok[self.slots(pages, 0, cached)]
        return cached if ok.all() else int(ok.argmin())

    def copy_on_host(self, pages: np.ndarray, host: np.ndarray) -> None:
        """Host pages ``host`` hold copies of device ``pages`` (as they are now)."""
        self.host_of[pages] = host
        self._writes_seen[pages] = self.host_writes[host]

    def copied_down(self, pairs: np.ndarray) -> None:
        """(device page, host page) rows: the host pages' record is now the device pages'."""
        device, host = self.page_slots(pairs[:, 0]), self.page_slots(pairs[:, 1])
        self.host_tokens[host], self.host_ok[host] = self.tokens[device], self.ok[device]

    def written(self, slots: np.ndarray, ids: np.ndarray, drafted: np.ndarray) -> np.ndarray:
        """The model wrote ``ids`` at ``slots``; the draft wrote the same ids at ``drafted``
        (some of ``slots`` and slots it caught up on). Returns the (device page, host page)
        rows whose host copies the draft's new KV is to reach (``copied_down`` once it has)."""
        self.tokens[slots] = ids
        self.ok[slots] = False
        self.ok[drafted] = True
        self.host_of[slots // self.page_size] = -1  # the model's KV there is newer than a copy
        pages = np.unique(drafted // self.page_size)
        pages = pages[self.host_of[pages] >= 0]
        pages = pages[self.host_writes[self.host_of[pages]] == self._writes_seen[pages]]
        return np.stack([pages, self.host_of[pages]], axis=1)  # copies not written over


@dataclass
class _Drafting:
    """One step's sequences the draft drafts for (their index in the step, in batch order),
    what it proposed for each, and the slots its forwards wrote."""

    seqs: list[int] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    wrote: list[np.ndarray] = field(default_factory=list)


class DraftModel:
    """The draft's runner (weights and a pool of the target's page numbers), the record of
    which of its slots hold KV (``slots``), and its drafting: only the sequences a step asks
    drafts of run the draft, each from its first slot the draft has not computed (the tokens
    read back from the record) to its step's last token; every other sequence costs it
    nothing. No forward of the draft reads a slot that it has not written with the token the
    model's KV there is of."""

    def __init__(self, c: EngineConfig, draft_dir: str, num_pages: int,
                 num_host_pages: int) -> None:
        """``num_pages``, ``num_host_pages``: the target's pages and host pages (swap's and
        the host tier's), which the draft's pool holds at the same numbers."""
        from engine.worker.runner import ModelRunner

        spec = c.speculative()
        self.min_prob = spec.draft_min_token_prob
        config = msgspec.structs.replace(
            c, model=draft_dir, num_pages=num_pages, kv_cache_gb=None, host_cache_gb=0.0,
            num_host_pages=num_host_pages, enable_lora=False, lora_modules=[],
            enable_cuda_graph=False, speculative_config=None,
            sliding_kv_ratio=0.0)  # full KV at the target's pages (host pages too)
        self.runner = ModelRunner(config)
        self.checkpoint = draft_dir  # what the disk tier's identity names
        size = draft_vocab_size(spec.draft_vocab_size, self.runner.model.config.vocab_size)
        self.vocab = DraftVocab(self.runner.model, size) if size else None
        self.page_size = c.page_size
        self.slots = DraftSlots(num_pages, c.page_size, num_host_pages)
        self._step: _Drafting | None = None
        self.tokens_computed = 0  # tokens the draft's forwards ran, catching up included
        self.rows_trimmed = 0  # verify rows of drafts never made, dropped from the steps

    def propose(self, step: BatchInput, guide: Guide | None = None) -> None:
        """The step's page moves in the draft's pool, and the drafts of the sequences its
        ``draft_lens`` names into their placeholders (the draft's forwards: what each lacks,
        then one decode step at a time); ``guide``: the constrained sequences' grammars,
        which mask their drafts (engine/worker/grammar_drafts.py)."""
        drafting = self._step = _Drafting()
        self.slots.move(step)
        starts = np.cumsum(step.extend_lens) - step.extend_lens
        draft_lens = step.draft_lens if len(step.draft_lens) else np.zeros(step.num_seqs, int)
        rounds: list[StepBuilder] = []  # catching up further than one forward computes
        builder = StepBuilder(self.page_size)
        for i in np.flatnonzero(draft_lens).tolist():
            pages, cached, ids = self._seq(step, starts, i)
            start = self.slots.first_missing(pages, cached)
            tokens = self.slots.tokens[self.slots.slots(pages, start, cached)].tolist()
            tokens += ids[: len(ids) - int(draft_lens[i])]
            for n in range(max(len(tokens) - 1, 0) // CATCH_UP_CHUNK):
                if n == len(rounds):
                    rounds.append(StepBuilder(self.page_size))
                part = tokens[n * CATCH_UP_CHUNK : (n + 1) * CATCH_UP_CHUNK]
                rounds[n].add(pages, start + n * CATCH_UP_CHUNK, part, samples=0)
            done = max(len(tokens) - 1, 0) // CATCH_UP_CHUNK * CATCH_UP_CHUNK
            builder.add(pages, start + done, tokens[done:])
            drafting.seqs.append(i)
        moves = (step.copies, step.swap_out, step.swap_in)
        for part in rounds:
            self._forward(part.finish(*moves), drafting)
            moves = ()
        if drafting.seqs:
            logits = self._forward(builder.finish(*moves), drafting)
            self._draft(step, starts, draft_lens, drafting, logits, guide)
        elif moves and any(len(m) for m in moves):
            self.runner.forward(StepBuilder(self.page_size).finish(*moves))
        wrote = np.concatenate(drafting.wrote) if drafting.wrote else np.zeros(0, np.int64)
        stale = self.slots.written(np.asarray(step.out_slots, np.int64), step.input_ids, wrote)
        if len(stale):  # its KV, then its record: a load beside the steps reads them reversed
            with torch.inference_mode():
                self.runner.pool.swap_out(stale)
            self.slots.copied_down(stale)

    def _forward(self, batch: BatchInput, drafting: _Drafting) -> torch.Tensor:
        drafting.wrote.append(np.asarray(batch.out_slots, np.int64))
        self.tokens_computed += batch.num_tokens
        if self.vocab is not None:
            self.vocab.read(batch.input_ids)
        return self.runner.forward(batch)

    def _draft(self, step: BatchInput, starts: np.ndarray, draft_lens: np.ndarray,
               drafting: _Drafting, logits: torch.Tensor, guide: Guide | None) -> None:
        """The drafts from the first forward's logits on, one decode step of the draft at a
        time, into the step's placeholders. A constrained sequence's draft is the argmax of
        what its grammar allows after its drafts so far; its drafts end at the first one the
        grammar does not keep (proposed, then cut: engine/worker/grammar_drafts.py)."""
        guide = guide or Guide([], 0, None, None)  # no constrained sequence
        vocab = self.runner.config.vocab_size  # a head in blocks: fewer logits columns
        tokens, sure = self._pick(logits, guide.allowed(drafting.seqs, logits.device, vocab))
        drafting.drafts = [[t] for t in tokens]  # the first draft: always proposed
        active = [n for n, ok in enumerate(sure) if ok and draft_lens[drafting.seqs[n]] > 1
                  and guide.take(drafting.seqs[n], tokens[n])]
        while active:
            builder = StepBuilder(self.page_size)
            for n in active:
                pages, cached, _ = self._seq(step, starts, drafting.seqs[n])
                made = drafting.drafts[n]
                builder.add(pages, cached + len(made), made[-1:])
            logits = self._forward(builder.finish(), drafting)
            tokens, sure = self._pick(logits, guide.allowed(
                [drafting.seqs[n] for n in active], logits.device, vocab))
            still = []
            for n, token, ok in zip(active, tokens, sure, strict=True):
                if not ok:
                    continue  # unsure: this draft and any after it are not proposed
                drafting.drafts[n].append(token)
                if len(drafting.drafts[n]) < draft_lens[drafting.seqs[n]] and guide.take(
                        drafting.seqs[n], token):
                    still.append(n)
            active = still
        guide.rewind()
        step.input_ids = step.input_ids.copy()  # a received step's arrays are read-only
        for n, i in enumerate(drafting.seqs):
            made, k = drafting.drafts[n], int(draft_lens[i])
            first = int(starts[i] + step.extend_lens[i]) - k
            step.input_ids[first : first + k] = made + made[-1:] * (k - len(made))

    def unused(self, step: BatchInput) -> np.ndarray:
        """Per sequence of ``step`` (after ``propose``), the placeholders no draft filled (a
        sequence whose draft stopped early: the verify rows of drafts never made, which
        engine/worker/verify_rows.py drops from the model's step)."""
        unused = np.zeros(step.num_seqs, np.int64)
        drafting = self._step
        for n, i in enumerate(drafting.seqs if drafting is not None else ()):
            unused[i] = int(step.draft_lens[i]) - len(drafting.drafts[n])
        self.rows_trimmed += int(unused.sum())
        return unused

    def settle(self, step: BatchInput, sampled: np.ndarray, result: BatchResult) -> None:
        """After the sampler: the step's drafts into ``result``."""
        drafting, self._step = self._step, None
        if drafting is not None and drafting.seqs:
            result.draft_counts = np.array([len(d) for d in drafting.drafts],
                                           np.int32).tobytes()
            result.draft_ids = pack_ids([t for d in drafting.drafts for t in d])

    @staticmethod
    def _seq(step: BatchInput, starts: np.ndarray, i: int):
        """Sequence ``i`` of ``step``: its pages, its cached length and its new ids."""
        pages = step.page_indices[step.page_indptr[i] : step.page_indptr[i + 1]]
        extend = int(step.extend_lens[i])
        ids = step.input_ids[starts[i] : starts[i] + extend].tolist()
        return pages, int(step.seq_lens[i]) - extend, ids

    def _pick(self, logits: torch.Tensor,
              allowed: torch.Tensor | None = None) -> tuple[list[int], list[bool]]:
        """Each row's argmax (over the draft's vocabulary, ``vocab``; of the tokens
        ``allowed`` where given, [rows, vocab] bool) and whether the draft's probability of it
        (among those) reaches ``min_prob`` (one copy to the host)."""
        if self.vocab is not None:
            logits = self.vocab.columns(logits)
            if allowed is not None:
                allowed = allowed[:, self.vocab.ids(allowed.device)]
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        best, token = torch.softmax(logits.float(), dim=-1).max(dim=-1)
        if self.vocab is not None:
            token = self.vocab.ids(token.device)[token]
        host = torch.stack([token.double(), best.double()]).cpu().numpy()
        return host[0].astype(np.int64).tolist(), (host[1] >= self.min_prob).tolist()
