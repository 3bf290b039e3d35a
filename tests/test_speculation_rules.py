"""Speculative decoding's rules without a model: the option's keys, prompt lookup against a
brute-force search, how many drafts a sequence gets from acceptance and step costs, stop
strings and stop tokens inside accepted drafts, acceptance in one pass, speculative
sampling's distribution, and the metrics by method (tests/test_speculation.py runs them
through the engine)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

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
from tests.test_speculation import spec
from tests.tokenizer_fixtures import byte_level_tokenizer
from tokenizer_worker.core import TokenizerWorker


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
    checked in turn; and a sequence's first-ending search against ``Seq.ending`` of each
    token in turn."""
    from scheduler.request import Seq

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

    for _ in range(300):
        params = SamplingParams(max_tokens=int(rng.integers(1, 12)),
                                stop_token_ids=rng.integers(0, 9, int(rng.integers(0, 3))).tolist(),
                                ignore_eos=bool(rng.integers(2)))
        req = type("Req", (), {"params": params,
                               "max_len": lambda self, n, p=params: 5 + p.max_tokens})()
        seq = type("Seq", (), {"req": req})()
        new, length = rng.integers(0, 9, int(rng.integers(2, 8))).tolist(), int(rng.integers(5, 9))
        reasons = [Seq.ending(seq, t, length + i, {2}, 100) for i, t in enumerate(new)]
        end = next((i for i, r in enumerate(reasons) if r is not None), len(new) - 1)
        assert Seq.first_ending(seq, new, length, {2}, 100) == (end, reasons[end])


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


def test_metrics_show_drafts_by_method():
    stats = SchedulerStats(spec_method="ngram", spec_drafted_tokens=40, spec_accepted_tokens=30,
                           spec_emitted_tokens=42, spec_verifications=12)
    text = Metrics(lambda: stats, lambda: FrontendState(0, 0, True)).render().decode()
    assert 'radixserve_spec_decode_num_draft_tokens_total{method="ngram"} 40.0' in text
    assert 'radixserve_spec_decode_acceptance_rate{method="ngram"} 0.75' in text
    assert 'radixserve_spec_decode_mean_accepted_length{method="ngram"} 2.5' in text
    assert "spec_decode" not in Metrics(SchedulerStats, lambda: FrontendState(0, 0, True)
                                        ).render().decode()
