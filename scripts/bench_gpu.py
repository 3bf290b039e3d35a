"""The engine at Llama-3-8B's shapes on one GPU, with random weights (no download).

Four measurements, each printed as a markdown table as soon as it finishes:

1. Memory bandwidth: a large device-to-device copy, timed, beside the assumed rate that the
   floors below use (``--hbm-bandwidth``). A copy of N bytes reads N and writes N, so the rate
   printed is 2N / time.
2. Decode: ``ModelRunner.forward`` on a decode batch (every sequence adds one token to a
   ``--context``-token KV of its own pages), the median of ``--steps`` timed steps after
   warm-up, at each of ``--batches``; beside it the HBM floor, the time to read every weight
   and every KV byte once::

       floor = (weight bytes + batch x context x layers x 2 x kv_heads x head_dim x kv bytes)
               / hbm_bandwidth

   and the fraction of the floor reached (floor / step; the target is >= 0.70 at batch 64).
   "Weight bytes" counts every parameter, the embedding table included, although a step
   gathers only a few of its rows.
3. Prefill: 8 sequences x ``--context`` new tokens in one step (or ``--chunk`` tokens of each
   per step), tokens/s as the median of a few.
4. The offline engine (``engine.Engine``, its own scheduler and worker processes) on a
   shared-prefix workload, with prefix caching on and off. The engine has no switch for
   prefix caching, so "off" sends the same prompts, each in a cache namespace of its own
   (``GenerateRequest.namespace``, the server's cache salt): requests in different namespaces
   share nothing. Reports output tokens/s, prefix hit rates and on / off.

The model is a ``config.json`` with Llama-3-8B's shapes in a temporary directory, loaded with
``load_format="dummy"`` (random weights drawn on the device); the engine's tokenizer is the
demo model's (``engine.checkpoints.demo_model``), and prompts are token ids. ``--tiny`` shrinks everything
(hidden 256, 2 layers, float32) so CI runs it on a CPU in seconds.

    python scripts/bench_gpu.py                            # H200: about 90 GiB of device memory
    python scripts/bench_gpu.py --enable-cuda-graph --json out.json
    python scripts/bench_gpu.py --batches 64 --skip-engine --attention-backend flashinfer
    python scripts/bench_gpu.py --tiny --device cpu        # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a file from anywhere
    sys.path.insert(0, str(REPO))

from engine import Engine, SamplingParams  # noqa: E402
from engine.checkpoints.demo_model import TOKENIZER_VOCAB_SIZE, build_demo_model  # noqa: E402
from engine.contracts.engine_config import EngineConfig  # noqa: E402
from engine.contracts.step import BatchInput  # noqa: E402
from engine.profiler.workload import grouped_prompt_ids  # noqa: E402
from engine.runtime.offline import RequestResult  # noqa: E402
from engine.worker.runner import ModelRunner  # noqa: E402

PAGE_SIZE = 16
HBM_BANDWIDTH = 4.3e12  # B/s: the H200's measured copy rate (read + write)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

LLAMA3_8B = {
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "rope_theta": 500000.0, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
}
# Shapes the GPU checks build (scripts/gpu_check.py, check_cuda_graphs.py): 16/4 heads of 128.
CHECK_MODEL = {
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 8,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 32000,
    "rope_theta": 500000.0, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
}
TINY_MODEL = {
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
    "rope_theta": 10000.0, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}


@dataclasses.dataclass(frozen=True)
class Preset:
    """Every size the benchmark uses; the flags override some of them."""

    model: dict[str, Any]
    batches: tuple[int, ...]
    context: int
    steps: int
    warmup_steps: int
    prefill_seqs: int
    prefill_repeats: int
    copy_bytes: int
    groups: int
    per_group: int
    prefix: int
    question: int
    output_len: int

    @property
    def dtype(self) -> str:
        return self.model["torch_dtype"]


GPU = Preset(LLAMA3_8B, batches=(1, 16, 64, 256), context=2048, steps=20, warmup_steps=5,
             prefill_seqs=8, prefill_repeats=3, copy_bytes=2 << 30, groups=16, per_group=16,
             prefix=1024, question=64, output_len=128)
TINY = Preset(TINY_MODEL, batches=(1, 4), context=256, steps=5, warmup_steps=2, prefill_seqs=2,
              prefill_repeats=2, copy_bytes=64 << 20, groups=2, per_group=4, prefix=64,
              question=16, output_len=8)


def kv_read_bytes(batch: int, context: int, num_layers: int, num_kv_heads: int, head_dim: int,
                  elem_bytes: int) -> int:
    """Bytes of K and V a decode step reads: every layer's, for every token of every sequence."""
    return batch * context * num_layers * 2 * num_kv_heads * head_dim * elem_bytes


