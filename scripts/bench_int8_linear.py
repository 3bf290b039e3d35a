"""What an int8 form (AMX int8 tiles where the CPU has them) would give the projections of
bench_extend.py's step: its error against the float64 product of the format's numbers, beside
the block kernel's and the resident bf16 copy's, on the step's own activations, and its time,
quantization included, against the resident form's bf16 GEMM.

    python scripts/bench_int8_linear.py [--seqs 8] [--head 512] [--question 32]
        [--step WEIGHT,... [--repeats 15]]

Each weight is requantized to int8 per output row (symmetric, its largest |w| over 127) from
dequantize_weight's numbers. The activations, by projection (``SCHEMES``): the inputs of qkv and
gate_up (RMSNorm's rows) keep the ``OUTLIERS`` columns with the largest |x| over the call's rows
in bf16 and quantize the rest of each row to int8 under its own scale; those of o and down
(attention's output, SiLU(gate) * up), whose largest values are not in a few columns, quantize
each row to int8 and its rounding remainder again (two digits). The form is
scripts/int8_linear_probe.cpp (oneDNN's brgemm micro-kernel through torch, built here once;
its comment says how), timed whole: the activations' quantization, the products and the
rescaling; beside it, the same probe with one digit a row and no outlier columns (the error
bar's miss: its error 1.5-2.7x the block kernel's), and oneDNN's ``qlinear_pointwise`` over
int8 rows alone (its quantization not counted): the int8 GEMM's own time. The step's model is the server's default
(its forms pinned to blocks, so every projection's input is what a step computes).

``--step gate_up,down``: instead, the whole step of the server's default model (``auto``
forms) timed with those projections' calls of 65 rows or more in the probe's int8 form against
the same step without, in one process, ABBA, medians of ``--repeats``.
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

from engine.checkpoints.artifact_cache import default_cache_dir  # noqa: E402
from engine.checkpoints.model_source import resolve_model  # noqa: E402
from engine.contracts.engine_config import EngineConfig  # noqa: E402
from engine.worker.model import quant  # noqa: E402
from engine.worker.model.linear_forms import make_resident, resident_product  # noqa: E402
from engine.worker.runner import ModelRunner  # noqa: E402
from scripts.bench_extend import build_batches  # noqa: E402

OUTLIERS = 8
# projection -> (outlier columns kept in bf16, int8 digits of the rest of each row)
SCHEMES = {"qkv": (OUTLIERS, 1), "gate_up": (OUTLIERS, 1), "o": (0, 2), "down": (0, 2)}


def probe_op() -> object:
    """torch.ops.radixserve_int8_probe.int8_linear, built from scripts/int8_linear_probe.cpp."""
    from torch.utils.cpp_extension import load

    root = Path(__file__).resolve().parents[1]
    build = default_cache_dir() / "int8-linear-probe"
    build.mkdir(parents=True, exist_ok=True)
    load(name="radixserve_int8_probe", sources=[str(root / "scripts/int8_linear_probe.cpp")],
         build_directory=str(build), is_python_module=False,
         extra_include_paths=[str(root / "engine/worker/csrc")],
         extra_cflags=["-O3", "-march=native", "-fopenmp",
                       "-DRADIXSERVE_OPS_NAMESPACE=radixserve_int8_probe"],
         extra_ldflags=["-fopenmp"])
    ops = torch.ops.radixserve_int8_probe
    if not ops.int8_linear_available():
        raise SystemExit("this CPU or build has no int8 brgemm on AMX for the probe")
    return ops.int8_linear


def int8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 [N, K], the probe's [N / 64, K / 4, 64, 4] layout of it, float32 scale per output
    row)."""
    scales = weight.abs().amax(1).clamp_min(1e-30) / 127
    qweight = torch.round(weight / scales[:, None]).to(torch.int8)
    rows, cols = qweight.shape
    vnni = qweight.reshape(rows // 64, 64, cols // 4, 4).permute(0, 2, 1, 3).contiguous()
    return qweight, vnni, scales.float()


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
    parser.add_argument("--step", default="", help="projections (comma-separated) to time in a "
                        "whole step in the int8 form (default: none, the per-product table)")
    parser.add_argument("--repeats", type=int, default=15, help="--step's repeats (default 15)")
    args = parser.parse_args()
    args.decodes, args.shared = 0, False
    if args.step:
        step_times(args, args.step.split(","))
        return
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
    int8_linear = probe_op()
    errors: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    timings: dict[str, tuple[float, ...]] = {}
    for key, x in inputs.items():
        layer, name = layers[key], names[key]
        outliers, digits = SCHEMES[name]
        weight = layer.dense(torch.float32)
        want = x.double() @ weight.double().T
        qweight, vnni, weight_scales = int8_weight(weight)
        make_resident(layer, x.dtype)
        got = {"blocks": layer.ops.quant_linear(x, *layer.kernel, layer.bits, layer.rows,
                                                layer.digits),
               "resident": resident_product(layer, x),
               "int8": int8_linear(x, vnni, weight_scales, outliers, digits)}
        errors[name].append(tuple(((out.double() - want).norm() / want.norm()).item()
                                  for out in got.values()))
        if name not in timings:
            packed = torch.ops.onednn.qlinear_prepack(qweight, list(x.shape))
            qx = torch.full(x.shape, 128, dtype=torch.uint8)
            zeros = torch.zeros_like(weight_scales, dtype=torch.int64)
            timings[name] = (
                seconds(lambda x=x, layer=layer: resident_product(layer, x)),
                seconds(lambda x=x, w=vnni, ws=weight_scales, k=outliers, d=digits:
                        int8_linear(x, w, ws, k, d)),
                seconds(lambda x=x, w=vnni, ws=weight_scales: int8_linear(x, w, ws, 0, 1)),
                seconds(lambda qx=qx, packed=packed, ws=weight_scales, z=zeros:
                        torch.ops.onednn.qlinear_pointwise(qx, 1.0, 128, packed, ws, z, None,
                                                           1.0, 0, torch.bfloat16, "none", [],
                                                           "")))
        layer.resident = None
    rows = next(iter(inputs.values())).shape[0]
    print(f"{torch.get_num_threads()} threads, {rows} rows; relative error against float64 "
          "(mean over layers, worst int8 / blocks), time of one product (median of 20)")
    print("| weight | int8 activations | blocks | resident bf16 | int8 | worst int8 / blocks "
          "| resident bf16 GEMM | int8 form, whole | one digit a row, whole | int8 GEMM alone |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, found in errors.items():
        outliers, digits = SCHEMES[name]
        scheme = f"{outliers} columns bf16, rows int8" if outliers else "rows int8, two digits"
        mean = [statistics.mean(e[i] for e in found) for i in range(3)]
        worst = max(e[2] / e[0] for e in found)
        cells = " | ".join(f"{t * 1e3:.3f} ms" for t in timings[name])
        print(f"| {name} {layer_shape(layers, names, name)} | {scheme} | {mean[0]:.4f} "
              f"| {mean[1]:.4f} | {mean[2]:.4f} | {worst:.2f}x | {cells} |")


def step_times(args: argparse.Namespace, weights: list[str]) -> None:
    """bench_extend.py's step with ``weights``' products of 65 rows or more in the int8 form,
    against the same step without, ABBA."""
    int8_linear = probe_op()
    runner = ModelRunner(EngineConfig(model=resolve_model(None).path))
    forms: dict[int, tuple] = {}
    for module in runner.model.modules():
        for name, layer in getattr(module, "quantized", {}).items():
            if name in weights:
                _, vnni, weight_scales = int8_weight(layer.dense(torch.float32))
                forms[id(layer)] = (vnni, weight_scales, *SCHEMES[name])
    call = quant.QuantizedLinear.__call__

    def int8_call(layer: quant.QuantizedLinear, x: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
        form = forms.get(id(layer))
        if form is None or x.shape[0] < 65:
            return call(layer, x, bias)
        out = int8_linear(x.contiguous(), *form)
        return out if bias is None else out.add_(bias)

    prefill, step = build_batches(runner, args)
    if prefill is not None:
        runner.forward(prefill)
    times: dict[bool, list[float]] = {False: [], True: []}
    for repeat in range(args.repeats + 2):
        for int8 in ((False, True) if repeat % 2 == 0 else (True, False)):
            quant.QuantizedLinear.__call__ = int8_call if int8 else call
            start = time.perf_counter()
            runner.forward(step)
            if repeat >= 2:  # two warm-up rounds
                times[int8].append(time.perf_counter() - start)
    quant.QuantizedLinear.__call__ = call
    base, int8 = (statistics.median(times[key]) for key in (False, True))
    print(f"{args.seqs} x {args.question} rows over {args.head}-token heads, "
          f"{torch.get_num_threads()} threads, medians of {args.repeats}: resident bf16 "
          f"{base * 1e3:.1f} ms, {'/'.join(weights)} int8 {int8 * 1e3:.1f} ms, "
          f"ratio {int8 / base:.3f}")


def layer_shape(layers: dict, names: dict, name: str) -> str:
    layer = next(layers[key] for key, found in names.items() if found == name)
    return f"{layer.rows}x{layer.cols}"


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
