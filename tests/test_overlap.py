"""Overlap scheduling: the next step is planned and queued while the worker runs the current
one (placeholders for the tokens it samples). Outputs must equal serial scheduling's, token for
token, with every page accounted for after every step (the harness checks)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from engine.contracts.protocol import TokenizedRequest, pack_ids
from engine.contracts.sampling_params import SamplingParams
from engine.contracts.step import BatchInput
from engine.contracts.worker_messages import ForwardBatch, RowSampling
from tests.test_scheduler import Harness


@pytest.fixture(scope="module")
def model_dir(harness_model_dir: str) -> str:
    return harness_model_dir


def _mixed_workload(h: Harness, stop_token: int) -> None:
    rng = np.random.default_rng(7)
    system = rng.integers(3, 4000, 120).tolist()
    kinds = [
        SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.9, seed=3, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=8, temperature=1.0, n=2, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=6, beam_width=2, n=2),
        SamplingParams(max_tokens=10, temperature=0.8, seed=5, repetition_penalty=1.3,
                       ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                       stop_token_ids=[stop_token]),
    ]
    for i in range(12):
        prompt = system[: int(rng.integers(70, 120))] + rng.integers(3, 4000, 7).tolist()
        h.add(f"r{i}", prompt, kinds[i % len(kinds)])
        if i % 3 == 2:
            h.step()
    h.run()


def test_overlap_gives_the_outputs_of_serial_steps(model_dir):
    """Greedy, seeded sampling with logprobs, n > 1, beams, penalties and a stop token over a
    shared head with chunked prefill: overlap changes only when steps are planned."""
    runs = {}
    for overlap in (False, True):
        h = Harness(model_dir, num_pages=256, page_size=4, chunked_prefill_size=24,
                            overlap_schedule='on' if overlap else 'off')
        _mixed_workload(h, stop_token=17)
        runs[overlap] = h
    serial, overlapped = runs[False], runs[True]
    assert serial.ahead == 0
    # Batches with forks, beam steps or penalties wait for their outputs: few steps overlap here.
    assert overlapped.ahead > 0
    assert overlapped.outputs == serial.outputs
    reasons = {rid: [f.finish_reason for f in finals] for rid, finals in serial.finals.items()}
    assert {rid: [f.finish_reason for f in finals]
            for rid, finals in overlapped.finals.items()} == reasons
    # Admission happens a step earlier, before chunks in flight reach the tree; a prompt whose
    # head is being prefilled waits for it (scheduler/policy.py), so sharing is not lost.
    hits = [h.sched.tree.stats.hit_tokens for h in (serial, overlapped)]
    assert hits[1] >= 0.95 * hits[0], hits


def test_plain_decoding_overlaps_every_step(model_dir):
    """Greedy and seeded sampled requests (no forks, beams or penalties): after the first step
    every step is planned while the previous one is still queued."""
    runs = {}
    for overlap in (False, True):
        h = Harness(model_dir, num_pages=128, overlap_schedule='on' if overlap else 'off')
        for i in range(6):
            h.add(f"g{i}", [5 + i, 6, 7, 8], SamplingParams(max_tokens=20, temperature=0.0,
                                                             ignore_eos=True))
            h.add(f"s{i}", [9, 10 + i], SamplingParams(max_tokens=16, temperature=0.8, seed=i,
                                                       ignore_eos=True))
        h.run()
        runs[overlap] = h
    assert runs[True].outputs == runs[False].outputs
    assert runs[True].ahead >= runs[True].steps - 2, (runs[True].ahead, runs[True].steps)


def test_a_stop_inside_a_look_ahead_step_ends_the_sequence_there(model_dir):
    """The step after a stop token was already queued (it computes one more token for the
    finished sequence): the output ends at the stop token and that row is dropped."""
    free = Harness(model_dir, num_pages=64)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    free.add("free", [5, 6, 7], params)
    free.run()
    first = free.outputs["free"][0]
    stop_at = first[4]
    h = Harness(model_dir, num_pages=64)
    h.add("stopped", [5, 6, 7], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                               stop_token_ids=[stop_at]))
    h.run()
    assert h.ahead > 0
    assert h.outputs["stopped"][0] == first[: first.index(stop_at) + 1]
    assert h.finals["stopped"][0].finish_reason == "stop"


def test_a_session_turn_ending_inside_a_look_ahead_step_is_cached_to_its_end(model_dir):
    """A session turn needs its last token's KV in the tree. A turn that ends on a stop token
    was already queued for one more step, which computes that KV (its sample is dropped); one
    that ends at max_tokens gets its closing step. Either way the next turn hits the whole
    history."""
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    free = Harness(model_dir, num_pages=64, page_size=4)
    free.add("free", [100, 200, 300], greedy)
    free.run()
    stop_at = free.outputs["free"][0][2]
    h = Harness(model_dir, num_pages=64, page_size=4)
    h.sched.sessions.open("s", ttl=60.0)
    history: list[int] = []
    for turn, stop in enumerate([[stop_at], [], []]):
        prompt = history + [100 + turn, 200 + turn, 300 + turn] if turn else [100, 200, 300]
        params = msgspec.structs.replace(greedy, stop_token_ids=stop)
        h.sched.add_request(TokenizedRequest(rid=f"t{turn}", prompt_ids=pack_ids(prompt),
                                             params=params, reply_to=0, session_id="s"))
        while not h.sched.idle:  # (not h.run(): the pinned history holds pages at idle)
            h.step()
        assert h.finals[f"t{turn}"][0].cached_tokens == len(history)
        output = h.outputs[f"t{turn}"][0]
        if stop:
            assert output == free.outputs["free"][0][:3]
        history = prompt + output
        assert h.sched.sessions.pinned_tokens == len(history)
    assert h.ahead > 0


def test_the_worker_refuses_a_placeholder_its_previous_batch_did_not_sample(model_dir):
    h = Harness(model_dir, num_pages=16)
    step = BatchInput.build([([0, 1], 0, [5, -3])], page_size=16)
    msg = ForwardBatch(batch_id=1, step=step, sampling=[RowSampling(SamplingParams(), 0)])
    with pytest.raises(ValueError, match="row 2 of the previous batch"):
        h.worker.step(msg)


def test_a_next_turn_sent_during_the_closing_step_waits_for_it(model_dir):
    """A client sends its next turn as soon as the last token arrives, while the turn's closing
    step (its last token's KV) may still be queued: the next turn is admitted after that step
    came back, so it hits the whole history, as with serial steps."""
    h = Harness(model_dir, num_pages=64, page_size=4)
    h.sched.sessions.open("s", ttl=60.0)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = [100, 200, 300]
    h.sched.add_request(TokenizedRequest(rid="t0", prompt_ids=pack_ids(first), params=params,
                                         reply_to=0, session_id="s"))
    while "t0" not in h.finals:
        h.step()
    assert not h.sched.idle  # the closing step is still to run or in flight
    history = first + h.outputs["t0"][0]
    h.sched.add_request(TokenizedRequest(rid="t1", prompt_ids=pack_ids(history + [7, 8]),
                                         params=params, reply_to=0, session_id="s"))
    while not h.sched.idle:
        h.step()
    assert h.finals["t1"][0].cached_tokens == len(history)
