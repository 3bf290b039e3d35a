"""Waiting for finished requests' replacements, so that requests sent together prefill together.

Clients that keep a fixed number of requests in flight (a benchmark's slots, an agent's
workers, a batch job's pool) send a new request the moment one finishes. Requests that finish
in the same step are replaced a few milliseconds apart (10-30 ms through the frontend on a
2-core CPU); a step started at the first arrival prefills that one alone, and the rest wait for
its step and then run in the next, their first tokens a whole step later. Once split, the
cohorts stay split: each finishes a step apart from the other, and so are their replacements
(docs/benchmarks.md, "Prefill on AMX": the shared-prefix workload's 1 + 6 + 1).

So the scheduler process (scheduler/process.py) holds back:

- the whole next step, while nothing runs and fewer requests have arrived than finished since
  the engine began to settle, for at most ``--refill-wait-ms`` (default 50, at most 1000) after
  the last finish. A backlog (requests a step planned with admission open left waiting: more
  than it takes) counts as arrived; requests that came after that step are replacements, also
  where they replaced a cohort that ended a step before the last one;
- the admission of waiting requests (the running ones decode on), while every running request
  ends at its next step (its last token by ``max_tokens``): the engine is settling, and the
  requests waiting now prefill beside the replacements of those about to end, one step later.

A step with anything running that does not end at its next step never waits; nor does one once
as many requests have arrived as finished. What it costs: at most ``--refill-wait-ms`` and one
step of first-token time, only where requests arrive while the engine settles and fewer than
finished (a single client sending one request at a time replaces its one request: no wait).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from scheduler.request import Request, Status


def ends_next_step(req: Request, context_len: int) -> bool:
    """Whether ``req`` finishes at its next step for certain: each of its sequences decodes its
    last token (by ``max_tokens`` or the context), with no session's closing step after it."""
    seqs = req.live_seqs()
    return bool(seqs) and req.session_id is None and not req.is_beam and all(
        s.status is Status.RUNNING and not s.closing and s.remaining == 1
        and len(s.tokens) + 1 >= req.max_len(context_len) for s in seqs)


class RefillWait:
    def __init__(self, wait_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        """``wait_s``: the longest wait past the last finish (0: never wait)."""
        self.wait_s, self.clock = wait_s, clock
        self.expected = 0  # replacements still awaited
        self.deadline = 0.0
        self.backlog = 0  # requests the last step planned with admission open left waiting

    def admitted(self, waiting: int) -> None:
        """A step was planned with admission open and left ``waiting`` requests waiting: they
        did not fit (a backlog), so they are nobody's replacements."""
        self.backlog = waiting

    def finished(self, count: int, settling: bool) -> None:
        """A step's result ended ``count`` requests; ``settling``: every request still running
        ends at its next step (none running: the engine is idle). The backlog takes as many
        finished requests' places: fewer replacements are awaited, none where it fills them.
        A cohort that ended a step earlier and was replaced already does not make the next
        cohort's replacements a backlog: those arrivals came after the last admitting step."""
        if not settling or self.wait_s <= 0:
            self.expected = 0
            return
        taken = min(self.backlog, count)
        self.backlog -= taken
        count -= taken
        if count > 0:
            self.expected += count
            self.deadline = self.clock() + self.wait_s

    def arrived(self) -> None:
        self.expected = max(self.expected - 1, 0)

    def hold_seconds(self) -> float:
        """How much longer to wait for replacements (0: none awaited, or waited long enough)."""
        if self.expected <= 0:
            return 0.0
        left = self.deadline - self.clock()
        if left <= 0:
            self.expected = 0
            return 0.0
        return left
