"""Quantized weight formats: how a linear layer's weight is held in blocks, written once into
a checkpoint's ``quantized.safetensors`` and read by the worker's kernels
(engine/worker/csrc/quant_linear.cpp)::

    format  bits  per block of 32 weights along a row        w =           from
    q8_0    8     32 int8 q, float16 scale d                 d * q         GGUF Q8_0
    q5_0    5     32 int8 q in -16..15, float16 d            d * q         GGUF Q5_0
    q4_0    4     16 bytes of nibbles, float16 d             d * (q - 8)   GGUF Q4_0
    q4_1    4     16 bytes of nibbles, float16 d and m       d * q + m     GGUF Q4_1
    q4_k    4     16 bytes of nibbles, uint8 sc and mn,      D * sc * q    GGUF Q4_K
                  float16 D and -Dmin of its super-block     - Dmin * mn
    q6_k    6     32 int8 q in -32..31, int8 sc for each     D * sc * q    GGUF Q6_K
                  16, float16 D of its super-block
    int8    8     32 int8 q, float16 d and m                 d * q + m     --quantization int8;
                                                                           GGUF Q5_1
    int4    4     as q4_1 (a group's minimum and step)       d * q + m     --quantization int4

Every GGUF type is kept losslessly. Q5_0's 5-bit values are held as int8 (q - 16, the same d)
here and in 5 bits by the kernel's layout (csrc/quant_layout.h); Q5_1's widen to int8's (q with
its d and m), which the 8-bit loops read unchanged. The
K-quants keep their two levels of scales: a 256-weight super-block's float16 D (and Q4_K's
Dmin) over 6-bit sub-block scales sc and minimums mn (Q4_K, one each per 32 weights) or int8
scales (Q6_K, one per 16; its values q - 32, held in int8 here and in 6 bits by the kernel's
layout, csrc/quant_layout.h). The kernel multiplies D * sc in float32, which
holds it exactly (11 bits of D times 6 or 8 of sc; float16 holds few of these products), so
the numbers are those of the GGUF file.

A 4-bit block's byte j holds element j in its low nibble and element j + 16 in its high one
(GGUF's order). Each weight is a few arrays with one row per output feature, so fusing
projections (q/k/v, gate/up) concatenates rows and tensor parallel takes rows, or columns in
whole blocks: ``qweight`` (uint8 [N, K / 2] or int8 [N, K]), ``scales`` (float16 [N, K / 32];
q4_k's uint8, q6_k's int8 [N, K / 16]), for q4_1, q4_k, int8 and int4 ``mins`` (the scales'
dtype, [N, K / 32]; q4_k's uint8), and for the K-quants their super-block's float16 D beside
each block, ``super_scales`` [N, K / 32], and q4_k's -Dmin, ``super_mins`` [N, K / 32] (one
value a block, so that a tensor-parallel column share need not be whole super-blocks; the
kernel's layout holds one a super-block).

In the file, weight ``NAME`` is stored as ``NAME.<part>`` for each of its parts, and the
file's metadata ``formats`` maps every such ``NAME`` to its format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

BLOCK = 32
# bits a weight's value takes in the kernel's layout; a checkpoint holds 4-bit values two a
# byte and the others in int8 (``stored_bits``)
BITS = {"q8_0": 8, "q5_0": 5, "q4_0": 4, "q4_1": 4, "q4_k": 4, "q6_k": 6, "int8": 8,
        "int4": 4}
WITH_MINS = ("q4_1", "q4_k", "int8", "int4")
# the K-quants' sub-block scales (and Q4_K's minimums): small integers under super_scales
# (and super_mins), one float16 a block
INTEGER_SCALES = {"q4_k": torch.uint8, "q6_k": torch.int8}
SCALES_PER_BLOCK = {"q6_k": 2}  # one scale for each 16 weights
PARTS = ("qweight", "scales", "mins", "super_scales", "super_mins")
FILE = "quantized.safetensors"
GGUF_TYPES = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q5_0", "Q5_1": "int8",
              "Q4_K": "q4_k", "Q6_K": "q6_k"}
# bytes of one GGUF block: (weights, bytes)
_GGUF_BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22),
                "Q5_1": (32, 24), "Q4_K": (256, 144), "Q6_K": (256, 210)}


def stored_bits(fmt: str) -> int:
    """Bits a value takes in the checkpoint's ``qweight``: 4, or 8 (int8) for the others."""
    return 4 if BITS[fmt] == 4 else 8


