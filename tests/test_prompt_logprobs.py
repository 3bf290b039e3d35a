"""Prompt logprobs (``prompt_logprobs``; ``echo`` with ``logprobs`` at the door) through the
scheduler and the worker, against transformers in fp32: every prompt token after the first,
its logprob and top-N, with the prompt chunked, with its prefix already cached (a request that
wants them computes its whole prompt), and after a preemption."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.contracts.protocol import unpack_ids
from engine.contracts.sampling_params import SamplingParams
from tests.test_scheduler import Harness, hf_model, model_dir  # noqa: F401 (fixtures)

TOP = 3


def reference(hf, prompt: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """transformers' logprob of each prompt token after the first, and the top-``TOP`` ids and
    logprobs before it."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1].double()
    logprobs = logits.log_softmax(-1)
    target = logprobs.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    values, ids = logprobs.topk(TOP, dim=-1)
    return target.numpy(), ids.numpy(), values.numpy()


def collected(h: Harness, rid: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    outs = h.prompt_outputs[rid]
    lps = np.concatenate([np.frombuffer(o.prompt_logprobs, np.float32) for o in outs])
    ids = np.concatenate([unpack_ids(o.prompt_top_ids).reshape(-1, TOP) for o in outs])
    top = np.concatenate([np.frombuffer(o.prompt_top_logprobs, np.float32).reshape(-1, TOP)
                          for o in outs])
    return lps, ids, top


@pytest.mark.parametrize("page_size", [1, 16])
def test_prompt_logprobs_equal_transformers_chunked_and_after_a_cache_hit(
        model_dir, hf_model, page_size) -> None:  # noqa: F811
    rng = np.random.default_rng(0)
    prefix = rng.integers(5, 500, 40).tolist()
    prompts = {"fresh": rng.integers(5, 500, 57).tolist(),
               "cached": prefix + rng.integers(5, 500, 23).tolist()}
    h = Harness(model_dir, device="cpu", page_size=page_size, num_pages=4096 // page_size,
                chunked_prefill_size=16)
    h.add("warm", prefix + [7, 8, 9], SamplingParams(max_tokens=2, temperature=0.0))
    h.run()  # the prefix is cached now
    for rid, prompt in prompts.items():
        h.add(rid, prompt, SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=TOP))
    h.add("plain", prefix + [11, 12], SamplingParams(max_tokens=1, temperature=0.0))
    h.run()
    for rid, prompt in prompts.items():
        lps, ids, top = collected(h, rid)
        want_lps, want_ids, want_top = reference(hf_model, prompt)
        assert len(lps) == len(prompt) - 1
        np.testing.assert_allclose(lps, want_lps, atol=1e-4, rtol=0)
        np.testing.assert_allclose(top, want_top, atol=1e-4, rtol=0)
        assert (ids == want_ids).mean() > 0.99  # near-ties may swap
        # computed whole: no cache hit, and its prompt is cached afterwards as usual
        assert h.finals[rid][0].cached_tokens == 0
    assert "plain" not in h.prompt_outputs
    assert h.finals["plain"][0].cached_tokens == len(prefix)


def test_prompt_logprobs_survive_a_preemption_mid_prompt(model_dir, hf_model,  # noqa: F811
                                                         monkeypatch) -> None:
    """Requests admitted optimistically into a small pool get preempted (recompute) while
    their prompts are still being prefilled in chunks: each prompt's logprobs still come out
    once, in order, equal to transformers'."""
    import scheduler.planner

    monkeypatch.setattr(scheduler.planner, "NEW_TOKEN_RATIO", (0.05, 0.05, 0.0))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(5, 500, 60).tolist() for _ in range(5)]
    h = Harness(model_dir, device="cpu", page_size=4, num_pages=60, chunked_prefill_size=8,
                preemption_mode="recompute")
    for i, prompt in enumerate(prompts):
        h.add(str(i), prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                             prompt_logprobs=TOP))
    h.run()
    assert h.sched.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        lps, _, _ = collected(h, str(i))
        np.testing.assert_allclose(lps, reference(hf_model, prompt)[0], atol=1e-4, rtol=0)
