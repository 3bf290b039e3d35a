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
from engine.contracts.protocol import (
    GenerateRequest,
    SchedulerStats,
    SeqOutput,
    TokenOutputs,
    pack_ids,
    unpack_ids,
)
from engine.contracts.sampling_params import SamplingParams
from engine.contracts.speculative import SpeculativeConfig
from engine.server.metrics import FrontendState, Metrics
from engine.worker.sampler import RowState, sample
from scheduler import speculation
from scheduler.ngram import propose_ngram
from tests.test_scheduler import Harness
from tests.tokenizer_fixtures import byte_level_tokenizer
from tokenizer_worker.core import TokenizerWorker


@pytest.fixture(scope="module")
def model_dir() -> str:
    # the demo model, not the scheduler tests' smaller one (harness_model_dir): how much is
    # drafted follows the steps' measured times (StepCosts), and the smaller model's steps are
    # a third as long, so a pause on a busy machine weighs three times as much (with it,
    # tests/test_suffix.py's retries test failed once in six runs on a busy 2-core machine)
    return str(build_demo_model())


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
def test_the_option_takes_vllm_keys_and_refuses_bad_json_with_a_sentence():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)  # vLLM's default
    one = SpeculativeConfig.parse(spec(2, prompt_lookup_min=None, prompt_lookup_max=4))
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (4, 4)
    for bad, words in [("{method: ngram}", "must be a JSON object"),
                       ('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
                       ('{"method": "ngram"}', "num_speculative_tokens"),
                       (spec(2, typo=1), "unknown field `typo`"),
                       (spec(0), "num_speculative_tokens"),
                       (spec(2, prompt_lookup_min=4, prompt_lookup_max=2), "must not exceed")]:
        with pytest.raises(ValueError, match="--speculative-config") as caught:
            EngineConfig(model="demo", speculative_config=bad).validate()
        assert words in str(caught.value)


# ------------------------------------------------------------------------------ the proposer
def brute_force_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_prompt_lookup_matches_a_brute_force_search():
    rng = np.random.default_rng(1)
    found = 0
    for _ in range(400):
        tokens = rng.integers(0, int(rng.integers(2, 12)), int(rng.integers(1, 60))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        k = int(rng.integers(1, 6))
        got = propose_ngram(np.array(tokens), min_n, max_n, k).tolist()
        assert got == brute_force_ngram(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)
        found += bool(got)
    assert found > 100


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


def test_draft_counts_follow_acceptance_and_what_a_draft_row_costs():
    """``StepCosts`` fits the steps' times (seconds = t_B + b x draft rows) into each batch
    size's share, a draft row's time over a draft-free step's time per token; the drafts a
    sequence makes are those whose chance of adding a token beats it."""
    costs = speculation.StepCosts()
    assert costs.share(1) == pytest.approx(0.15) and costs.share(8) == 0.5  # the prior
    rng = np.random.default_rng(0)
    for _ in range(300):
        size = int(rng.choice([1, 4]))
        rows = int(rng.integers(0, 6)) * size
        base = 0.018 + 0.003 * size  # a draft-free step: the weights, then 3 ms a row
        costs.observe(size, rows, (base + 0.003 * rows) * (1 + 0.05 * rng.standard_normal()))
    assert costs.slope() == pytest.approx(0.003, rel=0.15)
    assert costs.share(1) == pytest.approx(0.003 / 0.021, rel=0.2)
    assert costs.share(4) == pytest.approx(0.012 / 0.030, rel=0.2)
    assert costs.share(16) == 0.5  # not seen: the prior
    worth = speculation.worth_drafting
    assert worth(0.7, 0.15, 5) == 5 and worth(0.7, 0.45, 5) == 2  # 0.7^2 = 0.49 > 0.45
    assert worth(0.5, 0.25, 8) == 1 and worth(0.4, 0.45, 8) == 0 and worth(1.0, 0.9, 3) == 3
    assert worth(0.3, 0.0, 4) == 4  # free rows
    seq = type("Seq", (), {"draft_hits": 0.0, "draft_tries": 0.0})()
    assert speculation.acceptance(seq) == pytest.approx(speculation.PRIOR_ACCEPT)
    s = speculation.Speculator(SpeculativeConfig.parse(spec(4)))
    seq.draft_backoff, seq.draft_pause = 4, 0
    for _ in range(3):
        s.accept(seq, 4, 0)  # all rejected: the acceptance falls under the pause threshold
    assert speculation.acceptance(seq) < speculation.PAUSE_BELOW


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


def test_a_stop_string_inside_several_tokens_cuts_the_tokens_there():
    tokenizer = byte_level_tokenizer()
    worker = TokenizerWorker(tokenizer, 0)
    ids = tokenizer.encode("one two three four five")
    runs = {}
    for rid, chunks in (("one_by_one", [[i] for i in ids]), ("at_once", [ids])):
        worker.on_request(GenerateRequest(rid=rid, text="x", params=SamplingParams(
            stop=[" thr"], logprobs=0)))
        texts, kept = [], []
        for chunk in chunks:
            lps = np.arange(len(chunk), dtype=np.float32)
            results, aborts = worker.on_outputs(TokenOutputs([SeqOutput(
                rid, 0, pack_ids(chunk), lps.tobytes())]))
            for r in results:
                texts.append(r.text)
                kept += unpack_ids(r.token_ids).tolist()
                assert len(r.logprobs) == len(r.token_ids)
            if aborts:
                break
        assert "".join(texts) == "one two"
        runs[rid] = kept
    # the tokens one per step would have produced: up to the one completing the stop string
    assert runs["at_once"] == runs["one_by_one"]
    assert 0 < len(runs["at_once"]) < len(ids)


def test_a_steps_acceptances_in_one_pass_are_those_of_each_verification():
    """``Speculator.accepted`` (all verifications of a step at once) against each one's drafts
    checked in turn; and the scheduler's first-finish search against ``_finish_reason`` of each
    token in turn."""
    from scheduler.scheduler import Scheduler

    rng = np.random.default_rng(11)
    for _ in range(200):
        verifies, tokens, want = [], [], []
        for _ in range(int(rng.integers(1, 6))):
            drafts = rng.integers(0, 3, int(rng.integers(1, 7))).tolist()
            sampled = rng.integers(0, 3, len(drafts) + 1).tolist()
            verifies.append((len(tokens), drafts))
            tokens += sampled
            want.append(next((i for i, (d, t) in enumerate(zip(drafts, sampled[:-1],
                                                                strict=True)) if d != t),
                             len(drafts)))
        got = speculation.Speculator.accepted(np.array(tokens, dtype=np.int32), verifies)
        assert got.tolist() == want

    sched = Scheduler.__new__(Scheduler)
    sched.eos_ids = {2}
    sched.info = type("Info", (), {"context_len": 100})()
    for _ in range(300):
        params = SamplingParams(max_tokens=int(rng.integers(1, 12)),
                                stop_token_ids=rng.integers(0, 9, int(rng.integers(0, 3))).tolist(),
                                ignore_eos=bool(rng.integers(2)))
        req = type("Req", (), {"params": params,
                               "max_len": lambda self, n, p=params: 5 + p.max_tokens})()
        seq = type("Seq", (), {"req": req})()
        new, length = rng.integers(0, 9, int(rng.integers(2, 8))).tolist(), int(rng.integers(5, 9))
        reasons = [sched._finish_reason(seq, t, length + i) for i, t in enumerate(new)]
        end = next((i for i, r in enumerate(reasons) if r is not None), len(new) - 1)
        assert sched._first_finish(seq, new, length) == (end, reasons[end])


# ------------------------------------------------------------------- rejection sampling
def test_speculative_sampling_keeps_the_target_distribution():
    """A point-mass draft d: accepted with probability p(d); the emitted token (d when
    accepted, the residual's draw otherwise) is distributed as p, the rejected ones as p with
    d removed and renormalised. Fixed seed; chi-square against 99.9% quantiles."""
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.2, 0.5, 0.0, -0.5, -1.0, 1.6, 0.3])
    p = torch.softmax(logits, 0).numpy().astype(np.float64)
    rows, draft = 40_000, 6
    params = SamplingParams(temperature=1.0)
    state = RowState(params, np.zeros(0, np.int32), np.zeros(0, np.int32))
    out = sample(logits.repeat(rows, 1), [state] * rows).token_ids
    s = speculation.Speculator(SpeculativeConfig.parse(spec(1)))
    seq = type("Seq", (), {"draft_hits": 0.0, "draft_tries": 0.0, "draft_backoff": 4,
                           "draft_pause": 0})()
    tokens = np.stack([out[:2000], np.zeros(2000, dtype=out.dtype)], 1).reshape(-1)
    accepted = s.accepted(tokens, [(2 * i, [draft]) for i in range(2000)])
    kept = np.array([s.accept(seq, 1, int(a)) for a in accepted])
    assert set(kept) <= {1, 2}  # 2: accepted + bonus; 1: the residual's token
    assert np.array_equal(kept == 2, out[:2000] == draft)
    accepted = out == draft
    assert abs(accepted.mean() - p[draft]) < 4 * np.sqrt(p[draft] * (1 - p[draft]) / rows)
    counts = np.bincount(out, minlength=len(p))
    assert ((counts - rows * p) ** 2 / (rows * p)).sum() < 24.3  # df 7
    residual = np.delete(p, draft) / (1 - p[draft])
    rejected = np.delete(np.bincount(out[~accepted], minlength=len(p)), draft)
    n = rejected.sum()
    assert ((rejected - n * residual) ** 2 / (n * residual)).sum() < 22.5  # df 6


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


def test_metrics_show_drafts_by_method():
    stats = SchedulerStats(spec_method="ngram", spec_drafted_tokens=40, spec_accepted_tokens=30,
                           spec_emitted_tokens=42, spec_verifications=12)
    text = Metrics(lambda: stats, lambda: FrontendState(0, 0, True)).render().decode()
    assert 'radixserve_spec_decode_num_draft_tokens_total{method="ngram"} 40.0' in text
    assert 'radixserve_spec_decode_acceptance_rate{method="ngram"} 0.75' in text
    assert 'radixserve_spec_decode_mean_accepted_length{method="ngram"} 2.5' in text
    assert "spec_decode" not in Metrics(SchedulerStats, lambda: FrontendState(0, 0, True)
                                        ).render().decode()


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
