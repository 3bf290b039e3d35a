"""Speculative decoding with no draft model (scheduler/speculation.py): the option, prompt
lookup, verification in one step and its rollback, driven in-process with the accounting
check after every step (the harness). Outputs are compared with decoding without drafts.

Most tests draft with an oracle (the continuation the run without drafts produced, with a
wrong token at a position that varies by step), so that verification sees full acceptance,
rejection at every position and stops inside accepted drafts; the demo model's random
weights rarely repeat themselves, which the ngram proposer needs."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest
import torch

from engine.checkpoints.demo_model import build_demo_model
from engine.contracts.engine_config import EngineConfig
from engine.contracts.sampling_params import SamplingParams
from scheduler import speculation
from scheduler.ngram import propose_ngram
from tests.test_scheduler import Harness


@pytest.fixture(scope="module")
def model_dir() -> str:
    # the demo model, not the scheduler tests' smaller one (harness_model_dir): how much is
    # drafted follows the steps' measured times (StepCosts), and the smaller model's steps are
    # a third as long, so a pause on a busy machine weighs three times as much (with it,
    # tests/test_suffix.py's retries test failed once in six runs on a busy 2-core machine)
    return str(build_demo_model())


@pytest.fixture(autouse=True)
def untimed_steps(monkeypatch):
    """The steps' times are not fed to the drafting rules (their priors decide), so which
    steps verify drafts, and so which rows' logits come from a verify step, does not hang on
    how loaded the machine is; the rules' use of measured times is tested on given ones
    (tests/test_speculation_rules.py)."""
    monkeypatch.setattr(speculation.Speculator, "step_took", lambda self, entries, seconds: None)


def spec(k: int = 4, **extra) -> str:
    return json.dumps({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
                       "prompt_lookup_max": 3, **extra})


class Oracle:
    """Drafts the continuation a reference run produced; the draft at position
    ``len(tokens) % wrong_every`` (when inside the draft) is made wrong."""

    def __init__(self, sequences: list[list[int]], wrong_every: int = 3) -> None:
        self.sequences = sequences
        self.wrong_every = wrong_every
        self.calls = 0

    def __call__(self, tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
        self.calls += 1
        have = tokens.tolist()
        for ref in self.sequences:
            if len(ref) > len(have) and ref[: len(have)] == have:
                draft = ref[len(have) : len(have) + k]
                wrong = len(have) % self.wrong_every if self.wrong_every else len(draft)
                if wrong < len(draft):
                    draft[wrong] = (draft[wrong] + 1) % 4000 + 3
                return np.array(draft, dtype=np.int64)
        return tokens[:0]


def run(model_dir: str, requests: dict[str, tuple[list[int], SamplingParams]],
        **options) -> Harness:
    h = Harness(model_dir, **options)
    h.seen = []  # every SeqOutput, in order
    take = h.sched.take_outputs

    def recording() -> dict:
        outputs = take()
        h.seen.extend(outputs.get(0, []))
        return outputs

    h.sched.take_outputs = recording
    for rid, (prompt, params) in requests.items():
        h.add(rid, prompt, params)
    h.run()
    return h


def references(h: Harness, requests) -> list[list[int]]:
    return [requests[rid][0] + out for rid, outs in h.outputs.items() for out in outs.values()]


def assert_same_outputs(base: Harness, spec_run: Harness) -> None:
    assert spec_run.outputs == base.outputs
    reasons = {rid: sorted((f.index, f.finish_reason) for f in finals)
               for rid, finals in base.finals.items()}
    assert {rid: sorted((f.index, f.finish_reason) for f in finals)
            for rid, finals in spec_run.finals.items()} == reasons


def workload(seed: int = 0, count: int = 6, max_tokens: int = 24) -> dict:
    """Prompts with and without repeats (a passage, something else, the passage's head)."""
    rng = np.random.default_rng(seed)
    requests = {}
    for i in range(count):
        passage = rng.integers(3, 4000, int(rng.integers(12, 40))).tolist()
        prompt = passage + [11, 12] + passage[:6] if i % 2 else passage
        requests[f"r{i}"] = (prompt, SamplingParams(max_tokens=max_tokens + i, temperature=0.0,
                                                    ignore_eos=True))
    return requests


# ------------------------------------------------------------------------------ the option


# ------------------------------------------------------------------------------ the proposer


# ------------------------------------------------------------------------ greedy identity
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_outputs_are_those_of_decoding_without_drafts(model_dir, page_size, monkeypatch):
    """Oracle drafts (full, partial and no acceptance) and then the real prompt lookup, with
    chunked prefill: token for token the same outputs."""
    options = dict(page_size=page_size, num_pages=2048 // page_size, chunked_prefill_size=8,
                   max_prefill_tokens=24)
    requests = workload()
    base = run(model_dir, requests, **options)
    oracle = Oracle(references(base, requests))
    monkeypatch.setattr(speculation, "propose_ngram", oracle)
    drafted = run(model_dir, requests, speculative_config=spec(), **options)
    assert_same_outputs(base, drafted)
    s = drafted.sched.speculator
    assert 0 < s.accepted_tokens < s.drafted_tokens, (s.accepted_tokens, s.drafted_tokens)
    assert drafted.steps < base.steps
    monkeypatch.setattr(speculation, "propose_ngram", propose_ngram)
    looked_up = run(model_dir, requests, speculative_config=spec(), **options)
    assert_same_outputs(base, looked_up)
    assert looked_up.sched.speculator.drafted_tokens > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_verify_step_gives_the_logits_of_decode_steps(model_dir, dtype):
    """A verify step (the last token and 5 drafts, 6 logits rows) against 6 decode steps of the
    same tokens, on the compiled kernel's path: the same logits within the dtype's rounding of
    the projections (their matrix products take 6 rows at once), the same greedy tokens; the
    attention itself is the decode kernel's, row for row."""
    from engine.contracts.step import StepBuilder
    from engine.worker.runner import ModelRunner

    runner = ModelRunner(EngineConfig(model=model_dir, num_pages=64, page_size=16, dtype=dtype))
    assert runner.attention._paged_decode is not None
    rng = np.random.default_rng(8)
    prompt, new = rng.integers(3, 4000, 37).tolist(), rng.integers(3, 4000, 6).tolist()
    decoded, verified = list(range(0, 4)), list(range(8, 12))
    for pages in (decoded, verified):
        builder = StepBuilder(16)
        builder.add(pages, 0, prompt)
        runner.forward(builder.finish())
    steps = []
    for i, token in enumerate(new):
        builder = StepBuilder(16)
        builder.add(decoded, len(prompt) + i, [token])
        steps.append(runner.forward(builder.finish()).clone())
    builder = StepBuilder(16)
    builder.add(verified, len(prompt), new, num_drafts=5)
    batch = builder.finish()
    verify = runner.forward(batch)
    assert [g.paged is not None for g in runner.attention._groups] == [True]
    decode = torch.cat(steps)
    assert verify.shape == decode.shape == (6, runner.config.vocab_size)
    tolerance = 1e-4 if dtype == "float32" else 0.05
    torch.testing.assert_close(verify, decode, atol=tolerance, rtol=0)
    assert torch.equal(verify.argmax(-1), decode.argmax(-1))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_drafts_keeps_outputs_identical(model_dir, mode, monkeypatch):
    options = dict(num_pages=16, preemption_mode=mode, chunked_prefill_size=64,
                   num_host_pages=64 if mode == "swap" else 0)
    requests = workload(seed=2, count=8, max_tokens=30)
    base = run(model_dir, requests, **options)
    assert base.sched.num_preemptions > 0
    monkeypatch.setattr(speculation, "propose_ngram", Oracle(references(base, requests)))
    drafted = run(model_dir, requests, speculative_config=spec(), **options)
    assert drafted.sched.num_preemptions > 0
    assert drafted.sched.speculator.accepted_tokens > 0
    assert_same_outputs(base, drafted)
    assert len(drafted.sched.mem.host_free) == drafted.sched.mem.num_host_pages


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_adaptive_k_state_survives_preemption(model_dir, mode, monkeypatch):
    """A preempted sequence's drafting state (acceptance counts, pause, backoff, probe) is the
    one it drafts from when it runs again: nothing resets it, and nothing changes it while it
    waits."""
    from scheduler.planner import StepPlanner

    options = dict(num_pages=16, preemption_mode=mode, chunked_prefill_size=64,
                   num_host_pages=64 if mode == "swap" else 0)
    requests = workload(seed=2, count=8, max_tokens=30)
    base = run(model_dir, requests, **options)
    monkeypatch.setattr(speculation, "propose_ngram",
                        Oracle(references(base, requests), wrong_every=2))

    def state(seq):
        return (seq.draft_hits, seq.draft_tries, seq.draft_pause, seq.draft_backoff,
                seq.draft_probe)

    at_preemption, checked = {}, []
    preempt, drafts_for = StepPlanner._preempt, speculation.Speculator.drafts_for

    def recording_preempt(self, req, work):
        for seq in req.live_seqs():
            at_preemption[id(seq)] = state(seq)
        return preempt(self, req, work)

    def checking_drafts_for(self, seq, limit, num_running):
        if id(seq) in at_preemption:
            assert state(seq) == at_preemption.pop(id(seq))
            checked.append(seq.draft_tries)
        return drafts_for(self, seq, limit, num_running)

    monkeypatch.setattr(StepPlanner, "_preempt", recording_preempt)
    monkeypatch.setattr(speculation.Speculator, "drafts_for", checking_drafts_for)
    drafted = run(model_dir, requests, speculative_config=spec(), **options)
    assert drafted.sched.num_preemptions > 0 and drafted.sched.speculator.accepted_tokens > 0
    assert any(tries > 0 for tries in checked)  # preempted after verifying, drafting again
    assert_same_outputs(base, drafted)


def test_seeded_samples_n_and_logprobs_are_those_without_drafts(model_dir, monkeypatch):
    """Sampled rows draw each token with its own step's seeded noise, so a seeded run gives
    the same tokens with drafts (accepted or not); parallel samples draft each on their own;
    logprobs come from the same positions' logits."""
    rng = np.random.default_rng(3)
    requests = {
        "n2": (rng.integers(3, 4000, 20).tolist(),
               SamplingParams(max_tokens=20, temperature=0.9, seed=5, n=2, ignore_eos=True)),
        "lp": (rng.integers(3, 4000, 30).tolist(),
               SamplingParams(max_tokens=18, temperature=0.7, top_k=50, seed=9, logprobs=3,
                              ignore_eos=True)),
        "greedy_lp": (rng.integers(3, 4000, 25).tolist(),
                      SamplingParams(max_tokens=16, temperature=0.0, logprobs=2,
                                     ignore_eos=True)),
    }
    base = run(model_dir, requests, num_pages=256)
    monkeypatch.setattr(speculation, "propose_ngram", Oracle(references(base, requests)))
    drafted = run(model_dir, requests, num_pages=256, speculative_config=spec())
    assert_same_outputs(base, drafted)
    assert drafted.sched.speculator.accepted_tokens > 0
    for rid in ("lp", "greedy_lp"):
        for field in ("logprobs", "top_logprobs"):
            want, got = (np.concatenate([np.frombuffer(getattr(o, field), np.float32)
                                         for o in run.seen if o.rid == rid])
                         for run in (base, drafted))
            np.testing.assert_allclose(got, want, atol=1e-4)


def test_a_stop_token_inside_accepted_drafts_ends_the_output_there(model_dir, monkeypatch):
    requests = workload(seed=4, count=2, max_tokens=20)
    free = run(model_dir, requests, num_pages=256)
    out = free.outputs["r0"][0]
    stop_at = next(t for j, t in enumerate(out) if j >= 4 and t not in out[:j])
    params = msgspec.structs.replace(requests["r0"][1], stop_token_ids=[stop_at])
    stopped = {"r0": (requests["r0"][0], params)}
    base = run(model_dir, stopped, num_pages=256)
    assert base.outputs["r0"][0] == out[: out.index(stop_at) + 1]
    oracle = Oracle(references(free, requests), wrong_every=0)  # always right: runs past it
    monkeypatch.setattr(speculation, "propose_ngram", oracle)
    drafted = run(model_dir, stopped, num_pages=256, speculative_config=spec(k=6))
    assert_same_outputs(base, drafted)
    assert drafted.finals["r0"][0].finish_reason == "stop"


# ------------------------------------------------------------------- rejection sampling


# ---------------------------------------------------------------- rollback and adapting
def test_rejected_drafts_roll_back_their_pages_and_drafting_pauses(model_dir, monkeypatch):
    requests = workload(seed=5, count=3, max_tokens=40)
    base = run(model_dir, requests, page_size=2, num_pages=512)
    monkeypatch.setattr(speculation, "propose_ngram", Oracle(references(base, requests),
                                                             wrong_every=1))
    h = Harness(model_dir, page_size=2, num_pages=512, speculative_config=spec(k=6))
    for rid, (prompt, params) in requests.items():
        h.add(rid, prompt, params)
    while not h.sched.idle:
        h.step()  # the harness checks the accounting after every step
        for req in [] if h.sched.inflight else h.sched.running:  # drafts in flight hold pages
            for seq in req.live_seqs():
                assert len(seq.pages) <= h.sched.alloc.pages_for(len(seq.tokens))
    h.assert_idle_clean()
    assert h.outputs == base.outputs
    s = h.sched.speculator
    assert s.accepted_tokens == 0 and s.drafted_tokens > 0
    # every draft rejected: each sequence pauses after a couple of tries, for longer each time
    assert s.verifications < 0.4 * sum(p.max_tokens for _, p in requests.values())


def test_no_drafts_while_the_batch_is_large_and_overlap_runs_then(model_dir, monkeypatch):
    requests = workload(seed=6, count=6, max_tokens=10)
    for i, rid in enumerate(requests):  # finishing at different times: the batch shrinks
        requests[rid] = (requests[rid][0], msgspec.structs.replace(
            requests[rid][1], max_tokens=8 + 6 * i))
    base = run(model_dir, requests, num_pages=512)
    monkeypatch.setattr(speculation, "propose_ngram", Oracle(references(base, requests)))
    h = run(model_dir, requests, num_pages=512,
            speculative_config=spec(disable_by_batch_size=2))
    assert_same_outputs(base, h)
    assert h.ahead > 0  # look-ahead steps while more than 2 ran
    s = h.sched.speculator
    assert s.drafted_tokens > 0
    late = sum(p.max_tokens for rid, (_, p) in requests.items() if rid in ("r4", "r5"))
    assert s.emitted_tokens <= late


def test_drafts_take_only_pages_no_sequence_of_the_step_needs(model_dir, monkeypatch):
    """Two decoding requests and a finished one's prefix cached in the tree, with one free page:
    the later (lower-progress) request's next token needs it, and the earlier one's drafts
    would too. Drafts are planned last, so they find no page: the step evicts nothing and
    preempts no one, and the outputs are those decoding without drafts gives."""
    monkeypatch.setattr(speculation, "propose_ngram",
                        lambda tokens, lo, hi, k: np.full(k, 7, dtype=np.int64))
    monkeypatch.setattr(speculation.StepCosts, "share", lambda self, batch_size: 0.0)  # K = 4
    rng = np.random.default_rng(17)
    cached, first, second = (rng.integers(3, 4000, n).tolist() for n in (40, 41, 40))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    requests = {"a": (first, params), "b": (second, params)}
    options = {"page_size": 4, "num_pages": 64, "overlap_schedule": "off"}
    base = run(model_dir, requests, **options)
    h = Harness(model_dir, speculative_config=spec(k=4), **options)
    h.add("cached", cached, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    h.run()
    for rid, (prompt, p) in requests.items():
        h.add(rid, prompt, p)
    while h.step() or h.queued:  # both prefilled (41 and 40 tokens), first tokens sampled
        pass
    # "b"'s next token starts a page; "a"'s does not, but its drafts would
    alloc = h.sched.alloc
    held = alloc.alloc(alloc.num_free_pages - 1)  # the pool otherwise full: one page free
    evictable = alloc.num_evictable_pages
    assert evictable >= 10  # the finished request's prefix, cached
    batch = h.sched.schedule()
    assert alloc.num_evictable_pages == evictable and h.sched.num_preemptions == 0
    assert [len(e.drafts) for e in h.sched.inflight[0][1]] == [0, 0]
    alloc.decref(held)
    h.sched.process_result(h.worker.step(batch))
    h.run()
    assert {rid: h.outputs[rid] for rid in requests} == base.outputs
    assert h.sched.num_preemptions == 0
    assert h.sched.speculator.drafted_tokens > 0  # with pages free again, "a" drafts
