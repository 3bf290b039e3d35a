"""How many drafts a draft model (``--speculative-config '{"model": ...}'``) proposes for each
decoding sequence's step, and when it stops. The drafts themselves are made in the model
worker (engine/worker/draft.py), which also ends a step's drafts early where the draft is
unsure; here the per-sequence rule, as for the cache's drafts (scheduler/speculation.py):

- acceptance ``a``: the chance that a draft whose predecessors were accepted is accepted too
  (decayed counts behind a prior, ``ModelDrafts``);
- cost: a draft row of a step with the draft model's drafts costs ``share`` of the step's time
  per token (``DraftCosts``: the steps' measured times, fitted as for the cache's drafts, with
  a prior of what a draft a third the size of the model costs: its forward and a verify row;
  not the step in which the draft catches up after turning on, ``catching_up``);
- K, at most ``num_speculative_tokens``, the one with the most tokens per unit of time: a
  verification of K drafts yields ``1 + a + ... + a ** K`` tokens for ``1 + share * K`` of a
  step's time (a draft here costs far more than the cache's, whose marginal rule would draft
  too many); K = 0 the best: the sequence pauses (decode steps without the draft model,
  doubling each time, a one-draft probe after), logged and counted in ``/metrics``
  (``spec_model_pauses``);
- the batch size: per number of running sequences B, whether sequences draft at all, from
  the output tokens per second of the steps themselves (``Arms``): steps of B sequences with
  drafting on (the draft model's drafts, the cache's and plain decodes, as the rules above
  pick them; only steps where the draft model drafted) against steps with it off (decodes
  only, as an engine without speculation runs them): first ``OFF_TRIAL`` steps off, then a
  trial of on (``MIN_TRIAL`` to ``TRIAL`` steps: fewer where the difference is clear); the
  better one then runs for ``FIRST_RATIO`` times what the other's trial takes at the step
  times measured, twice as long each time it stands (to ``LONGEST_RATIO``), then the other
  is tried again. On needs ``MARGIN`` more tokens per second than off. A batch size not yet
  measured starts from the closest one within a factor of two that has decided: its choice,
  held as long as there. While off at B, no sequence drafts (no probes either), so the draft
  computes nothing and no step verifies; each decision logged, the sequence-steps off
  counted in ``/metrics`` (``spec_model_off_steps``). This counts everything a step costs:
  the draft's forwards, the verify rows of both kinds of drafts and what the step's size
  does to the kernels.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

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


# ``Arms``: the steps a trial of off measures, the least and the most a trial of on measures
# (ended early where one choice brings ``CLEAR`` times the other's output per second); the
# better choice then holds for ``FIRST_RATIO`` times the other's trial at the step times
# measured, twice as long each time it stands (to ``LONGEST_RATIO`` times); on must bring
# ``MARGIN`` times the output tokens per second of off.
OFF_TRIAL, MIN_TRIAL, TRIAL, CLEAR = 4, 2, 8, 1.3
FIRST_RATIO, LONGEST_RATIO, MARGIN = 16, 256, 1.03
DECAY = 0.95  # an arm's measured steps weigh DECAY times the ones after them


class DraftCosts(StepCosts):
    """``StepCosts`` of the steps that verify the draft model's drafts: a draft row there
    costs the draft's forward too (a third of the model's at 0.5B drafting 1.5B)."""

    # a 0.5B draft's decode step costs 0.50 of a 1.5B's (its LM head over 32768 ids; 0.58
    # over all), and each verify row 0.09 of it (scripts/bench_speculation.py --cost,
    # Qwen2.5-Coder Q4_K_M, 2 cores, docs/benchmarks.md)
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


class Arms:
    """At one batch size: the draft model on or off, from the output tokens per second the
    steps of each measured (decayed sums of steps, tokens and seconds). ``choice`` is the
    better one, run first off for ``OFF_TRIAL`` steps; ``trying`` while the other one runs
    its trial (off: ``OFF_TRIAL`` steps; on: up to ``TRIAL``, ended after ``MIN_TRIAL`` where
    one is ``CLEAR``-ly better); ``left``: the measured steps until the next decision. The
    first step after the draft model turns on in which it drafts is not measured: it
    computes the draft's KV of the tokens it missed."""

    def __init__(self, near: Arms | None = None) -> None:
        self.sums = {True: np.zeros(3), False: np.zeros(3)}  # on / off: steps, tokens, seconds
        self.choice, self.trying, self.tried = False, False, 0
        self.left, self.ratio = OFF_TRIAL, FIRST_RATIO
        self.hold = 0  # the steps the last decision held its choice for (0: none yet)
        if near is not None:  # a batch size close to one decided: its choice, for its hold
            self.choice, self.left = near.choice, near.hold
        self.warming = self.choice

    def running(self) -> bool:
        """Whether the draft model drafts now."""
        return self.choice != self.trying

    def rate(self, on: bool) -> float | None:
        _, tokens, seconds = self.sums[on]
        return float(tokens / seconds) if seconds > 0.0 else None

    def step_seconds(self, on: bool) -> float:
        steps, _, seconds = self.sums[on]
        return float(seconds / steps)

    def observe(self, on: bool, drafted: bool, tokens: int, seconds: float) -> bool | None:
        """A step planned with the draft model ``on`` (or off), ``drafted`` where some of its
        sequences verified the draft model's drafts, emitted ``tokens`` in ``seconds``; the new
        choice where a trial ended (None: none did). Left out: a step planned before the last
        switch, and one with the draft model on where no sequence drafted with it (all of
        them paused or drafting from the cache: what it costs is not the draft model's)."""
        if on != self.running() or on and not drafted:
            return None
        if on and self.warming:
            self.warming = False
            return None
        sums = self.sums[on]
        sums *= DECAY
        sums += (1.0, tokens, seconds)
        self.left -= 1
        if not self.trying:
            if self.left <= 0:  # the other one's trial
                self._switch(self.choice, True, TRIAL if not self.choice else OFF_TRIAL)
            return None
        self.tried += 1
        rate_on, rate_off = self.rate(True), self.rate(False)
        if rate_on is None or rate_off is None:
            return None
        if self.left > 0 and (self.tried < MIN_TRIAL
                              or max(rate_on / rate_off, rate_off / rate_on) < CLEAR):
            return None
        best = rate_on > MARGIN * rate_off
        changed = best != self.choice
        self.ratio = FIRST_RATIO if changed else min(2 * self.ratio, LONGEST_RATIO)
        # the other one's next trial (on: and its first step) at the step times measured, a
        # ``ratio``-th of the time until then
        steps = TRIAL + 1 if not best else OFF_TRIAL
        trial = steps * self.step_seconds(not best) / self.step_seconds(best)
        self.hold = max(OFF_TRIAL, round(self.ratio * trial))
        self._switch(best, False, self.hold)
        return best

    def _switch(self, choice: bool, trying: bool, left: int) -> None:
        was = self.running()
        self.choice, self.trying, self.left, self.tried = choice, trying, left, 0
        if self.running() != was:
            self.warming = self.running()


