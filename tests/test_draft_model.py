"""Speculative decoding with a draft model (engine/worker/draft.py, scheduler/draft_model.py):
two small written models of one tokenizer, driven in-process with the accounting check after
every step (the harness of tests/test_scheduler.py). Outputs are compared with decoding
without drafts; the draft's KV shares the target's pages.

Drafts: a draft that IS the target (the same weights) proposes what the target then picks
(greedy), so verification accepts whole drafts and the draft's catch-up runs; a draft of other
weights is mostly rejected, so rollbacks run; one of the target's weights with noise added
between the two."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from engine.contracts.engine_config import EngineConfig
from engine.contracts.sampling_params import SamplingParams
from engine.contracts.speculative import SpeculativeConfig
from engine.worker.draft import check_same_vocabulary
from tests.conftest_models import load_reference, write_checkpoint
from tests.test_scheduler import Harness
from tests.tokenizer_fixtures import byte_level_tokenizer, metaspace_tokenizer

VOCAB = 128


def _model(path, seed: int, tokenizer=None, **overrides) -> str:
    write_checkpoint(path, "llama", seed=seed, head_std=0.6, vocab_size=VOCAB,
                     max_position_embeddings=512, **overrides)
    (tokenizer or byte_level_tokenizer()).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """target; same (its copy); other (other weights, one layer); near (the target's weights
    with noise: mostly accepted, sometimes not); foreign (another tokenizer)."""
    root = tmp_path_factory.mktemp("draft_models")
    target = _model(root / "target", seed=0)
    same = str(root / "same")
    shutil.copytree(target, same)
    near = str(root / "near")
    shutil.copytree(target, near)
    from safetensors.torch import load_file, save_file

    weights = load_file(f"{near}/model.safetensors")
    gen = torch.Generator().manual_seed(3)
    noisy = {k: v + 0.35 * v.std() * torch.randn(v.shape, generator=gen) if v.dim() == 2 else v
             for k, v in weights.items()}
    save_file(noisy, f"{near}/model.safetensors", metadata={"format": "pt"})
    return {"target": target, "same": same, "near": near,
            "other": _model(root / "other", seed=1, num_hidden_layers=1),
            "foreign": _model(root / "foreign", seed=1, tokenizer=metaspace_tokenizer())}


def spec(model: str, k: int = 4, **extra) -> str:
    return json.dumps({"model": model, "num_speculative_tokens": k, **extra})


def workload(seed: int = 0, count: int = 5, max_tokens: int = 30) -> dict:
    rng = np.random.default_rng(seed)
    return {f"r{i}": (rng.integers(3, VOCAB, int(rng.integers(5, 40))).tolist(),
                      SamplingParams(max_tokens=max_tokens + 3 * i, temperature=0.0,
                                     ignore_eos=True))
            for i in range(count)}


def run(model_dir: str, requests: dict, **options) -> Harness:
    h = Harness(model_dir, **options)
    for rid, (prompt, params) in requests.items():
        h.add(rid, prompt, params)
    h.run()
    return h


@pytest.mark.parametrize("draft", ["same", "near", "other"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_outputs_are_those_without_a_draft(models, draft, page_size):
    requests = workload(seed=page_size)
    base = run(models["target"], requests, page_size=page_size, num_pages=400)
    h = run(models["target"], requests, page_size=page_size, num_pages=400,
            speculative_config=spec(models[draft]))
    assert h.outputs == base.outputs
    s = h.sched.speculator
    assert s.model.drafted_tokens > 0
    if draft == "same":
        assert s.model.accepted_tokens == s.model.drafted_tokens
    if draft == "other":
        assert s.model.accepted_tokens < s.model.drafted_tokens
