"""When a draft model drafts at all (scheduler/draft_model.py, ``Arms``): at each batch size,
from the output tokens per second that steps with it and steps without it measured. The
steps' times are given (``DraftModelPolicy.step_took``) or faked from what each step holds, so
the decisions do not hang on how loaded the machine is; the models and the harness are those
of tests/test_draft_model.py."""

from __future__ import annotations

import logging

import pytest

from engine.contracts.sampling_params import SamplingParams
from scheduler.draft_model import FIRST_HOLD, TRIAL, DraftModelPolicy
from scheduler.speculation import Speculator
from tests.test_draft_model import models, run, spec, workload  # noqa: F401 (a fixture)
from tests.test_scheduler import Harness


def test_the_draft_model_turns_off_where_its_steps_emit_less_and_tries_it_again(caplog):
    """At each batch size, the steps with the draft model and those without are measured
    (output tokens per second) ``TRIAL`` steps each; the better one holds, the other tried
    again after ``FIRST_HOLD`` steps where the choice changed, twice the last hold where it
    stands. At 8 sequences the steps with it
    emit 40 tokens/s, without it 50: off (logged once, its sequence-steps counted); at 1, 60
    against 50: on. A step planned before a switch is not counted for the new choice."""
    policy = DraftModelPolicy(4)

    def run(batch: int, rate_on: float, rate_off: float, count: int) -> list[bool]:
        seen = []
        for _ in range(count):
            on = policy.pays(batch)
            seen.append(on)
            policy.step_took(batch, on, 10, 10 / (rate_on if on else rate_off))
        return seen

    with caplog.at_level(logging.INFO, logger="radixserve.scheduler"):
        assert run(8, 40.0, 50.0, 12) == [True] * TRIAL + [False] * TRIAL
        policy.step_took(8, True, 10, 0.01)  # planned with it on: left out
        assert run(8, 40.0, 50.0, FIRST_HOLD + TRIAL + 2 * FIRST_HOLD) == (
            [False] * FIRST_HOLD + [True] * TRIAL + [False] * 2 * FIRST_HOLD)
        assert run(1, 60.0, 50.0, 3 * TRIAL + 6 * FIRST_HOLD) == (
            [True] * TRIAL + [False] * TRIAL + [True] * 2 * FIRST_HOLD + [False] * TRIAL
            + [True] * 4 * FIRST_HOLD)
    assert policy.pays(4)  # never measured
    off = TRIAL + FIRST_HOLD + 2 * FIRST_HOLD + 2 * TRIAL
    assert policy.off_steps == off and policy.stats()["spec_model_off_steps"] == off
    assert [r.getMessage() for r in caplog.records] == [
        "the draft model is off at 8 running sequences (40.0 output tokens/s with it, 50.0 "
        "without)"]


@pytest.mark.parametrize("row_cost", [0.5, 0.001])
def test_faked_step_times_turn_the_draft_model_off_where_it_loses(models, monkeypatch,  # noqa: F811
                                                                  row_cost):
    """Steps' times faked from what they hold: 0.1 s, and ``row_cost`` for each of the draft
    model's drafts (its forward and verify row). At 0.5 s a draft, the steps with it emit
    fewer tokens per second than those without, though every draft is accepted: the draft
    model stops drafting and, while off, computes nothing (no draft forward); at 0.001 s it
    keeps drafting after its trial of steps without it. Greedy outputs are those without it."""
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
    computed = []  # after each step: whether it is on, the draft's tokens computed
    while not h.sched.idle:
        h.step()
        computed.append((model.drafting(4), draft.tokens_computed))
        assert len(computed) < 2000, "the scheduler did not finish"
    h.assert_idle_clean()
    assert h.outputs == base.outputs
    assert model.accepted_tokens == model.drafted_tokens > 0
    if row_cost > 0.01:
        off = [i for i in range(1, len(computed)) if not computed[i - 1][0]]
        assert len(off) >= FIRST_HOLD and model.off_steps >= 4 * FIRST_HOLD
        # two steps after the switch (one planned before it, one in flight), nothing more
        quiet = off[2 : FIRST_HOLD]
        assert all(computed[i][1] == computed[quiet[0]][1] for i in quiet)
        assert model.drafted_tokens < sum(len(o[0]) for o in h.outputs.values()) // 2
    else:
        # its trial of steps without it (and a step planned before the trial ended)
        assert 4 * TRIAL <= model.off_steps <= 4 * (TRIAL + 1) and model.drafting(4)
        assert model.accepted_tokens > sum(len(o[0]) for o in h.outputs.values()) // 2
