"""When a draft model drafts at all (scheduler/draft_model.py, ``Arms``): at each batch size,
from the output tokens per second that steps with it and steps without it measured. The
steps' times are given (``DraftModelPolicy.step_took``) or faked from what each step holds, so
the decisions do not hang on how loaded the machine is; the models and the harness are those
of tests/test_draft_model.py."""

from __future__ import annotations

import itertools
import logging

import pytest

from engine.contracts.sampling_params import SamplingParams
from scheduler.draft_model import (
    FIRST_RATIO,
    MIN_TRIAL,
    OFF_TRIAL,
    TRIAL,
    DraftModelPolicy,
)
from scheduler.speculation import Speculator
from tests.test_draft_model import models, run, spec, workload  # noqa: F401 (a fixture)
from tests.test_scheduler import Harness


def test_the_draft_model_turns_off_where_its_steps_emit_less_and_tries_it_again(caplog):
    """At each batch size, steps without the draft model are measured first (output tokens per
    second, ``OFF_TRIAL`` steps), then steps with it (its first not measured: the draft's
    catch-up): ``TRIAL`` steps, or ``MIN_TRIAL`` where one is ``CLEAR``-ly better. The better
    one then holds for ``FIRST_RATIO`` times the other's trial at the step times measured,
    twice that each time it stands (its first decision confirms off). At 8 sequences the
    steps with it emit 30 tokens/s (1/3 s a step), without it 50 (0.2 s): off after 2 steps
    with it, held 2 * 16 * 9 * (1/3) / 0.2 = 480 steps, then 960; at 1, 60 against 50 (1/6 s):
    on after 8, held 16 * 4 * 0.2 * 6 = 77 steps (and its first), then 154. Each decision
    logged, the sequence-steps off counted. A step planned before a switch is not counted
    for the new choice, nor one with it on where no sequence drafted with it. A size never
    measured takes the choice of the closest one within a factor of two that has decided."""
    policy = DraftModelPolicy(4)

    def run(batch: int, rate_on: float, rate_off: float, count: int) -> list[tuple[bool, int]]:
        seen = []
        for _ in range(count):
            on = policy.pays(batch)
            seen.append(on)
            policy.step_took(batch, on, on, 10, 10 / (rate_on if on else rate_off))
        return [(on, len(list(steps))) for on, steps in itertools.groupby(seen)]

    assert (OFF_TRIAL, MIN_TRIAL, TRIAL, FIRST_RATIO) == (4, 2, 8, 16)
    with caplog.at_level(logging.INFO, logger="radixserve.scheduler"):
        assert run(8, 30.0, 50.0, 7) == [(False, 4), (True, 3)]
        policy.step_took(8, True, True, 10, 0.01)  # planned with it on: left out
        assert run(8, 30.0, 50.0, 480 + 3 + 5) == [(False, 480), (True, 3), (False, 5)]
        policy.step_took(1, False, False, 10, 0.2)
        policy.step_took(1, True, False, 10, 0.01)  # left out: none drafted with it
        assert run(1, 60.0, 50.0, 3 + 86 + 4 + 155 + 2) == [
            (False, 3), (True, 86), (False, 4), (True, 155), (False, 2)]
    assert policy.pays(5) is False and policy.drafting(2) and not policy.drafting(3)
    off = 4 + 480 + 5 + 3 + 4 + 2 + 1
    assert policy.off_steps == off and policy.stats()["spec_model_off_steps"] == off
    assert [r.getMessage() for r in caplog.records] == [
        f"the draft model is {on} at {size} running sequences for {steps} steps ({rate_on} "
        f"output tokens/s with it, {rate_off} without)" for on, size, steps, rate_on, rate_off
        in (("off", 8, 480, 30.0, 50.0), ("off", 8, 960, 30.0, 50.0),
            ("on", 1, 77, 60.0, 50.0), ("on", 1, 154, 60.0, 50.0))]


