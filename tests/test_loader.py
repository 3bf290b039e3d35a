"""Checkpoint loading: configs in every format transformers has written, sharded and tied
weights, and errors that name the file and key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.contracts.engine_config import EngineConfig
from engine.worker.model.config import ModelConfig
from engine.worker.model.loader import load_model
from engine.worker.model.rope import rope_inv_freq
from tests.conftest_models import write_checkpoint

CPU, F32 = torch.device("cpu"), torch.float32


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    return dst


def edit_config(path: Path, **fields) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))


def test_sharded_checkpoint_loads_the_same_weights(llama_dir: Path, tmp_path: Path) -> None:
    sharded = write_checkpoint(tmp_path / "sharded", "llama", max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    one = load_model(llama_dir, device=CPU, dtype=F32).state_dict()
    many = load_model(sharded, device=CPU, dtype=F32).state_dict()
    assert one.keys() == many.keys()
    assert all(torch.equal(one[name], many[name]) for name in one)


def test_tied_embeddings_share_one_tensor(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "tied", "llama", tie_word_embeddings=True)
    model = load_model(path, device=CPU, dtype=F32)
    assert model.lm_head is model.embed
    assert "lm_head.weight" not in model.weight_targets()


def test_unsupported_architecture_lists_the_supported(llama_dir: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(llama_dir, tmp_path / "gpt2")
    edit_config(path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel is not supported.*LlamaForCausalLM"):
        ModelConfig.from_dir(path)


def test_missing_config_and_weights_are_named(llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_model(tmp_path, device=CPU, dtype=F32)
    path = copy_checkpoint(llama_dir, tmp_path / "no_weights")
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights.*pytorch_model\.bin"):
        load_model(path, device=CPU, dtype=F32)


def test_index_naming_a_missing_shard(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "sharded", "llama", max_shard_size="20KB")
    victim = sorted(path.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=f"lists {victim.name}, which is not in"):
        load_model(path, device=CPU, dtype=F32)


def test_shape_mismatch_names_file_key_and_shapes(llama_dir: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(llama_dir, tmp_path / "wide")
    edit_config(path, intermediate_size=128)
    with pytest.raises(
        ValueError,
        match=r"model\.safetensors: tensor '.*_proj\.weight' has shape .*96.* but config\.json implies .*128",
    ):
        load_model(path, device=CPU, dtype=F32)


def test_missing_and_unknown_keys_are_named(llama_dir: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(llama_dir, tmp_path / "edited")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing from model\.safetensors: model\.norm\.weight"):
        load_model(path, device=CPU, dtype=F32)
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"has tensor 'model\.layers\.0\.mlp\.extra\.weight'"):
        load_model(path, device=CPU, dtype=F32)


LLAMA = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=32,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
)


def test_legacy_config_fields_and_generation_eos() -> None:
    raw = dict(
        LLAMA,
        rope_theta=500000.0,
        rope_scaling={"type": "linear", "factor": 2.0},
        head_dim=None,
        eos_token_id=[2, 7],
    )
    config = ModelConfig.from_dict(raw, {"eos_token_id": [7, 9]})
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.head_dim == 16 and config.num_kv_heads == 4
    assert config.eos_token_ids == (2, 7, 9)
    assert config.sliding_windows == (None, None)


def test_unsupported_rope_type_lists_the_supported() -> None:
    raw = dict(LLAMA, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match=r"'dynamic' is not supported; supported: default, linear"):
        ModelConfig.from_dict(raw)


def test_qwen2_windows_only_when_enabled() -> None:
    raw = dict(LLAMA, architectures=["Qwen2ForCausalLM"], sliding_window=8, max_window_layers=1)
    assert ModelConfig.from_dict(raw).sliding_windows == (None, None)
    assert ModelConfig.from_dict(dict(raw, use_sliding_window=True)).sliding_windows == (None, 8)
    assert ModelConfig.from_dict(raw).qkv_bias and not ModelConfig.from_dict(raw).o_bias


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 16,
        },
    ],
)
def test_rope_frequencies_match_transformers(rope_scaling: dict) -> None:
    hf = LlamaConfig(
        hidden_size=128,
        num_attention_heads=2,
        max_position_embeddings=256,
        rope_scaling=rope_scaling,
    )
    expected, expected_scale = ROPE_INIT_FUNCTIONS[rope_scaling["rope_type"]](hf, "cpu")
    ours, scale = rope_inv_freq(
        ModelConfig.from_dict({**hf.to_dict(), "architectures": ["LlamaForCausalLM"]})
    )
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)
    assert scale == pytest.approx(expected_scale)


def test_dummy_load_format_needs_only_the_config(llama_dir: Path, tmp_path: Path) -> None:
    only_config = tmp_path / "config_only"
    only_config.mkdir()
    (only_config / "config.json").write_text((llama_dir / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(only_config, device=CPU, dtype=F32)
    first = load_model(only_config, device=CPU, dtype=F32, load_format="dummy", seed=3)
    again = load_model(only_config, device=CPU, dtype=F32, load_format="dummy", seed=3)
    other = load_model(only_config, device=CPU, dtype=F32, load_format="dummy", seed=4)
    weights = first.weight_targets()
    for name, tensor in weights.items():
        assert torch.equal(tensor, again.weight_targets()[name]), name
        if name.endswith("norm.weight"):
            assert torch.all(tensor == 1), name
        else:
            assert 0.015 < tensor.float().std() < 0.025, name
    assert not torch.equal(weights["model.embed_tokens.weight"],
                           other.weight_targets()["model.embed_tokens.weight"])
    # The runner takes the same path: random weights give finite logits through every layer.
    from engine.contracts.step import BatchInput
    from engine.worker.runner import ModelRunner

    runner = ModelRunner(EngineConfig(model=str(only_config), num_pages=4, dtype="float32",
                                      load_format="dummy"))
    logits = runner.forward(BatchInput.build([([0, 1], 0, list(range(20)))], 16))
    assert logits.shape == (1, runner.config.vocab_size) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="load_format must be auto or dummy"):
        load_model(only_config, device=CPU, dtype=F32, load_format="pt")
