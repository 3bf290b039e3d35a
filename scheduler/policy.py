"""Which waiting request goes first.

``lpm`` (longest prefix match, cache-aware) admits the request with the most cached prefix
first, so requests sharing a prefix run while it is still cached; ``fcfs`` keeps arrival
order. Preempted requests always go first (they were admitted before and their progress is
on the host or in the tree). Past ``LPM_MAX_QUEUE`` waiting requests, lpm falls back to fcfs:
a prefix peek per request per step would cost more than it saves.
"""

from __future__ import annotations

from radix import RadixTree
from scheduler.request import Request

LPM_MAX_QUEUE = 128
SHARED_HEAD = 32  # tokens two prompts must share for the second to wait for the first's prefill


def shared_head(tokens, namespace, prompt_len: int) -> tuple | None:
    """A prompt's first ``SHARED_HEAD`` tokens (None for a prompt too short to share). A
    request whose head another request is prefilling right now waits for that prefill when it
    would otherwise compute a long stretch itself (``long_uncached``): once the prefill is in
    the tree it hits all of it instead of computing its own copy."""
    if prompt_len <= 2 * SHARED_HEAD:
        return None
    return (namespace, *tokens[:SHARED_HEAD])


def long_uncached(prompt_len: int, cached: int) -> bool:
    """Whether prefilling past ``cached`` tokens computes a long stretch itself."""
    return prompt_len - max(cached, 0) > 2 * SHARED_HEAD


def order_waiting(waiting: list[Request], policy: str, tree: RadixTree) -> list[Request]:
    if policy == "fcfs" or len(waiting) > LPM_MAX_QUEUE:
        return sorted(waiting, key=lambda r: (r.cached_tokens < 0, r.arrival))
    for req in waiting:
        seq = req.seqs[0]
        req.peeked_prefix = tree.peek_prefix(seq.tokens, req.namespace, len(seq.tokens) - 1)
    return sorted(waiting, key=lambda r: (r.cached_tokens < 0, -r.peeked_prefix, r.arrival))
