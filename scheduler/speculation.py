"""Speculative decoding with no draft model: which sequences draft, how many tokens, and what
their verification kept. The drafts come from prompt lookup over the sequence's own tokens
(``ngram``, scheduler/ngram.py) or from its own tokens and everything the radix cache holds
(``suffix``, scheduler/suffix.py over scheduler/suffix_index.py).

A decoding sequence with ``k`` drafts runs as a ``k + 1``-token extend (its last token, then
the drafts) with logits on every row; row ``i`` is sampled as that sequence's output number
``num_outputs + i`` would be without drafts (the same seeded noise, scheduler/batch.py), so::

    drafts        d0   d1   d2   d3
    sampled   s0   s1   s2   s3   s4        (s_i from the logits after d_{i-1})
    kept      s0 .. s_a, where a is the first i with s_i != d_i (or k: all accepted + bonus)

Greedy rows pick the argmax, so the output is the one decoding without drafts gives. Sampled
rows follow speculative (rejection) sampling for a draft that is a point mass on ``d``: the
sampler's exponential race returns ``d`` with probability ``p(d)`` (accept), and otherwise a
token drawn from ``p`` with ``d`` removed and renormalised (the race's winner given it is not
``d``), which is exactly the rule's residual; seeded runs give the output they give without
drafts. Rejected positions roll back: the sequence's ``computed`` counts only kept tokens, the
tree only ever gets settled ones, and pages past the kept tokens return (``SeqMemory.trim``).

Adaptive rules, so that drafting never costs more than it brings:

- a sequence's acceptance ``a``: the chance that a draft whose predecessors were accepted is
  accepted too (its verifications' accepted drafts over the drafts they tried, up to and
  including the first rejected one; decayed counts behind a prior, ``Seq.draft_hits`` and
  ``Seq.draft_tries``);
- what a draft costs (``StepCosts``): each decode or verify step's time, from sending it to
  its result, fitted per batch size B as ``T = t_B + b * drafts`` (one slope for all B);
  a draft row costs ``share = b * B / t_B`` of a step's time per token that step produces;
- the j-th draft of a sequence adds a token with probability ``a ** j`` and costs ``share``:
  a sequence drafts the K (at most ``num_speculative_tokens``) with ``a ** K > share``. At one
  sequence on a CPU a draft row costs ~0.15 of a step and K follows acceptance; at 4 and more,
  where the step's cost is mostly per row (docs/benchmarks.md), ~0.45, and only sequences whose
  drafts are mostly right draft. On a GPU, where rows are nearly free, nearly every sequence
  drafts fully;
- a sequence with no draft worth making, or whose acceptance falls under ``PAUSE_BELOW``
  (drafts that keep failing), pauses for a number of decode steps that doubles each time it
  happens again (back to the first length once half of a verification's drafts are
  accepted), then drafts one token as a probe, whatever it costs.

A constrained sequence (structured output) drafts too: the model worker keeps its drafts up to
the first its grammar does not (refused, or ending the grammar or making it force tokens),
verifies each row under the grammar's mask after the drafts before it, and says how many it
kept (``BatchResult.grammar_drafts``; a cut draft counts as rejected, engine/worker/
grammar_drafts.py); the tokens the grammar forces after the emitted ones follow them.

The state is the sequence's: preemption (recompute or swap) keeps it. No sequence drafts while
more than ``disable_by_batch_size`` run. Not drafted: beams, rows with penalties (their
sampler reads the whole history), a session's closing step, prefill chunks, a step that
preempted, and a sequence whose drafts would need pages that are not free once every sequence
of the step has its own (drafts are planned last: they never evict the cache or preempt
anyone, scheduler/planner.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from engine.contracts.speculative import SpeculativeConfig
from scheduler.draft_model import draft_rate
from scheduler.drafting import (
    FIRST_PAUSE,
    HISTORY,
    LONGEST_PAUSE,
    MIN_SHARE,
    PAUSE_BELOW,
    PRIOR_ACCEPT,
    PRIOR_TRIES,
    StepCosts,
)
from scheduler.ngram import LOOKUP_WINDOW, propose_ngram
from scheduler.suffix import SuffixProposer
from scheduler.suffix_index import SuffixIndex

if TYPE_CHECKING:
    from radix.tree import RadixTree
    from scheduler.outputs import SampledRows
    from scheduler.request import Seq



def worth_drafting(accept: float, share: float, most: int) -> int:
    """The drafts worth making: the K (at most ``most``) with ``accept ** K > share``."""
    if accept >= 1.0 or share <= 0.0:
        return most
    if accept <= share:
        return 0
    return min(most, math.ceil(math.log(share) / math.log(accept)) - 1)


def acceptance(seq: Seq) -> float:
    """The chance that ``seq``'s next draft is accepted once its predecessors were."""
    return ((seq.draft_hits + PRIOR_ACCEPT * PRIOR_TRIES)
            / (seq.draft_tries + PRIOR_TRIES))