def hbm_floor_seconds(weight_bytes: int, kv_bytes: int, bandwidth: float) -> float:
    """Seconds to read every weight and the step's KV once at ``bandwidth`` bytes/s."""
    return (weight_bytes + kv_bytes) / bandwidth


def write_config(directory: Path, model: dict[str, Any]) -> None:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 0,
              "eos_token_id": 0, **model}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def measure_copy_rate(device: torch.device, num_bytes: int, repeats: int = 5) -> float:
    """Bytes moved per second (read + write) by a device-to-device copy of ``num_bytes``."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    src.fill_(1)
    dst.copy_(src)
    seconds = statistics.median(timed(lambda: dst.copy_(src), device) for _ in range(repeats))
    return 2 * num_bytes / seconds


def decode_batch(batch: int, context: int, pages_per_seq: int, vocab: int,
                 rng: np.random.Generator) -> BatchInput:
    """``batch`` sequences, each on its own pages, each adding token ``context - 1``."""
    seqs = [(range(i * pages_per_seq, (i + 1) * pages_per_seq), context - 1,
             [int(rng.integers(vocab))]) for i in range(batch)]
    return BatchInput.build(seqs, PAGE_SIZE)


def bench_decode(runner: ModelRunner, batches: tuple[int, ...], context: int, steps: int,
                 warmup_steps: int, bandwidth: float) -> list[dict[str, float]]:
    c, device = runner.config, runner.device
    weight_bytes = runner.weight_bytes  # (the parameters themselves may be prepacked on CPU)
    kv_elem_bytes = runner.pool.kv.element_size()
    pages_per_seq = -(-context // PAGE_SIZE)
    rng = np.random.default_rng(0)
    rows = []
    for batch in batches:
        step = decode_batch(batch, context, pages_per_seq, c.vocab_size, rng)
        runner.check(step)
        for _ in range(warmup_steps):
            runner.forward(step, checked=True)
            synchronize(device)  # as the sampler's copy would: see ModelRunner.forward
        seconds = statistics.median(timed(lambda s=step: runner.forward(s, checked=True), device)
                                    for _ in range(steps))
        kv_bytes = kv_read_bytes(batch, context, c.num_layers, runner.model.plan.num_kv_heads,
                                 c.head_dim, kv_elem_bytes)
        floor = hbm_floor_seconds(weight_bytes, kv_bytes, bandwidth)
        rows.append({"batch": batch, "step_ms": seconds * 1e3, "tokens_per_s": batch / seconds,
                     "weight_gb": weight_bytes / 1e9, "kv_gb": kv_bytes / 1e9,
                     "floor_ms": floor * 1e3, "fraction_of_floor": floor / seconds})
        row = rows[-1]
        print(f"| {batch} | {row['step_ms']:.4g} | {row['tokens_per_s']:,.0f} | "
              f"{row['weight_gb']:.4g} | {row['kv_gb']:.4g} | {row['floor_ms']:.4g} | "
              f"{row['fraction_of_floor']:.3g} |", flush=True)
    return rows


def bench_prefill(runner: ModelRunner, num_seqs: int, length: int, chunk: int,
                  repeats: int) -> dict[str, float]:
    """``num_seqs`` fresh sequences of ``length`` tokens, ``chunk`` new tokens of each per step."""
    pages_per_seq = -(-length // PAGE_SIZE)
    rng = np.random.default_rng(1)
    prompts = rng.integers(runner.config.vocab_size, size=(num_seqs, length))
    steps = []
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        seqs = [(range(i * pages_per_seq, (i + 1) * pages_per_seq), start, prompts[i, start:end])
                for i in range(num_seqs)]
        steps.append(BatchInput.build(seqs, PAGE_SIZE))
    for step in steps:
        runner.check(step)

    def run_all() -> None:
        for step in steps:
            runner.forward(step, checked=True)
            synchronize(runner.device)  # as the sampler's copy would: see ModelRunner.forward

    run_all()  # warm-up: kernels and allocator sized for this shape
    seconds = statistics.median(timed(run_all, runner.device) for _ in range(repeats))
    return {"seqs": num_seqs, "tokens_per_seq": length, "chunk": chunk, "steps": len(steps),
            "seconds": seconds, "tokens_per_s": num_seqs * length / seconds}


def run_offline(engine: Engine, prompts: list[list[int]], output_len: int,
                namespaces: list[str | None]) -> dict[str, float]:
    """All prompts at once through ``Engine.stream`` (``generate`` takes no namespace)."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)

    async def one(prompt: list[int], namespace: str | None) -> RequestResult:
        result = RequestResult("")
        async for out in engine.stream(prompt, params, namespace=namespace):
            result.add(out)
        return result

    async def run_all() -> list[RequestResult]:
        return await asyncio.gather(*(one(p, ns) for p, ns in zip(prompts, namespaces,
                                                                   strict=True)))

    start = time.perf_counter()
    results = asyncio.run(run_all())
    seconds = time.perf_counter() - start
    failed = [r.error for r in results if r.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} requests failed: {failed[0]}")
    output_tokens = sum(len(r.token_ids) for r in results)
    return {"seconds": seconds, "output_tokens": output_tokens,
            "output_tokens_per_s": output_tokens / seconds,
            "hit_rate": sum(r.cached_tokens for r in results)
            / sum(r.prompt_tokens for r in results)}


