"""LoRA adapters: PEFT loading and its refusals, rows of several adapters and of the base
model in one batch token-identical to transformers + peft in fp32, and each adapter's prefixes
cached apart."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoints.demo_model import build_demo_model
from engine.contracts.sampling_params import SamplingParams
from engine.worker import lora_pool
from engine.worker.model.config import ModelConfig
from engine.worker.model.lora import load_adapter
from tests.lora_fixtures import ADAPTERS, make_adapter, make_adapters, oracle_models, peft_model
from tests.test_scheduler import GREEDY, Harness, hf_greedy, shared_prefix_prompts

# peft looked up, not imported: every test process collects this module, and the import takes
# about a second
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                reason="peft is not installed")


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(build_demo_model())


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return make_adapters(model_dir, root)


@pytest.fixture(scope="module")
def oracles(model_dir, adapters):
    return oracle_models(model_dir, adapters)


def lora_harness(model_dir: str, adapters: dict[str, str], **options) -> Harness:
    modules = [f"{name}={path}" for name, path in adapters.items()]
    return Harness(model_dir, enable_lora=True, lora_modules=modules, **options)


def add(h: Harness, rid: str, prompt: list[int], adapter: str | None,
        params: SamplingParams = GREEDY, namespace: str | None = None) -> None:
    from engine.contracts.protocol import TokenizedRequest, pack_ids

    h.sched.add_request(TokenizedRequest(rid=rid, prompt_ids=pack_ids(prompt), params=params,
                                         reply_to=0, lora_name=adapter, namespace=namespace))


def test_adapters_and_base_in_one_batch_match_peft(model_dir, adapters, oracles):
    """Six requests in flight (two per adapter, two of the base model) sharing a system
    prompt, prefilled in chunks, in a pool small enough that one is preempted: every one's
    greedy tokens are transformers + peft's under its own adapter."""
    h = lora_harness(model_dir, adapters, num_pages=20, chunked_prefill_size=24,
                     max_prefill_tokens=64)
    for layer in h.worker.runner.model.layers:
        layer.mlp_chunk_tokens = 7  # the MLP's row chunks cut through adapters' row groups
    steps = []  # each batch's adapter ids
    run_step = h.worker.step
    h.worker.step = lambda msg: (steps.append(set(msg.step.lora_ids.tolist())),
                                 run_step(msg))[1]
    prompts = shared_prefix_prompts(6, seed=3)
    names = [None, "alpha", "beta"] * 2
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        add(h, f"r{i}", prompt, name)
    h.run()
    assert h.sched.num_preemptions > 0
    assert {0, 1, 2} in steps  # one forward served both adapters and the base model
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        expected = hf_greedy(oracles[name], prompt, 12)
        assert h.outputs[f"r{i}"][0] == expected, (i, name)
    # the adapters change the answers (else the comparison above shows nothing)
    for i, name in enumerate(names):
        if name is not None:
            assert h.outputs[f"r{i}"][0] != hf_greedy(oracles[None], prompts[i], 12), name


@pytest.mark.parametrize("form", ["torch", "op"])
def test_every_row_adapted_out_of_slot_order_matches_peft(model_dir, adapters, oracles,
                                                          monkeypatch, form):
    """Four requests in flight, every one adapted, their rows alternating between the two
    adapters' slots (no base-model row in any step): greedy tokens are transformers + peft's
    under each one's adapter, through the compiled op and through the torch form that serves
    without it (CUDA, RADIXSERVE_CPU_KERNELS=0, no compiler), which gathers rows in slot order
    and must put each delta back on its own row."""
    if form == "torch":
        monkeypatch.setattr(lora_pool, "lora_bgmv_op", lambda: None)
    h = lora_harness(model_dir, adapters, num_pages=256)
    assert (h.worker.runner.lora.kernel is None) == (form == "torch")
    steps = []  # each step's adapter ids, in row order
    run_step = h.worker.step
    h.worker.step = lambda msg: (steps.append(msg.step.lora_ids.tolist()), run_step(msg))[1]
    prompts = shared_prefix_prompts(4, seed=8)
    names = ["alpha", "beta"] * 2
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        add(h, f"r{i}", prompt, name)
    h.run()
    assert [1, 2, 1, 2] in steps and all(0 not in ids for ids in steps)
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        assert h.outputs[f"r{i}"][0] == hf_greedy(oracles[name], prompt, 12), (i, name)


