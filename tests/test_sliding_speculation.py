"""Speculation over sliding-window layers with pages of their own (``--sliding-kv-ratio``):
a verify step writes the sliding KV of its drafts into fresh sliding pages, and a rejection
rolls those back with the full pages (``SeqMemory.trim``). On the small Gemma-3-shaped model of
tests/test_sliding_kv.py (16-token window), at page sizes 1 and 16: greedy tokens equal
transformers' and decoding without drafts, with prompt lookup (an oracle that drafts the
reference continuation with a wrong token at varying places, so whole acceptances,
rejections at every position and stops inside drafts all happen), the suffix index over the
cache and a draft model; no page of either pool leaks (the harness's accounting after every
step, both pools empty at the end).
"""

from __future__ import annotations

import json
import shutil

import pytest

from engine.contracts.sampling_params import SamplingParams
from scheduler import speculation
from tests.test_scheduler import hf_greedy
from tests.test_sliding_kv import WindowHarness, gemma_dir, hf_gemma, prompts  # noqa: F401
from tests.test_speculation import Oracle

PARAMS = SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True)


class VerifyHarness(WindowHarness):
    """``WindowHarness``, and a verify step's sequence holds the sliding KV of its first
    query's window and of its drafts' pages, no more."""

    def check_windows(self, entries) -> None:
        super().check_windows(entries)
        sliding = self.sched.tree.sliding
        for entry in entries:
            if entry.drafts:
                seq = entry.seq  # planned: ``computed`` counts the verified token
                first = sliding.window_start(seq.computed - 1)
                assert seq.lease.swa_from <= first, "a verify step lost sliding KV it reads"
                held = len(seq.pages) - seq.lease.swa_from
                bound = -(-(sliding.window + entry.extend) // sliding.page_size) + 1
                assert held <= bound, f"a verify step holds {held} window pages"


def run(gemma_dir, page_size: int, requests, **options) -> VerifyHarness:  # noqa: F811
    h = VerifyHarness(gemma_dir, page_size=page_size, num_pages=2048 // page_size,
                      sliding_kv_ratio=0.5, chunked_prefill_size=24, max_prefill_tokens=64,
                      **options)
    for rid, prompt in requests.items():
        h.add(rid, prompt, PARAMS)
    h.run()
    assert_both_pools_empty(h)
    return h


def assert_both_pools_empty(h: WindowHarness) -> None:
    sliding = h.sched.tree.sliding.allocator
    assert sliding.num_pinned_pages == 0
    h.sched.tree.reset()
    assert sliding.num_free_pages == sliding.num_pages
    assert h.sched.alloc.num_free_pages == h.sched.alloc.num_pages


def oracle(refs: list[list[int]], wrong_every: int, hf_gemma):  # noqa: F811
    """``Oracle``'s drafts, its wrong tokens inside the model's vocabulary."""
    drafts, vocab = Oracle(refs, wrong_every), hf_gemma.config.vocab_size
    return lambda *args: drafts(*args) % vocab


def ngram(k: int) -> str:
    return json.dumps({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
                       "prompt_lookup_max": 3})


@pytest.mark.parametrize("page_size", [1, 16])
def test_prompt_lookup_drafts_roll_back_both_pools_and_keep_the_tokens(
        gemma_dir, hf_gemma, page_size, monkeypatch):  # noqa: F811
    requests = {f"r{i}": p for i, p in enumerate(prompts(4, seed=11))}
    base = run(gemma_dir, page_size, requests)
    for rid, p in requests.items():
        assert base.outputs[rid][0] == hf_greedy(hf_gemma, p, PARAMS.max_tokens), rid
    refs = [requests[rid] + out[0] for rid, out in base.outputs.items()]
    monkeypatch.setattr(speculation, "propose_ngram", oracle(refs, 5, hf_gemma))
    drafted = run(gemma_dir, page_size, requests, speculative_config=ngram(6))
    spec = drafted.sched.speculator
    assert spec.accepted_tokens > 0 and spec.drafted_tokens > spec.accepted_tokens
    assert drafted.outputs == base.outputs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_preempted_drafting_sequences_keep_the_tokens(gemma_dir, hf_gemma, page_size, mode,  # noqa: F811
                                                      monkeypatch):
    """A pool too small for the load: sequences that draft are preempted (recomputed or
    swapped out with their windows)."""
    requests = {f"r{i}": p for i, p in enumerate(prompts(8, seed=1))}
    options = dict(num_pages=320 // page_size, sliding_kv_ratio=0.3, preemption_mode=mode,
                   num_host_pages=512 // page_size if mode == "swap" else 0)
    base = run_small(gemma_dir, page_size, requests, **options)
    assert base.sched.num_preemptions > 0
    refs = [requests[rid] + out[0] for rid, out in base.outputs.items()]
    monkeypatch.setattr(speculation, "propose_ngram", oracle(refs, 4, hf_gemma))
    drafted = run_small(gemma_dir, page_size, requests, speculative_config=ngram(4), **options)
    assert drafted.sched.speculator.accepted_tokens > 0
    assert drafted.outputs == base.outputs


def run_small(gemma_dir, page_size: int, requests, **options) -> VerifyHarness:  # noqa: F811
    h = VerifyHarness(gemma_dir, page_size=page_size, chunked_prefill_size=24,
                      max_prefill_tokens=48, **options)
    for rid, prompt in requests.items():
        h.add(rid, prompt, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    h.run()
    assert_both_pools_empty(h)
    return h


@pytest.mark.parametrize("page_size", [1, 16])
def test_suffix_drafts_from_the_cache_keep_the_tokens(gemma_dir, hf_gemma,  # noqa: F811
                                                      page_size):
    """Resent prompts: the suffix index drafts the continuations the first wave cached."""
    spec = json.dumps({"method": "suffix", "num_speculative_tokens": 6})
    wave = prompts(3, seed=13)
    h = VerifyHarness(gemma_dir, page_size=page_size, num_pages=2048 // page_size,
                      sliding_kv_ratio=0.5, chunked_prefill_size=24, max_prefill_tokens=64,
                      speculative_config=spec)
    for again in ("a", "b"):
        for i, p in enumerate(wave):
            h.add(f"{again}{i}", p, PARAMS)
        h.run()
    assert h.sched.speculator.accepted_tokens > 0
    for i, p in enumerate(wave):
        expected = hf_greedy(hf_gemma, p, PARAMS.max_tokens)
        assert h.outputs[f"a{i}"][0] == h.outputs[f"b{i}"][0] == expected, i
    assert_both_pools_empty(h)


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_draft_model_over_windows_keeps_the_tokens(gemma_dir, hf_gemma, page_size,  # noqa: F811
                                                     tmp_path):
    """The draft (here the target's own weights: whole drafts accepted) keeps full KV in a
    pool of its own at the target's page numbers; the target's windows slide as without it."""
    draft = str(tmp_path / "draft")
    shutil.copytree(gemma_dir, draft)
    spec = json.dumps({"model": draft, "num_speculative_tokens": 4})
    requests = {f"r{i}": p for i, p in enumerate(prompts(3, seed=14))}
    h = run(gemma_dir, page_size, requests, speculative_config=spec)
    assert h.sched.speculator.accepted_tokens > 0
    assert h.worker.draft.runner.pool.swa.numel() == 0
    for rid, p in requests.items():
        assert h.outputs[rid][0] == hf_greedy(hf_gemma, p, PARAMS.max_tokens), rid
