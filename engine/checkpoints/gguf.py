"""A GGUF file (llama.cpp's format) of the Llama family as an ordinary Hugging Face checkpoint.

``gguf_checkpoint(path)`` converts the file once and returns the cached directory, which the
worker and the tokenizer worker then load like any checkpoint::

    <cache>/gguf-<key>/
        config.json               LlamaForCausalLM, from the file's ``llama.*`` metadata
        generation_config.json    bos / eos (and end-of-turn) ids from ``tokenizer.ggml.*``
        model.safetensors         every tensor dequantized (shards + index past 1 GiB)
        quantized.safetensors     the Q4_0, Q4_1 and Q8_0 tensors in their own blocks
                                  (engine/checkpoints/quant_formats.py), which
                                  ``--quantization auto`` serves without widening them
        tokenizer.json, tokenizer_config.json, chat_template.jinja
                                  transformers' GGUF tokenizer converter, saved
        source.json               the GGUF it came from (name, sha256, tensor types); written
                                  last, so its presence means the directory is complete

Tensors are read with the ``gguf`` package's reader and dequantized with ``gguf.quants``:
Q4_0, Q4_1 and Q8_0 blocks become float32 (a block's f16 scale times a small integer needs
more mantissa than 16 bits hold, so nothing narrower is exact); F16, BF16 and F32 tensors are
kept as stored. Any other tensor type is refused before anything is written, with its name.
The quantized tensors are also kept as they are, split into values, scales and minimums.

llama.cpp's converter stores each head's rows of the Q and K projections interleaved (row i of
the first rotary half next to row i of the second) for its RoPE kernel; transformers and this
engine rotate halves, so those rows are put back in order here. Row permutation commutes with
block quantization (blocks run along a row), so dequantize-then-unpermute is exact.

``<key>`` is a sha256 of the whole file (plus this converter's version and transformers', whose
tokenizer conversion is part of the output). A full hash reads the file once per start, about
0.15 s for SmolLM2-135M's 98 MB (~0.65 GB/s here, so seconds for a multi-GB file), which is
cheap next to loading those weights; in exchange the key is exact: a file edited in place with
its size and mtime kept, or a different file at the same path, never reuses a stale conversion,
and a copy of the file under any name reuses its conversion.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from engine.checkpoints.artifact_cache import build_once, default_cache_dir, write_json
from engine.checkpoints.quant_formats import FILE as QUANTIZED_FILE
from engine.checkpoints.quant_formats import GGUF_TYPES, PackedWeight, from_gguf
from engine.checkpoints.quant_formats import write as write_quantized

CONVERTER_VERSION = 2
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
SHARD_BYTES = 1 << 30
REQUIRED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "source.json")

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_MODEL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: the file itself, or the one ``.gguf`` in a directory that
    has no ``config.json``. None when ``path`` is neither (an ordinary checkpoint directory)."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ValueError(f"{path} holds several GGUF files ({names}); pass --model FILE.gguf")
    return found[0] if found else None


def gguf_checkpoint(path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The checkpoint directory converted from the GGUF file ``path``, converting it if needed."""
    path = Path(path)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    sha256 = _file_sha256(path)
    key = hashlib.sha256(
        f"{sha256}\0{CONVERTER_VERSION}\0{version('transformers')}".encode()
    ).hexdigest()[:16]
    final = cache_dir / f"gguf-{key}"
    return build_once(final, lambda staging: _convert(path, sha256, staging), REQUIRED_FILES)


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class _Metadata:
    """Typed access to a GGUF file's key/value metadata, with errors that name the file."""

    def __init__(self, reader: Any, source: Path) -> None:
        self.reader, self.source = reader, source

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.source.name} has no {key!r} metadata; is it a complete GGUF?")
        return value

    def integer(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default) if default is not None else self.need(key)
        if not isinstance(value, int):
            raise ValueError(
                f"{self.source.name}: {key} is {value!r}; radixserve needs one value for every "
                "layer"
            )
        return value


