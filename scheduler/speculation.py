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

Adaptive rules: a sequence's acceptance rate (a moving average of accepted / drafted) sets how
many tokens it drafts; one whose drafts are mostly rejected pauses drafting for a number of
steps that doubles each time it happens again. No sequence drafts while more than
``disable_by_batch_size`` run: the step is then bound by compute, and a draft costs as much as
a token. Not drafted: beams, rows with penalties (their sampler reads the whole history), a
session's closing step, prefill chunks, a step that preempted, and a sequence whose drafts
would need pages that are not free once every sequence of the step has its own (drafts are
planned last: they never evict the cache or preempt anyone, scheduler/planner.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from engine.contracts.speculative import SpeculativeConfig
from scheduler.ngram import LOOKUP_WINDOW, propose_ngram
from scheduler.suffix import SuffixProposer
from scheduler.suffix_index import SuffixIndex

if TYPE_CHECKING:
    from radix.tree import RadixTree
    from scheduler.request import Seq

RATE_WEIGHT = 0.3  # weight of the latest verification in the moving acceptance rate
PAUSE_BELOW = 0.25  # acceptance rate under which a sequence pauses drafting
FIRST_PAUSE, LONGEST_PAUSE = 4, 64  # decode steps without drafts; doubled on each new pause


class Speculator:
    """Drafts for decoding sequences and the counters behind ``/metrics``. Holds no pages; the
    per-sequence state lives on the ``Seq`` (``draft_rate``, ``draft_pause``,
    ``draft_backoff``). With the ``suffix`` method and a ``tree``, its index holds copies of
    the tokens the tree caches (bounded: scheduler/suffix_index.py)."""

    def __init__(self, config: SpeculativeConfig, tree: RadixTree | None = None) -> None:
        self.config = config
        self.method = config.method
        self.suffix: SuffixProposer | None = None
        if config.method == "suffix":
            index = None
            if tree is not None and config.suffix_decoding_max_cached_requests:
                index = SuffixIndex.attached(tree, config.suffix_decoding_max_cached_requests,
                                             config.suffix_decoding_max_tree_depth)
            self.suffix = SuffixProposer(config, index)
        self.drafted_tokens = 0  # draft tokens verified
        self.accepted_tokens = 0  # of those, accepted
        self.emitted_tokens = 0  # tokens verification steps produced (accepted + one each)
        self.verifications = 0  # sequence-steps that verified drafts

    def may_draft(self, num_running: int) -> bool:
        """Whether sequences draft while ``num_running`` run (else the step is compute-bound)."""
        return num_running <= self.config.disable_by_batch_size

    def drafts_for(self, seq: Seq, limit: int, num_running: int) -> list[int]:
        """Draft tokens for ``seq``'s next decode step (empty: decode as usual); ``limit`` is
        the length the sequence may reach, ``num_running`` the sequences running."""
        c = self.config
        if not self.may_draft(num_running) or seq.req.params.structured_outputs is not None:
            return []  # a constrained row's grammar state advances one sampled token a step
        if seq.draft_pause > 0:
            seq.draft_pause -= 1
            return []
        k = min(math.ceil(c.num_speculative_tokens * seq.draft_rate),
                limit - len(seq.tokens) - 1)  # room for the drafts and the bonus token
        if k < 1:
            return []
        tokens = np.asarray(seq.tokens[-LOOKUP_WINDOW:], dtype=np.int64)
        if self.suffix is not None:
            return self.suffix.propose(tokens, seq.req.namespace, k)
        return propose_ngram(tokens, c.prompt_lookup_min, c.prompt_lookup_max, k).tolist()

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

    def accept(self, seq: Seq, drafted: int, accepted: int) -> int:
        """``seq`` verified ``drafted`` drafts and ``accepted`` of them (``accepted``): updates
        its rate, its pause and the counters; returns the tokens it keeps (the accepted drafts
        and the token after them)."""
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.emitted_tokens += accepted + 1
        self.verifications += 1
        seq.draft_rate += RATE_WEIGHT * (accepted / drafted - seq.draft_rate)
        if accepted / drafted >= 0.5:
            seq.draft_backoff = FIRST_PAUSE
        if seq.draft_rate < PAUSE_BELOW:
            seq.draft_pause = seq.draft_backoff
            seq.draft_backoff = min(2 * seq.draft_backoff, LONGEST_PAUSE)
            seq.draft_rate = 0.5  # after the pause, try again with half the drafts
        return accepted + 1

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
        }