def test_a_prefix_cached_by_the_base_model_is_no_hit_for_an_adapter(model_dir, adapters,
                                                                    oracles):
    h = lora_harness(model_dir, adapters, num_pages=256)
    prompt = shared_prefix_prompts(1, seed=4)[0]
    add(h, "base", prompt, None)
    h.run()
    add(h, "alpha", prompt, "alpha")
    h.run()
    add(h, "base-again", prompt, None)
    add(h, "beta", prompt, "beta")
    h.run()
    add(h, "alpha-again", prompt, "alpha")
    add(h, "alpha-salted", prompt, "alpha", namespace="tenant")  # cache_salt composes with it
    h.run()
    add(h, "alpha-salted-again", prompt, "alpha", namespace="tenant")
    h.run()
    hits = {rid: finals[0].cached_tokens for rid, finals in h.finals.items()}
    assert hits["alpha"] == hits["beta"] == hits["alpha-salted"] == 0
    assert hits["base-again"] == hits["alpha-again"] == len(prompt) - 1
    assert hits["alpha-salted-again"] == len(prompt) - 1
    assert h.outputs["alpha-again"] == h.outputs["alpha"]
    assert h.outputs["alpha"][0] == hf_greedy(oracles["alpha"], prompt, 12)


def test_more_adapters_than_max_loras_wait_and_swap(model_dir, adapters, oracles):
    """With one adapter resident at a time, requests of two adapters in flight together are
    queued step by step (never failed) and the pool swaps adapters between steps."""
    h = lora_harness(model_dir, adapters, num_pages=256, max_loras=1)
    prompts = shared_prefix_prompts(4, seed=5)
    names = ["alpha", "beta", "beta", None]
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        add(h, f"r{i}", prompt, name)
    h.run()
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        assert h.outputs[f"r{i}"][0] == hf_greedy(oracles[name], prompt, 12), name
    assert h.worker.runner.lora.swaps >= 2


def test_an_unknown_adapter_is_a_404(model_dir, adapters):
    h = lora_harness(model_dir, adapters, num_pages=64)
    add(h, "x", [5, 6, 7], "gamma")
    h.step()
    (final,) = h.finals["x"]
    assert final.status == 404 and "'gamma' does not exist" in final.error


