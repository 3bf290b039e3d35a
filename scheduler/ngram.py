"""Prompt lookup (vLLM's ``ngram`` method): draft the tokens that followed the latest earlier
occurrence of a sequence's last n tokens in its own prompt and output.

    tokens   ... a b c d e ... x y [a b c]      suffix "a b c" (n = 3) seen before at "a b c"
                       └─────┘                  draft: the K tokens after it, "d e ..."

The search looks at the last ``LOOKUP_WINDOW`` tokens only, so its cost per sequence and step
is bounded (O(window x prompt_lookup_max) numpy compares, no per-token Python).
"""

from __future__ import annotations

import numpy as np

LOOKUP_WINDOW = 4096  # tokens searched, from the end of the sequence


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to ``k`` draft tokens for the sequence ``tokens`` (int array, settled tokens only):
    the continuation of the latest earlier occurrence of its longest suffix of ``max_n`` ..
    ``min_n`` tokens that occurs earlier. Empty when none does."""
    tokens = tokens[-LOOKUP_WINDOW:]
    length = len(tokens)
    if k < 1 or length <= min_n:
        return tokens[:0]
    max_n = min(max_n, length - 1)
    # An occurrence ending at e (exclusive, e < length) matches i + 1 suffix tokens when
    # tokens[e - 1 - j] == tokens[length - 1 - j] for every j <= i; a window that would start
    # before the sequence never matches.
    ends = np.arange(1, length)
    matched = np.ones(len(ends), dtype=bool)
    run = np.zeros(len(ends), dtype=np.int64)
    for j in range(max_n):
        at = ends - 1 - j
        matched &= (at >= 0) & (tokens[np.maximum(at, 0)] == tokens[length - 1 - j])
        run += matched
    best = int(run.max(initial=0))
    if best < min_n:
        return tokens[:0]
    end = int(ends[np.flatnonzero(run == best)[-1]])  # the latest of the longest
    return tokens[end : end + k]
