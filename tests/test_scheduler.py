"""The scheduler driven in-process against the real model runner (no sockets), with the
accounting invariant checked after every step, against transformers as the oracle."""

from __future__ import annotations

import weakref
from collections import deque

import numpy as np
import pytest
import torch

from engine.contracts.engine_config import EngineConfig
from engine.contracts.protocol import TokenizedRequest, decode, encode, pack_ids, unpack_ids
from engine.contracts.sampling_params import SamplingParams
from engine.worker.process import Worker
from scheduler.scheduler import Scheduler


@pytest.fixture(scope="module")
def model_dir(harness_model_dir: str) -> str:
    return harness_model_dir


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


# Per model object (a peft wrapper is another object), per prompt: the longest greedy run made.
# Tests and their parameters ask for the same references again (the same prompts in each
# preemption mode, a wave repeated); a shorter run is the longer one's head.
_REFERENCES: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[int, ...], list[int]]] = (
    weakref.WeakKeyDictionary())


def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Reference greedy decoding that keeps going past EOS (like ignore_eos)."""
    runs = _REFERENCES.setdefault(model, {})
    known = runs.get(tuple(prompt), [])
    if len(known) >= steps:
        return known[:steps]
    ids = torch.tensor([prompt])
    out, past = [], None
    with torch.no_grad():
        for _ in range(steps):
            res = model(ids if past is None else ids[:, -1:], past_key_values=past, use_cache=True)
            past = res.past_key_values
            token = int(res.logits[0, -1].argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    runs[tuple(prompt)] = out
    return list(out)


class Harness:
    def __init__(self, model_dir: str, tp=None, **options) -> None:
        # fp32 and dense weights unless asked: outputs are compared with transformers' fp32
        # token for token. Overlap on (the default on GPU; off on CPU) so every scheduler test
        # runs it. ``tp``: the worker is rank 0 of that group.
        self.config = EngineConfig(model=model_dir, **{"dtype": "float32", "quantization": "none",
                                                       "overlap_schedule": "on", **options})
        self.worker = Worker(self.config, tp)
        self.sched = Scheduler(self.config, self.worker.info)
        self.outputs: dict[str, dict[int, list[int]]] = {}
        self.finals: dict[str, list] = {}
        self.prompt_outputs: dict[str, list] = {}  # outputs carrying prompt logprobs
        self.steps = 0
        self.queued: deque = deque()
        self.ahead = 0

    def add(self, rid: str, prompt, params: SamplingParams, namespace: str | None = None) -> None:
        self.sched.add_request(TokenizedRequest(rid=rid, prompt_ids=pack_ids(prompt), params=params,
                                                reply_to=0, namespace=namespace))

    def step(self) -> bool:
        """Plan a step; run the oldest batch once the scheduler plans no further ahead (with
        overlap, one batch stays queued behind the one the worker runs, as between processes)."""
        batch = self.sched.schedule()
        if batch is not None:
            # Through the wire format both ways, as between the processes.
            self.queued.append(decode(encode(batch)))
            self.ahead += len(self.queued) > 1  # planned while another batch was queued
        if self.queued and (batch is None or len(self.queued) > 1):
            result = self.worker.step(self.queued.popleft())
            self.sched.process_result(decode(encode(result)))
            self.steps += 1
        self.sched.check()  # accounting after every step
        for out in self.sched.take_outputs().get(0, []):
            if out.prompt_logprobs:
                self.prompt_outputs.setdefault(out.rid, []).append(out)
                continue
            seqs = self.outputs.setdefault(out.rid, {})
            ids = unpack_ids(out.token_ids).tolist()
            seqs[out.index] = ids if out.replace else seqs.get(out.index, []) + ids
            if out.finish_reason is not None:
                self.finals.setdefault(out.rid, []).append(out)
        return batch is not None

    def run(self, max_steps: int = 2000) -> None:
        while not self.sched.idle:
            self.step()
            assert self.steps < max_steps, "the scheduler did not finish"
        self.assert_idle_clean()

    def assert_idle_clean(self) -> None:
        alloc = self.sched.alloc
        assert alloc.num_pinned_pages == 0, "pages still pinned at idle"
        assert alloc.num_free_pages + alloc.num_evictable_pages == alloc.num_pages


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def shared_prefix_prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    system = rng.integers(3, 4000, 70).tolist()
    return [system[: int(rng.integers(10, 70))] + rng.integers(3, 4000, int(rng.integers(1, 40))).tolist()
            for _ in range(count)]


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_matches_transformers_with_prefix_hits_and_chunks(model_dir, hf_model, page_size):
    h = Harness(model_dir, page_size=page_size, num_pages=4096 // page_size,
                chunked_prefill_size=24, max_prefill_tokens=64)
    prompts = shared_prefix_prompts(10)
    for i, p in enumerate(prompts[:4]):
        h.add(f"a{i}", p, GREEDY)
    h.run()
    for i, p in enumerate(prompts[4:]):  # a second wave hits what the first cached
        h.add(f"b{i}", p, GREEDY)
    h.run()
    for rid, p in zip([f"a{i}" for i in range(4)] + [f"b{i}" for i in range(6)], prompts, strict=True):
        assert h.outputs[rid][0] == hf_greedy(hf_model, p, 12), rid
    assert sum(f[0].cached_tokens for r, f in h.finals.items() if r.startswith("b")) > 0


def test_same_prompts_again_hit_all_but_the_last_token(model_dir):
    h = Harness(model_dir, num_pages=512)
    prompts = shared_prefix_prompts(6, seed=1)
    for i, p in enumerate(prompts):
        h.add(f"a{i}", p, GREEDY)
    h.run()
    for i, p in enumerate(prompts):
        h.add(f"b{i}", p, GREEDY)
    h.run()
    for i, p in enumerate(prompts):
        assert h.finals[f"b{i}"][0].cached_tokens == len(p) - 1
        assert h.outputs[f"b{i}"] == h.outputs[f"a{i}"]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_identical(model_dir, hf_model, mode):
    h = Harness(model_dir, num_pages=16, preemption_mode=mode, chunked_prefill_size=64,
                num_host_pages=64 if mode == "swap" else 0)
    prompts = shared_prefix_prompts(12, seed=0)
    for i, p in enumerate(prompts):
        h.add(str(i), p, GREEDY)
    h.run()
    assert h.sched.num_preemptions > 0
    for i, p in enumerate(prompts):
        assert h.outputs[str(i)][0] == hf_greedy(hf_model, p, 12)
    assert len(h.sched.mem.host_free) == h.sched.mem.num_host_pages


def test_abort_releases_pages_within_one_step(model_dir):
    h = Harness(model_dir, num_pages=256)
    h.add("x", list(range(5, 60)), SamplingParams(max_tokens=200, temperature=0.0))
    h.step()
    h.step()
    assert h.sched.alloc.num_pinned_pages > 0
    h.sched.abort("x")
    h.step()
    assert h.sched.idle
    assert h.finals["x"][0].finish_reason == "abort"
    h.assert_idle_clean()


def test_parallel_samples_share_the_prefill_and_are_reproducible(model_dir):
    params = SamplingParams(max_tokens=10, temperature=1.0, n=3, seed=7, ignore_eos=True)
    runs = []
    for _ in range(2):
        h = Harness(model_dir, num_pages=256)
        h.add("r", list(range(5, 40)), params)
        h.run()
        runs.append(h.outputs["r"])
    assert runs[0] == runs[1]
    assert len(runs[0]) == 3 and len({tuple(v) for v in runs[0].values()}) == 3


def test_beam_search_matches_transformers(model_dir, hf_model):
    prompt = list(range(100, 130))
    h = Harness(model_dir, num_pages=256, page_size=4)
    h.add("beam", prompt, SamplingParams(max_tokens=6, beam_width=3, n=2))
    h.run()
    assert [h.outputs["beam"][i] for i in range(2)] == hf_beams(hf_model, prompt, 6)


def hf_beams(hf_model, prompt: list[int], max_new_tokens: int) -> list[list[int]]:
    """transformers' two best of 3 beams for ``prompt`` (no early stop, no length penalty)."""
    ref = hf_model.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=2,
                            max_new_tokens=max_new_tokens, do_sample=False,
                            early_stopping=False, length_penalty=1.0, pad_token_id=0)
    return [[t for t in row[len(prompt):].tolist() if t != 0] for row in ref]


