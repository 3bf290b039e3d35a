"""Quantized weights: the block formats (engine/checkpoints/quant_formats.py) and the compiled
kernels that read them (csrc/quant_linear.cpp, in this CPU's build, the AVX2 build and the
portable one) against float64 references at every shape the default model uses and at odd
sizes; the layers over them. Served models: tests/test_quant_models.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from gguf.quants import quantize as gguf_quantize

from engine.checkpoints.quant_formats import (
    BLOCK,
    PackedWeight,
    from_gguf,
    quantize,
    scales_per_block,
)
from engine.worker.model.parallel import Slice
from engine.worker.model.quant import (
    DIGITS,
    MixedQuantizedLinear,
    QuantizedLinear,
    part_sources,
    quantized_linear,
)
from tests.test_cpu_kernels import load_variants

# SmolLM2-135M's projections (qkv, o, gate_up, down, the tied LM head) and odd sizes: rows not a
# multiple of the interleaving, one block, an odd number of blocks.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576),
          (33, 96), (7, 32), (40, 160), (17, 224)]
FORMATS = ["q8_0", "q5_0", "q4_0", "q4_1", "q4_k", "q6_k", "int8", "int4"]
K_QUANTS = {"Q4_K": 144, "Q6_K": 210}  # bytes of a 256-weight super-block


@pytest.fixture(scope="module")
def variants() -> dict[str, object]:
    return load_variants()


def kquant_blocks(kind: str, rows: int, cols: int, seed: int,
                  scales: tuple[float, float] = (2e-5, 3e-4)) -> np.ndarray:
    """GGUF ``kind`` (Q4_K, Q6_K) blocks of a [rows, cols] weight (cols a multiple of 256),
    made from their byte layout: any bytes are a valid block once its float16 scales are finite,
    so random bytes with scales drawn from ``scales`` (about llama.cpp's for weights of 0.05)."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, cols // 256, K_QUANTS[kind]), dtype=np.uint8)
    offsets = (0, 2) if kind == "Q4_K" else (208,)  # d and dmin; d
    for offset, factor in zip(offsets, (1, 8), strict=False):
        d = (rng.uniform(*scales, (rows, cols // 256)) * factor).astype(np.float16)
        data[..., offset:offset + 2] = d[..., None].view(np.uint8)
    return data.reshape(rows, -1)


def random_weight(fmt: str, rows: int, cols: int, seed: int) -> PackedWeight:
    """A weight in ``fmt`` with random blocks (GGUF's own quantizer for its formats, the
    K-quants' byte layout for theirs, cut to ``cols``)."""
    if fmt in ("q4_k", "q6_k"):
        p = from_gguf(fmt.upper(), kquant_blocks(fmt.upper(), rows, -(-cols // 256) * 256, seed))
        return p.columns(0, cols)
    generator = torch.Generator().manual_seed(seed)
    dense = torch.randn(rows, cols, generator=generator) * 0.05
    if fmt in ("int8", "int4"):
        return quantize(dense, fmt)
    kind = fmt.upper()
    blocks = gguf_quantize(dense.numpy(), GGMLQuantizationType[kind])
    return from_gguf(kind, blocks)


def emulated(x: torch.Tensor, p: PackedWeight, digits: int) -> torch.Tensor:
    """What the kernel computes, in float64: activations quantized per row and block of 32
    (step max|x| / 127, ties to even; with ``digits`` 2 a second digit, what the first leaves
    in 254ths of its step), integer block products scaled by both scales, and the minimum
    times the block's exact sum of x."""
    rows, cols = p.shape
    xb = x.double().view(x.shape[0], -1, BLOCK)
    amax = xb.abs().amax(-1, keepdim=True)
    step = amax / 127
    xq = torch.round(xb * torch.where(amax > 0, 127 / amax, 0))
    if digits == 2:
        left = xb - xq * step
        xq = xq * 254 + torch.round(left * torch.where(amax > 0, 127 * 254 / amax, 0)).clamp(
            -127, 127)
        step = step / 254
    halves = scales_per_block(p.format)  # scales per block: q6_k's, one for each 16 weights
    scales = p.block_scales().expand(rows, cols // BLOCK * halves)
    if p.mins is not None:
        mins = p.block_mins()
    else:  # q8_0 and q6_k have none, q4_0's is -8 d
        mins = torch.zeros(rows, cols // BLOCK, dtype=torch.float64) if p.bits != 4 else (
            -8 * scales)
    per_scale = scales.repeat_interleave(BLOCK // halves, dim=1)
    q = (p.dequantize() - mins.repeat_interleave(BLOCK, dim=1)) / torch.where(
        per_scale == 0, 1, per_scale)
    products = torch.einsum("mse,nse->mns", xq.reshape(x.shape[0], -1, BLOCK // halves),
                            torch.round(q).view(rows, -1, BLOCK // halves))
    steps = step[..., 0].repeat_interleave(halves, dim=1)
    out = (products * scales[None] * steps[:, None, :]).sum(-1)
    out += torch.einsum("mb,nb->mn", xb.sum(-1), mins)
    return out


@pytest.mark.parametrize("digits", [1, 2])
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_build_computes_what_the_format_and_the_activations_say(variants, fmt, digits):
    """Every build against the float64 emulation of its arithmetic (only float32 rounding
    apart), and against the exact product with the dequantized weights (apart by what
    quantizing the activations costs: under 1% for 8-bit weights and 3% for 4-bit with one
    digit, 0.05% with two; bf16's own rounding of x and of the result 1%), for float32 and
    bf16 activations and 1 to 9 rows."""
    for index, (rows, cols) in enumerate(SHAPES):
        if rows > 10_000 and fmt in ("q4_0", "q4_1", "q4_k", "int4"):
            continue  # the LM head: 8-bit in the GGUF files served
        p = random_weight(fmt, rows, cols, seed=index)
        batch = 1 if rows > 10_000 else 1 + index % 9
        x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(100 + index))
        exact = x.double() @ p.dequantize().T
        # the emulation depends on the activations' dtype, not on the build
        wants = {dtype: emulated(x.to(dtype).float(), p, digits)
                 for dtype in (torch.float32, torch.bfloat16)}
        for name, ops in variants.items():
            kernel = ops.quant_repack(*p.repack_args())
            for dtype, want in wants.items():
                out = ops.quant_linear(x.to(dtype), *kernel, p.bits, rows, digits)
                assert out.dtype == dtype and out.shape == (batch, rows)
                tolerance = 1e-5 if dtype == torch.float32 else 8e-3
                err = ((out.double() - want).norm() / want.norm()).item()
                assert err < tolerance, (name, rows, cols, dtype, err)
                err = ((out.double() - exact).norm() / exact.norm()).item()
                bound = (0.01 if p.bits != 4 else 0.03) if digits == 1 else (
                    5e-4 if dtype == torch.float32 else 0.01)
                assert err < bound, (name, rows, cols, dtype, err)


@pytest.mark.parametrize("digits", [1, 2])
@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q8_0", "q5_0"])
def test_a_rows_result_is_the_same_in_a_call_of_any_size(variants, fmt, digits):
    """Calls of 1 to 17 rows share each unpacked block between up to 8 rows (a verify step's
    K + 1 in one pass): every row of each call is bit for bit the row computed alone, in every
    build (what ``--deterministic`` relies on)."""
    p = random_weight(fmt, 40, 512, seed=11)
    x = torch.randn(17, 512, generator=torch.Generator().manual_seed(12))
    for name, ops in variants.items():
        kernel = ops.quant_repack(*p.repack_args())
        for dtype in (torch.float32, torch.bfloat16):
            xs = x.to(dtype)
            alone = torch.cat([ops.quant_linear(xs[m:m + 1], *kernel, p.bits, 40, digits)
                               for m in range(17)])
            for count in range(2, 18):
                out = ops.quant_linear(xs[:count], *kernel, p.bits, 40, digits)
                assert torch.equal(out, alone[:count]), (name, dtype, count)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantizing_rows_gives_the_formats_numbers(variants, fmt):
    """dequantize_weight over the repacked layout (the embedding's lookups, any row order)
    gives exactly the format's numbers in every build."""
    p = random_weight(fmt, 40, 160, seed=7)
    rows = torch.tensor([39, 0, 17, 16, 17])
    for name, ops in variants.items():
        kernel = ops.quant_repack(*p.repack_args())
        got = ops.dequantize_weight(*kernel, p.bits, 40, rows, torch.float32)
        assert torch.equal(got, p.dequantize()[rows].float()), name


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_gguf_blocks_keep_their_numbers(variants, kind):
    """A GGUF tensor's blocks, split into values, scales and minimums (Q5_0's and Q5_1's
    values in int8), stand for exactly what the gguf package dequantizes them to, and the
    kernel's layout of them (Q5_0 in 5 bits) gives them too, in every build."""
    dense = np.random.default_rng(0).standard_normal((24, 96)).astype(np.float32)
    blocks = gguf_quantize(dense, GGMLQuantizationType[kind])
    packed = from_gguf(kind, blocks)
    assert packed.format == {"Q5_1": "int8"}.get(kind, kind.lower())
    want = dequantize(blocks, GGMLQuantizationType[kind])
    assert np.array_equal(packed.dequantize().numpy(), want.astype(np.float64))
    for name, ops in variants.items():
        kernel = ops.quant_repack(*packed.repack_args())
        got = ops.dequantize_weight(*kernel, packed.bits, 24, torch.arange(24), torch.float32)
        assert np.array_equal(got.numpy(), want), name


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_k_quant_blocks_keep_their_numbers(variants, kind):
    """A K-quant's super-blocks taken apart into blocks of 32, each with its integer scale
    (and minimum) and its super-block's float16 D (and -Dmin), stand for exactly the numbers
    the gguf package dequantizes them to (gguf computes in float32: its rounding of Q4_K's
    d * q - dmin * m, one step, is float32's of the exact value), over scales from subnormal
    to large float16 and every byte pattern; the kernel's dequantization, which forms D * sc
    in float32, gives them too, in every build."""
    for scales in ((2e-5, 3e-4), (1e-7, 1e-5), (1.0, 1000.0)):
        blocks = kquant_blocks(kind, 24, 512, seed=1, scales=scales)
        packed = from_gguf(kind, blocks)
        assert packed.scales.dtype == (torch.uint8 if kind == "Q4_K" else torch.int8)
        assert packed.super_scales.dtype == torch.float16
        assert packed.super_scales.shape == (24, 512 // BLOCK)
        want = dequantize(blocks, GGMLQuantizationType[kind])
        assert np.array_equal(packed.dequantize().float().numpy(), want), scales
        for name, ops in variants.items():
            kernel = ops.quant_repack(*packed.repack_args())
            got = ops.dequantize_weight(*kernel, packed.bits, 24, torch.arange(24),
                                        torch.float32)
            assert np.array_equal(got.numpy(), want), (name, scales)


def test_int8_and_int4_quantize_to_the_nearest_steps():
    """Per group of 32, from the group's minimum to its maximum: int8 in 255 steps (q -128 at
    the minimum, 127 at the maximum), int4 in 15; every value within half a step of the
    numbers stored (float32's rounding of the division apart): the values are computed from
    the float16 step and minimum, not from the unrounded ones, whose rounding would put some
    values past the half step (0.52-0.55 of one)."""
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 0.05 + 0.02
    groups = w.view(64, 4, BLOCK)
    for fmt, levels in (("int8", 255), ("int4", 15)):
        p = quantize(w, fmt)
        assert p.mins.shape == p.scales.shape == (64, 4)
        spread = groups.amax(-1) - groups.amin(-1)  # int4's from the float16 minimum
        torch.testing.assert_close(p.scales.float(), spread / levels, rtol=2e-3, atol=0)
        if fmt == "int8":
            assert p.qweight.dtype == torch.int8 and p.qweight.shape == (64, 128)
            q = p.qweight.view(64, 4, BLOCK)
            assert (q.amin(-1) <= -127).all() and (q.amax(-1) >= 126).all()
        else:
            assert p.qweight.shape == (64, 64)
        step = p.scales.double().repeat_interleave(BLOCK, dim=1)
        err = (p.dequantize() - w.double()).abs() / step
        assert err.max() < 0.5 + 1e-4, fmt


def test_int8_holds_a_4_bit_grid_exactly():
    """A weight already on a 4-bit grid of 15 steps (a Q4_1 checkpoint's values) lands on int8's
    255 steps (17 each) up to float16's rounding: what served Q4_1 checkpoints re-quantize."""
    generator = torch.Generator().manual_seed(1)
    low = torch.randn(8, 2, 1, generator=generator) * 0.02
    levels = torch.randint(0, 16, (8, 2, BLOCK), generator=generator)
    levels[..., 0], levels[..., 1] = 0, 15
    w = (low + levels * 0.004).view(8, 2 * BLOCK)
    p = quantize(w, "int8")
    assert torch.equal(p.qweight.view(8, 2, BLOCK).long(), levels * 17 - 128)
    err = (p.dequantize() - w.double()).abs().max().item()
    assert err < 0.004 * 15 * 2**-10


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_layer_gives_8_bit_weights_two_activation_digits_and_4_bit_ones_one(fmt):
    """QuantizedLinear computes what the emulation does with two activation digits for 8-, 6-
    and 5-bit weights and one for 4-bit (one digit against 8-bit weights is off by about 0.3%, most of
    what int8 weights lose)."""
    p = random_weight(fmt, 40, 160, seed=8)
    layer = QuantizedLinear(fmt, 40, 160, torch.device("cpu"))
    for part, tensor in layer.parts().items():
        tensor.copy_(getattr(p, part).expand_as(tensor))
    layer.repack()
    x = torch.randn(3, 160, generator=torch.Generator().manual_seed(9))
    digits = 1 if p.bits == 4 else 2  # the rule itself, not the module's table
    assert layer.digits == digits, (fmt, layer.digits)
    want = emulated(x, p, digits)
    other = emulated(x, p, 3 - digits)
    err = ((layer(x).double() - want).norm() / want.norm()).item()
    assert err < 1e-5 < ((other - want).norm() / want.norm()).item() / 10, (fmt, err)


def test_a_fused_projection_of_mixed_formats_keeps_each_part_in_its_blocks():
    """q/k/v parts in q4_k, q4_k and q6_k (Q4_K_M's mix), and q8_0, q6_k, q8_0 (three runs):
    each run of one format is one block layer, loaded through the fused rows of its parts, and
    the product is each part's own, side by side: bit for bit what the part's layer alone
    gives, the emulation's to float32's rounding; the bias added once, the bytes by format."""
    rows, cols = (64, 32, 32), 256
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(11))
    bias = torch.randn(sum(rows), generator=torch.Generator().manual_seed(12))
    for formats, runs in ((("q4_k", "q4_k", "q6_k"), ["q4_k", "q6_k"]),
                          (("q8_0", "q6_k", "q8_0"), ["q8_0", "q6_k", "q8_0"])):
        weights = [random_weight(fmt, n, cols, seed=20 + i)
                   for i, (fmt, n) in enumerate(zip(formats, rows, strict=True))]
        fused = quantized_linear(formats, rows, cols, torch.device("cpu"))
        assert isinstance(fused, MixedQuantizedLinear)
        assert [run.format for run in fused.runs] == runs
        alone = []
        for start, p in zip((0, 64, 96), weights, strict=True):
            for part, tensor in fused.parts(slice(start, start + p.shape[0])).items():
                tensor.copy_(getattr(p, part))
            layer = QuantizedLinear(p.format, p.shape[0], cols, torch.device("cpu"))
            for part, tensor in layer.parts().items():
                tensor.copy_(getattr(p, part))
            layer.repack()
            alone.append(layer)
        fused.repack()
        out = fused(x, bias)
        assert torch.equal(out, torch.cat([layer(x) for layer in alone], dim=1) + bias)
        want = torch.cat([emulated(x, p, DIGITS[p.bits]) for p in weights], dim=1)
        err = (((out - bias).double() - want).norm() / want.norm()).item()
        assert err < 1e-5, (formats, err)
        held: dict[str, int] = {}
        for layer in alone:
            held[layer.format] = held.get(layer.format, 0) + layer.nbytes
        assert fused.bytes_by_format() == held
    assert isinstance(quantized_linear(("q4_k",) * 3, rows, cols, torch.device("cpu")),
                      QuantizedLinear)


@pytest.mark.parametrize("fmt", FORMATS)
def test_products_over_column_shards_add_up_to_the_whole(variants, fmt):
    """Tensor parallel's row-parallel projections: the kernel over each rank's whole blocks of
    the columns sums to the kernel over all of them (activations are quantized per block, so
    the shards see the same integers), up to float32's rounding."""
    p = random_weight(fmt, 48, 768, seed=3)
    x = torch.randn(5, 768, generator=torch.Generator().manual_seed(4))
    for name, ops in variants.items():
        def product(cols: slice, p=p, ops=ops) -> torch.Tensor:
            kernel = ops.quant_repack(*p.columns(cols.start, cols.stop).repack_args())
            return ops.quant_linear(x[:, cols].contiguous(), *kernel, p.bits, 48,
                                    DIGITS[p.bits])

        whole = product(slice(0, 768))
        # shares on the K-quants' super-blocks of 256, and inside them (each block its own D)
        for cut in (256, 64, 416):
            shards = product(slice(0, cut)) + product(slice(cut, 768))
            torch.testing.assert_close(shards, whole, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("fmt, bits", [("q4_k", 4.625), ("q6_k", 6.5625)])
def test_k_quants_keep_one_float16_a_super_block(variants, fmt, bits):
    """The kernel's layout of a K-quant holds its integer sub-block scales and one float16 D
    (and Dmin) per super-block of 256: Q4_K 4.625 bits a weight (the file's 4.5 with its 6-bit
    scales in bytes), Q6_K 6.5625 (the file's, its values in 6 bits); a column share that starts inside a
    super-block keeps a D per block, and computes the same."""
    p = random_weight(fmt, 64, 1024, seed=5)
    layer = QuantizedLinear(fmt, 64, 1024, torch.device("cpu"))
    for part, tensor in layer.parts().items():
        tensor.copy_(getattr(p, part))
    layer.repack()
    assert layer.nbytes * 8 / (64 * 1024) == bits
    x = torch.randn(2, 1024, generator=torch.Generator().manual_seed(6))
    for name, ops in variants.items():
        share = p.columns(160, 1024)
        kernel = ops.quant_repack(*share.repack_args())
        assert kernel[3].shape[1] == 1024 // BLOCK - 5, name  # one D per block
        out = ops.quant_linear(x[:, 160:].contiguous(), *kernel, p.bits, 64, DIGITS[p.bits])
        want = emulated(x[:, 160:], share, DIGITS[p.bits])
        assert ((out.double() - want).norm() / want.norm()).item() < 1e-5, name


def test_q5_0_keeps_its_5_bits_and_values_outside_a_width_are_refused(variants):
    """The kernel's layout of Q5_0 holds 5.5 bits a weight (its values in 5 bits, a float16
    step per 32: the file's); every build refuses int8 values that do not fit 5 or 6 bits with
    a sentence instead of dropping their high bits."""
    p = random_weight("q5_0", 64, 1024, seed=5)
    layer = QuantizedLinear("q5_0", 64, 1024, torch.device("cpu"))
    for part, tensor in layer.parts().items():
        tensor.copy_(getattr(p, part))
    layer.repack()
    assert layer.nbytes * 8 / (64 * 1024) == 5.5
    for ops in variants.values():
        for bits, value in ((5, 16), (5, -17), (6, 32), (6, -33)):
            values = p.qweight.clone()
            values[3, 7] = value
            with pytest.raises(RuntimeError, match=f"{bits}-bit values must lie in"):
                ops.quant_repack(values, p.scales, None, None, None, bits)


def test_a_tensor_parallel_split_keeps_whole_blocks():
    rows = part_sources("w", Slice(0, 96, 192, 576), "q4_1")
    assert rows["w.qweight"] == rows["w.scales"] == Slice(0, 96, 192, 576)
    columns = part_sources("w", Slice(1, 288, 576, 576), "q4_1")
    assert columns == {"w.qweight": Slice(1, 144, 288, 288), "w.scales": Slice(1, 9, 18, 18),
                       "w.mins": Slice(1, 9, 18, 18)}
    assert part_sources("w", Slice(1, 64, 128, 128), "int8") == {
        "w.qweight": Slice(1, 64, 128, 128), "w.scales": Slice(1, 2, 4, 4),
        "w.mins": Slice(1, 2, 4, 4)}
    assert part_sources("w", Slice(1, 64, 128, 128), "q8_0") == {
        "w.qweight": Slice(1, 64, 128, 128), "w.scales": Slice(1, 2, 4, 4)}
    # a K-quant's super-block scales sit beside each block, so a share need not be whole
    # super-blocks of 256
    assert part_sources("w", Slice(1, 160, 512, 512), "q4_k") == {
        "w.qweight": Slice(1, 80, 256, 256), "w.scales": Slice(1, 5, 16, 16),
        "w.mins": Slice(1, 5, 16, 16), "w.super_scales": Slice(1, 5, 16, 16),
        "w.super_mins": Slice(1, 5, 16, 16)}
    assert part_sources("w", Slice(1, 160, 512, 512), "q6_k") == {
        "w.qweight": Slice(1, 160, 512, 512), "w.scales": Slice(1, 10, 32, 32),
        "w.super_scales": Slice(1, 5, 16, 16)}
