"""Which quantized weights ``--quantization`` serves for a checkpoint directory.

    auto   the checkpoint's own quantized.safetensors when it has one (a GGUF file's Q4_0, Q4_1
           and Q8_0 tensors, engine/checkpoints/gguf.py), else nothing
    none   nothing: every weight dense, in --dtype
    int8   the decoder layers' projections (q, k, v, o, gate, up, down) quantized once, per
    int4   group of 32 (engine/checkpoints/quant_formats.py), and cached in the radixserve
           cache as ``quant-<format>-<key>/quantized.safetensors``

Embeddings, norms and the LM head stay in --dtype under int8 and int4 (only a GGUF brings its
own quantized embedding), and so does a projection whose rows are not whole groups of 32 (the
demo model's down projection reads 688 inputs), which the loader logs. ``<key>`` hashes the
checkpoint's path and its weight files' names, sizes and modification times, so an edited
checkpoint is quantized again.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from engine.checkpoints.artifact_cache import build_once, default_cache_dir
from engine.checkpoints.model_source import weight_files
from engine.checkpoints.quant_formats import BLOCK, FILE, quantize, write

QUANTIZATIONS = ("auto", "none", "int8", "int4")
QUANTIZER_VERSION = 4  # 4: projections of partial groups stay dense
LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]|mlp\.(gate|up|down))_proj\.weight")


def quantized_file(model_dir: str | Path, quantization: str,
                   cache_dir: str | Path | None = None) -> Path | None:
    """The quantized.safetensors whose weights replace the checkpoint's dense ones, or None."""
    model_dir = Path(model_dir)
    if quantization == "none":
        return None
    if quantization == "auto":
        own = model_dir / FILE
        return own if own.is_file() else None
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, "
                         f"got {quantization!r}")
    files = weight_files(model_dir)
    identity = [str(model_dir.resolve()), quantization, str(QUANTIZER_VERSION)]
    for file in files:
        stat = file.stat()
        identity += [file.name, str(stat.st_size), str(stat.st_mtime_ns)]
    key = hashlib.sha256("\0".join(identity).encode()).hexdigest()[:16]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"quant-{quantization}-{key}"
    return build_once(final, lambda staging: _quantize(files, quantization, staging),
                      [FILE]) / FILE


def _quantize(files: list[Path], fmt: str, directory: Path) -> None:
    from safetensors import safe_open

    packed = {}
    for file in files:
        with safe_open(str(file), framework="pt") as reader:
            for name in reader.keys():
                if LINEAR.fullmatch(name) and _whole_blocks(reader.get_slice(name).get_shape()):
                    packed[name] = quantize(reader.get_tensor(name), fmt)
    write(packed, directory / FILE)


def _whole_blocks(shape: list[int]) -> bool:
    return len(shape) == 2 and shape[1] % BLOCK == 0
