"""What the runner needs to know about a checkpoint, read from its ``config.json``.

``ModelConfig.from_dir`` accepts the config formats transformers has written over time: RoPE
settings either as ``rope_parameters`` (transformers 5) or as top-level ``rope_theta`` plus
``rope_scaling`` (older checkpoints, ``type`` or ``rope_type``), and end-of-sequence ids from both
``config.json`` and ``generation_config.json``. What a family fixes whatever its config says (Qwen2's
biases, Gemma 3's norms and embeddings) is engine/worker/model/architecture.py's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.checkpoints.layer_windows import sliding_windows
from engine.worker.model.architecture import ACTIVATIONS, FAMILIES, gemma_config

# architecture name -> model_type, for checkpoints whose config lacks "architectures"
SUPPORTED_ARCHITECTURES: dict[str, str] = {name: f.model_type for name, f in FAMILIES.items()}
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
    qk_norm: bool  # Qwen3, Gemma 3: RMSNorm over each head of q and k before RoPE
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None for plain RoPE; else the normalised parameters
    sliding_windows: tuple[int | None, ...]  # per layer: attend to the last W positions only
    eos_token_ids: tuple[int, ...]
    # the rest as architecture.py's Family describes them
    activation: str  # the MLP's gate: "silu" or "gelu_tanh" (GELU's tanh approximation)
    norm_offset: float  # a norm's stored weight w scales by norm_offset + w
    sandwich_norms: bool  # norms on the attention's and the MLP's outputs too
    embedding_scale: float | None  # embeddings times this, in the model's dtype
    attention_scale: float  # the scores' factor: head_dim ** -0.5, or query_pre_attn_scalar's
    sliding_rope_theta: float | None  # sliding layers' plain RoPE base, where it differs

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
        family = FAMILIES[architecture]
        _refuse_unsupported(raw, source)
        sliding_rope_theta = None
        if family.model_type == "gemma3_text":
            raw, sliding_rope_theta = gemma_config(raw, source)
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"{source}: num_attention_heads ({num_heads}) must be a multiple "
                             f"of num_key_value_heads ({num_kv_heads})")
        activation = raw.get(family.activation_key) or "silu"
        if activation not in ACTIVATIONS:
            raise ValueError(f"{source}: {family.activation_key} {activation!r} is not "
                             f"supported; supported: {', '.join(ACTIVATIONS)}")
        num_layers = int(raw["num_hidden_layers"])
        max_context = int(raw.get("max_position_embeddings") or 2048)
        rope_theta, rope_scaling = _rope(raw, max_context, source)
        attention_bias = bool(raw.get("attention_bias", False))
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
            qkv_bias=attention_bias or family.qkv_bias,
            o_bias=attention_bias and not family.qkv_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=family.qk_norm,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            sliding_windows=sliding_windows(raw, architecture, num_layers),
            eos_token_ids=tuple(dict.fromkeys(eos)),
            activation=ACTIVATIONS[activation],
            norm_offset=family.norm_offset,
            sandwich_norms=family.sandwich_norms,
            embedding_scale=hidden**0.5 if family.scaled_embedding else None,
            attention_scale=(float(raw["query_pre_attn_scalar"]) ** -0.5
                             if raw.get("query_pre_attn_scalar") else head_dim**-0.5),
            sliding_rope_theta=sliding_rope_theta,
        )


def _refuse_unsupported(raw: dict[str, Any], source: str) -> None:
    """Config switches transformers honours and this engine does not, as sentences."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(key) is not None:
            raise ValueError(f"{source}: {key} is {raw[key]}; radixserve does not cap logits "
                             "with tanh (Gemma 3 checkpoints leave it null)")
    if raw.get("use_bidirectional_attention"):
        raise ValueError(f"{source}: use_bidirectional_attention is set (an embedding model); "
                         "radixserve serves causal language models only")


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

