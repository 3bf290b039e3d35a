"""What tells the supported families apart: a small description each, read by the one model
implementation (engine/worker/model/llama.py) through ``ModelConfig``.

Everything else (sizes, RoPE, windows, biases a config switches on) comes from config.json;
a family fixes only what its transformers implementation does whatever the config says::

    family     biases       q/k norm  norms a layer        MLP          embeddings   RoPE
    llama      config's     -         2                    SiLU-gated   as stored    one
    mistral    -            -         2                    SiLU-gated   as stored    one
    qwen2      q/k/v        -         2                    SiLU-gated   as stored    one
    qwen3      config's     yes       2                    SiLU-gated   as stored    one
    gemma3     config's     yes       4 (1 + w, sandwich)  GELU-gated   x sqrt(h)    per layer kind

Sliding windows differ by family too (engine/checkpoints/layer_windows.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.checkpoints.layer_windows import FULL, SLIDING


@dataclass(frozen=True)
class Family:
    model_type: str
    qkv_bias: bool = False  # q/k/v biases whatever attention_bias says (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE
    # Gemma: a norm's stored weight w scales by 1 + w (the loader folds the 1 in once)
    norm_offset: float = 0.0
    # Gemma 3: a norm on the attention's output and one on the MLP's, before each joins the
    # residual, beside the two on their inputs
    sandwich_norms: bool = False
    # Gemma: embeddings times sqrt(hidden_size), the factor rounded to the model's dtype
    scaled_embedding: bool = False
    activation_key: str = "hidden_act"  # the config field naming the MLP's gate activation


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama"),
    "MistralForCausalLM": Family("mistral"),
    "Qwen2ForCausalLM": Family("qwen2", qkv_bias=True),
    "Qwen3ForCausalLM": Family("qwen3", qk_norm=True),
    "Gemma3ForCausalLM": Family("gemma3_text", qk_norm=True, norm_offset=1.0,
                                sandwich_norms=True, scaled_embedding=True,
                                activation_key="hidden_activation"),
}
# the gate activations, by the names configs give them
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}



# Gemma3TextConfig's defaults where they differ from the generic ones
GEMMA3_DEFAULTS = {"head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
                   "query_pre_attn_scalar": 256, "tie_word_embeddings": True}


def gemma_config(raw: dict[str, Any], source: str) -> tuple[dict[str, Any], float]:
    """A Gemma 3 config in the generic form ``ModelConfig`` reads (Gemma's defaults filled in,
    the full-attention layers' RoPE as the one RoPE) and the sliding layers' RoPE base, which
    transformers 5 writes per layer kind in ``rope_parameters`` and older configs as
    ``rope_theta`` (+ ``rope_scaling``) and ``rope_local_base_freq``."""
    raw = {**GEMMA3_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    params = raw.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        full, local = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"{source}: the sliding layers' rope type "
                             f"{local['rope_type']!r} is not supported (only 'default')")
        return ({**raw, "rope_parameters": {"rope_theta": 1_000_000.0, **full}},
                float(local.get("rope_theta", 10_000.0)))
    return ({"rope_theta": 1_000_000.0, **raw},
            float(raw.get("rope_local_base_freq") or 10_000.0))
