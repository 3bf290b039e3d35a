"""Quantized weight formats: how a linear layer's weight is held in blocks, written once into
a checkpoint's ``quantized.safetensors`` and read by the worker's kernels
(engine/worker/csrc/quant_linear.cpp)::

    format  bits  per block of 32 weights along a row        w =           from
    q8_0    8     32 int8 q, float16 scale d                 d * q         GGUF Q8_0
    q4_0    4     16 bytes of nibbles, float16 d             d * (q - 8)   GGUF Q4_0
    q4_1    4     16 bytes of nibbles, float16 d and m       d * q + m     GGUF Q4_1
    int8    8     32 int8 q, float16 d and m                 d * q + m     --quantization int8
    int4    4     as q4_1 (a group's minimum and step)       d * q + m     --quantization int4

A 4-bit block's byte j holds element j in its low nibble and element j + 16 in its high one
(GGUF's order). Each weight is three arrays with one row per output feature, so fusing
projections (q/k/v, gate/up) concatenates rows and tensor parallel takes rows, or columns in
whole blocks: ``qweight`` (uint8 [N, K / 2] or int8 [N, K]), ``scales`` (float16 [N, K / 32])
and, for q4_1, int8 and int4, ``mins`` (float16 [N, K / 32]).

In the file, weight ``NAME`` is stored as ``NAME.qweight``, ``NAME.scales`` (and
``NAME.mins``), and the file's metadata ``formats`` maps every such ``NAME`` to its format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

BLOCK = 32
BITS = {"q8_0": 8, "q4_0": 4, "q4_1": 4, "int8": 8, "int4": 4}
WITH_MINS = ("q4_1", "int8", "int4")
PARTS = ("qweight", "scales", "mins")
FILE = "quantized.safetensors"
GGUF_TYPES = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}


@dataclass
class PackedWeight:
    """One weight in a block format (see the module doc)."""

    format: str
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    @property
    def bits(self) -> int:
        return BITS[self.format]

    @property
    def shape(self) -> tuple[int, int]:
        rows, width = self.qweight.shape
        return rows, width * 8 // self.bits

    def parts(self) -> dict[str, torch.Tensor]:
        found = {"qweight": self.qweight, "scales": self.scales, "mins": self.mins}
        return {part: tensor for part, tensor in found.items() if tensor is not None}

    def dequantize(self) -> torch.Tensor:
        """The float64 [N, K] matrix the blocks stand for (the tests' reference)."""
        rows, cols = self.shape
        if self.bits == 8:
            q = self.qweight.to(torch.float64).view(rows, -1, BLOCK)
        else:
            nibbles = self.qweight.view(rows, -1, BLOCK // 2).to(torch.int16)
            q = torch.cat((nibbles & 15, nibbles >> 4), dim=-1).to(torch.float64)
        blocks = q.shape[1]
        scales = self.scales.to(torch.float64).expand(rows, blocks)[..., None]
        if self.format == "q4_0":
            return (scales * (q - 8)).reshape(rows, cols)
        mins = 0.0 if self.mins is None else self.mins.to(torch.float64)[..., None]
        return (scales * q + mins).reshape(rows, cols)


def from_gguf(kind: str, blocks: np.ndarray) -> PackedWeight:
    """A GGUF tensor's raw blocks (uint8 [N, bytes per row]) of type ``kind`` (Q8_0, Q4_0,
    Q4_1) as a ``PackedWeight``: the same numbers, split into the three arrays."""
    rows = blocks.shape[0]
    scale_bytes = 4 if kind == "Q4_1" else 2
    per_block = scale_bytes + (BLOCK if kind == "Q8_0" else BLOCK // 2)
    data = np.ascontiguousarray(blocks).reshape(rows, -1, per_block)
    scales = np.ascontiguousarray(data[..., :2]).view(np.float16).reshape(rows, -1)
    mins = (np.ascontiguousarray(data[..., 2:4]).view(np.float16).reshape(rows, -1)
            if kind == "Q4_1" else None)
    values = np.ascontiguousarray(data[..., scale_bytes:]).reshape(rows, -1)
    if kind == "Q8_0":
        values = values.view(np.int8)
    return PackedWeight(GGUF_TYPES[kind], torch.from_numpy(values.copy()),
                        torch.from_numpy(scales.copy()),
                        None if mins is None else torch.from_numpy(mins.copy()))


def quantize(weight: torch.Tensor, fmt: str) -> PackedWeight:
    """``weight`` [N, K] (any float dtype) in format ``fmt``, per group of 32 along a row:
    from the group's minimum to its maximum in 255 steps (``int8``, q = -128 at the minimum, m
    the value at q = 0) or 15 (``int4``, q = 0 at the minimum). Groups rather than one scale
    per output row, and a minimum rather than a symmetric range: over SmolLM2's weights
    (docs/benchmarks.md, "Quantized weights"), per-row symmetric int8 agreed with the
    unquantized model on 96.5% of greedy steps even with exact float activations, per-group
    symmetric on 98.8% with the kernel's activations; a group's range in 255 steps halves the
    step of a range centred off zero. Scales and minimums are rounded to float16 before the
    values are computed from them, so the blocks hold the nearest representable weights."""
    w = weight.detach().to(torch.float32)
    rows, cols = w.shape
    if cols % BLOCK:
        raise ValueError(f"a weight of {cols} columns is not a whole number of {BLOCK}-wide "
                         "blocks; it cannot be quantized")
    if fmt not in ("int8", "int4"):
        raise ValueError(f"unknown quantization {fmt!r}: int8 or int4")
    groups = w.view(rows, -1, BLOCK)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    tiny = torch.finfo(torch.float16).tiny
    if fmt == "int8":
        scales = ((high - low) / 255).to(torch.float16)
        step = scales.float().clamp_min(tiny)
        mins = (low + 128 * step).to(torch.float16)
        q = torch.round((groups - mins.float()[..., None]) / step[..., None])
        return PackedWeight(fmt, q.clamp_(-128, 127).to(torch.int8).reshape(rows, cols),
                            scales, mins)
    mins = low.to(torch.float16)
    scales = ((high - mins.float()) / 15).to(torch.float16)
    step = scales.float().clamp_min(tiny)[..., None]
    q = torch.round((groups - mins.float()[..., None]) / step).clamp_(0, 15).to(torch.uint8)
    packed = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)
    return PackedWeight(fmt, packed.reshape(rows, -1), scales, mins)


def write(weights: dict[str, PackedWeight], path: Path) -> None:
    """``weights`` (checkpoint name -> packed weight) as one safetensors file (module doc)."""
    from safetensors.torch import save_file

    tensors = {f"{name}.{part}": tensor.contiguous()
               for name, packed in weights.items() for part, tensor in packed.parts().items()}
    formats = {name: packed.format for name, packed in weights.items()}
    save_file(tensors, str(path), metadata={"format": "pt", "formats": json.dumps(formats)})


def read_formats(path: Path) -> dict[str, str]:
    """Checkpoint name -> format of every weight ``path`` (a quantized.safetensors) holds."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as reader:
        return json.loads((reader.metadata() or {}).get("formats", "{}"))
