"""``echo`` and prompt logprobs through a real server (demo model, fp32) with the official openai
client, as lm-evaluation-harness's ``local-completions`` model scores a loglikelihood task:
``echo: true, logprobs: N, max_tokens: 0`` over token-id prompts, the continuation's logprob
sum read from the prompt's token logprobs and compared with transformers' log-softmax sum;
with and without a cached prefix, streaming, with generated tokens, and ``/generate``'s
``prompt_logprobs``."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from engine.checkpoints.demo_model import build_demo_model
from engine.contracts.tokenizer import load_tokenizer
from tests.server_process import API_KEY, AUTH, serve_module

pytestmark = pytest.mark.e2e

CONTEXTS = ["The capital of France is", "def add(a, b):\n    return",
            "Once upon a time, there was"]
CONTINUATIONS = [" Paris.", " a + b", " a small dog named Rex"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_module(tmp_path_factory.mktemp("echo"), "--api-key", API_KEY)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(build_demo_model()))


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(build_demo_model()),
                                                dtype=torch.float32).eval()


def hf_loglikelihood(hf, context: list[int], continuation: list[int]) -> float:
    ids = context + continuation
    with torch.no_grad():
        logprobs = hf(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    return sum(float(logprobs[len(context) + i - 1, t]) for i, t in enumerate(continuation))


def score(oai, model, context: list[int], continuation: list[int]) -> tuple[float, object]:
    """lm-evaluation-harness's way: the last len(continuation) token logprobs of the echo."""
    reply = oai.completions.create(model=model, prompt=context + continuation, max_tokens=0,
                                   echo=True, logprobs=1, temperature=0.0)
    lps = reply.choices[0].logprobs.token_logprobs
    assert lps[0] is None and len(lps) == len(context) + len(continuation)
    return sum(lps[-len(continuation):]), reply


def test_loglikelihoods_equal_transformers_with_and_without_a_cached_prefix(
        oai, model, tokenizer, hf) -> None:
    for text, cont in zip(CONTEXTS, CONTINUATIONS, strict=True):
        context, continuation = tokenizer(text)["input_ids"], tokenizer(cont)["input_ids"]
        want = hf_loglikelihood(hf, context, continuation)
        # the context alone first, so the scored prompt's prefix sits in the cache
        oai.completions.create(model=model, prompt=context, max_tokens=1, temperature=0.0)
        for _ in range(2):  # and the whole prompt cached the second time
            got, reply = score(oai, model, context, continuation)
            assert abs(got - want) < 1e-4, (text, got, want)
            choice = reply.choices[0]
            assert choice.text == tokenizer.decode(context + continuation)
            assert reply.usage.completion_tokens == 0 and choice.finish_reason == "length"
            top = choice.logprobs.top_logprobs
            assert top[0] is None and all(len(t) >= 1 for t in top[1:])


def test_echo_streams_and_generates_after_the_prompt(oai, model, tokenizer) -> None:
    prompt = CONTEXTS[0]
    whole = oai.completions.create(model=model, prompt=prompt, max_tokens=5, echo=True,
                                   logprobs=2, temperature=0.0)
    choice = whole.choices[0]
    generated = oai.completions.create(model=model, prompt=prompt, max_tokens=5,
                                       temperature=0.0).choices[0].text
    assert choice.text == prompt + generated
    count = len(tokenizer(prompt)["input_ids"])
    assert len(choice.logprobs.tokens) == count + 5
    assert choice.logprobs.text_offset[count] == len(prompt)
    chunks = list(oai.completions.create(model=model, prompt=prompt, max_tokens=5, echo=True,
                                         logprobs=2, temperature=0.0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    streamed = [lp for c in chunks if c.choices and c.choices[0].logprobs
                for lp in c.choices[0].logprobs.token_logprobs]
    np.testing.assert_allclose([x if x is not None else 0.0 for x in streamed],
                               [x if x is not None else 0.0
                                for x in choice.logprobs.token_logprobs], atol=1e-6)
    # echo without logprobs keeps the prefix cache: the prompt's text, nothing computed anew
    plain = oai.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True)
    assert plain.choices[0].text == prompt and plain.choices[0].logprobs is None


def test_generate_returns_prompt_logprobs(server, tokenizer, hf) -> None:
    ids = tokenizer(CONTEXTS[1] + CONTINUATIONS[1])["input_ids"]
    body = {"input_ids": ids, "sampling_params": {"max_tokens": 1, "temperature": 0.0,
                                                  "prompt_logprobs": 2}}
    answer = httpx.post(f"{server.url}/generate", json=body, headers=AUTH, timeout=60).json()
    choice = answer["choices"][0]
    lps = choice["prompt_logprobs"]
    assert lps[0] is None and len(lps) == len(ids)
    want = hf_loglikelihood(hf, ids[:1], ids[1:])
    assert abs(sum(lps[1:]) - want) < 1e-4
    assert all(len(top) == 2 for top in choice["prompt_top_logprobs"][1:])


def test_echo_refusals(oai, model, server) -> None:
    import openai  # here, not above: every test process collects this module (a 0.4 s import)

    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        oai.completions.create(model=model, prompt="hi", max_tokens=0)
    body = {"text": "hi", "sampling_params": {"prompt_logprobs": 21}}
    response = httpx.post(f"{server.url}/generate", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "sampling_params.prompt_logprobs"