def _config(meta: _Metadata, tied: bool, vocab_size: int) -> tuple[dict, dict]:
    """config.json and generation_config.json from the ``llama.*`` and tokenizer metadata."""
    hidden = meta.integer("llama.embedding_length")
    heads = meta.integer("llama.attention.head_count")
    head_dim = meta.integer("llama.attention.key_length", hidden // heads)
    rope_dim = meta.integer("llama.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(
            f"{meta.source.name} rotates {rope_dim} of each head's {head_dim} dimensions; "
            "radixserve supports RoPE over whole heads only"
        )
    rope_scaling = None
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(meta.need("llama.rope.scaling.factor"))}
    elif scaling != "none":
        raise ValueError(
            f"{meta.source.name} uses {scaling!r} RoPE scaling; the GGUF converter reads none "
            "or linear only"
        )
    special = {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    special = {name: value for name, value in special.items() if value is not None}
    # Chat models end a turn with an end-of-turn token that may differ from end-of-text.
    eos = [special.get("eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
    eos = list(dict.fromkeys(i for i in eos if i is not None))
    generation = {**special, "eos_token_id": eos[0] if len(eos) == 1 else eos}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": meta.integer("llama.feed_forward_length"),
        "num_hidden_layers": meta.integer("llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.integer("llama.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": meta.integer("llama.context_length"),
        "rms_norm_eps": _float32(meta.need("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
        **generation,
    }
    return config, generation


def _float32(value: float) -> float:
    """A float32 from the file as the decimal it was written from (1e-05, not 9.9999997e-06)."""
    return float(str(np.float32(value)))


def _hf_name(gguf_name: str, source: Path) -> str:
    if gguf_name in _MODEL_TENSORS:
        return _MODEL_TENSORS[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}.weight"
    hint = (" (Llama 3.1 style RoPE frequency factors, which the GGUF converter does not read)"
            if gguf_name == "rope_freqs.weight" else "")
    raise ValueError(f"{source.name} has tensor {gguf_name!r}, which a Llama model does not{hint}")


def _unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of each head's two rotary halves (see the module doc)."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _dequantized(reader: Any, config: dict, source: Path) -> Iterator[tuple[str, Any]]:
    """(HF name, torch tensor) for every tensor of the file, in file order."""
    import torch
    from gguf.quants import dequantize

    stored_as = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        # a copy: F32 tensors come back as read-only views of the memory-mapped file
        values = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        match = _LAYER_NAME.fullmatch(tensor.name)
        if match and match.group(2) in heads:
            values = _unpermute_rope_rows(values, heads[match.group(2)])
        yield (_hf_name(tensor.name, source),
               torch.from_numpy(values).to(stored_as.get(kind, torch.float32)))


def _packed(reader: Any, config: dict, source: Path) -> dict[str, PackedWeight]:
    """HF name -> the file's own blocks, for every Q8_0, Q4_0 and Q4_1 tensor (rows in the
    order the dequantized tensors have)."""
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    packed = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in GGUF_TYPES:
            continue
        blocks = np.asarray(tensor.data)
        match = _LAYER_NAME.fullmatch(tensor.name)
        if match and match.group(2) in heads:
            blocks = _unpermute_rope_rows(blocks, heads[match.group(2)])
        packed[_hf_name(tensor.name, source)] = from_gguf(kind, blocks)
    return packed


def _write_weights(tensors: Iterator[tuple[str, Any]], directory: Path) -> None:
    """model.safetensors, or 1 GiB shards and their index (host memory: one shard at a time)."""
    from safetensors.torch import save_file

    shard: dict[str, Any] = {}
    shard_of: dict[str, int] = {}  # tensor name -> its shard's number, from 1
    count, size = 1, 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > SHARD_BYTES:
            save_file(shard, str(directory / f".shard-{count}"), metadata={"format": "pt"})
            shard, count, size = {}, count + 1, 0
        shard[name] = tensor
        shard_of[name] = count
        size += nbytes
    save_file(shard, str(directory / f".shard-{count}"), metadata={"format": "pt"})
    file_names = {1: "model.safetensors"} if count == 1 else {
        i: f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)}
    for i, file_name in file_names.items():
        (directory / f".shard-{i}").chmod(0o644)  # ordinary cached data, like the json files
        (directory / f".shard-{i}").rename(directory / file_name)
    if count > 1:
        index = {"metadata": {}, "weight_map": {n: file_names[i] for n, i in shard_of.items()}}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _convert(path: Path, sha256: str, directory: Path) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    meta = _Metadata(reader, path)
    architecture = meta.get("general.architecture")
    if architecture != "llama":
        raise ValueError(
            f"{path.name} holds a {architecture!r} model; radixserve reads GGUF files of the Llama "
            "family (general.architecture 'llama') only"
        )
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    unsupported = {name: kind for name, kind in types.items() if kind not in SUPPORTED_TYPES}
    if unsupported:
        kinds = ", ".join(sorted(set(unsupported.values())))
        example = next(iter(unsupported))
        raise ValueError(
            f"{path.name} stores tensors as {kinds} (e.g. {example}), which radixserve cannot "
            f"dequantize; supported GGUF tensor types: {', '.join(SUPPORTED_TYPES)}"
        )
    for name in types:
        _hf_name(name, path)  # an unknown tensor fails here, before any work
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise ValueError(f"{path.name} has no token_embd.weight tensor")
    config, generation = _config(meta, tied="output.weight" not in types,
                                 vocab_size=int(embedding.shape[1]))

    _write_weights(_dequantized(reader, config, path), directory)
    packed = _packed(reader, config, path)
    if packed:
        write_quantized(packed, directory / QUANTIZED_FILE)
    write_json(directory / "config.json", config)
    write_json(directory / "generation_config.json", generation)
    _write_tokenizer(path, directory, config["max_position_embeddings"])
    write_json(directory / "source.json", {
        "file": path.name, "sha256": sha256, "converter_version": CONVERTER_VERSION,
        "tensor_types": dict(sorted(Counter(types.values()).items())),
    })


def _write_tokenizer(path: Path, directory: Path, context_len: int) -> None:
    """transformers' GGUF tokenizer conversion (vocabulary, merges, pre-tokenizer, special
    tokens, chat template), saved as tokenizer files."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.model_max_length = context_len
    tokenizer.save_pretrained(str(directory))