def test_bad_requests_get_clear_errors(model_dir):
    h = Harness(model_dir, num_pages=64, max_waiting_requests=1)
    h.add("long", [5] * 5000, GREEDY)
    h.add("huge", list(range(10, 600)), SamplingParams(max_tokens=2000))
    h.add("vocab", [1, 99999], GREEDY)
    h.add("ok", [5, 6, 7], GREEDY)
    h.add("full", [5, 6, 7], GREEDY)
    errors = {o.rid: (o.status, o.error) for o in h.sched.take_outputs()[0]}
    assert errors["long"][0] == 400 and "context is 4,096 tokens" in errors["long"][1]
    assert errors["huge"][0] == 400 and "KV pool has 64" in errors["huge"][1]
    assert errors["vocab"][0] == 400 and "[0, 4096)" in errors["vocab"][1]
    assert errors["full"][0] == 503 and "queue is full" in errors["full"][1]
    assert "ok" not in errors
    h.run()
    assert h.finals["ok"][0].finish_reason == "length"


def test_stop_token_ids_and_max_tokens(model_dir):
    h = Harness(model_dir, num_pages=128)
    h.add("free", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    h.run()
    first = h.outputs["free"][0]
    stop_at = first[3]
    h.add("stopped", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                               stop_token_ids=[stop_at]))
    h.run()
    assert h.outputs["stopped"][0] == first[: first.index(stop_at) + 1]
    assert h.finals["stopped"][0].finish_reason == "stop"
    assert h.finals["free"][0].finish_reason == "length"


