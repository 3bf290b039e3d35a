"""Tiny random Hugging Face checkpoints for runner tests, written with transformers itself.

Each kind stresses a different part of the model code: GQA, an explicit head_dim that differs
from hidden / heads, per-head q/k norms, qkv bias, sliding windows, scaled RoPE, tied
embeddings, sharded safetensors, Gemma 3's norms, GELU, scaled embeddings, attention scale and
RoPE per layer kind. Weights are drawn with a fixed seed and a larger spread than
transformers' init (and non-trivial norm weights and biases) so logits are peaked and every
weight matters.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

_COMMON: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    # GQA 4 query heads over 2 KV heads, head_dim 16
    "llama": ("LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2)),
    # Llama 3 style RoPE scaling
    "llama3_rope": (
        "LlamaForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    # biases on every projection (q/k/v/o and the MLP), multi-head attention
    "llama_bias": (
        "LlamaForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=4, attention_bias=True, mlp_bias=True),
    ),
    # explicit head_dim 24 != 64 / 4, per-head q/k RMSNorm, tied embeddings
    "qwen3": (
        "Qwen3ForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=True),
    ),
    # q/k/v bias, 4 query heads per KV head
    "qwen2": ("Qwen2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=1)),
    # every layer attends to the last 8 positions only
    "mistral": (
        "MistralForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=8),
    ),
    # a sliding layer (window 8, RoPE base 10,000) then a full one (base 1,000,000); scores
    # scaled by query_pre_attn_scalar 24, not head_dim 16; four (1 + w) norms a layer, q/k
    # norms, GELU, embeddings times 8; tied
    "gemma3": (
        "Gemma3ForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
             layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24),
    ),
}
# where the config class is not the architecture's name with Config for ForCausalLM
_CONFIG_CLASSES = {"Gemma3ForCausalLM": "Gemma3TextConfig"}


def write_checkpoint(
    path: str | Path,
    kind: str = "llama",
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    head_std: float = 0.15,
    **overrides: Any,
) -> Path:
    """Save a random ``kind`` checkpoint (see KINDS) into ``path`` and return it.

    ``max_shard_size`` (e.g. "20KB") writes sharded safetensors with an index file;
    ``head_std`` is the spread of an untied LM head's weights (the logits' spread grows with
    it); ``overrides`` replace config fields.
    """
    path = Path(path)
    architecture, fields = KINDS[kind]
    config_cls = getattr(transformers, _CONFIG_CLASSES.get(
        architecture, architecture.replace("ForCausalLM", "Config")))
    config = config_cls(**{**_COMMON, **fields, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.normal_(0.0, 0.2)
            elif name == "lm_head.weight":
                param.normal_(0.0, head_std)
            else:
                param.normal_(0.0, 0.15)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def noisy_copy(source: str | Path, dest: str | Path, scale: float, seed: int) -> str:
    """A copy of the checkpoint at ``source`` in ``dest``, its matrices with Gaussian noise of
    ``scale`` times each one's spread added: a draft model that mostly agrees with it."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, dest)
    weights = load_file(f"{dest}/model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    noisy = {k: v + scale * v.std() * torch.randn(v.shape, generator=gen) if v.dim() == 2 else v
             for k, v in weights.items()}
    save_file(noisy, f"{dest}/model.safetensors", metadata={"format": "pt"})
    return str(dest)


def load_reference(path: str | Path) -> torch.nn.Module:
    """transformers' own float32 model for a checkpoint: the parity oracle."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models gain nothing from threads, and on a busy 2-core machine an OpenMP barrier
    waiting for a descheduled thread makes every op many times slower. Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