class Speculator:
    """Drafts for decoding sequences and the counters behind ``/metrics``. Holds no pages; the
    per-sequence state lives on the ``Seq`` (``draft_hits``, ``draft_tries``, ``draft_pause``,
    ``draft_backoff``, ``draft_probe``), the steps' costs in ``costs`` (the scheduler reports
    each decode or verify step's time). With the ``suffix`` method and a ``tree``, its index
    holds copies of the tokens the tree caches (bounded: scheduler/suffix_index.py)."""

    def __init__(self, config: SpeculativeConfig, tree: RadixTree | None = None) -> None:
        self.config = config
        self.method = config.method
        self.suffix: SuffixProposer | None = None
        self.model = None  # the draft model's policy (method "draft_model")
        if config.method == "draft_model":
            from scheduler.draft_model import DraftModelPolicy  # it imports this module

            self.model = DraftModelPolicy(config.num_speculative_tokens)
        if config.method in ("suffix", "draft_model"):
            index = None
            if tree is not None and config.suffix_decoding_max_cached_requests:
                index = SuffixIndex.attached(tree, config.suffix_decoding_max_cached_requests,
                                             config.suffix_decoding_max_tree_depth)
            self.suffix = SuffixProposer(config, index)
        self.drafted_tokens = 0  # draft tokens verified
        self.accepted_tokens = 0  # of those, accepted
        self.emitted_tokens = 0  # tokens verification steps produced (accepted + one each)
        self.verifications = 0  # sequence-steps that verified drafts
        self.costs = StepCosts()
        self._step: list | None = None  # a measured step's B, on, drafted, tokens, seconds

    def may_draft(self, num_running: int) -> bool:
        """Whether sequences draft while ``num_running`` run (else the step is compute-bound)."""
        return num_running <= self.config.disable_by_batch_size

    def drafts_for(self, seq: Seq, limit: int, num_running: int) -> list[int]:
        """Draft tokens for ``seq``'s next decode step (empty: decode as usual); ``limit`` is
        the length the sequence may reach, ``num_running`` the sequences running."""
        c = self.config
        if not self.may_draft(num_running):
            return []
        if seq.draft_pause > 0:
            seq.draft_pause -= 1
            return []
        room = limit - len(seq.tokens) - 1  # for the drafts and the bonus token
        accept, share = acceptance(seq), max(self.costs.share(num_running), MIN_SHARE)
        k = 0 if accept < PAUSE_BELOW else min(
            worth_drafting(accept, share, c.num_speculative_tokens), room)
        if seq.draft_probe:  # a pause ended: one draft, whatever it costs
            seq.draft_probe, k = False, min(1, room)
        elif k < 1 <= room:
            seq.draft_pause, seq.draft_probe = seq.draft_backoff, True
            seq.draft_backoff = min(2 * seq.draft_backoff, LONGEST_PAUSE)
        if k < 1:
            return []
        tokens = np.asarray(seq.tokens[-LOOKUP_WINDOW:], dtype=np.int64)
        if self.suffix is not None:
            return self.suffix.propose(tokens, seq.req.namespace, k)
        return propose_ngram(tokens, c.prompt_lookup_min, c.prompt_lookup_max, k).tolist()

    def plan(self, seq: Seq, limit: int, num_running: int) -> tuple[list[int], bool]:
        """``seq``'s drafts for its next decode step and whether the draft model makes them
        (then the ids are placeholders the model worker fills): with a draft model, the
        cache's continuation where the suffix method finds one whose expected tokens per
        unit of time (its acceptance and its verify rows' cost; no draft forward) are at least
        what the draft model's best K brings (its acceptance, its drafts' cost), else the
        draft model's; none at a batch size where drafting is off (``DraftModelPolicy.pays``)."""
        if self.model is not None and self.may_draft(num_running) and not self.model.pays(
                num_running):
            return [], False  # no drafts of either kind at this batch size
        drafts = self.drafts_for(seq, limit, num_running)
        if self.model is None or not self.may_draft(num_running) or (
                drafts and self._cache_rate(seq, len(drafts), num_running)
                >= self.model.rate(seq, num_running)):
            return drafts, False
        k = self.model.drafts_for(seq, limit - len(seq.tokens) - 1, num_running)
        return [0] * k, k > 0

    def _cache_rate(self, seq: Seq, count: int, num_running: int) -> float:
        """Tokens per draft-free step's time of verifying ``count`` of the cache's drafts."""
        return draft_rate(acceptance(seq), max(self.costs.share(num_running), MIN_SHARE),
                          count)

    def verified(self, entries: list, rows: SampledRows) -> dict[int, tuple[int, int]]:
        """Each verification of a step's result, by its first logits row: the drafts it
        proposed (the draft model's as the worker made them, ``draft_counts`` and
        ``draft_ids``, in the order of the entries that asked for them) and how many it
        accepted, all in one pass (``accepted``). A constrained verification accepts only
        among the drafts its grammar kept (``grammar_drafts``): a draft cut is one rejected."""
        made = iter(np.split(rows.draft_ids, np.cumsum(rows.draft_counts)[:-1])
                    if len(rows.draft_counts) else ())
        verifies, proposed, row = [], {}, 0
        for i, entry in enumerate(entries):
            if entry.drafts:
                drafts = next(made).tolist() if entry.model_drafts else entry.drafts
                proposed[row] = len(drafts)
                if len(rows.grammar_drafts) and rows.grammar_drafts[i] >= 0:
                    drafts = drafts[: rows.grammar_drafts[i]]
                if drafts:
                    verifies.append((row, drafts))
            row += entry.samples
        accepted = dict.fromkeys(proposed, 0)
        accepted.update(zip((r for r, _ in verifies),
                            self.accepted(rows.tokens, verifies).tolist(), strict=True))
        return {r: (count, accepted[r]) for r, count in proposed.items()}

    @staticmethod
    def accepted(tokens: np.ndarray, verifies: list[tuple[int, list[int]]]) -> np.ndarray:
        """How many drafts each verification accepts, for all of a step's at once (one numpy
        pass over their rows, no Python per row): ``verifies`` holds each one's first logits row
        in ``tokens`` (the step's samples) and its drafts; a verification accepts its drafts up
        to the first that differs from the token sampled at its row."""
        if not verifies:
            return np.zeros(0, dtype=np.int64)
        counts = np.fromiter((len(d) for _, d in verifies), dtype=np.int64, count=len(verifies))
        firsts = np.fromiter((r for r, _ in verifies), dtype=np.int64, count=len(verifies))
        offsets = np.cumsum(counts) - counts
        local = np.arange(int(counts.sum())) - np.repeat(offsets, counts)
        drafts = np.fromiter((t for _, d in verifies for t in d), dtype=np.int64,
                             count=len(local))
        agree = tokens[np.repeat(firsts, counts) + local] == drafts
        # Each row's candidate for its verification's count: its own index where it disagrees,
        # the verification's length where it agrees; the least is the first disagreement.
        return np.minimum.reduceat(np.where(agree, np.repeat(counts, counts), local), offsets)

    def accept(self, seq: Seq, drafted: int, accepted: int, by_model: bool = False) -> int:
        """``seq`` verified ``drafted`` drafts and ``accepted`` of them (``accepted``; the
        draft model's: ``by_model``): updates its rate, its pause and the counters; returns
        the tokens it keeps (the accepted drafts and the token after them)."""
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.emitted_tokens += accepted + 1
        self.verifications += 1
        if self._step is not None:
            self._step[3] += accepted
        if by_model:
            self.model.accept(seq, drafted, accepted)
            return accepted + 1
        tried = accepted + (accepted < drafted)  # the drafts reached: up to the first rejected
        seq.draft_hits = HISTORY * seq.draft_hits + accepted
        seq.draft_tries = HISTORY * seq.draft_tries + tried
        if accepted / drafted >= 0.5:
            seq.draft_backoff = FIRST_PAUSE
        return accepted + 1

    def step_took(self, entries: list, seconds: float) -> None:
        """A step came back ``seconds`` after it was sent: a step of decodes and verifies only
        (each entry's tokens its last one and its drafts) tells what drafts cost. With a draft
        model, also the step's output tokens per second (its verifications' accepted drafts
        counted by ``accept``, which follows; handed on at the next step)."""
        # planned with the draft model as it stands before the previous step's measure
        on = self.model is not None and self.model.drafting(len(entries))
        if self._step is not None:
            self.model.step_took(*self._step)
            self._step = None
        if entries and all(e.extend == 1 + len(e.drafts) and e.samples == e.extend
                           for e in entries):
            modelled = [e for e in entries if e.model_drafts]
            costs = self.model.costs if modelled else self.costs
            # not the step in which the draft catches up (the KV of every token it missed)
            if not (modelled and self.model.catching_up(len(entries))):
                costs.observe(len(entries), sum(len(e.drafts) for e in modelled or entries),
                              seconds)
            if self.model is not None:
                self._step = [len(entries), on or bool(modelled), bool(modelled),
                              len(entries), seconds]

    def check(self) -> None:
        """The suffix index's bookkeeping (with the scheduler's accounting check)."""
        if self.suffix is not None and self.suffix.index is not None:
            self.suffix.index.check()

    def stats(self) -> dict[str, float | str]:
        return {
            "spec_method": self.method,
            "spec_drafted_tokens": self.drafted_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_emitted_tokens": self.emitted_tokens,
            "spec_verifications": self.verifications,
            **(self.model.stats() if self.model is not None else {}),
        }

