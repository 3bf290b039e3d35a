"""What the two rules that decide how many drafts a step proposes share (scheduler/
speculation.py for the cache's drafts, scheduler/draft_model.py for a draft model's): the
priors and pauses, what a draft row costs measured from the steps' times (``StepCosts``), and
the draft model's per-sequence record, which ``Seq`` carries. Kept apart so that ``Seq``
(scheduler/request.py) and the two rules import it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# A new sequence's acceptance: PRIOR_ACCEPT, worth PRIOR_TRIES tried drafts; a verification's
# counts weigh HISTORY times the previous ones' (all drafts rejected: the acceptance falls to
# 0.42, 0.33, 0.28 and below, towards 0.22). Under PAUSE_BELOW a sequence pauses, whatever
# its drafts cost; no draft row is taken to cost less than MIN_SHARE (a sampled row, pages).
PRIOR_ACCEPT, PRIOR_TRIES, HISTORY = 0.7, 1.5, 0.7
PAUSE_BELOW, MIN_SHARE = 0.3, 0.02
FIRST_PAUSE, LONGEST_PAUSE = 4, 64  # decode steps without drafts; doubled on each new pause


@dataclass
class ModelDrafts:
    """A sequence's record of the draft model's drafts: accepted and tried (decayed), decode
    steps left without them, the next pause's length, and whether a pause just ended."""

    hits: float = 0.0
    tries: float = 0.0
    pause: int = 0
    backoff: int = FIRST_PAUSE
    probe: bool = False

    def acceptance(self) -> float:
        return (self.hits + PRIOR_ACCEPT * PRIOR_TRIES) / (self.tries + PRIOR_TRIES)


class StepCosts:
    """What a draft costs, from the steps' own times. A decode or verify step of B sequences
    with D draft rows took T seconds: per B, decayed sums of D, T, D * D and D * T (the last
    ``1 / (1 - DECAY)`` or so steps of that size); one slope ``b`` (seconds per draft row) from
    the deviations within each B, and ``t_B`` the draft-free step's time. ``share(B)`` is a
    draft row's time over the time per token of a draft-free step, ``b * B / t_B``; until the
    steps have varied enough to tell (``MIN_SPREAD`` draft rows squared), ``PRIOR_SHARE * B``,
    at most ``PRIOR_MAX`` (what one sequence's draft row costs on a CPU; at that bound, sequences
    whose drafts are mostly right still draft, and so the steps vary)."""

    DECAY = 0.95
    MIN_SPREAD = 4.0
    PRIOR_SHARE, PRIOR_MAX = 0.15, 0.5

    def __init__(self) -> None:
        self.sums: dict[int, np.ndarray] = {}  # B -> [n, D, T, D*D, D*T], decayed

    def observe(self, batch_size: int, drafts: int, seconds: float) -> None:
        sums = self.sums.setdefault(batch_size, np.zeros(5))
        sums *= self.DECAY
        sums += (1.0, drafts, seconds, drafts * drafts, drafts * seconds)

    def slope(self) -> float | None:
        """Seconds a draft row adds to a step (None: the steps have not varied enough)."""
        spread = covariance = 0.0
        for n, d, t, dd, dt in self.sums.values():
            spread += dd - d * d / n
            covariance += dt - d * t / n
        if spread < self.MIN_SPREAD:
            return None
        return max(covariance / spread, 0.0)

    def share(self, batch_size: int) -> float:
        prior = min(self.PRIOR_SHARE * batch_size, self.PRIOR_MAX)
        b, sums = self.slope(), self.sums.get(batch_size)
        if b is None or sums is None or sums[0] < 1.0:
            return prior
        n, d, t = sums[:3]
        draft_free = t / n - b * d / n
        if draft_free <= 0.0:
            return prior
        return min(b * batch_size / draft_free, 1.0)
