"""LoRA adapters under tensor parallel: each rank's share of an adapter against the whole one,
sharded forwards (ranks as threads) with adapters and base rows equal to tp 1's (the compiled
kernel and torch's form), a tp 2 worker whose adapters and base rows in one batch give
transformers + peft's greedy tokens, with runtime loads and unloads reaching every rank, and a
--tp-size 2 server (two gloo processes) loading adapters over HTTP."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from engine.checkpoints.demo_model import build_demo_model
from engine.contracts.engine_config import EngineConfig
from engine.contracts.protocol import Shutdown, encode
from engine.contracts.step import BatchInput
from engine.worker.model.config import ModelConfig
from engine.worker.model.lora import load_adapter, projection_shapes
from engine.worker.model.parallel import ShardPlan
from engine.worker.runner import ModelRunner
from engine.worker.tp_rank import follow
from tests.conftest_models import one_torch_thread
from tests.lora_fixtures import ADAPTERS, make_adapter, make_adapters, oracle_models, peft_model
from tests.test_lora import add, update
from tests.test_scheduler import Harness, hf_greedy, shared_prefix_prompts
from tests.test_tp import ThreadRank, run_ranks

pytestmark = [pytest.mark.usefixtures(one_torch_thread.__name__),
              pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                 reason="peft is not installed")]


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(build_demo_model())


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return make_adapters(model_dir, root)


def test_lora_with_tp_validates(model_dir, adapters):
    EngineConfig(model=model_dir, tp_size=2, enable_lora=True,
                 lora_modules=[f"{n}={p}" for n, p in adapters.items()]).validate()


@pytest.mark.parametrize("size", [2, 8])
def test_each_rank_holds_its_share_of_an_adapter(model_dir, adapters, size):
    """Column-parallel q/k/v and gate/up: each rank's update is the whole adapter's on the
    base weight's output columns it holds (KV heads replicated at 8 ranks). Row-parallel o and
    down: the ranks' updates of their input columns sum to the whole one."""
    c = ModelConfig.from_dir(model_dir)
    generator = torch.Generator().manual_seed(0)
    for name, path in adapters.items():
        whole = load_adapter(name, path, c, 64)
        plans = [ShardPlan.for_rank(c, r, size) for r in range(size)]
        shares = [load_adapter(name, path, c, 64, plan) for plan in plans]
        for (layer, fused), (a, bt) in whole.mats.items():
            x = torch.randn(3, a.shape[1], generator=generator)
            delta = x @ a.t() @ bt
            if fused in ("o", "down"):
                width = a.shape[1] // size
                parts = [x[:, r * width : (r + 1) * width] @ s.mats[(layer, fused)][0].t()
                         @ s.mats[(layer, fused)][1] for r, s in enumerate(shares)]
                torch.testing.assert_close(sum(parts), delta, rtol=1e-5, atol=1e-5)
                continue
            for plan, share in zip(plans, shares, strict=True):
                sa, sbt = share.mats[(layer, fused)]
                assert sbt.shape[1] == sum(projection_shapes(c, plan)[fused][1])
                sources = plan.layer_sources("", c)
                prefix = "self_attn." if fused == "qkv" else "mlp."
                modules = ("q", "k", "v") if fused == "qkv" else ("gate", "up")
                columns, offset = [], 0
                for module, full in zip(modules, projection_shapes(c)[fused][1], strict=True):
                    part = sources[f"{prefix}{module}_proj.weight"]
                    columns.append(torch.arange(offset + part.start, offset + part.stop))
                    offset += full
                torch.testing.assert_close(x @ sa.t() @ sbt, delta[:, torch.cat(columns)])


def mixed_steps(page_size: int, vocab: int) -> list[BatchInput]:
    """A prefill of three sequences (adapters 1 and 2, the base model), then one more token or
    a few for each over the pages of the first step."""
    rng = np.random.default_rng(6)
    prompts = [rng.integers(3, vocab, n) for n in (9, 6, 7)]
    pages = [[3, 7, 9], [1, 4], [2, 5]]
    first = BatchInput.build([(p, 0, ids[:-2]) for p, ids in zip(pages, prompts, strict=True)],
                             page_size, "all")
    second = BatchInput.build([(p, len(ids) - 2, ids[-2:])
                               for p, ids in zip(pages, prompts, strict=True)], page_size, "all")
    for step in (first, second):
        step.lora_ids = np.array([1, 2, 0], dtype=np.int32)
    return [first, second]


@pytest.mark.parametrize("kernel", [True, False], ids=["lora_bgmv", "torch"])
def test_sharded_forward_with_adapters_equals_unsharded(model_dir, adapters, kernel):
    options = dict(page_size=4, num_pages=16, dtype="float32", attention_backend="torch",
                   quantization="none", enable_lora=True,
                   lora_modules=[f"{n}={p}" for n, p in adapters.items()])
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    steps = mixed_steps(4, vocab)

    def runner_for(tp: ThreadRank | None) -> ModelRunner:
        runner = ModelRunner(EngineConfig(model=model_dir, **options), tp)
        if not kernel:
            runner.lora.kernel = None
        elif runner.lora.kernel is None:
            pytest.skip("the compiled CPU kernels are not available")
        return runner

    unsharded = runner_for(None)
    expected = [unsharded.forward(step) for step in steps]
    base = ModelRunner(EngineConfig(model=model_dir, **{**options, "enable_lora": False,
                                                        "lora_modules": None}))
    base_steps = mixed_steps(4, vocab)
    for step in base_steps:
        step.lora_ids = step.lora_ids[:0]
    base_logits = base.forward(base_steps[0])

    def rank_work(tp: ThreadRank):
        runner = runner_for(tp)
        shapes = projection_shapes(runner.config, runner.model.plan)
        assert runner.lora.slots_b[0]["qkv"].shape[-1] == sum(shapes["qkv"][1])
        return [runner.forward(step) for step in steps]

    got = run_ranks(2, rank_work)[0]
    for logits, want in zip(got, expected, strict=True):
        torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(logits.argmax(-1), want.argmax(-1))
    # the adapters' rows (7 and 4 tokens) differ from the base model's, the base row's do not
    assert (expected[0][:11] - base_logits[:11]).abs().amax(-1).min() > 1e-3
    torch.testing.assert_close(expected[0][11:], base_logits[11:])


