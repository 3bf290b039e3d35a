"""How many drafts a draft model (``--speculative-config '{"model": ...}'``) proposes for each
decoding sequence's step, and when it stops. The drafts themselves are made in the model
worker (engine/worker/draft.py), which also ends a step's drafts early where the draft is
unsure; here the per-sequence rule, as for the cache's drafts (scheduler/speculation.py):

- acceptance ``a``: the chance that a draft whose predecessors were accepted is accepted too
  (decayed counts behind a prior, ``ModelDrafts``);
- cost: a draft row of a step with the draft model's drafts costs ``share`` of the step's time
  per token (``DraftCosts``: the steps' measured times, fitted as for the cache's drafts, with
  a prior of what a draft a third the size of the model costs: its forward and a verify row);
- K, at most ``num_speculative_tokens``, the one with the most tokens per unit of time: a
  verification of K drafts yields ``1 + a + ... + a ** K`` tokens for ``1 + share * K`` of a
  step's time (a draft here costs far more than the cache's, whose marginal rule would draft
  too many); K = 0 the best: the sequence pauses (decode steps without the draft model,
  doubling each time, a one-draft probe after), logged and counted in ``/metrics``
  (``spec_model_pauses``);
- the batch size: where the cost measured at B running sequences is such that not even drafts
  accepted ``CEILING`` of the time would pay (``pays``), no sequence drafts with the draft
  model while B run (no probes either), so the draft computes nothing; logged when it turns
  off or on, the sequence-steps counted in ``/metrics`` (``spec_model_off_steps``). The
  costs at B are those its steps measured (the prior until then), so it turns on again where
  other batch sizes' steps move the fitted cost of a draft.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from scheduler.drafting import (
    FIRST_PAUSE,
    HISTORY,
    LONGEST_PAUSE,
    MIN_SHARE,
    StepCosts,
)

if TYPE_CHECKING:
    from scheduler.request import Seq

logger = logging.getLogger("radixserve.scheduler")


# The acceptance that ``DraftModelPolicy.pays`` grants the drafts: above what the real pair
# reaches on code (88-93%, docs/benchmarks.md), so only a batch size where drafting cannot pay
# turns the draft model off.
CEILING = 0.95


class DraftCosts(StepCosts):
    """``StepCosts`` of the steps that verify the draft model's drafts: a draft row there
    costs the draft's forward too (a third of the model's at 0.5B drafting 1.5B)."""

    # a 0.5B draft's decode step costs 0.37 of a 1.5B's, and each verify row 0.15 of it
    # (scripts/bench_speculation.py --cost, Qwen2.5-Coder Q4_K_M, 2 cores)
    PRIOR_SHARE, PRIOR_MAX = 0.5, 0.7


def draft_rate(accept: float, share: float, k: int) -> float:
    """Tokens per draft-free step's time of a verification of ``k`` drafts, ``(1 + a + ... +
    a**k) / (1 + share * k)``."""
    return sum(accept**j for j in range(k + 1)) / (1.0 + share * k)


def best_drafts(accept: float, share: float, most: int) -> int:
    """The K (at most ``most``) with the most tokens per unit of time (``draft_rate``); 0
    when no draft pays."""
    best, best_rate = 0, 1.0
    for k in range(1, most + 1):
        rate = draft_rate(accept, share, k)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


class DraftModelPolicy:
    """Per sequence, how many drafts the draft model proposes; the counters for ``/metrics``."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.costs = DraftCosts()
        self.drafted_tokens = 0  # the draft model's drafts verified
        self.accepted_tokens = 0  # of those, accepted
        self.pauses = 0  # sequences' pauses of the draft model (not worth its cost)
        self.off_steps = 0  # sequence-steps without it: no draft pays at their batch size
        self._off: set[int] = set()  # batch sizes it is off at

    def pays(self, num_running: int) -> bool:
        """Whether the draft model drafts at all while ``num_running`` sequences run: not once
        the steps measured at that batch size cost so much a draft that even drafts accepted
        ``CEILING`` of the time would not pay for it."""
        sums = self.costs.sums.get(num_running)
        measured = sums is not None and sums[0] >= 1.0 and self.costs.slope() is not None
        share = self.costs.share(num_running)
        on = not measured or best_drafts(CEILING, share, self.most) > 0
        if on == (num_running in self._off):
            self._off.symmetric_difference_update((num_running,))
            logger.info("the draft model is %s at %d running sequences (a draft costs %.2f "
                        "of a step)", "on" if on else "off", num_running, share)
        self.off_steps += not on
        return on

    def drafts_for(self, seq: Seq, room: int, num_running: int) -> int:
        """How many drafts ``seq``'s next step asks of the draft model (0: none); ``room``:
        the tokens it may still add after its next one."""
        state = seq.model_drafts
        if state.pause > 0:
            state.pause -= 1
            state.probe = state.pause == 0
            return 0
        if state.probe:  # a pause ended: one draft, whatever it costs
            state.probe = False
            return min(1, room)
        share = max(self.costs.share(num_running), MIN_SHARE)
        k = min(best_drafts(state.acceptance(), share, self.most), room)
        if k < 1 <= room:
            state.pause = state.backoff
            state.backoff = min(2 * state.backoff, LONGEST_PAUSE)
            self.pauses += 1
            logger.info("request %s: the draft model pauses for %d steps (acceptance %.2f, a "
                        "draft costs %.2f of a step)", seq.req.rid, state.pause,
                        state.acceptance(), share)
            return 0
        return max(k, 0)

    def rate(self, seq: Seq, num_running: int) -> float:
        """The tokens per draft-free step's time that ``seq``'s best K of the draft model's
        drafts would bring now (1.0: none pays; paused: 1.0)."""
        state = seq.model_drafts
        if state.pause > 0:
            return 1.0
        share = max(self.costs.share(num_running), MIN_SHARE)
        k = best_drafts(state.acceptance(), share, self.most)
        return draft_rate(state.acceptance(), share, k)

    def accept(self, seq: Seq, drafted: int, accepted: int) -> None:
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        state = seq.model_drafts
        state.hits = HISTORY * state.hits + accepted
        state.tries = HISTORY * state.tries + accepted + (accepted < drafted)
        if accepted / drafted >= 0.5:
            state.backoff = FIRST_PAUSE

    def stats(self) -> dict[str, int]:
        return {"spec_model_drafted_tokens": self.drafted_tokens,
                "spec_model_accepted_tokens": self.accepted_tokens,
                "spec_model_pauses": self.pauses,
                "spec_model_off_steps": self.off_steps}
