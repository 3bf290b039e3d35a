"""``--deterministic`` with sliding-window layers in pages of their own (``--sliding-kv-ratio``):
on the small Gemma-3-shaped model of tests/test_sliding_kv.py (two sliding layers with a
16-token window, then a full one), every logits row of a prompt several windows long is the
same bits cold, resent, extending a cached head inside and at the edge of a page, beside other
requests, and in other chunk sizes; and the same bits as with full KV in every layer."""

from __future__ import annotations

import random

import pytest
import torch

from engine.contracts.sampling_params import SamplingParams
from tests.conftest_models import write_checkpoint
from tests.test_deterministic import LogitsHarness

WINDOW = 16
PROMPT = random.Random(7).choices(range(3, 90), k=90)
TOKENS = 20
CONFIGS = {"float32": {"dtype": "float32"}, "default": {}}


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> str:
    return str(write_checkpoint(
        tmp_path_factory.mktemp("gemma3_deterministic") / "model", "gemma3",
        sliding_window=WINDOW, num_hidden_layers=3, max_position_embeddings=512,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"]))


def greedy(seed: int, tokens: int = TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, seed=seed)


def harness(model: str, config: str, **options) -> LogitsHarness:
    options = {"chunked_prefill_size": 64, **options}
    return LogitsHarness(model, quantization="none", page_size=4, num_pages=512,
                         sliding_kv_ratio=0.5, **CONFIGS[config], **options)


def cold(model: str, config: str, **options) -> LogitsHarness:
    h = harness(model, config, **options)
    h.add("r1", PROMPT, greedy(1))
    h.run()
    return h


def resent(h: LogitsHarness) -> None:
    h.add("r0", PROMPT, greedy(0))
    h.run()
    h.add("r1", PROMPT, greedy(1))
    h.run()
    assert h.finals["r1"][0].cached_tokens == len(PROMPT) - 1


def cached_at(split: int):
    def scenario(h: LogitsHarness) -> None:
        h.add("r0", PROMPT[:split], greedy(0, 1))
        h.run()
        h.add("r1", PROMPT, greedy(1))
        h.run()
        assert h.finals["r1"][0].cached_tokens == split
    return scenario


def beside(others: int):
    def scenario(h: LogitsHarness) -> None:
        for i in range(others):
            h.add(f"o{i}", random.Random(100 + i).choices(range(3, 90), k=20 + 13 * i),
                  greedy(100 + i, 40))
        h.step()
        h.step()
        h.add("r1", PROMPT, greedy(1))
        h.run()
    return scenario


SCENARIOS = {"resent": resent, "cached inside a page": cached_at(41),
             "cached at a page edge": cached_at(48), "beside 3": beside(3)}


def assert_same(want: LogitsHarness, got: LogitsHarness) -> None:
    a, b = want.rows(1), got.rows(1)
    assert [length for length, _ in b] == list(range(TOKENS))
    for (length, x), (_, y) in zip(a, b, strict=True):
        assert torch.equal(x, y), f"logits row {length} differs by {float((x - y).abs().max()):.3g}"
    assert got.outputs["r1"][0] == want.outputs["r1"][0]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_cached_or_batched_prompt_gives_its_cold_logits_over_windows(gemma_dir, config,
                                                                       scenario):
    h = harness(gemma_dir, config)
    SCENARIOS[scenario](h)
    assert_same(cold(gemma_dir, config), h)


@pytest.mark.parametrize("config", CONFIGS)
def test_chunks_and_full_kv_change_no_logits(gemma_dir, config):
    reference = cold(gemma_dir, config)
    assert_same(reference, cold(gemma_dir, config, chunked_prefill_size=24))
    full = LogitsHarness(gemma_dir, quantization="none", page_size=4, num_pages=512,
                         chunked_prefill_size=64, **CONFIGS[config])
    full.add("r1", PROMPT, greedy(1))
    full.run()
    assert_same(reference, full)
