"""LoRA adapters over sliding-window layers held in pages of their own (``--sliding-kv-ratio``),
on the small Gemma-3-shaped model of tests/test_sliding_kv.py (two sliding layers with a
16-token window, then a full one): two adapters and the base model, prompts several windows
long, greedy tokens equal transformers + peft's under each one's adapter, cold, resent and as a
next turn; each adapter's prefixes and kept windows hit only under that adapter; no page of
either pool leaks."""

from __future__ import annotations

import importlib.util

import pytest

from engine.contracts.sampling_params import SamplingParams
from tests.lora_fixtures import make_adapters, oracle_models
from tests.test_lora import add
from tests.test_scheduler import hf_greedy
from tests.test_sliding_kv import WindowHarness, gemma_dir, prompts  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                reason="peft is not installed")

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
NAMES = (None, "alpha", "beta")


@pytest.fixture(scope="module")
def adapters(gemma_dir, tmp_path_factory) -> dict[str, str]:  # noqa: F811
    return make_adapters(gemma_dir, tmp_path_factory.mktemp("gemma_adapters"))


@pytest.fixture(scope="module")
def oracles(gemma_dir, adapters):  # noqa: F811
    return oracle_models(gemma_dir, adapters)


@pytest.mark.parametrize("page_size", [1, 16])
def test_adapters_over_windows_match_peft_and_hit_per_adapter(gemma_dir, adapters,  # noqa: F811
                                                              oracles, page_size):
    modules = [f"{name}={path}" for name, path in adapters.items()]
    h = WindowHarness(gemma_dir, page_size=page_size, num_pages=2048 // page_size,
                      sliding_kv_ratio=0.5, chunked_prefill_size=24, max_prefill_tokens=64,
                      enable_lora=True, lora_modules=modules)
    prompt = prompts(1, seed=11)[0]
    for name in NAMES:  # one prompt under each adapter, in flight together
        add(h, f"cold-{name}", prompt, name, GREEDY)
    h.run()
    for name in NAMES:
        assert h.outputs[f"cold-{name}"][0] == hf_greedy(oracles[name], prompt, 20), name
    # the adapters change the answers (else the comparison above shows nothing)
    assert len({tuple(h.outputs[f"cold-{name}"][0]) for name in NAMES}) == 3
    hits = {name: h.finals[f"cold-{name}"][0].cached_tokens for name in NAMES}
    assert hits == {None: 0, "alpha": 0, "beta": 0}  # no adapter hits another's KV
    for name in NAMES:  # exact resends and next turns, each under its own adapter
        add(h, f"again-{name}", prompt, name, GREEDY)
        turn = prompt + h.outputs[f"cold-{name}"][0] + [5, 6, 7]
        add(h, f"turn-{name}", turn, name, GREEDY)
    h.run()
    for name in NAMES:
        assert h.finals[f"again-{name}"][0].cached_tokens == len(prompt) - 1, name
        assert h.outputs[f"again-{name}"][0] == h.outputs[f"cold-{name}"][0], name
        turn = prompt + h.outputs[f"cold-{name}"][0] + [5, 6, 7]
        # the history hits to its last output, whose KV was never computed
        assert h.finals[f"turn-{name}"][0].cached_tokens == len(prompt) + 19, name
        assert h.outputs[f"turn-{name}"][0] == hf_greedy(oracles[name], turn, 20), name
    assert h.sched.tree.num_namespaces == 3
    sliding = h.sched.tree.sliding.allocator
    assert sliding.num_pinned_pages == 0
    h.sched.tree.reset()
    assert sliding.num_free_pages == sliding.num_pages
    assert h.sched.alloc.num_free_pages == h.sched.alloc.num_pages
