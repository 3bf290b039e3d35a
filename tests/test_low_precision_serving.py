"""bf16 end to end: the scheduler driving the runner through forks, beams, chunked prefill and
both preemption modes over shared prefixes (the cascade path), and a live bf16 server taking
concurrent streams in groups that share 512-token heads (the reproduction of the crash where
the cascade merge wrote float32 into a bf16 buffer and failed every batch that took it).

Greedy outputs are compared by their common prefix (one bf16 near-tie flips a token, and
everything after it legitimately differs). The demo model's random weights give flat logits
with many near-ties, so bf16 drifts from fp32 early even in transformers: over the 16 grouped
requests × 12 tokens, transformers' bf16 keeps 166 of 192 of its fp32 greedy tokens (86%),
the engine's bf16 (float32 residual stream) keeps 163-174 of its fp32 ones (which step a
request joins changes its batch, and bf16 rounding with it) and agrees with transformers' bf16
on 173. A count over 192 tokens moves 6 points with one early flip, so the test asserts what
bf16 may do instead: every token where the engine's bf16 leaves its fp32 path is a near-tie in
fp32 (top-2 logit lead under ``NEAR_TIE``; transformers' own bf16 flips leads up to 0.13 on
these prompts), and that it keeps about as many of its fp32 tokens as transformers' bf16
keeps of its own (within ``DRIFT_MARGIN``). Agreeing with transformers' bf16 token for token
is no oracle: with the engine unchanged it fell from 173 of 192 tokens to 0.73 of them under
transformers 5.24.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.checkpoints.demo_model import build_demo_model
from engine.contracts.sampling_params import SamplingParams
from tests.server_process import ServerProcess
from tests.test_scheduler import Harness, hf_greedy

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
NEAR_TIE = 0.25  # fp32 logit lead of the greedy token over the next one
DRIFT_MARGIN = 0.10  # two flips early in a 12-token output of the 16 grouped requests


@pytest.fixture(scope="module")
def model_dir() -> str:
    """The demo model, whose logits the bounds above were measured on."""
    return str(build_demo_model())


def grouped_prompts(groups: int, members: int, head: int, seed: int) -> list[list[int]]:
    """``groups`` shared heads of ``head`` tokens, each followed by ``members`` questions."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(groups):
        shared = rng.integers(3, 4000, head).tolist()
        prompts += [shared + rng.integers(3, 4000, int(rng.integers(4, 24))).tolist()
                    for _ in range(members)]
    return prompts


def run_mix(directory: str, dtype: str, mode: str, compiled: bool = True
            ) -> tuple[Harness, list[int]]:
    """Greedy requests in groups over 96-token heads, a seeded n=3 request and a 3-beam
    request, in a pool small enough to preempt; returns the harness and the size of each
    cascade the attention backend planned over the run (0 for a decode group it gave the
    compiled CPU kernel, or the extends it gave the extend kernel, where that one is built).
    ``compiled=False``: decodes and extends take gather + SDPA and the cascade."""
    h = Harness(directory, dtype=dtype, num_pages=40, preemption_mode=mode,
                num_host_pages=64 if mode == "swap" else 0, chunked_prefill_size=48)
    backend = h.worker.runner.attention
    # The decode kernel, also where the engine would not pick it (a CPU with neither AVX-512 nor AVX2).
    backend._paged_decode = torch.ops.radixserve.paged_decode if compiled else None
    if not compiled:
        backend._extend_attention = None
    plan, cascade_groups = backend._plan, []

    def recording_plan(batch, *args) -> None:
        plan(batch, *args)
        cascade_groups.extend(g.cascade.num_groups for g in backend._groups if g.cascade)
        cascade_groups.extend(0 for g in backend._groups if g.paged is not None)

    backend._plan = recording_plan
    for i, prompt in enumerate(grouped_prompts(4, 4, 96, seed=1)):
        h.add(f"g{i}", prompt, GREEDY)
    h.add("fork", list(range(200, 300)), SamplingParams(max_tokens=10, temperature=1.0, n=3,
                                                        seed=5, ignore_eos=True))
    h.add("beam", list(range(400, 490)), SamplingParams(max_tokens=6, beam_width=3, n=2))
    h.run()  # accounting checked after every step; pages back to idle at the end
    return h, cascade_groups


