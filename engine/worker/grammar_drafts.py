"""Drafts of a constrained sequence (speculation, scheduler/speculation.py, under a grammar,
engine/worker/grammar.py): only tokens its grammar allows, verified under the grammar's mask
at every position, the grammar left where the emitted tokens take it.

A constrained verification is ``k + 1`` sampling rows of one grammar key. Its rows' masks are
the grammar's states after the drafts before each, so row ``i`` is sampled as the step without
drafts would sample it once ``d0 .. d(i-1)`` were emitted::

    drafts            d0    d1    d2           cut at d2: the grammar refuses it, or taking it
    grammar state  G0    G1    G2    (G3)      ends the grammar or makes it force tokens
    verify rows    s0    s1    s2              each s_i under G_i's mask; row 3 dropped

A draft is kept while the grammar takes it and is, after it, neither ended (the step without
drafts ends the sequence there) nor forcing tokens (that step appends the forced tokens
instead of sampling the next: a sampled token could spell them otherwise); drafts past the first
one not kept are not verified (``Verify.kept``), their rows dropped from the step where it can
drop rows. The draft model drafts under the same rule (``Guide``): its logits masked by the
grammar's state after its drafts so far, it stops at the first draft the rule does not keep.
A walk through the drafts consumes them on the sequence's own matcher and rolls them back,
so the matcher ends each step where the tokens the scheduler keeps leave it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch


class DraftWalk:
    """One constrained sequence's matcher advanced through drafts (``take``) and back
    (``rewind``); ``forces``: the row takes forced tokens (it reports no logprobs)."""

    def __init__(self, matcher, forces: bool) -> None:
        self.matcher, self.forces, self.taken = matcher, forces, 0

    def take(self, token: int) -> bool:
        """Whether the grammar keeps ``token`` as the next draft (it advances then)."""
        matcher = self.matcher
        if matcher.validate_tokens([token]) != 1:
            return False
        matcher.consume_token(token)
        if matcher.is_stopped() or (self.forces and matcher.compute_ff_tokens()):
            matcher.rollback(1)
            return False
        self.taken += 1
        return True

    def rewind(self) -> None:
        if self.taken:
            self.matcher.rollback(self.taken)
            self.taken = 0


@dataclass
class Verify:
    """A constrained sequence's verification: sampling rows ``first`` .. ``first + rows - 1``
    (bitmask rows from ``index``), sequence ``seq`` of the step, its drafts and how many of
    them its grammar keeps."""

    first: int
    rows: int
    index: int
    seq: int
    walk: DraftWalk
    drafts: list[int] = field(default_factory=list)
    kept: int = 0


def cut_drafts(verifies: list[Verify], step, unused: np.ndarray) -> np.ndarray:
    """Each verification's drafts read from ``step`` (the draft model's filled in; the last
    ``unused[seq]`` of a sequence never made) and kept as its grammar takes them, the walk left
    after the kept ones; returns per sequence of the step the drafts cut."""
    cut = np.zeros(step.num_seqs, np.int64)
    at = step.resolved_logits_rows()
    for v in verifies:
        count = v.rows - 1 - int(unused[v.seq])
        v.drafts = step.input_ids[at[v.first + 1 : v.first + 1 + count]].tolist()
        while v.walk.taken < count and v.walk.take(v.drafts[v.walk.taken]):
            pass
        v.kept = v.walk.taken
        cut[v.seq] = count - v.kept
    return cut


def fill_verify_rows(verifies: list[Verify], bitmask: np.ndarray, fill: Callable) -> None:
    """Each verification's rows' masks, from the state after its kept drafts back to the first
    (``fill(matcher, bitmask, row)``), rolling the walk back as it goes."""
    for v in verifies:
        for j in range(v.kept, -1, -1):
            fill(v.walk.matcher, bitmask, v.index + j)
            if j:
                v.walk.matcher.rollback(1)
        v.walk.taken = 0


def emitted(v: Verify, tokens: np.ndarray) -> list[int]:
    """What a verification emits: its samples up to the first that differs from its kept
    draft, and that one (all kept drafts accepted: the one after them)."""
    samples = tokens[v.first : v.first + v.kept + 1].tolist()
    accepted = next((j for j, d in enumerate(v.drafts[: v.kept]) if samples[j] != d), v.kept)
    return samples[: accepted + 1]


class Guide:
    """What the draft model's drafting asks of the grammars: the tokens each constrained
    sequence's grammar allows after its drafts so far (``allowed``), and whether it keeps the
    draft picked (``take``); ``rewind`` when drafting ends. ``fill(matcher, bitmask, row)``
    and ``unpack(bitmask, device, vocab)`` are the grammars' own."""

    def __init__(self, verifies: list[Verify], vocab_size: int, fill: Callable,
                 unpack: Callable) -> None:
        self.walks = {v.seq: v.walk for v in verifies}
        self.vocab_size, self._fill, self._unpack = vocab_size, fill, unpack

    def allowed(self, seqs: list[int], device: torch.device, vocab: int) -> torch.Tensor | None:
        """[len(seqs), vocab] bool for the step's sequences ``seqs``; None where none of them
        is constrained (every token allowed)."""
        if not any(s in self.walks for s in seqs):
            return None
        bitmask = np.full((len(seqs), (self.vocab_size + 31) // 32), -1, np.int32)
        for row, seq in enumerate(seqs):
            if seq in self.walks:
                self._fill(self.walks[seq].matcher, bitmask, row)
        return self._unpack(bitmask, device, vocab)

    def take(self, seq: int, token: int) -> bool:
        walk = self.walks.get(seq)
        return walk is None or walk.take(token)

    def rewind(self) -> None:
        for walk in self.walks.values():
            walk.rewind()
