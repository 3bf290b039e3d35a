"""Products with quantized weights on this CPU: radixserve's kernel (csrc/quant_linear.cpp) in
the default model's formats against the dense bf16 product (oneDNN, prepacked: what
``--quantization none`` runs) and torch's own weight-only kernels (``_weight_int8pack_mm``,
int8 per output row; ``_weight_int4pack_mm_for_cpu``, 4-bit per group of 32), with the
activations in one int8 digit or two (quant_linear's ``digits``), at
SmolLM2-135M's projection shapes and 1 to 128 activation rows (bf16 activations).

    .venv/bin/python scripts/bench_quant.py                  # torch's threads
    .venv/bin/python scripts/bench_quant.py --threads 1 --rows 1,8

Each figure is the median time of ``--repeats`` calls, the candidates taking turns call by
call; "x dense" is the dense time over the candidate's (above 1: faster than dense).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.checkpoints.quant_formats import BLOCK, quantize  # noqa: E402
from engine.worker.cpu_kernels import quant_ops  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}


def candidates(rows: int, cols: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """name -> the product x @ W.T of one random weight in that form."""
    ops = quant_ops()
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)) * 0.05
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.bfloat16())
    found = {"dense bf16": lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none",
                                                                        [], "")}
    # as served (int8's activations in two int8 digits), and int4 with two digits too
    for fmt, digits in (("int4", 1), ("int4", 2), ("int8", 2)):
        p = quantize(weight, fmt)
        kernel = ops.quant_repack(*p.repack_args())
        name = f"ours {fmt}" + (", 2 digits" if fmt == "int4" and digits == 2 else "")
        found[name] = lambda x, k=kernel, bits=p.bits, d=digits: ops.quant_linear(x, *k, bits,
                                                                                  rows, d)
    # torch's int8 takes one scale per output row
    row_scales = weight.abs().amax(1) / 127
    q8 = torch.round(weight / row_scales[:, None]).to(torch.int8)
    found["torch int8"] = lambda x: torch.ops.aten._weight_int8pack_mm(x, q8,
                                                                        row_scales.bfloat16())
    p4 = quantize(weight, "int4")
    values = torch.cat((p4.qweight.view(rows, -1, 16) & 15, p4.qweight.view(rows, -1, 16) >> 4),
                       -1).view(rows, cols).to(torch.int32)
    packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
    # torch's 4-bit is (q - 8) * scale + zero
    zero = p4.mins.float() + 8 * p4.scales.float()
    scale_zero = torch.stack((p4.scales.float(), zero), -1).transpose(0, 1).contiguous()
    scale_zero = scale_zero.bfloat16()
    found["torch int4"] = lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed4, BLOCK,
                                                                               scale_zero)
    return found


def median_times(funcs: dict[str, Callable], x: torch.Tensor, repeats: int) -> dict[str, float]:
    for func in funcs.values():  # warm-up
        func(x)
    times: dict[str, list[float]] = {name: [] for name in funcs}
    for _ in range(repeats):
        for name, func in funcs.items():
            start = time.perf_counter()
            func(x)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,8,16,32,128")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    if quant_ops() is None:
        sys.exit("the compiled CPU kernels are not available here")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}; microseconds per product (x dense)")
    names = None
    for shape, (rows, cols) in SHAPES.items():
        funcs = candidates(rows, cols)
        if names is None:
            names = list(funcs)
            print("| shape | rows | " + " | ".join(names) + " |")
            print("|---|---|" + "---|" * len(names))
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, cols).bfloat16()
            t = median_times(funcs, x, args.repeats if rows < 10_000 else args.repeats // 3)
            dense = t["dense bf16"]
            cells = [f"{t[n] * 1e6:,.0f}" + ("" if n == "dense bf16" else
                                              f" ({dense / t[n]:.2f}x)") for n in names]
            print(f"| {shape} {rows}x{cols} | {m} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
