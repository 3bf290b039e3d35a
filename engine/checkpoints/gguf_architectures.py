"""What a GGUF's ``general.architecture`` means to the converter (engine/checkpoints/gguf.py):
its ``<arch>.*`` metadata as a Hugging Face config.json, its tensor names as Hugging Face names,
the tensors a file of that metadata must hold, and what llama.cpp's converter did to them that
loading undoes.

    GGUF       Hugging Face         llama.cpp's converter did
    llama      LlamaForCausalLM     interleaved each head's rotary halves in Q and K rows
    qwen2      Qwen2ForCausalLM     nothing (q/k/v biases kept as attn_q.bias ...)
    qwen3      Qwen3ForCausalLM     nothing (q/k norms as attn_q_norm ...)
    gemma3     Gemma3ForCausalLM    added 1 to every norm weight (HF's RMSNorm scales by 1 + w)

Gemma 3's layer pattern is not in the file: llama.cpp slides every layer but each sixth when
``gemma3.attention.sliding_window`` is set (rope base 10,000 on those), and scales the scores by
1 / sqrt(key_length) (1 / sqrt(hidden / heads) for the 62-layer 27B), as transformers'
Gemma3TextConfig does by ``query_pre_attn_scalar``.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

ARCHITECTURES = {  # general.architecture -> (HF architecture, model_type)
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",  # before the MLP; Gemma's name for it differs
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA3_LAYER_TENSORS = {**_LAYER_TENSORS, "ffn_norm": "pre_feedforward_layernorm"}
_MODEL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
GEMMA3_PATTERN = 6  # llama.cpp's: layer i slides unless (i + 1) % 6 == 0
# Gemma 3's documented turn format, for files that carry no chat template (the 270M's): no
# system turn, so a system message opens the first user turn, as Google's template does.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') "
    "+ message['content'] | trim + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
CHAT_TEMPLATES = {"gemma3": GEMMA3_CHAT_TEMPLATE}  # for files without one
END_OF_TURN = {"gemma3": "<end_of_turn>"}  # a turn's last token, an end of sequence too


def check_architecture(architecture: Any, source: str) -> None:
    if architecture not in ARCHITECTURES:
        raise ValueError(f"{source} holds a {architecture!r} model; radixserve reads GGUF files "
                         f"of the architectures {', '.join(map(repr, ARCHITECTURES))} only")


def hf_config(meta: Any, architecture: str, tied: bool, vocab_size: int) -> tuple[dict, dict]:
    """config.json and generation_config.json from the ``<architecture>.*`` and tokenizer
    metadata (``meta``: gguf.py's ``_Metadata``)."""
    def key(field: str) -> str:
        return f"{architecture}.{field}"

    name = meta.source.name
    hidden = meta.integer(key("embedding_length"))
    heads = meta.integer(key("attention.head_count"))
    layers = meta.integer(key("block_count"))
    head_dim = meta.integer(key("attention.key_length"), hidden // heads)
    value_dim = meta.integer(key("attention.value_length"), head_dim)
    rope_dim = meta.integer(key("rope.dimension_count"), head_dim)
    if value_dim != head_dim:
        raise ValueError(f"{name} has keys of {head_dim} and values of {value_dim} dimensions "
                         "a head; radixserve supports equal ones only")
    if rope_dim != head_dim:
        raise ValueError(f"{name} rotates {rope_dim} of each head's {head_dim} dimensions; "
                         "radixserve supports RoPE over whole heads only")
    rope_scaling = None
    scaling = meta.get(key("rope.scaling.type"), "none")
    if scaling == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(meta.need(key("rope.scaling.factor")))}
    elif scaling != "none":
        raise ValueError(f"{name} uses {scaling!r} RoPE scaling; the GGUF converter reads none "
                         "or linear only")
    generation = _generation(meta, architecture)
    hf_architecture, model_type = ARCHITECTURES[architecture]
    config = {
        "architectures": [hf_architecture],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": meta.integer(key("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": meta.integer(key("attention.head_count_kv"), heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": meta.integer(key("context_length")),
        "rms_norm_eps": _float32(meta.need(key("attention.layer_norm_rms_epsilon"))),
        "rope_theta": _float32(meta.get(key("rope.freq_base"), 10000.0)),
        "rope_scaling": rope_scaling,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
        **generation,
    }
    if architecture == "gemma3":
        config = _gemma3(meta, config)
    return config, generation


def _gemma3(meta: Any, config: dict) -> dict:
    """Gemma 3's config.json as transformers 5 writes one (see the module doc)."""
    window = meta.get("gemma3.attention.sliding_window")
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    kinds = ["sliding_attention" if window and (i + 1) % GEMMA3_PATTERN else "full_attention"
             for i in range(layers)]
    scalar = hidden // config["num_attention_heads"] if layers == 62 else config["head_dim"]
    full_rope = {"rope_type": "default", "rope_theta": config.pop("rope_theta"),
                 **(config.pop("rope_scaling") or {})}
    del config["hidden_act"]
    return {**config, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar,
            "sliding_window": window or None, "layer_types": kinds,
            "rope_parameters": {"full_attention": full_rope, "sliding_attention": {
                "rope_type": "default", "rope_theta": 10000.0}},
            "final_logit_softcapping": None, "attn_logit_softcapping": None}


def _generation(meta: Any, architecture: str) -> dict:
    """bos / eos / pad ids; chat models end a turn with a token that may differ from
    end-of-text (the file's eot id, or the architecture's end-of-turn token)."""
    special = {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    special = {name: value for name, value in special.items() if value is not None}
    eos = [special.get("eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
    if architecture in END_OF_TURN:
        tokens = meta.get("tokenizer.ggml.tokens") or []
        if END_OF_TURN[architecture] in tokens:
            eos.append(tokens.index(END_OF_TURN[architecture]))
    eos = list(dict.fromkeys(i for i in eos if i is not None))
    return {**special, "eos_token_id": eos[0] if len(eos) == 1 else eos}


def _float32(value: float) -> float:
    """A float32 from the file as the decimal it was written from (1e-05, not 9.9999997e-06)."""
    return float(str(np.float32(value)))


def hf_name(gguf_name: str, config: dict, source: str) -> str:
    """The Hugging Face name of tensor ``gguf_name`` of a model of ``config`` (config.json)."""
    if gguf_name in _MODEL_TENSORS:
        return _MODEL_TENSORS[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    gemma = config["model_type"] == "gemma3_text"
    names = _GEMMA3_LAYER_TENSORS if gemma else _LAYER_TENSORS
    if match and match.group(2) in names:
        return f"model.layers.{match.group(1)}.{names[match.group(2)]}.{match.group(3)}"
    hint = (" (Llama 3.1 style RoPE frequency factors, which the GGUF converter does not read)"
            if gguf_name == "rope_freqs.weight" else "")
    raise ValueError(f"{source} has tensor {gguf_name!r}, which a {config['architectures'][0]} "
                     f"model does not{hint}")


def expected_shapes(config: dict, architecture: str) -> dict[str, tuple[int, ...]]:
    """GGUF name -> shape (rows first, as Hugging Face has it) of every tensor a file of this
    metadata holds (the LM head's only when it is not tied to the embeddings)."""
    h, ffn, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,)}
    if not config["tie_word_embeddings"]:
        shapes["output.weight"] = (vocab, h)
    layer = {"attn_norm.weight": (h,), "attn_q.weight": (q, h), "attn_k.weight": (kv, h),
             "attn_v.weight": (kv, h), "attn_output.weight": (h, q), "ffn_norm.weight": (h,),
             "ffn_gate.weight": (ffn, h), "ffn_up.weight": (ffn, h), "ffn_down.weight": (h, ffn)}
    if architecture == "qwen2":
        layer |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
    if architecture in ("qwen3", "gemma3"):
        layer |= {"attn_q_norm.weight": (config["head_dim"],),
                  "attn_k_norm.weight": (config["head_dim"],)}
    if architecture == "gemma3":
        layer |= {"post_attention_norm.weight": (h,), "post_ffw_norm.weight": (h,)}
    for i in range(config["num_hidden_layers"]):
        shapes |= {f"blk.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


def check_tensors(found: dict[str, tuple[int, ...]], config: dict, architecture: str,
                  source: str) -> None:
    """Refuse, with sentences, a file whose tensors (GGUF name -> shape, rows first) are not
    the ones its metadata describes."""
    for name in found:
        hf_name(name, config, source)  # an unknown tensor fails here, before any work
    expected = expected_shapes(config, architecture)
    missing = [name for name in expected if name not in found]
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4
                                         else "")
        raise ValueError(f"{source} lacks tensors that a {architecture} model of its metadata "
                         f"({config['num_hidden_layers']} layers) has: {shown}")
    extra = [name for name in found if name not in expected]
    if extra:
        raise ValueError(f"{source} has tensor {extra[0]!r}, which a {architecture} model of "
                         f"its metadata ({config['num_hidden_layers']} layers) does not")
    for name, shape in found.items():
        if shape != expected[name]:
            raise ValueError(
                f"{source}: tensor {name!r} is {' x '.join(map(str, shape))} but the file's "
                f"metadata (hidden {config['hidden_size']}, {config['num_attention_heads']} "
                f"heads of {config['head_dim']}, {config['num_key_value_heads']} KV heads, "
                f"MLP {config['intermediate_size']}) implies "
                f"{' x '.join(map(str, expected[name]))}")


def as_hf_rows(gguf_name: str, rows: np.ndarray, config: dict) -> np.ndarray:
    """A tensor's rows (values, or the blocks of a quantized one) in Hugging Face's order:
    Llama's Q and K rows with each head's rotary halves back apart (see gguf.py's module doc)."""
    match = _LAYER_NAME.fullmatch(gguf_name)
    if config["model_type"] != "llama" or not match or match.group(3) != "weight":
        return rows
    heads = {"attn_q": config["num_attention_heads"],
             "attn_k": config["num_key_value_heads"]}.get(match.group(2))
    if heads is None:
        return rows
    return (rows.reshape(heads, rows.shape[0] // heads // 2, 2, *rows.shape[1:])
            .swapaxes(1, 2).reshape(rows.shape))


def as_hf_values(gguf_name: str, values: np.ndarray, config: dict) -> np.ndarray:
    """A dequantized float32 tensor as Hugging Face holds it: rows in its order, and Gemma's
    norms back to w from the 1 + w llama.cpp stored (as transformers' GGUF loader does)."""
    values = as_hf_rows(gguf_name, values, config)
    if config["model_type"] == "gemma3_text" and gguf_name.endswith("norm.weight"):
        values = values - np.float32(1.0)
    return values
