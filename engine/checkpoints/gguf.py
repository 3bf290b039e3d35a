"""A GGUF file (llama.cpp's format) of a Llama, Qwen2, Qwen3 or Gemma 3 model as an ordinary
Hugging Face checkpoint (what each architecture's metadata and tensors mean:
engine/checkpoints/gguf_architectures.py).

``gguf_checkpoint(path)`` converts the file once and returns the cached directory, which the
worker and the tokenizer worker then load like any checkpoint::

    <cache>/gguf-<key>/
        config.json               from the file's ``<general.architecture>.*`` metadata
        generation_config.json    bos / eos (and end-of-turn) ids from ``tokenizer.ggml.*``
        model.safetensors         every tensor dequantized (shards + index past 1 GiB)
        quantized.safetensors     the quantized tensors in block formats that hold the same
                                  numbers (engine/checkpoints/quant_formats.py), which
                                  ``--quantization auto`` serves without widening them
        tokenizer.json, tokenizer_config.json, chat_template.jinja
                                  transformers' GGUF tokenizer converter, saved (the
                                  file's chat template; Gemma 3's turns if it has none)
        source.json               the GGUF it came from (name, sha256, tensor types); written
                                  last, so its presence means the directory is complete

Tensors are read with the ``gguf`` package's reader and dequantized with ``gguf.quants``:
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q6_K blocks become float32 (a block's f16 scale times a
small integer needs more mantissa than 16 bits hold, so nothing narrower is exact); F16, BF16
and F32 tensors are kept as stored. Any other tensor type (Q2_K, Q3_K, Q5_K, the IQ types) is
refused before anything is written, with its name. The quantized tensors are also kept as
they are, split into values, scales and minimums (Q5_0's and Q5_1's values in int8, the
K-quants' super-blocks into blocks of 32 with their integer scales and the super-block's
float16 ones).

In Llama files, llama.cpp's converter stores each head's rows of the Q and K projections
interleaved (row i of
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
from engine.checkpoints.gguf_architectures import (
    CHAT_TEMPLATES,
    as_hf_rows,
    as_hf_values,
    check_architecture,
    check_tensors,
    hf_config,
    hf_name,
)
from engine.checkpoints.quant_formats import FILE as QUANTIZED_FILE
from engine.checkpoints.quant_formats import GGUF_TYPES, PackedWeight, from_gguf
from engine.checkpoints.quant_formats import write as write_quantized

CONVERTER_VERSION = 4  # 4: Q5_0 tensors in their own format, q5_0 (was q8_0)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K")
SHARD_BYTES = 1 << 30
REQUIRED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "source.json")

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
    sha256 = file_sha256(path)
    key = hashlib.sha256(
        f"{sha256}\0{CONVERTER_VERSION}\0{version('transformers')}".encode()
    ).hexdigest()[:16]
    final = cache_dir / f"gguf-{key}"
    return build_once(final, lambda staging: _convert(path, sha256, staging), REQUIRED_FILES)


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, as hex, read in 1 MiB pieces."""
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


def _dequantized(reader: Any, config: dict, source: Path) -> Iterator[tuple[str, Any]]:
    """(HF name, torch tensor) for every tensor of the file, in file order."""
    import torch
    from gguf.quants import dequantize

    stored_as = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        # a copy: F32 tensors come back as read-only views of the memory-mapped file
        values = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        values = as_hf_values(tensor.name, values, config)
        yield (hf_name(tensor.name, config, source.name),
               torch.from_numpy(values).to(stored_as.get(kind, torch.float32)))


def _packed(reader: Any, config: dict, source: Path) -> dict[str, PackedWeight]:
    """HF name -> the file's own blocks, for every quantized tensor (rows in the order the
    dequantized tensors have)."""
    packed = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in GGUF_TYPES:
            continue
        blocks = as_hf_rows(tensor.name, np.asarray(tensor.data), config)
        packed[hf_name(tensor.name, config, source.name)] = from_gguf(kind, blocks)
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
    check_architecture(architecture, path.name)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    unsupported = {name: kind for name, kind in types.items() if kind not in SUPPORTED_TYPES}
    if unsupported:
        kinds = ", ".join(sorted(set(unsupported.values())))
        example = next(iter(unsupported))
        raise ValueError(
            f"{path.name} stores tensors as {kinds} (e.g. {example}), which radixserve cannot "
            f"read; supported GGUF tensor types: {', '.join(SUPPORTED_TYPES)} (a Q4_K_M, Q4_0 "
            "or Q8_0 file of the same model reads)"
        )
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise ValueError(f"{path.name} has no token_embd.weight tensor")
    config, generation = hf_config(meta, architecture, tied="output.weight" not in types,
                                   vocab_size=int(embedding.shape[1]))
    check_tensors({t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors},
                  config, architecture, path.name)

    _write_weights(_dequantized(reader, config, path), directory)
    packed = _packed(reader, config, path)
    if packed:
        write_quantized(packed, directory / QUANTIZED_FILE)
    write_json(directory / "config.json", config)
    write_json(directory / "generation_config.json", generation)
    _write_tokenizer(path, directory, config["max_position_embeddings"],
                     CHAT_TEMPLATES.get(architecture))
    write_json(directory / "source.json", {
        "file": path.name, "sha256": sha256, "converter_version": CONVERTER_VERSION,
        "tensor_types": dict(sorted(Counter(types.values()).items())),
    })


def _write_tokenizer(path: Path, directory: Path, context_len: int,
                     default_template: str | None) -> None:
    """transformers' GGUF tokenizer conversion (vocabulary, merges, pre-tokenizer, special
    tokens, chat template), saved as tokenizer files; ``default_template`` where the file has
    no chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.model_max_length = context_len
    if not tokenizer.chat_template and default_template:
        tokenizer.chat_template = default_template
    tokenizer.save_pretrained(str(directory))
