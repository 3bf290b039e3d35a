"""Multi-LoRA serving speed: requests/s with 1, 4 and 16 distinct adapters mixed at 16 in
flight against the base model alone, in one process and one run; an adapter swap's cost; and
the low-rank update's three forms on one step's rows: the compiled kernel (as served on CPU)
and torch's two (segmented per adapter, as served without the kernels, and gathered per row,
BGMV's form).

The scheduler and the model worker run in-process (no sockets), every configuration on the
same worker with every adapter loaded (``--max-loras`` 16, so none is swapped mid-run); the
configurations alternate, repeat after repeat, and each gets fresh random prompts and a fresh
scheduler (no prefix hits). Adapters are written in PEFT's format with random A and B of rank
``--rank`` on q, k, v, o, gate, up and down.

    python scripts/bench_lora.py                 # SmolLM2-135M-Instruct (its Q4_1 GGUF)
    python scripts/bench_lora.py --model demo    # the tiny demo model
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from engine.checkpoints.model_source import resolve_model
from engine.contracts.engine_config import EngineConfig
from engine.contracts.protocol import TokenizedRequest, pack_ids
from engine.contracts.sampling_params import SamplingParams
from engine.worker.model.config import ModelConfig
from engine.worker.model.lora import MODULES, projection_shapes
from engine.worker.process import Worker
from scheduler.scheduler import Scheduler


def write_adapter(directory: Path, config: ModelConfig, rank: int, seed: int) -> Path:
    """A PEFT adapter of ``config``'s shapes with random A and B on every projection."""
    directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(config)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (fused, part) in MODULES.items():
            width, outs = shapes[fused]
            block = "self_attn" if fused in ("qkv", "o") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, width, generator=generator) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(outs[part], rank,
                                                          generator=generator) * 0.02
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
         "target_modules": list(MODULES), "bias": "none"}))
    return directory


def run(worker: Worker, config: EngineConfig, adapters: list[str | None], requests: int,
        prompt_len: int, output_len: int, vocab: int, seed: int) -> float:
    """Requests/s of ``requests`` requests, the i-th under ``adapters[i % len(adapters)]``."""
    sched = Scheduler(config, worker.info)
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i in range(requests):
        prompt = rng.integers(3, vocab, prompt_len).tolist()
        sched.add_request(TokenizedRequest(rid=str(i), prompt_ids=pack_ids(prompt),
                                           params=params, reply_to=0,
                                           lora_name=adapters[i % len(adapters)]))
    start = time.perf_counter()
    while not sched.idle:
        batch = sched.schedule()
        if batch is not None:
            sched.process_result(worker.step(batch))
        sched.take_outputs()
    return requests / (time.perf_counter() - start)


def update_forms(worker: Worker, seqs: int, rows_each: int, adapters: int, repeats: int
                 ) -> tuple[float, float, float]:
    """Microseconds of layer 0's gate/up update for ``seqs`` sequences of ``rows_each`` rows,
    sequence i under adapter ``i mod adapters``, in the model's dtype: the compiled kernel (as
    served on CPU, the pool's slots as they are), then torch's forms over float32 copies of the
    slots: segmented (as served without the kernels: the rows gathered once, one pair of
    matmuls per adapter, one scatter) and gathered per row (BGMV's form: each row's A and B
    gathered, two batched matmuls)."""
    pool = worker.runner.lora
    lora_ids = np.arange(seqs) % adapters + 1
    step = pool.prepare(lora_ids, np.full(seqs, rows_each))
    rows = seqs * rows_each
    plan = step.plan(0, rows)
    a = pool.slots_a[0]["gate_up"].float()
    b = pool.slots_b[0]["gate_up"].float()  # transposed: [slot, rank, out]
    width = int(pool.width_tensors[(0, "gate_up")].max())
    x = torch.randn(rows, a.shape[2]).to(worker.runner.dtype)
    out = torch.zeros(rows, b.shape[2], dtype=x.dtype)
    index = torch.from_numpy(np.repeat([pool.resident[int(i)] for i in lora_ids], rows_each))

    def kernel() -> None:
        step.add_(0, "gate_up", x, out)

    def segmented() -> None:
        gathered_rows = (x if plan.index is None else x.index_select(0, plan.index)).float()
        delta = gathered_rows.new_zeros(plan.num_rows, out.shape[1])
        for slot, lo, hi in plan.segments:
            torch.mm(gathered_rows[lo:hi] @ a[slot, :width].t(), b[slot, :width],
                     out=delta[lo:hi])
        if plan.index is None:
            out.add_(delta.to(out.dtype))
        else:
            out.index_add_(0, plan.index, delta.to(out.dtype))

    def gathered() -> None:
        row_a, row_b = a[index, :width], b[index, :width]
        out.add_(torch.bmm(torch.bmm(x.float()[:, None], row_a.transpose(1, 2)),
                           row_b)[:, 0].to(out.dtype))

    timed = (kernel, segmented, gathered) if pool.kernel is not None else (segmented, gathered)
    times = [_median_us(form, repeats) for form in timed]
    return (float("nan"), *times) if pool.kernel is None else tuple(times)