def bench_engine(model_dir: Path, preset: Preset, args: argparse.Namespace,
                 vocab: int) -> dict[str, Any]:
    for name in TOKENIZER_FILES:
        shutil.copy(build_demo_model() / name, model_dir / name)
    prompt_len = preset.prefix + preset.question
    num_prompts = preset.groups * preset.per_group
    # Room for every prompt unshared, plus one page per request for the last partial page.
    num_pages = num_prompts * (-(-(prompt_len + preset.output_len) // PAGE_SIZE) + 1)
    options = dict(load_format="dummy", dtype=preset.dtype, device=args.device,
                   attention_backend=args.attention_backend, num_pages=num_pages,
                   page_size=PAGE_SIZE, enable_cuda_graph=args.enable_cuda_graph)
    ids_vocab = min(vocab, TOKENIZER_VOCAB_SIZE)  # ids the demo tokenizer can spell
    prompts = grouped_prompt_ids(np.random.default_rng(0), preset.groups, preset.per_group,
                                 preset.prefix, preset.question, 3, ids_vocab)
    with Engine(str(model_dir), **options) as engine:
        warmup = grouped_prompt_ids(np.random.default_rng(1), 1, 2, preset.prefix,
                                    preset.question, 3, ids_vocab)
        run_offline(engine, warmup, preset.output_len, ["warm-up"] * len(warmup))
        on = run_offline(engine, prompts, preset.output_len, [None] * num_prompts)
        off = run_offline(engine, prompts, preset.output_len,
                          [f"salt-{i}" for i in range(num_prompts)])
    for name, run in (("on", on), ("off (own namespace each)", off)):
        print(f"| {name} | {run['output_tokens_per_s']:,.0f} | {run['hit_rate']:.1%} | "
              f"{run['seconds']:.2f} |", flush=True)
    ratio = on["output_tokens_per_s"] / off["output_tokens_per_s"]
    print(f"\non / off: {ratio:.2f}x\n", flush=True)
    return {"on": on, "off": off, "ratio": ratio, "num_pages": num_pages}


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Preset]:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU-sized shapes for a smoke test")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "flashinfer"))
    ap.add_argument("--batches", type=lambda s: tuple(int(b) for b in s.split(",")),
                    help=f"decode batch sizes, comma-separated (default "
                         f"{','.join(map(str, GPU.batches))}; tiny "
                         f"{','.join(map(str, TINY.batches))})")
    ap.add_argument("--context", type=int,
                    help=f"tokens of KV each sequence reads, also the prefill length (default "
                         f"{GPU.context}; tiny {TINY.context})")
    ap.add_argument("--steps", type=int,
                    help=f"timed decode steps per batch (default {GPU.steps}; tiny {TINY.steps})")
    ap.add_argument("--chunk", type=int, help="prefill tokens per sequence per step "
                                              "(default: the whole context in one step)")
    ap.add_argument("--hbm-bandwidth", type=float, default=HBM_BANDWIDTH,
                    help="B/s the floors assume (default %(default).2g)")
    ap.add_argument("--skip-engine", action="store_true", help="skip the offline engine part")
    ap.add_argument("--enable-cuda-graph", action="store_true",
                    help="CUDA graphs for decode steps: the runner's (captured up to the "
                         "largest batch) and the engine's (EngineConfig.enable_cuda_graph)")
    ap.add_argument("--json", metavar="OUT", help="also write every number to OUT as JSON")
    args = ap.parse_args(argv)
    base = TINY if args.tiny else GPU
    preset = dataclasses.replace(base, batches=args.batches or base.batches,
                                 context=args.context or base.context,
                                 steps=args.steps or base.steps)
    if preset.context + 1 > preset.model["max_position_embeddings"]:
        ap.error(f"--context {preset.context} is past the model's "
                 f"{preset.model['max_position_embeddings']} positions")
    args.chunk = args.chunk or preset.context
    return args, preset


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args, preset = parse_args(argv)
    device = torch.device(args.device)
    report: dict[str, Any] = {"preset": "tiny" if args.tiny else "llama-3-8b",
                              "device": str(device), "dtype": preset.dtype}
    if device.type == "cuda":
        report["device_name"] = torch.cuda.get_device_name(device)

    copy_rate = measure_copy_rate(device, preset.copy_bytes)
    report["bandwidth"] = {"measured_copy_rate": copy_rate, "assumed": args.hbm_bandwidth,
                           "copy_bytes": preset.copy_bytes}
    print("## Memory bandwidth\n\n| copy size | measured (read + write) | assumed by the floors |"
          f"\n|---|---:|---:|\n| {preset.copy_bytes / 2**30:.2f} GiB | {copy_rate / 1e12:.3f} TB/s"
          f" | {args.hbm_bandwidth / 1e12:.3f} TB/s |\n", flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        model_dir = Path(tmp)
        write_config(model_dir, preset.model)
        pages_per_seq = -(-preset.context // PAGE_SIZE)
        num_pages = max(max(preset.batches), preset.prefill_seqs) * pages_per_seq
        start = time.perf_counter()
        runner = ModelRunner(EngineConfig(
            model=str(model_dir), load_format="dummy", dtype=preset.dtype,
            attention_backend=args.attention_backend, num_pages=num_pages, page_size=PAGE_SIZE,
            device=args.device, enable_cuda_graph=args.enable_cuda_graph,
            cuda_graph_max_bs=max(preset.batches)))
        synchronize(device)
        build_s = time.perf_counter() - start
        report["runner"] = {"attention_backend": runner.attention_backend,
                            "cuda_graphs_asked": args.enable_cuda_graph,
                            "num_pages": num_pages, "kv_pool_gib": runner.kv_cache_bytes / 2**30,
                            "build_s": build_s}
        print(f"## Decode, {preset.context}-token contexts\n\nattention backend "
              f"{runner.attention_backend}, CUDA graphs "
              f"{'asked for' if args.enable_cuda_graph else 'off'}; {preset.dtype} on {device}; KV pool {num_pages} pages "
              f"({runner.kv_cache_bytes / 2**30:.3g} GiB); built in {build_s:.1f} s\n\n"
              "| batch | step ms | tok/s | weights GB | KV read GB | HBM floor ms | "
              "fraction of floor |\n|---:|---:|---:|---:|---:|---:|---:|", flush=True)
        report["decode"] = bench_decode(runner, preset.batches, preset.context, preset.steps,
                                        preset.warmup_steps, args.hbm_bandwidth)

        prefill = bench_prefill(runner, preset.prefill_seqs, preset.context, args.chunk,
                                preset.prefill_repeats)
        report["prefill"] = prefill
        print(f"\n## Prefill\n\n| sequences x tokens | chunk | steps | seconds | tok/s |\n"
              f"|---|---:|---:|---:|---:|\n| {prefill['seqs']} x {prefill['tokens_per_seq']} | "
              f"{prefill['chunk']} | {prefill['steps']} | {prefill['seconds']:.3f} | "
              f"{prefill['tokens_per_s']:,.0f} |\n", flush=True)
        vocab = runner.config.vocab_size
        # The engine's worker is another process: give it this one's device memory.
        del runner
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

        if not args.skip_engine:
            print(f"## Offline engine, {preset.groups} groups x {preset.per_group} prompts, "
                  f"{preset.prefix}-token shared prefix + {preset.question}, "
                  f"{preset.output_len} out\n\n| prefix caching | output tok/s | hit rate | "
                  "seconds |\n|---|---:|---:|---:|", flush=True)
            report["engine"] = bench_engine(model_dir, preset, args, vocab)

    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
