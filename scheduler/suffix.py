"""The ``suffix`` method's drafts (vLLM's suffix decoding, with the radix cache as its global
tree): the longest match of a sequence's last tokens, in its own tokens and in the suffix
index over the cache (scheduler/suffix_index.py), and the most frequent continuation after
its occurrences::

    own tokens      ... x a b c d e ........ p a b c d f ...      occurrences of "a b c" (the
    a cached run    ... q a b c d e ...                            longest suffix of the
    the sequence    ..................................... a b c    context found; at most
                                                                   max_depth tokens)
    draft           d (3 of 3), then e (2 of 3: estimated probability 2/3)

A draft walks the occurrences' continuations token by token: the most frequent next token
among the occurrences that still agree with the draft (a tie goes to the most recent), the
draft's estimated probability multiplied by that token's share; it stops once that falls below
``suffix_decoding_min_token_prob``, at ``suffix_decoding_max_spec_factor`` x the match length,
or at ``k`` tokens. Of the two drafts (own tokens, the cache), the one with the larger
expected accepted length (the sum of its prefixes' probabilities) is proposed; own tokens win
a tie.

Cost per sequence and step: the own-token search compares the last ``LOOKUP_WINDOW`` tokens
(scheduler/ngram.py) once, then only the occurrences still matching, one numpy pass per
matched token (at most ``max_depth``); the index lookup is bounded in its own module; each
draft token is one ``np.unique`` over at most ``MAX_CANDIDATES`` occurrences.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from engine.contracts.speculative import MIN_SUFFIX_MATCH, SpeculativeConfig
from scheduler.suffix_index import MAX_CANDIDATES, SuffixIndex


def own_matches(tokens: np.ndarray, max_depth: int, k: int) -> tuple[int, np.ndarray]:
    """The longest match (at most ``max_depth`` tokens, at least ``MIN_SUFFIX_MATCH``) of the
    end of ``tokens`` (int64) at an earlier position of ``tokens``, and the next ``k`` tokens
    after its ``MAX_CANDIDATES`` most recent occurrences (rows, newest first; -1 past the end).
    ``(0, no rows)`` when nothing matches."""
    length = len(tokens)
    none = np.empty((0, k), dtype=np.int64)
    if length <= MIN_SUFFIX_MATCH:
        return 0, none
    # ends[i]: an occurrence ending before tokens[ends[i]] matches ``matched`` tokens so far
    ends = np.flatnonzero(tokens[:-1] == tokens[-1]) + 1
    matched = 1
    while ends.size and matched < min(max_depth, length - 1):
        at = ends - 1 - matched
        longer = (at >= 0) & (tokens[np.maximum(at, 0)] == tokens[length - 1 - matched])
        if not longer.any():
            break
        ends = ends[longer]
        matched += 1
    if not ends.size or matched < MIN_SUFFIX_MATCH:
        return 0, none
    ahead = ends[::-1][:MAX_CANDIDATES, None] + np.arange(k)
    return matched, np.where(ahead < length, tokens[np.minimum(ahead, length - 1)], -1)


def vote(continuations: np.ndarray, limit: int, min_prob: float) -> tuple[list[int], float]:
    """The draft the occurrences' ``continuations`` (rows, newest first, -1 past their end)
    vote for, at most ``limit`` tokens, and its expected accepted length."""
    draft: list[int] = []
    prob, score = 1.0, 0.0
    alive = np.ones(len(continuations), dtype=bool)
    for j in range(min(limit, continuations.shape[1])):
        column = continuations[alive, j]
        voters = column[column >= 0]
        if not voters.size:
            break
        values, first, counts = np.unique(voters, return_index=True, return_counts=True)
        top = np.flatnonzero(counts == counts.max())
        pick = top[np.argmin(first[top])]
        prob *= counts[pick] / len(column)  # occurrences that end here count as misses
        if prob < min_prob:
            break
        token = int(values[pick])
        draft.append(token)
        score += prob
        alive &= continuations[:, j] == token
    return draft, score


class SuffixProposer:
    """Drafts for the ``suffix`` method from a sequence's own tokens and, when given, the
    suffix index over the radix cache (none: ``suffix_decoding_max_cached_requests`` is 0)."""

    def __init__(self, config: SpeculativeConfig, index: SuffixIndex | None) -> None:
        self.max_depth = config.suffix_decoding_max_tree_depth
        self.max_spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob
        self.index = index

    def propose(self, tokens: np.ndarray, namespace: Hashable, k: int) -> list[int]:
        """Up to ``k`` draft tokens after ``tokens`` (int64, settled tokens only, the last
        ``LOOKUP_WINDOW`` of the sequence) of a request in ``namespace``."""
        found = [own_matches(tokens, self.max_depth, k)]
        if self.index is not None:
            found.append(self.index.matches(tokens, namespace, k))
        best: list[int] = []
        best_score = 0.0
        for length, continuations in found:
            limit = min(k, int(self.max_spec_factor * length))
            draft, score = vote(continuations, limit, self.min_token_prob)
            if score > best_score:
                best, best_score = draft, score
        return best
