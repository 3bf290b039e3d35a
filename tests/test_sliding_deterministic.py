"""``--deterministic`` with sliding-window layers in pages of their own (``--sliding-kv-ratio``):
on the small Gemma-3-shaped model of tests/test_sliding_kv.py (two sliding layers with a
16-token window, then a full one), every logits row of a prompt several windows long is the
same bits cold, resent, extending a cached head inside and at the edge of a page, beside other
requests, and in other chunk sizes; and the same bits as with full KV in every layer."""

from __future__ import annotations

import functools
import random

import pytest

from tests.conftest_models import write_checkpoint
from tests.test_deterministic import (
    LogitsHarness,
    assert_same,
    cached_at,
    in_batch,
    params,
    resend,
)

WINDOW = 16
VOCAB = range(3, 90)  # the written model's 96 tokens, without its special ones
PROMPT = random.Random(7).choices(VOCAB, k=90)
CONFIGS = {"float32": {"dtype": "float32"}, "default": {}}
SCENARIOS = {"resent": functools.partial(resend, prompt=PROMPT),
             "cached inside a page": cached_at(41, PROMPT),
             "cached at a page edge": cached_at(48, PROMPT),
             "beside 3": in_batch(3, PROMPT, VOCAB)}


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> str:
    return str(write_checkpoint(
        tmp_path_factory.mktemp("gemma3_deterministic") / "model", "gemma3",
        sliding_window=WINDOW, num_hidden_layers=3, max_position_embeddings=512,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"]))


def harness(model: str, config: str, **options) -> LogitsHarness:
    options = {"chunked_prefill_size": 64, "sliding_kv_ratio": 0.5, **options}
    return LogitsHarness(model, quantization="none", page_size=4, num_pages=512,
                         **CONFIGS[config], **options)


def cold(model: str, config: str, **options) -> LogitsHarness:
    h = harness(model, config, **options)
    h.add("r1", PROMPT, params(1))
    h.run()
    return h


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
    assert_same(reference, cold(gemma_dir, config, sliding_kv_ratio=0.0))