@pytest.mark.parametrize("row_cost", [0.5, 0.001])
def test_faked_step_times_turn_the_draft_model_off_where_it_loses(models, monkeypatch,  # noqa: F811
                                                                  row_cost):
    """Steps' times faked from what they hold: 0.1 s, and ``row_cost`` for each of the draft
    model's drafts (its forward and verify row). At 0.5 s a draft, the steps with it emit
    fewer tokens per second than those without, though every draft is accepted: the draft
    model stops drafting and, while off, computes nothing (no draft forward) and no sequence
    verifies drafts (not the cache's either); at 0.001 s it
    drafts after its first steps without it. Greedy outputs are those without it."""
    step_took = Speculator.step_took
    monkeypatch.setattr(Speculator, "step_took", lambda self, entries, seconds: step_took(
        self, entries, 0.1 + row_cost * sum(len(e.drafts) for e in entries if e.model_drafts)))
    monkeypatch.setattr(Speculator, "_cache_rate", lambda self, seq, count, n: 0.0)
    requests = {rid: (prompt, SamplingParams(max_tokens=110, temperature=0.0, ignore_eos=True))
                for rid, (prompt, _) in workload(seed=7, count=4).items()}
    base = run(models["target"], requests, page_size=4, num_pages=400)
    h = Harness(models["target"], page_size=4, num_pages=400,
                speculative_config=spec(models["same"]))
    draft, model = h.worker.draft, h.sched.speculator.model
    for rid, (prompt, params) in requests.items():
        h.add(rid, prompt, params)
    computed = []  # after each step: whether it is on, the draft's tokens computed, verifies
    while not h.sched.idle:
        h.step()
        computed.append((model.drafting(4), draft.tokens_computed,
                         h.sched.speculator.verifications))
        assert len(computed) < 2000, "the scheduler did not finish"
    h.assert_idle_clean()
    assert h.outputs == base.outputs
    assert model.accepted_tokens == model.drafted_tokens > 0
    if row_cost > 0.01:
        # the longest run of steps planned with it off (the one after its trial)
        runs = itertools.groupby(range(1, len(computed)), lambda i: computed[i - 1][0])
        off = max((list(steps) for on, steps in runs if not on), key=len)
        assert len(off) >= 64 and model.off_steps >= 4 * 64
        # two steps after the switch (one planned before it, one in flight), no draft forward
        # and no verification (of the draft model's drafts or the cache's)
        assert all(computed[i][1:] == computed[off[2]][1:] for i in off[2:])
        assert model.drafted_tokens < sum(len(o[0]) for o in h.outputs.values()) // 2
    else:
        # its first steps without it (and up to two planned before they were measured)
        assert 4 * OFF_TRIAL <= model.off_steps <= 4 * (OFF_TRIAL + 2) and model.drafting(4)
        assert model.accepted_tokens > sum(len(o[0]) for o in h.outputs.values()) // 2


def test_the_drafts_catch_up_is_not_taken_for_what_a_draft_costs(models, monkeypatch):  # noqa: F811
    """The first step with the draft model's drafts after it turns on at a batch size also
    computes the draft's KV of every token it missed (the prompts, the steps without it): its
    time is no measure of what a draft costs (taken for one, it bent the fit of a draft row's
    cost: here to a share of 0, the later steps having more drafts in less time than it).
    Steps' times faked: 0.1 s, 0.005 s for each of the draft model's drafts, and 1 s more
    where the draft computed more than one token of each sequence beyond its drafts (a
    catch-up). The draft row's share of a step of 4 sequences is then that of the drafts
    alone, 0.005 * 4 / 0.1."""
    step_took = Speculator.step_took
    computed = [0]

    def timed(self, entries, seconds):
        draft = h.worker.draft
        extra = draft.tokens_computed - computed[0]
        computed[0] = draft.tokens_computed
        drafts = sum(len(e.drafts) for e in entries if e.model_drafts)
        caught_up = extra - drafts > len(entries)
        catch_ups.append(caught_up)
        step_took(self, entries, 0.1 + 0.005 * drafts + caught_up)

    catch_ups: list[bool] = []
    monkeypatch.setattr(Speculator, "step_took", timed)
    monkeypatch.setattr(Speculator, "_cache_rate", lambda self, seq, count, n: 0.0)
    requests = {rid: (prompt, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
                for rid, (prompt, _) in workload(seed=7, count=4).items()}
    h = Harness(models["target"], page_size=4, num_pages=400,
                speculative_config=spec(models["same"]))
    for rid, (prompt, params) in requests.items():
        h.add(rid, prompt, params)
    h.run()
    h.assert_idle_clean()
    model = h.sched.speculator.model
    assert any(catch_ups) and model.accepted_tokens == model.drafted_tokens > 0
    assert model.costs.share(4) == pytest.approx(0.005 * 4 / 0.1)
