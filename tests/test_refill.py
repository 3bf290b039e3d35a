"""Waiting for finished requests' replacements (scheduler/refill.py): the rule with a fake
clock, and the scheduler process's decisions driven in process over the real model runner (the
loop's own methods, without its sockets), outputs against transformers."""

from __future__ import annotations

import numpy as np
import pytest

from engine.contracts.protocol import decode, encode, unpack_ids
from engine.contracts.sampling_params import SamplingParams
from scheduler.process import SchedulerLoop
from scheduler.refill import RefillWait, ends_next_step
from scheduler.request import Request, Seq, Status
from tests.test_scheduler import Harness, hf_greedy, hf_model, model_dir  # noqa: F401

WAIT = 0.05  # seconds (the default --refill-wait-ms)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_waits_for_as_many_arrivals_as_finished_within_the_bound():
    clock = Clock()
    refill = RefillWait(WAIT, clock=clock)
    refill.finished(3, settling=True)
    assert refill.hold_seconds() == pytest.approx(WAIT)
    refill.arrived()
    refill.arrived()
    clock.now += 0.01
    assert refill.hold_seconds() == pytest.approx(WAIT - 0.01)
    refill.arrived()
    assert refill.hold_seconds() == 0.0
    # finishes add up while the engine settles; the bound runs from the last one
    refill.finished(2, settling=True)
    refill.arrived()
    clock.now += WAIT / 2
    refill.finished(1, settling=True)
    assert refill.expected == 2 and refill.hold_seconds() == pytest.approx(WAIT)
    clock.now += WAIT
    assert refill.hold_seconds() == 0.0 and refill.expected == 0
    # anything running on past its next step: no wait; nor with a bound of 0
    refill.finished(4, settling=False)
    assert refill.hold_seconds() == 0.0
    off = RefillWait(wait_s=0.0, clock=clock)
    off.finished(4, settling=True)
    assert off.hold_seconds() == 0.0


def test_ends_next_step_only_at_the_last_token():
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    def running(outputs: int, **fields) -> Request:
        req = Request("r", np.array([5, 6, 7, 8]), params, 0, None, 0.0, **fields)
        seq = Seq(req, 0, [5, 6, 7, 8] + [9] * outputs, status=Status.RUNNING)
        seq.computed = len(seq.tokens) - 1
        req.seqs.append(seq)
        return req

    assert ends_next_step(running(2), context_len=100)
    assert not ends_next_step(running(1), context_len=100)
    assert ends_next_step(running(1), context_len=6)  # the context ends it
    assert not ends_next_step(running(2, session_id="s"), context_len=100)  # a closing step follows
    closing = running(2)
    closing.seqs[0].closing = True
    assert not ends_next_step(closing, context_len=100)


def _loop(h: Harness, clock: Clock) -> SchedulerLoop:
    """The scheduler process's decisions over ``h``'s scheduler, without its sockets."""
    loop = SchedulerLoop.__new__(SchedulerLoop)
    loop.sched, loop.refill = h.sched, RefillWait(WAIT, clock=clock)
    return loop


def _arrive(h: Harness, loop: SchedulerLoop, rid: str, prompt: list[int], params) -> None:
    h.add(rid, prompt, params)
    loop.refill.arrived()


def _iterate(h: Harness, loop: SchedulerLoop, during=None) -> list[str] | None:
    """One pass of the loop with nothing in flight: the rids of the step it ran (None: held);
    ``during``, if given, is called while the step runs (after it was planned)."""
    if loop._hold():
        return None
    batch = loop._plan()
    if batch is None:
        return None
    rids = [e.seq.req.rid for e in h.sched.inflight[-1][1]]
    if during is not None:
        during()
    result = h.worker.step(decode(encode(batch)))
    before = len(h.sched.requests)
    h.sched.process_result(decode(encode(result)))
    loop.refill.finished(before - len(h.sched.requests), loop._settling())
    h.sched.check()
    for out in h.sched.take_outputs().get(0, []):
        seqs = h.outputs.setdefault(out.rid, {})
        seqs[out.index] = seqs.get(out.index, []) + unpack_ids(out.token_ids).tolist()
    return rids


def test_replacements_prefill_together_and_decode_as_transformers(model_dir, hf_model):  # noqa: F811
    clock = Clock()
    h = Harness(model_dir, overlap_schedule="off")
    loop = _loop(h, clock)
    prompts = [[11 + i, 22, 33 + 2 * i, 44, 55 + i] for i in range(6)]
    short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    longer = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    _arrive(h, loop, "a1", prompts[0], short)
    _arrive(h, loop, "a2", prompts[1], short)
    _arrive(h, loop, "b", prompts[2], longer)
    assert _iterate(h, loop) == ["a1", "a2", "b"]  # nothing had finished: no wait
    assert _iterate(h, loop) == ["a1", "a2", "b"]
    assert _iterate(h, loop) == ["a1", "a2", "b"]  # a1 and a2 end; b ends at its next step
    assert loop.refill.expected == 2
    _arrive(h, loop, "c", prompts[3], short)
    # b runs its last token alone: c waits for the other replacement
    assert _iterate(h, loop) == ["b"]
    assert not h.sched.running and loop.refill.expected == 2  # 2 - c + b
    assert _iterate(h, loop) is None  # idle: held
    _arrive(h, loop, "d", prompts[4], short)
    assert _iterate(h, loop) is None
    _arrive(h, loop, "e", prompts[5], short)
    assert _iterate(h, loop) == ["c", "d", "e"]  # all three prefill in one step
    while h.sched.running or h.sched.waiting:
        _iterate(h, loop)
    for rid, prompt, n in zip("a1 a2 b c d e".split(), prompts, (3, 3, 4, 3, 3, 3), strict=True):
        assert h.outputs[rid][0] == hf_greedy(hf_model, prompt, n), rid
    h.assert_idle_clean()