def test_requests_sharing_an_uncached_prefix_wait_for_the_first_prefill(model_dir):
    h = Harness(model_dir, num_pages=512)
    system = list(range(100, 200))
    for i in range(4):
        h.add(str(i), system + [300 + i, 301, 302], GREEDY)
    h.add("other", list(range(1000, 1100)), GREEDY)
    h.step()  # one of the shared group and the unrelated request run; the rest wait a step
    assert len(h.sched.running) == 2
    h.run()
    cached = sorted(h.finals[str(i)][0].cached_tokens for i in range(4))
    assert cached == [0, 100, 100, 100]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forks_and_beams_under_memory_pressure_preempt_instead_of_failing(model_dir, mode):
    """16 concurrent n=3 requests, three long single samples and two 3-beam requests in a pool
    of 24 pages, where the admission estimate (70% of max_tokens at first) lets requests in
    that outgrow it: a
    fork allocates nothing when it happens (its partial-page copy is planned in the next step,
    where running out of pages preempts), so every request completes; the pool is clean after
    every step."""
    h = Harness(model_dir, num_pages=24, page_size=4, preemption_mode=mode,
                num_host_pages=64 if mode == "swap" else 0)
    sampled = SamplingParams(max_tokens=16, temperature=1.0, n=3, seed=3, ignore_eos=True)
    for i in range(3):  # long single samples: they outgrow their estimate while others fork
        h.add(f"long{i}", [90 + i, 91, 92], SamplingParams(max_tokens=40, temperature=0.0,
                                                          ignore_eos=True))
    for i in range(16):
        h.add(f"n{i}", [5 + i, 6, 7, 8, 9], sampled)
    for i in range(2):
        h.add(f"beam{i}", [40 + i, 41, 42], SamplingParams(max_tokens=4, beam_width=3, n=2))
    h.run()
    assert h.sched.num_preemptions > 0
    for i in range(16):
        finals = h.finals[f"n{i}"]
        assert sorted(f.index for f in finals) == [0, 1, 2]
        assert all(f.error is None and f.finish_reason == "length" for f in finals)
        assert all(len(h.outputs[f"n{i}"][k]) == 16 for k in range(3))
    for i in range(2):
        assert [f.error for f in h.finals[f"beam{i}"]] == [None, None]
        assert len(h.outputs[f"beam{i}"]) == 2


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beams_that_cannot_grow_wait_and_come_back_whole(model_dir, mode, monkeypatch):
    """Six greedy requests ahead of a 3-beam request (more progress, so the beams cannot take
    their pages), admitted by a deliberately optimistic estimate into a pool too small for all:
    the beams are preempted, all together, and resume once pages are free; they end as the
    beams run alone do."""
    beam = SamplingParams(max_tokens=16, beam_width=3, n=2)
    alone = Harness(model_dir, num_pages=64, page_size=4)
    alone.add("beam", list(range(40, 50)), beam)
    alone.run()

    import scheduler.planner
    monkeypatch.setattr(scheduler.planner, "NEW_TOKEN_RATIO", (0.05, 0.05, 0.0))
    h = Harness(model_dir, num_pages=32, page_size=4, preemption_mode=mode,
                num_host_pages=64 if mode == "swap" else 0)
    beam_preemptions = []
    preempt = h.sched.planner._preempt
    monkeypatch.setattr(h.sched.planner, "_preempt", lambda req, work: (
        beam_preemptions.append(req.rid) if req.is_beam else None, preempt(req, work)))
    for i in range(6):
        h.add(f"g{i}", list(range(90 + i, 96 + i)),
              SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for _ in range(2):
        h.step()
    h.add("beam", list(range(40, 50)), beam)
    h.run()
    assert "beam" in beam_preemptions
    assert [f.error for f in h.finals["beam"]] == [None, None]
    assert h.outputs["beam"] == alone.outputs["beam"]
    assert all(len(h.outputs[f"g{i}"][0]) == 40 for i in range(6))


@pytest.mark.parametrize("seed", [6, 9, 24])
def test_swap_preemption_of_a_sequence_with_no_private_page(model_dir, hf_model, seed):
    """Arrivals interleaved with steps (seeds that once failed): a victim whose every page is
    shared (cached, or another sequence's) has nothing to swap; it used to be left WAITING
    still holding its page references, which leaked at its re-admission and failed the
    accounting check. Now it is released into the tree and recomputed (a hit)."""
    rng = np.random.default_rng(seed)
    h = Harness(model_dir, num_pages=16, preemption_mode="swap", num_host_pages=64,
                chunked_prefill_size=64)
    prompts = shared_prefix_prompts(12, seed=seed % 3)
    for i, prompt in enumerate(prompts):
        h.add(str(i), prompt, GREEDY)
        for _ in range(int(rng.integers(0, 3))):
            h.step()  # checks the accounting after every step
    h.run()
    assert h.sched.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        assert h.outputs[str(i)][0] == hf_greedy(hf_model, prompt, 12)


def _random_mix(h: Harness, rng: np.random.Generator) -> list[str]:
    """Greedy, sampled n > 1 and beam requests over a partly shared head, arriving between
    steps, with the odd abort; returns the request ids."""
    system = rng.integers(3, 4000, 40).tolist()
    rids = []
    for i in range(int(rng.integers(6, 14))):
        kind = int(rng.integers(0, 4))
        prompt = system[: int(rng.integers(0, 40))] + rng.integers(3, 4000, int(rng.integers(1, 30))).tolist()
        max_tokens = int(rng.integers(2, 16))
        if kind == 0:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        elif kind == 1:
            params = SamplingParams(max_tokens=max_tokens, temperature=1.0,
                                    n=int(rng.integers(2, 4)), seed=i, ignore_eos=True)
        elif kind == 2:
            params = SamplingParams(max_tokens=max_tokens, beam_width=int(rng.integers(2, 4)), n=2)
        else:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.7, ignore_eos=True)
        h.add(str(i), prompt, params)
        rids.append(str(i))
        for _ in range(int(rng.integers(0, 3))):
            h.step()  # the accounting is checked after every step
            if rng.random() < 0.1 and h.sched.running:
                h.sched.abort(h.sched.running[int(rng.integers(0, len(h.sched.running)))].rid)
    return rids


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5, 110, 191])
def test_random_mixes_in_small_pools_keep_the_books_and_end_every_request(model_dir, seed):
    """Seeds 110 and 191 once crashed the scheduler (a swapped request resumed without room:
    OutOfPages) and failed innocent requests (the first waiting one instead of the one that
    could not fit). Every request now ends, finished or with a sentence; only a request that
    cannot fit the pool at all may fail, and it fails alone."""
    rng = np.random.default_rng(seed)
    mode, page_size = ["swap", "recompute"][seed % 2], [1, 4, 16][seed % 3]
    slots = int(rng.integers(10, 24)) * 16
    h = Harness(model_dir, num_pages=slots // page_size, page_size=page_size,
                preemption_mode=mode, num_host_pages=1024 // page_size if mode == "swap" else 0,
                chunked_prefill_size=int(rng.integers(16, 80)))
    rids = _random_mix(h, rng)
    h.run()
    assert sorted(h.finals) == sorted(rids)
    failed = {rid for rid, finals in h.finals.items() if any(f.error for f in finals)}
    assert len(failed) <= 1, failed
    for rid in failed:
        assert all("KV pool is too small" in f.error for f in h.finals[rid] if f.error)