def test_tp2_adapters_and_base_match_peft_and_updates_reach_every_rank(model_dir, adapters,
                                                                       tmp_path):
    """Rank 0 is a worker under a scheduler, rank 1 follows its messages: two adapters and the
    base model in flight together, in chunks with a preemption, give transformers + peft's
    greedy tokens; an adapter loaded at runtime serves its weights on both ranks and unloads
    from both; a load that fails on rank 1 alone fails for every rank."""

    options = dict(dtype="float32", quantization="none", enable_lora=True,
                   lora_modules=[f"{n}={p}" for n, p in adapters.items()], num_pages=20,
                   chunked_prefill_size=24, max_prefill_tokens=64)
    gamma = make_adapter(model_dir, tmp_path / "gamma", 10, **ADAPTERS["alpha"])
    prompts = shared_prefix_prompts(6, seed=3)
    names = [None, "alpha", "beta"] * 2
    loaded = {}  # rank -> its pool's adapter ids, after each update

    def rank0(tp: ThreadRank):
        h = Harness(model_dir, tp, **options)
        try:
            steps = []
            run_step = h.worker.step
            h.worker.step = lambda msg: (steps.append(set(msg.step.lora_ids.tolist())),
                                         run_step(msg))[1]
            for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
                add(h, f"r{i}", prompt, name)
            h.run()
            assert h.sched.num_preemptions > 0 and {0, 1, 2} in steps
            replies = [update(h, "gamma", str(gamma))]
            add(h, "gamma", prompts[0], "gamma")
            h.run()
            replies.append(update(h, "gamma"))
            replies.append(update(h, "delta", str(gamma)))
            loaded[0] = set(h.worker.runner.lora.adapters)
            return h.outputs, replies
        finally:
            tp.send_step(encode(Shutdown()))

    def rank1(tp: ThreadRank):
        runner = ModelRunner(EngineConfig(model=model_dir, **options), tp)
        load = runner.load_lora

        def load_but_delta(lora_id: int, name: str, path: str):
            if name == "delta":
                raise ValueError("rank 1 cannot read it")
            return load(lora_id, name, path)

        runner.load_lora = load_but_delta
        follow(runner, tp)
        loaded[1] = set(runner.lora.adapters)

    outputs, replies = run_ranks(2, lambda tp: (rank0 if tp.rank == 0 else rank1)(tp))[0]
    oracles = oracle_models(model_dir, adapters)
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        assert outputs[f"r{i}"][0] == hf_greedy(oracles[name], prompt, 12), (i, name)
    assert outputs["gamma"][0] == hf_greedy(peft_model(model_dir, gamma), prompts[0], 12)
    assert outputs["gamma"][0] != outputs["r1"][0]  # other weights than alpha's
    load_gamma, unload_gamma, load_delta = replies
    assert load_gamma.error is None and unload_gamma.error is None
    assert load_delta.status == 400 and "on every tensor-parallel rank" in load_delta.error
    assert loaded == {0: {1, 2}, 1: {1, 2}}  # gamma unloaded and delta dropped on both


@pytest.mark.e2e
def test_a_tp2_server_serves_adapters_from_start_and_loaded_over_http(model_dir, adapters,
                                                                     tmp_path):
    """Two gloo processes: an adapter given at start and one loaded through
    /v1/load_lora_adapter give transformers + peft's tokens; the unload reaches both ranks
    (a later load of other files under the name serves the new weights)."""
    import httpx

    from tests.server_process import API_KEY, AUTH, ServerProcess

    server = ServerProcess(tmp_path, "--api-key", API_KEY, "--tp-size", "2", "--num-pages",
                           "256", "--enable-lora", "--enable-runtime-lora-updating",
                           "--lora-modules", f"alpha={adapters['alpha']}")
    prompt = list(range(40, 75))

    def generate(client: httpx.Client, model: str) -> list[int]:
        response = client.post("/generate", json={"input_ids": prompt, "model": model,
                                                  "sampling_params": {"max_tokens": 8,
                                                                      "temperature": 0,
                                                                      "ignore_eos": True}})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]

    try:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client:
            got = {"alpha": generate(client, "alpha")}
            for path in (adapters["beta"], adapters["alpha"]):
                loaded = client.post("/v1/load_lora_adapter",
                                     json={"lora_name": "gamma", "lora_path": path})
                assert loaded.status_code == 200, loaded.text
                got[path] = generate(client, "gamma")
                assert client.post("/v1/unload_lora_adapter",
                                   json={"lora_name": "gamma"}).status_code == 200
    finally:
        assert server.stop() == 0
    for name, path in adapters.items():
        expected = hf_greedy(peft_model(model_dir, path), prompt, 8)
        assert got[path] == expected, name
    assert got["alpha"] == got[adapters["alpha"]]