class DraftModelPolicy:
    """Per sequence, how many drafts the draft model proposes; the counters for ``/metrics``."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.costs = DraftCosts()
        self.drafted_tokens = 0  # the draft model's drafts verified
        self.accepted_tokens = 0  # of those, accepted
        self.pauses = 0  # sequences' pauses of the draft model (not worth its cost)
        self.off_steps = 0  # sequence-steps without it: slower with it at their batch size
        self._arms: dict[int, Arms] = {}  # by batch size: on or off, measured

    def pays(self, num_running: int) -> bool:
        """Whether sequences draft at all (the draft model's drafts or the cache's) while
        ``num_running`` run: its ``Arms`` at that batch size."""
        on = self.drafting(num_running)
        self.off_steps += not on
        return on

    def drafting(self, num_running: int) -> bool:
        """Whether steps of ``num_running`` sequences are planned with the draft model on."""
        return self._arms_at(num_running).running()

    def catching_up(self, num_running: int) -> bool:
        """Whether a step of ``num_running`` sequences with the draft model's drafts is the
        first since it turned on there: its draft computes the KV of the tokens it missed,
        so its time is no measure of what a draft costs (``DraftCosts`` leaves it out; taken
        in, it bent the fit of a draft row's cost)."""
        return self._arms_at(num_running).warming

    def _arms_at(self, size: int) -> Arms:
        """The ``Arms`` at batch size ``size``; a new one starts from the closest size within
        a factor of two that has decided (its choice for its hold), else on."""
        arms = self._arms.get(size)
        if arms is None:
            near = sorted((abs(b - size), b) for b, a in self._arms.items()
                          if a.hold and max(b, size) <= 2 * min(b, size))
            arms = self._arms[size] = Arms(self._arms[near[0][1]] if near else None)
        return arms

    def step_took(self, num_running: int, on: bool, drafted: bool, tokens: int,
                  seconds: float) -> None:
        """A step of decodes and verifies of ``num_running`` sequences, planned with the draft
        model ``on`` (or off; ``drafted``: some of them drafted with it), emitted ``tokens``
        in ``seconds``."""
        arms = self._arms_at(num_running)
        choice = arms.observe(on, drafted, tokens, seconds)
        if choice is not None:
            logger.info("the draft model is %s at %d running sequences for %d steps (%.1f "
                        "output tokens/s with it, %.1f without)", "on" if choice else "off",
                        num_running, arms.hold, arms.rate(True), arms.rate(False))

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
