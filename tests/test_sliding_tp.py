"""``--tp-size 2`` with ``--sliding-kv-ratio 0.5``: two ranks over gloo, each holding one of
the small Gemma-3-shaped model's two KV heads (tests/test_sliding_kv.py) in both of its pools,
the same pages on every rank. Greedy tokens equal transformers' cold, resent (all but the last
token hit) and as a next turn (the whole history hits), then under a pool small enough to
preempt and evict windows. The scheduler checks both pools' accounting whenever it goes idle
(a leaked page ends the engine, and these calls with it)."""

from __future__ import annotations

import pytest

from engine import Engine
from engine.contracts.sampling_params import SamplingParams
from tests.conftest_models import one_torch_thread
from tests.test_scheduler import Harness, hf_greedy
from tests.test_sliding_kv import gemma_dir, hf_gemma, prompts  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures(one_torch_thread.__name__)]

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
OPTIONS = dict(tp_size=2, dtype="float32", quantization="none", chunked_prefill_size=24,
               max_prefill_tokens=64)


def test_tp2_over_windows_matches_transformers(gemma_dir, hf_gemma):  # noqa: F811
    cold = prompts(3, seed=0)
    with Engine(gemma_dir, page_size=16, num_pages=128, sliding_kv_ratio=0.5, **OPTIONS) as tp:
        first = tp.generate(cold, GREEDY)
        again = tp.generate(cold, GREEDY)
        turn = cold[0] + first[0].token_ids + [5, 6, 7]
        (next_turn,) = tp.generate([turn], GREEDY)
    assert [r.token_ids for r in first] == [hf_greedy(hf_gemma, p, 20) for p in cold]
    assert [r.token_ids for r in again] == [r.token_ids for r in first]
    assert [r.cached_tokens for r in again] == [len(p) - 1 for p in cold]
    assert next_turn.cached_tokens == len(cold[0]) + 19
    assert next_turn.token_ids == hf_greedy(hf_gemma, turn, 20)


def test_tp2_over_windows_preempted_and_evicted(gemma_dir, hf_gemma):  # noqa: F811
    """The same load on one rank in process preempts and evicts kept windows (the scheduler's
    decisions do not depend on the ranks); two ranks give its tokens, transformers'."""
    wave = prompts(6, seed=1)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    pool = dict(page_size=1, num_pages=320, sliding_kv_ratio=0.3)
    one = Harness(gemma_dir, chunked_prefill_size=24, max_prefill_tokens=64, **pool)
    for wave_name in ("a", "b"):
        for i, p in enumerate(wave):
            one.add(f"{wave_name}{i}", p, params)
        one.run()
    assert one.sched.num_preemptions > 0 and one.sched.tree.stats.sliding_evicted_pages > 0
    with Engine(gemma_dir, **pool, **OPTIONS) as tp:
        first = tp.generate(wave, params)
        second = tp.generate(wave, params)
    for i, p in enumerate(wave):
        expected = hf_greedy(hf_gemma, p, 32)
        assert one.outputs[f"a{i}"][0] == one.outputs[f"b{i}"][0] == expected, i
        assert first[i].token_ids == expected and second[i].token_ids == expected, i
