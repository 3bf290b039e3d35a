"""int8 KV against a full-precision cache on this CPU: attention, a decode step, capacity.

    .venv/bin/python scripts/bench_kv_int8.py [--model DIR] [--repeats 7] [--skip-serving]

1. Decode attention alone, one layer of the model's shape (SmolLM2-135M: 9 query heads over
   3 KV heads of 64), batch 8, 4,096-token contexts on shuffled 16-token pages: the torch
   backend as the engine runs it, over a cache in the model's dtype and over int8.
2. A whole decode step of the model (``ModelRunner.forward``), batch 8 at 544-token contexts.
3. Capacity and preemption: the same ``--kv-cache-gb`` for both caches, 24 requests of 300
   prompt tokens and 900 generated at once (admission expects 70% of max_tokens, so the pool
   runs short as they grow) through the in-process scheduler and worker, on
   ``--serving-model`` (default: the demo model, whose steps are fast enough on a CPU to run
   the whole workload; its head_dim of 32 gives int8 1.88x the pages); pages, preemptions and
   generated tokens per second.

Every figure is the median of ``--repeats``, the two caches alternating; the model runs in
``--dtype`` (bf16: the bf16 cache is the baseline). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.contracts.engine_config import EngineConfig  # noqa: E402
from engine.contracts.step import BatchInput  # noqa: E402
from engine.worker.attention import TorchNativeBackend  # noqa: E402
from engine.worker.kv_pool import KVPool  # noqa: E402
from engine.worker.kv_quant import quantize  # noqa: E402
from engine.worker.runner import ModelRunner  # noqa: E402

PAGE_SIZE = 16


def median_ratio(times: dict[str, list[float]], base: str, other: str) -> float:
    """The median of per-repeat base / other ratios (how many times faster ``other`` is)."""
    return statistics.median(b / o for b, o in zip(times[base], times[other], strict=True))


def decode_batch(batch_size: int, context: int, num_pages: int, seed: int = 0) -> BatchInput:
    """Each sequence holds ``context - 1`` cached tokens on shuffled pages and adds one."""
    per_seq = -(-context // PAGE_SIZE)
    order = np.random.default_rng(seed).permutation(num_pages)[: batch_size * per_seq]
    return BatchInput.build([(pages, context - 1, [7]) for pages in order.reshape(batch_size, -1)],
                            PAGE_SIZE)


def bench_attention(dtype: torch.dtype, kv_names: tuple[str, str], repeats: int,
                    batch_size: int = 8, context: int = 4096) -> dict[str, object]:
    heads, kv_heads, head_dim = 9, 3, 64
    num_pages = batch_size * context // PAGE_SIZE + 64
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(1, 2, num_pages, PAGE_SIZE, kv_heads, head_dim, generator=gen)
    backends = {}
    for name in kv_names:
        kv_dtype = torch.int8 if name == "int8" else dtype
        pool = KVPool(num_layers=1, num_pages=num_pages, page_size=PAGE_SIZE,
                      num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device="cpu",
                      kv_dtype=kv_dtype)
        pool.kv.copy_(quantize(values) if name == "int8" else values.to(dtype))
        backends[name] = TorchNativeBackend(pool, num_heads=heads, num_kv_heads=kv_heads,
                                            head_dim=head_dim, sliding_windows=(None,))
    batch = decode_batch(batch_size, context, num_pages)
    q, k, v = (torch.randn(batch_size, h, head_dim, generator=gen).to(dtype)
               for h in (heads, kv_heads, kv_heads))
    times: dict[str, list[float]] = {name: [] for name in kv_names}
    for _ in range(repeats + 1):  # the first round warms up
        for name, backend in backends.items():
            backend.plan(batch)
            began = time.perf_counter()
            for _ in range(10):
                backend.forward(0, q, k, v)
            times[name].append((time.perf_counter() - began) / 10)
    times = {name: t[1:] for name, t in times.items()}
    return {"ms": {n: round(statistics.median(t) * 1e3, 3) for n, t in times.items()},
            "speedup": round(median_ratio(times, *kv_names), 3),
            "paths": {n: "compiled kernel" if b._paged_decode else "gather + SDPA"
                      for n, b in backends.items()}}


def bench_step(model: str, dtype: str, kv_names: tuple[str, str], repeats: int,
               batch_size: int = 8, context: int = 544) -> dict[str, object]:
    runners = {kv: ModelRunner(EngineConfig(model=model, dtype=dtype, kv_cache_dtype=kv,
                                            page_size=PAGE_SIZE, kv_cache_gb=0.5))
               for kv in kv_names}
    times: dict[str, list[float]] = {kv: [] for kv in kv_names}
    for _ in range(repeats + 1):
        for kv, runner in runners.items():
            batch = decode_batch(batch_size, context, runner.num_pages)
            began = time.perf_counter()
            for _ in range(5):
                runner.forward(batch)
            times[kv].append((time.perf_counter() - began) / 5)
    times = {kv: t[1:] for kv, t in times.items()}
    return {"ms": {kv: round(statistics.median(t) * 1e3, 2) for kv, t in times.items()},
            "speedup": round(median_ratio(times, *kv_names), 3)}


def bench_serving(model: str, dtype: str, kv_names: tuple[str, str], kv_cache_gb: float,
                  requests: int = 24, prompt_len: int = 300, max_tokens: int = 900
                  ) -> dict[str, object]:
    """Many long sequences at once through the in-process scheduler and worker."""
    from engine.contracts.protocol import TokenizedRequest, pack_ids
    from engine.contracts.sampling_params import SamplingParams
    from engine.worker.process import Worker
    from scheduler.scheduler import Scheduler

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = {}
    for kv in kv_names:
        config = EngineConfig(model=model, dtype=dtype, kv_cache_dtype=kv, page_size=PAGE_SIZE,
                              kv_cache_gb=kv_cache_gb)
        worker = Worker(config)
        sched = Scheduler(config, worker.info)
        rng = np.random.default_rng(0)  # the same prompts for both caches
        prompts = [rng.integers(3, worker.info.vocab_size, prompt_len) for _ in range(requests)]
        for i, prompt in enumerate(prompts):
            sched.add_request(TokenizedRequest(rid=str(i), prompt_ids=pack_ids(prompt),
                                               params=params, reply_to=0))
        began, steps = time.perf_counter(), 0
        while not sched.idle:
            batch = sched.schedule()
            if batch is not None:
                sched.process_result(worker.step(batch))
                steps += 1
            sched.take_outputs()
        seconds = time.perf_counter() - began
        out[kv] = {"pages": worker.info.num_pages, "tokens": worker.info.num_pages * PAGE_SIZE,
                   "preemptions": sched.num_preemptions, "steps": steps,
                   "seconds": round(seconds, 1),
                   "generated_tok_s": round(requests * max_tokens / seconds, 1)}
    base, other = kv_names
    out["capacity_ratio"] = round(out[other]["tokens"] / out[base]["tokens"], 3)
    out["throughput_ratio"] = round(out[other]["generated_tok_s"]
                                    / out[base]["generated_tok_s"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--serving-model", default="demo", help="part 3's checkpoint")
    parser.add_argument("--kv-cache-gb", type=float, default=0.03,
                        help="the pool both caches get in part 3")
    parser.add_argument("--skip-serving", action="store_true")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        from engine.checkpoints.gguf import gguf_checkpoint
        from engine.checkpoints.model_source import default_gguf

        model = str(gguf_checkpoint(default_gguf()))
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    kv_names = (args.dtype, "int8")
    result = {"dtype": args.dtype, "threads": torch.get_num_threads(),
              "attention_b8_ctx4096": bench_attention(dtype, kv_names, args.repeats),
              "decode_step_b8_ctx544": bench_step(model, args.dtype, kv_names, args.repeats)}
    if not args.skip_serving:
        serving_model = args.serving_model
        if serving_model == "demo":
            from engine.checkpoints.demo_model import build_demo_model

            serving_model = str(build_demo_model())
        result["serving"] = bench_serving(serving_model, args.dtype, kv_names, args.kv_cache_gb)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
