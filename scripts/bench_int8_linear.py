"""What an int8 GEMM (oneDNN's, AMX tiles where the CPU has them) would give the projections of
bench_extend.py's step: its error against the float64 product of the format's numbers, beside
the block kernel's and the resident bf16 copy's, on the step's own activations, and its time
against the resident form's bf16 GEMM.

    python scripts/bench_int8_linear.py [--seqs 8] [--head 512] [--question 32]

The int8 form measured: each weight requantized to int8 per output row (symmetric, its largest
|w| over 127) from dequantize_weight's numbers, each activation row to int8 with its own scale
(its largest |x| over 127), oneDNN's ``qlinear_pointwise`` over them (uint8 rows at zero point
128, scale 1) and the rows' scales applied to its bf16 output; the timing leaves the activations'
quantization out (it counts oneDNN's product alone). The step's model is the server's default
(its forms pinned to blocks, so every projection's input is what a step computes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.checkpoints.model_source import resolve_model  # noqa: E402
from engine.contracts.engine_config import EngineConfig  # noqa: E402
from engine.worker.model import quant  # noqa: E402
from engine.worker.model.linear_forms import make_resident, resident_product  # noqa: E402
from engine.worker.runner import ModelRunner  # noqa: E402
from scripts.bench_extend import build_batches  # noqa: E402


def int8_product(x: torch.Tensor, qweight: torch.Tensor, weight_scales: torch.Tensor,
                 packed: torch.Tensor) -> torch.Tensor:
    """x @ W.T through oneDNN's int8 GEMM, the activations quantized per row."""
    xf = x.float()
    scales = xf.abs().amax(1, keepdim=True).clamp_min(1e-30) / 127
    qx = (torch.round(xf / scales) + 128).to(torch.uint8)
    out = torch.ops.onednn.qlinear_pointwise(qx, 1.0, 128, packed, weight_scales,
                                             torch.zeros_like(weight_scales, dtype=torch.int64),
                                             None, 1.0, 0, x.dtype, "none", [], "")
    return (out.float() * scales).to(x.dtype)


def seconds(run: object, repeats: int = 20) -> float:
    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--head", type=int, default=512)
    parser.add_argument("--question", type=int, default=32)
    args = parser.parse_args()
    args.decodes, args.shared = 0, False
    runner = ModelRunner(EngineConfig(model=resolve_model(None).path, linear_form="blocks"))
    names = {id(layer): name for module in runner.model.modules()
             for name, layer in getattr(module, "quantized", {}).items()}
    inputs: dict[int, torch.Tensor] = {}
    call = quant.QuantizedLinear.__call__

    def record(layer: quant.QuantizedLinear, x: torch.Tensor, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
        if x.shape[0] > 16:  # the projections', not the LM head's few rows
            inputs.setdefault(id(layer), x.clone())
        return call(layer, x, bias)

    prefill, step = build_batches(runner, args)
    if prefill is not None:
        runner.forward(prefill)
    quant.QuantizedLinear.__call__ = record
    runner.forward(step)
    quant.QuantizedLinear.__call__ = call
    layers = {id(layer): layer for module in runner.model.modules()
              for layer in getattr(module, "quantized", {}).values()}
    errors: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    timings: dict[str, tuple[float, float]] = {}
    for key, x in inputs.items():
        layer, name = layers[key], names[key]
        weight = layer.dense(torch.float32)
        want = x.double() @ weight.double().T
        weight_scales = weight.abs().amax(1).clamp_min(1e-30) / 127
        qweight = torch.round(weight / weight_scales[:, None]).to(torch.int8)
        packed = torch.ops.onednn.qlinear_prepack(qweight, list(x.shape))
        make_resident(layer, x.dtype)
        got = {"blocks": layer.ops.quant_linear(x, *layer.kernel, layer.bits, layer.rows,
                                                layer.digits),
               "resident": resident_product(layer, x),
               "int8": int8_product(x, qweight, weight_scales, packed)}
        errors[name].append(tuple(((out.double() - want).norm() / want.norm()).item()
                                  for out in got.values()))
        if name not in timings:
            qx = torch.full(x.shape, 128, dtype=torch.uint8)
            zeros = torch.zeros_like(weight_scales, dtype=torch.int64)
            timings[name] = (
                seconds(lambda x=x, layer=layer: resident_product(layer, x)),
                seconds(lambda qx=qx, packed=packed, ws=weight_scales, z=zeros:
                        torch.ops.onednn.qlinear_pointwise(qx, 1.0, 128, packed, ws, z, None,
                                                           1.0, 0, torch.bfloat16, "none", [],
                                                           "")))
        layer.resident = None
    rows = next(iter(inputs.values())).shape[0]
    print(f"{torch.get_num_threads()} threads, {rows} rows; relative error against float64 "
          "(mean over layers, worst int8 / blocks), time of one product")
    print("| weight | blocks | resident bf16 | int8, per-row activations | worst int8 / blocks "
          "| bf16 GEMM | int8 GEMM |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, found in errors.items():
        mean = [statistics.mean(e[i] for e in found) for i in range(3)]
        worst = max(e[2] / e[0] for e in found)
        bf16, int8 = timings[name]
        print(f"| {name} | {mean[0]:.4f} | {mean[1]:.4f} | {mean[2]:.4f} | {worst:.2f}x "
              f"| {bf16 * 1e3:.3f} ms | {int8 * 1e3:.3f} ms |")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