def test_the_wait_ends_at_its_bound(model_dir):  # noqa: F811
    clock = Clock()
    h = Harness(model_dir, overlap_schedule="off")
    loop = _loop(h, clock)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for i in range(3):
        _arrive(h, loop, f"a{i}", [7 + i, 8, 9], params)
    while h.sched.running or h.sched.waiting:
        assert _iterate(h, loop)
    assert loop.refill.expected == 3
    _arrive(h, loop, "late", [5, 6, 7], params)
    assert _iterate(h, loop) is None
    clock.now += WAIT
    assert _iterate(h, loop) == ["late"]
    while h.sched.running:
        _iterate(h, loop)
    h.assert_idle_clean()


def test_a_backlog_is_not_held_for_replacements(model_dir):  # noqa: F811
    """Requests already waiting when a cohort finishes (a backlog: more than a step takes) run
    at once: none of them is a replacement to wait for, and the engine would idle beside them."""
    clock = Clock()
    h = Harness(model_dir, overlap_schedule="off", max_running_requests=2)
    loop = _loop(h, clock)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for i in range(4):
        _arrive(h, loop, f"r{i}", [7 + i, 8, 9], params)
    assert _iterate(h, loop) == ["r0", "r1"]
    assert _iterate(h, loop) == ["r0", "r1"]  # they end; r2 and r3 waited all along
    assert not h.sched.running and len(h.sched.waiting) == 2
    assert _iterate(h, loop) == ["r2", "r3"]  # not held: no clock moves
    while h.sched.running:
        _iterate(h, loop)
    h.assert_idle_clean()


def test_a_backlog_is_what_an_admitting_step_left_waiting():
    clock = Clock()
    refill = RefillWait(WAIT, clock=clock)
    refill.admitted(2)  # two did not fit
    refill.finished(3, settling=True)
    assert refill.expected == 1  # the backlog takes two of the three places
    refill.arrived()
    refill.finished(2, settling=True)  # no step admitted since: nothing is a backlog now
    assert refill.expected == 2


def test_a_cohort_replaced_a_step_early_waits_for_the_next_cohorts_replacements(model_dir):  # noqa: F811
    """Cohorts ending a step apart: the first cohort's replacements, in before the second
    cohort's last step ends, are not a backlog; the second's are awaited, and all prefill in
    one step (counting them as a backlog ran the early ones beside only some of the rest, and
    the cohorts stayed split: docs/benchmarks.md, "Prefill on AMX")."""
    clock = Clock()
    h = Harness(model_dir, overlap_schedule="off")
    loop = _loop(h, clock)
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    longer = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for i in range(2):
        _arrive(h, loop, f"a{i}", [7 + i, 8, 9], short)
    for i in range(3):
        _arrive(h, loop, f"b{i}", [17 + i, 8, 9], longer)
    assert len(_iterate(h, loop)) == 5
    assert len(_iterate(h, loop)) == 5  # the a's end; the b's end at their next step
    assert loop.refill.expected == 2

    def replace_the_as() -> None:
        for i in range(2):
            _arrive(h, loop, f"c{i}", [27 + i, 8, 9], short)

    assert _iterate(h, loop, during=replace_the_as) == ["b0", "b1", "b2"]
    assert not h.sched.running and loop.refill.expected == 3
    assert _iterate(h, loop) is None  # held for the b's replacements
    for i in range(3):
        _arrive(h, loop, f"d{i}", [37 + i, 8, 9], short)
    assert _iterate(h, loop) == ["c0", "c1", "d0", "d1", "d2"]
    while h.sched.running:
        _iterate(h, loop)
    h.assert_idle_clean()


@pytest.mark.parametrize("value", [float("inf"), 1e12, -1.0])
def test_a_wait_past_its_bound_is_refused(value):
    """An endless (or negative) wait is refused with a sentence, not taken: the loop would hold
    an idle engine's waiting requests that long (inf: poll's timeout cannot be an int)."""
    from engine.contracts.engine_config import EngineConfig

    with pytest.raises(ValueError, match="--refill-wait-ms must be"):
        EngineConfig(model="demo", refill_wait_ms=value).validate()
    EngineConfig(model="demo", refill_wait_ms=1000).validate()
