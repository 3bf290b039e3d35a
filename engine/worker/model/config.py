"""What the runner needs to know about a checkpoint, read from its ``config.json``.

``ModelConfig.from_dir`` accepts the config formats transformers has written over time: RoPE
settings either as ``rope_parameters`` (transformers 5) or as top-level ``rope_theta`` plus
``rope_scaling`` (older checkpoints, ``type`` or ``rope_type``), and end-of-sequence ids from both
``config.json`` and ``generation_config.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# architecture name -> model_type, for checkpoints whose config lacks "architectures"
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_context_len: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before RoPE
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None for plain RoPE; else the normalised parameters
    sliding_windows: tuple[int | None, ...]  # per layer: attend to the last W positions only
    eos_token_ids: tuple[int, ...]

    @property
    def num_params(self) -> int:
        """Weights in the matrices (norms and biases left out: they are tiny)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        h = self.hidden_size
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no config.json; a model directory needs "
                                    "config.json and *.safetensors weights as written by "
                                    "transformers' save_pretrained")
        raw = json.loads(path.read_text())
        generation = model_dir / "generation_config.json"
        gen_raw = json.loads(generation.read_text()) if generation.is_file() else {}
        return cls.from_dict(raw, gen_raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None, *,
                  source: str = "config") -> ModelConfig:
        architecture = _architecture(raw, source)
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"{source}: num_attention_heads ({num_heads}) must be a multiple "
                             f"of num_key_value_heads ({num_kv_heads})")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (only "
                             "'silu')")
        num_layers = int(raw["num_hidden_layers"])
        max_context = int(raw.get("max_position_embeddings") or 2048)
        rope_theta, rope_scaling = _rope(raw, max_context, source)
        attention_bias = bool(raw.get("attention_bias", False))
        qwen2 = architecture == "Qwen2ForCausalLM"
        eos = _ids(raw.get("eos_token_id")) + _ids((generation or {}).get("eos_token_id"))
        return cls(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_context_len=max_context,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or qwen2,
            o_bias=attention_bias and not qwen2,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            sliding_windows=_sliding_windows(raw, architecture, num_layers),
            eos_token_ids=tuple(dict.fromkeys(eos)),
        )


def _architecture(raw: dict[str, Any], source: str) -> str:
    names = raw.get("architectures") or []
    if not names:
        by_type = {t: a for a, t in SUPPORTED_ARCHITECTURES.items()}
        if raw.get("model_type") in by_type:
            return by_type[raw["model_type"]]
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    found = ", ".join(names) or f"model_type {raw.get('model_type')!r}"
    raise ValueError(f"{source}: architecture {found} is not supported; supported: "
                     + ", ".join(SUPPORTED_ARCHITECTURES))


def _ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _rope(raw: dict[str, Any], max_context: int, source: str
          ) -> tuple[float, dict[str, Any] | None]:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor is not supported")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{source}: rope type {rope_type!r} is not supported; supported: "
                         + ", ".join(SUPPORTED_ROPE_TYPES))
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings",
                          raw.get("original_max_position_embeddings", max_context))
    params.pop("type", None)
    params.pop("rope_theta", None)
    return theta, params


def _sliding_windows(raw: dict[str, Any], architecture: str, num_layers: int
                     ) -> tuple[int | None, ...]:
    """Mirror transformers: Mistral windows every layer when ``sliding_window`` is set; Qwen2/3
    window the layers that ``layer_types`` (or ``use_sliding_window`` + ``max_window_layers``)
    mark as sliding; Llama never windows."""
    window = raw.get("sliding_window")
    if architecture == "LlamaForCausalLM" or not window:
        return (None,) * num_layers
    if architecture == "MistralForCausalLM":
        return (int(window),) * num_layers
    if not raw.get("use_sliding_window", False):
        return (None,) * num_layers
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if i >= int(raw.get("max_window_layers", 0)) else "full_attention"
        for i in range(num_layers)
    ]
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