def test_adapters_that_do_not_fit_are_refused_with_a_sentence(model_dir, adapters, tmp_path):
    config = ModelConfig.from_dir(model_dir)
    with pytest.raises(ValueError, match="has rank 8 but --max-lora-rank is 4"):
        load_adapter("beta", adapters["beta"], config, max_rank=4)
    bad = tmp_path / "bad"
    bad.mkdir()
    with open(f"{adapters['alpha']}/adapter_config.json") as file:
        settings = json.load(file)
    (bad / "adapter_config.json").write_text(json.dumps(settings))
    tensors = load_file(f"{adapters['alpha']}/adapter_model.safetensors")
    key = next(k for k in tensors if "q_proj.lora_B" in k)
    tensors[key] = torch.zeros(100, 4)
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"is \[100, 4\] but the base model's q_proj needs "
                                         r"\[256, 4\]"):
        load_adapter("bad", bad, config, max_rank=64)
    settings["target_modules"] = ["q_proj", "lm_head"]
    (bad / "adapter_config.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="targets lm_head; only q_proj"):
        load_adapter("bad", bad, config, max_rank=64)


def update(h: Harness, name: str, path: str | None = None):
    """Load (or, without ``path``, unload) an adapter through the scheduler and worker, as
    their processes pass the messages."""
    from engine.contracts.protocol import LoraUpdate, LoraUpdated

    checked = h.sched.update_lora(LoraUpdate(rid=f"lora-{name}-{path}", name=name, path=path))
    if isinstance(checked, LoraUpdated):
        return checked
    return h.sched.adapters.updated(h.worker.update_lora(checked))


def test_an_adapter_reloaded_with_new_weights_answers_with_them(model_dir, adapters, tmp_path):
    """Load at runtime, use (then hit its cache), unload, write other weights to the same
    directory, load again: the answers follow the new weights, and nothing cached under the
    old ones is read."""
    h = lora_harness(model_dir, {}, num_pages=256)
    path = make_adapter(model_dir, tmp_path / "gamma", 10, **ADAPTERS["alpha"])
    prompt = shared_prefix_prompts(1, seed=6)[0]
    assert update(h, "gamma", str(path)).error is None
    assert update(h, "gamma", str(path)).error.endswith("is already loaded; unload it first "
                                                         "to load other weights under that name")
    add(h, "first", prompt, "gamma")
    h.run()
    add(h, "hit", prompt, "gamma")
    h.step()
    busy = update(h, "gamma")
    assert busy.status == 400 and "has 1 requests in flight" in busy.error
    h.run()
    assert h.finals["hit"][0].cached_tokens == len(prompt) - 1
    assert h.outputs["first"][0] == hf_greedy(peft_model(model_dir, path), prompt, 12)
    assert update(h, "gamma").error is None
    add(h, "gone", prompt, "gamma")
    h.step()
    assert h.finals["gone"][0].status == 404
    make_adapter(model_dir, path, 11, **ADAPTERS["alpha"])  # new weights, same directory
    loaded = update(h, "gamma", str(path))
    assert [a.name for a in loaded.adapters] == ["gamma"] and loaded.adapter.lora_id == 2
    add(h, "reloaded", prompt, "gamma")
    h.run()
    assert h.finals["reloaded"][0].cached_tokens == 0
    new_answer = hf_greedy(peft_model(model_dir, path), prompt, 12)
    assert h.outputs["reloaded"][0] == new_answer != h.outputs["first"][0]
    assert len(h.worker.runner.lora.adapters) == 1  # the old weights left the worker
    bad = update(h, "delta", str(tmp_path / "nowhere"))
    assert bad.status == 400 and "adapter_config.json does not exist" in bad.error
    assert update(h, "delta", str(path)).error is None  # a failed load leaves the name free


def test_a_name_still_loading_is_refused(model_dir, adapters):
    """Two loads under one name at once (two clients, or one retrying): the second is refused
    while the first is with the worker, and again once it is served; the name holds the first
    one's weights."""
    from engine.contracts.protocol import LoraUpdate, LoraUpdated

    h = lora_harness(model_dir, {}, num_pages=64)
    first = h.sched.update_lora(LoraUpdate(rid="u1", name="gamma", path=adapters["alpha"]))
    assert isinstance(first, LoraUpdate)  # on its way to the worker
    for rid in ("u2", "u3"):
        second = h.sched.update_lora(LoraUpdate(rid=rid, name="gamma", path=adapters["beta"]))
        assert isinstance(second, LoraUpdated) and second.status == 400, second
        assert "already loaded" in second.error
        if rid == "u2":
            loaded = h.sched.adapters.updated(h.worker.update_lora(first))
            assert loaded.error is None
    assert [(a.name, a.rank) for a in h.sched.adapters.served.values()] == [("gamma", 4)]
    assert list(h.worker.runner.lora.adapters) == [first.lora_id]


def test_kv_events_name_the_adapter_of_each_block(model_dir, adapters):
    from engine.contracts.kv_events import BlockStored
    from scheduler.kv_events import BlockEvents

    h = lora_harness(model_dir, adapters, num_pages=64)
    events = BlockEvents(16, loras=h.sched.adapters.of_namespace)
    events.attach(h.sched.tree)
    prompt = shared_prefix_prompts(1, seed=7)[0]
    add(h, "base", prompt, None)
    add(h, "beta", prompt, "beta")
    h.run()
    stored = [e for e in events.take() if isinstance(e, BlockStored)]
    assert {(e.lora_id, e.lora_name) for e in stored} == {(None, None), (2, "beta")}
    # the same tokens hash apart under the adapter
    base = {h for e in stored if e.lora_id is None for h in e.block_hashes}
    assert not base & {h for e in stored if e.lora_id == 2 for h in e.block_hashes}


def test_the_disk_tier_serves_an_adapter_its_own_weights_blocks_only(model_dir, tmp_path):
    """A restart reads an adapter's blocks from disk; the same name with new weights, or the
    base model, reads none of them (the adapter's content hash is in the hash chain)."""
    path = make_adapter(model_dir, tmp_path / "gamma", 12, **ADAPTERS["alpha"])
    disk = tmp_path / "disk"
    disk.mkdir(mode=0o700)
    prompt = shared_prefix_prompts(1, seed=8)[0] * 3

    def served(rid: str, adapter: str | None = "gamma"):
        h = lora_harness(model_dir, {"gamma": str(path)}, page_size=16, num_pages=40,
                         disk_cache_dir=str(disk))
        add(h, rid, prompt, adapter)
        h.run()
        return h.finals[rid][0], h.outputs[rid][0]

    _, first = served("first")
    final, again = served("restart")
    assert final.cached_tokens_disk == (len(prompt) - 1) // 16 * 16 and again == first
    assert served("base", None)[0].cached_tokens_disk == 0
    make_adapter(model_dir, path, 13, **ADAPTERS["alpha"])
    final, answer = served("new-weights")
    assert final.cached_tokens_disk == 0
    assert answer == hf_greedy(peft_model(model_dir, path), prompt, 12) != first


def test_adapters_with_drafts_samples_beams_and_a_grammar(model_dir, adapters, oracles):
    """Under adapters: prompt-lookup drafts, n = 2 samples and beam search give transformers +
    peft's tokens; a constrained request keeps its grammar."""
    from engine.contracts.structured import StructuredOutputs
    from engine.contracts.tokenizer import load_tokenizer

    h = lora_harness(model_dir, adapters, num_pages=256, page_size=4,
                     speculative_config=json.dumps({"method": "ngram",
                                                    "num_speculative_tokens": 4,
                                                    "prompt_lookup_min": 1,
                                                    "prompt_lookup_max": 3}))
    repetitive = list(range(200, 212)) * 4
    add(h, "drafted", repetitive, "alpha")
    add(h, "samples", repetitive[:30], "beta", SamplingParams(
        max_tokens=12, temperature=0.0, n=2, ignore_eos=True))
    prompt = list(range(100, 130))
    add(h, "beams", prompt, "beta", SamplingParams(max_tokens=6, beam_width=3, n=2))
    add(h, "digits", prompt, "alpha", SamplingParams(
        max_tokens=16, temperature=0.0, structured_outputs=StructuredOutputs(regex="[0-9]{5}")))
    h.run()
    assert h.sched.stats()["spec_drafted_tokens"] > 0
    assert h.outputs["drafted"][0] == hf_greedy(oracles["alpha"], repetitive, 12)
    expected = hf_greedy(oracles["beta"], repetitive[:30], 12)
    assert h.outputs["samples"] == {0: expected, 1: expected}
    ref = oracles["beta"].generate(input_ids=torch.tensor([prompt]), num_beams=3,
                                   num_return_sequences=2, max_new_tokens=6, do_sample=False,
                                   early_stopping=False, length_penalty=1.0, pad_token_id=0)
    assert [h.outputs["beams"][i] for i in range(2)] == [
        [t for t in row[len(prompt):].tolist() if t != 0] for row in ref]
    text = load_tokenizer(model_dir).decode(h.outputs["digits"][0], skip_special_tokens=True)
    assert text.isdigit() and len(text) == 5


def test_the_dp_dispatcher_predicts_no_base_model_hit_for_an_adapter():
    """Replicas hash an adapter's blocks under its content hash, which the dispatcher does not
    know: an adapter request goes by load alone and claims none of the base model's blocks."""
    from engine.contracts.protocol import TokenizedRequest, pack_ids
    from tokenizer_worker.dispatch import Dispatcher

    dispatcher = Dispatcher(2, 4)
    ids = pack_ids(list(range(10, 50)))
    routes = [dispatcher.route(TokenizedRequest(rid=rid, prompt_ids=ids, params=GREEDY,
                                                reply_to=0, lora_name=adapter))[0]
              for rid, adapter in (("base", None), ("alpha", "alpha"), ("again", None))]
    assert routes == [0, 1, 0]  # the adapter's to the idle replica, the base model's home
    predicted = {rid: routed.predicted for rid, routed in dispatcher.requests.items()}
    assert predicted == {"base": 0, "alpha": 0, "again": 39}