@pytest.mark.slow
@pytest.mark.parametrize("mode,compiled", [("recompute", True), ("swap", True),
                                           ("recompute", False)])
def test_scheduler_paths_in_bf16_agree_with_fp32(model_dir, mode, compiled):
    low, cascade_groups = run_mix(model_dir, "bfloat16", mode, compiled)
    exact, _ = run_mix(model_dir, "float32", mode)
    assert low.sched.num_preemptions > 0
    # Decodes of sequences sharing heads: through the kernel, or merged by the cascade.
    assert (0 in cascade_groups) == compiled
    assert compiled or max(cascade_groups) >= 2
    if mode == "swap":
        assert len(low.sched.mem.host_free) == low.sched.mem.num_host_pages
    for rid, finals in low.finals.items():
        assert all(f.error is None and f.finish_reason == "length" for f in finals), rid
    assert len(low.outputs["fork"]) == 3 and len(low.outputs["beam"]) == 2

    prompts = grouped_prompts(4, 4, 96, seed=1)
    hf32, hf16 = (AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
                  for dtype in (torch.float32, torch.bfloat16))
    ours16 = [low.outputs[f"g{i}"][0] for i in range(len(prompts))]
    ours32 = [exact.outputs[f"g{i}"][0] for i in range(len(prompts))]
    ref16 = [hf_greedy(hf16, p, GREEDY.max_tokens) for p in prompts]
    ref32 = [hf_greedy(hf32, p, GREEDY.max_tokens) for p in prompts]
    assert ours32 == ref32  # the fp32 run is the oracle's
    for prompt, low_out, exact_out in zip(prompts, ours16, ours32, strict=True):
        at = common_prefix(low_out, exact_out)
        if at < len(exact_out):
            ids = torch.tensor([prompt + exact_out[:at]])
            with torch.no_grad():
                top = hf32(ids).logits[0, -1].topk(2).values
            lead = float(top[0] - top[1])
            assert lead < NEAR_TIE, f"bf16 flipped token {at} of {prompt[:4]}..., fp32 lead {lead}"
    # No more drift from fp32 than transformers' own bf16 shows on the same prompts, within
    # two early flips (its bf16 numerics move between transformers releases).
    assert agreement(ours16, ref32) >= agreement(ref16, ref32) - DRIFT_MARGIN


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def agreement(runs: list[list[int]], references: list[list[int]]) -> float:
    """The fraction of reference tokens in the common prefixes of each pair of outputs."""
    agreed = total = 0
    for ours, want in zip(runs, references, strict=True):
        agreed += common_prefix(ours, want)
        total += len(want)
    return agreed / total


@pytest.fixture(scope="module")
def bf16_server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("bf16_server"), "--dtype", "bfloat16",
                        "--num-pages", "1024")
    yield srv
    assert srv.stop() == 0


async def _stream(client: httpx.AsyncClient, prompt: list[int]) -> tuple[int, list[str], str]:
    """One streamed completion: (status, text pieces, finish reason or the error)."""
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
    pieces, finish = [], ""
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return resp.status_code, [], (await resp.aread()).decode()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return 500, pieces, json.dumps(event)
            choice = event["choices"][0]
            pieces.append(choice["text"])
            finish = choice["finish_reason"] or finish
    return resp.status_code, pieces, finish


@pytest.mark.e2e
def test_bf16_server_serves_concurrent_shared_prefix_streams(bf16_server):
    """The issue's reproduction: streams in 8 groups sharing 512-token heads, 16 in flight;
    every one completes (four waves, so later waves also extend cached heads)."""
    prompts = grouped_prompts(8, 8, 512, seed=2)

    async def main() -> list[tuple[int, list[str], str]]:
        limit = asyncio.Semaphore(16)
        async with httpx.AsyncClient(base_url=bf16_server.url, timeout=120) as client:
            async def one(prompt: list[int]):
                async with limit:
                    return await _stream(client, prompt)
            return await asyncio.gather(*(one(p) for p in prompts))

    results = asyncio.run(main())
    failed = [(status, finish) for status, _, finish in results
              if status != 200 or finish != "length"]
    assert failed == []
    health = httpx.get(f"{bf16_server.url}/health", timeout=10)
    assert health.status_code == 200