def product_us(dtype: torch.dtype, repeats: int) -> float:
    """Microseconds of a [1 x 32] by [32 x 3072] product (a decode row's B side) in ``dtype``."""
    left, right = torch.randn(1, 32, dtype=dtype), torch.randn(3072, 32, dtype=dtype)
    return _median_us(lambda: left @ right.t(), repeats)


def _median_us(work, repeats: int, calls: int = 50) -> float:
    work()
    timings = []
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                work()
            timings.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(timings)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="demo, a checkpoint directory or a .gguf file "
                                    "(default: SmolLM2-135M-Instruct)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--in-flight", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    source = resolve_model(args.model)
    model_config = ModelConfig.from_dir(source.path)
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"lora{i}" for i in range(16)]
        modules = [f"{name}={write_adapter(Path(tmp) / name, model_config, args.rank, i)}"
                   for i, name in enumerate(names)]
        config = EngineConfig(model=source.path, enable_lora=True, lora_modules=modules,
                              max_loras=16, max_lora_rank=args.rank, num_pages=4096,
                              max_running_requests=args.in_flight)
        worker = Worker(config)
        configs = {"base model": [None], "1 adapter": names[:1], "4 adapters": names[:4],
                   "16 adapters": names}
        run(worker, config, names, 16, args.prompt_len, 4, model_config.vocab_size, 99)  # warm
        results: dict[str, list[float]] = {name: [] for name in configs}
        for repeat in range(args.repeats):  # alternated: A B C D, A B C D, ...
            for k, (name, adapters) in enumerate(configs.items()):
                results[name].append(run(worker, config, adapters, args.requests,
                                         args.prompt_len, args.output_len,
                                         model_config.vocab_size, 1000 * repeat + k))
        pool = worker.runner.lora
        swap_ms = pool.swap_seconds / pool.swaps * 1e3
        forms = {(seqs, each, adapters): update_forms(worker, seqs, each, adapters,
                                                      2 * args.repeats)
                 for seqs, each, adapters in ((16, 1, 1), (16, 1, 4), (16, 1, 16), (4, 128, 4))}
        products = {str(d).removeprefix("torch."): product_us(d, 2 * args.repeats)
                    for d in (torch.float32, torch.bfloat16)}

    print(f"model {source.name or source.path}, dtype {worker.info.dtype}, weights "
          f"{', '.join(worker.runner.weight_formats)}, rank {args.rank} on q/k/v/o/gate/up/down,"
          f" {args.requests} requests of {args.prompt_len} + {args.output_len} tokens, "
          f"{args.in_flight} in flight, medians of {args.repeats}")
    base = statistics.median(results["base model"])
    print("| traffic | req/s | vs base model |")
    print("|---|---|---|")
    for name, values in results.items():
        value = statistics.median(values)
        print(f"| {name} | {value:.2f} | {value / base:.2f}x |")
    print(f"adapter swap (host copy into a device slot): {swap_ms:.2f} ms "
          f"({pool.adapters[1].nbytes / 2**20:.1f} MiB in float32 on the host)")
    print(f"layer 0 gate/up update, microseconds (kernel: {pool.dtype} slots; torch forms: "
          "float32):")
    print("| rows | adapters | kernel | segmented | gathered per row |")
    print("|---|---|---|---|---|")
    for (seqs, each, adapters), (kernel, segmented, gathered) in forms.items():
        print(f"| {seqs} x {each} | {adapters} | {kernel:.0f} | {segmented:.0f} | "
              f"{gathered:.0f} |")
    print("a [1 x 32] by [32 x 3072] product: " + ", ".join(
        f"{name} {us:.1f} us" for name, us in products.items()))


if __name__ == "__main__":
    main()