def scale_dtype(fmt: str) -> torch.dtype:
    return INTEGER_SCALES.get(fmt, torch.float16)


def weights_per_column(fmt: str) -> dict[str, int]:
    """Each part of a weight in ``fmt`` -> how many of a row's weights one of its columns
    stands for (a column share of the weight in whole blocks is these shares of its parts)."""
    found = {"qweight": 8 // stored_bits(fmt), "scales": BLOCK // scales_per_block(fmt)}
    if fmt in WITH_MINS:
        found["mins"] = BLOCK
    if fmt in INTEGER_SCALES:
        found["super_scales"] = BLOCK
        if fmt in WITH_MINS:
            found["super_mins"] = BLOCK
    return found


def scales_per_block(fmt: str) -> int:
    return SCALES_PER_BLOCK.get(fmt, 1)


@dataclass
class PackedWeight:
    """One weight in a block format (see the module doc)."""

    format: str
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None
    super_scales: torch.Tensor | None = None
    super_mins: torch.Tensor | None = None

    @classmethod
    def empty(cls, fmt: str, rows: int, cols: int, device: torch.device) -> PackedWeight:
        """Uninitialized parts of an [rows, cols] weight in ``fmt`` (a loader's targets)."""
        bits, blocks = stored_bits(fmt), cols // BLOCK
        small = dict(dtype=scale_dtype(fmt), device=device)
        supers = dict(dtype=torch.float16, device=device)
        return cls(
            fmt,
            torch.empty(rows, cols * bits // 8,
                        dtype=torch.int8 if bits == 8 else torch.uint8, device=device),
            torch.empty(rows, blocks * scales_per_block(fmt), **small),
            torch.empty(rows, blocks, **small) if fmt in WITH_MINS else None,
            torch.empty(rows, blocks, **supers) if fmt in INTEGER_SCALES else None,
            torch.empty(rows, blocks, **supers) if fmt == "q4_k" else None)

    @property
    def bits(self) -> int:
        return BITS[self.format]

    @property
    def shape(self) -> tuple[int, int]:
        rows, width = self.qweight.shape
        return rows, width * 8 // stored_bits(self.format)

    def parts(self) -> dict[str, torch.Tensor]:
        found = {part: getattr(self, part) for part in PARTS}
        return {part: tensor for part, tensor in found.items() if tensor is not None}

    def columns(self, start: int, stop: int) -> PackedWeight:
        """Columns [start, stop) of the weight (whole blocks), as a weight of its own."""
        cut = {part: getattr(self, part)[:, start // width: stop // width].contiguous()
               for part, width in weights_per_column(self.format).items()}
        return PackedWeight(self.format, **cut)

    def repack_args(self) -> tuple:
        """The kernel's ``quant_repack`` arguments (csrc/quant_linear.cpp)."""
        return (self.qweight, self.scales, self.mins, self.super_scales, self.super_mins,
                self.bits)

    def block_scales(self) -> torch.Tensor:
        """Each block's (q6_k: each 16 weights') scale d in float64 [N, K / 32 * halves]:
        the K-quants' D * sc, exact."""
        scales = self.scales.to(torch.float64)
        if self.super_scales is None:
            return scales
        halves = scales_per_block(self.format)
        return self.super_scales.to(torch.float64).repeat_interleave(halves, dim=1) * scales

    def block_mins(self) -> torch.Tensor | None:
        """Each block's minimum m in float64 [N, K / 32] (q4_k's -Dmin * mn), or None."""
        if self.mins is None:
            return None
        mins = self.mins.to(torch.float64)
        return mins if self.super_mins is None else self.super_mins.to(torch.float64) * mins

    def dequantize(self) -> torch.Tensor:
        """The float64 [N, K] matrix the blocks stand for (the tests' reference)."""
        rows, cols = self.shape
        if stored_bits(self.format) == 8:
            q = self.qweight.to(torch.float64)
        else:
            nibbles = self.qweight.view(rows, -1, BLOCK // 2).to(torch.int16)
            q = torch.cat((nibbles & 15, nibbles >> 4), dim=-1).to(torch.float64)
        q = q.reshape(rows, cols)
        width = BLOCK // scales_per_block(self.format)  # weights per scale
        scales = self.block_scales().expand(rows, cols // width)
        scales = scales.repeat_interleave(width, dim=1)
        if self.format == "q4_0":
            return scales * (q - 8)
        mins = self.block_mins()
        if mins is None:
            return scales * q
        return scales * q + mins.repeat_interleave(BLOCK, dim=1)


def from_gguf(kind: str, blocks: np.ndarray) -> PackedWeight:
    """A GGUF tensor's raw blocks (uint8 [N, bytes per row]) of type ``kind`` (a key of
    ``GGUF_TYPES``) as a ``PackedWeight`` of the same numbers (the module doc)."""
    rows = blocks.shape[0]
    data = np.ascontiguousarray(blocks).reshape(rows, -1, _GGUF_BLOCKS[kind][1])
    if kind in ("Q8_0", "Q4_0", "Q4_1"):
        values = data[..., 4 if kind == "Q4_1" else 2:]
        if kind == "Q8_0":
            values = values.view(np.int8)
        return _packed(kind, values, _half(data, 0), _half(data, 2) if kind == "Q4_1" else None)
    if kind in ("Q5_0", "Q5_1"):
        start = 4 if kind == "Q5_1" else 2  # the fifth bits: 32 of them, little-endian
        high = np.ascontiguousarray(data[..., start:start + 4]).view(np.uint32)
        fifth = (high >> np.arange(BLOCK, dtype=np.uint32)) & 1
        q = _nibbles(data[..., start + 4:]) | (fifth.astype(np.uint8) << 4)
        if kind == "Q5_0":
            return _packed(kind, (q.astype(np.int8) - 16), _half(data, 0))
        return _packed(kind, q.astype(np.int8), _half(data, 0), _half(data, 2))
    if kind == "Q4_K":
        packed = data[..., 4:16].astype(np.uint8)
        low, high, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
        sc = np.concatenate([low & 63, (rest & 15) | ((low >> 2) & 48)], axis=-1)
        mins = np.concatenate([high & 63, (rest >> 4) | ((high >> 2) & 48)], axis=-1)
        # 4 runs of 64 weights: 32 bytes, the first 32 weights low, the next 32 high
        q = data[..., 16:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
        q = (q & 15).reshape(rows, -1, BLOCK)
        per_block = (*sc.shape[:2], 8)  # the super-block's D and -Dmin beside its 8 blocks
        return _packed(kind, q[..., : BLOCK // 2] | (q[..., BLOCK // 2:] << 4), sc, mins,
                       np.broadcast_to(_half(data, 0)[..., None], per_block),
                       np.broadcast_to(-_half(data, 2)[..., None], per_block))
    if kind == "Q6_K":
        low = data[..., :128].reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
        high = (data[..., 128:192].reshape(rows, -1, 2, 1, 32)
                >> np.array([0, 2, 4, 6], np.uint8)[:, None])
        q = ((low & 15).reshape(rows, -1, 256) | ((high & 3).reshape(rows, -1, 256) << 4))
        sc = np.ascontiguousarray(data[..., 192:208]).view(np.int8)
        return _packed(kind, q.astype(np.int8) - 32, sc, None,
                       np.broadcast_to(_half(data, 208)[..., None], (*sc.shape[:2], 8)))
    raise ValueError(f"GGUF type {kind} has no block format here")


def _half(data: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of every block: [N, blocks]."""
    return np.ascontiguousarray(data[..., start:start + 2]).view(np.float16)[..., 0]


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: the low nibbles, then the high ones."""
    return np.concatenate([packed & 15, packed >> 4], axis=-1)


def _packed(kind: str, *parts: np.ndarray | None) -> PackedWeight:
    """``parts`` (values, scales and any of mins, super_scales, super_mins) as tensors
    [N, ...]."""
    rows = parts[0].shape[0]

    def tensor(array: np.ndarray | None) -> torch.Tensor | None:
        if array is None:
            return None
        return torch.from_numpy(np.ascontiguousarray(array).reshape(rows, -1).copy())

    return PackedWeight(GGUF_TYPES[kind], *(tensor(part) for part in parts))


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
