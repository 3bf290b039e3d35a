"""GPU check: the flashinfer attention backend against the torch backend, then decode timings.

Run by ``scripts/gpu_phase.py`` (docs/gpu.md), whose phase 1 installs the wheels and runs
``--parts prebuild`` and whose phase 2 runs the other parts. Each part prints a markdown table
as soon as it is done:

0. prebuild (``--kernels fa2`` or ``fa3``): every FlashInfer kernel module of that family that
   the checks, the benchmark and the CUDA tests load (bf16, head_dim 128, the shapes below),
   compiled in one parallel ninja run, timed (a second run finds them in FlashInfer's cache
   and compiles nothing). The engine takes FA3 only where its modules are built;
1. attention parity, bfloat16: random pool contents, random shuffled page tables, prefill /
   decode / mixed / cached-prefix batches, page sizes 1 and 16, GQA groups 2 and 4, a sliding
   window layer. Both backends read the same pool; both are compared with the torch backend in
   float32 on a float32 copy of the pool (``ok`` when flashinfer's error is within twice the torch
   bf16 error, or under 1e-2); one more row per config reads pages filled by a partial-page copy
   (copy-on-write);
2. decode attention time per step (32 layer calls + the per-step plan) at batch 1/32/128: torch,
   and flashinfer with its tensor-core decode on FA2 and, where its modules are built, FA3;
3. the whole ModelRunner on a Llama-shaped model with dummy weights (drawn on the GPU): logits
   of both backends on a mixed batch, the host syncs inside a copy-on-write step and a
   shared-prefix (cascade) step (torch's sync debug mode; 0 expected: the sampler makes the
   step's one), and decode tokens/s at batch 1/32/128, each step read back before the next
   as the sampler would.

4. fp8 KV (``--kv-cache-dtype fp8_e4m3|fp8_e5m2``): FlashInfer over fp8 pages against the torch
   backend in float32 over the same pages' values (the parity rule of part 1), decode attention
   time over fp8 pages against bf16 pages at batch 32/128, and the ModelRunner on an fp8 cache
   with CUDA graphs: its logits against the torch backend's on the same pages, and decode
   tokens/s against a bf16 cache.

CUDA graphs against eager decode: scripts/check_cuda_graphs.py.

Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.contracts.engine_config import EngineConfig  # noqa: E402
from engine.contracts.step import BatchInput  # noqa: E402
from engine.worker import kv_quant  # noqa: E402
from engine.worker.attention import make_backend  # noqa: E402
from engine.worker.kv_pool import KVPool  # noqa: E402
from scripts.gpu_kernels import (  # noqa: E402
    ATTENTION_CONFIGS,
    FP8_SHAPES,
    HEAD_DIM,
    fa3_built,
    prebuild_kernels,
)

SHAPES = {
    "fresh prefills": [(0, 1000), (0, 37), (0, 515)],
    "decode, page edges": [(0, 1), (14, 1), (15, 1), (16, 1), (1000, 1), (4095, 1)],
    "mixed": [(0, 300), (1000, 1), (517, 33), (64, 1), (15, 1), (31, 200)],
    "cached prefix": [(100, 50), (1024, 512), (16, 16)],
}


def random_batch(page_size: int, num_pages: int, shapes, seed: int = 0) -> BatchInput:
    rng = np.random.default_rng(seed)
    free = rng.permutation(num_pages)
    seqs, used = [], 0
    for cached, new in shapes:
        count = -(-(cached + new) // page_size)
        seqs.append((free[used : used + count], cached, rng.integers(0, 1000, new)))
        used += count
    return BatchInput.build(seqs, page_size, "all")


def make_pool(layers: int, pages: int, page_size: int, kv_heads: int, dtype,
              kv_dtype=None) -> KVPool:
    return KVPool(num_layers=layers, num_pages=pages, page_size=page_size, num_kv_heads=kv_heads,
                  head_dim=HEAD_DIM, dtype=dtype, device="cuda", kv_dtype=kv_dtype)


def backend(name: str, pool: KVPool, heads: int, kv_heads: int, windows,
            decode_backend: str = "fa2"):
    return make_backend(name, pool, num_heads=heads, num_kv_heads=kv_heads, head_dim=HEAD_DIM,
                        sliding_windows=windows, decode_backend=decode_backend)


def check_parity() -> bool:
    print("## attention parity (bfloat16; errors are max abs vs torch backend in float32)\n")
    print("| heads q/kv | window | page | batch | tokens | flashinfer err | torch bf16 err | ok |")
    print("|---|---|---:|---|---:|---:|---:|---|")
    all_ok = True
    for heads, kv_heads, windows in ATTENTION_CONFIGS:
        for page_size in (1, 16):
            for name, shapes in [*SHAPES.items(), ("copy-on-write", SHAPES["cached prefix"])]:
                pages = 16384 // page_size
                pool = make_pool(len(windows), pages, page_size, kv_heads, torch.bfloat16)
                pool.kv.normal_()
                pool32 = make_pool(len(windows), pages, page_size, kv_heads, torch.float32)
                pool32.kv.copy_(pool.kv)
                batch = random_batch(page_size, pages, shapes)
                if name == "copy-on-write":
                    # The first sequence's last page starts as a copy of part of a page no
                    # sequence lists (a partially matched page, copied before it is extended).
                    unused = np.setdiff1d(np.arange(pages), batch.page_indices)[0]
                    last = batch.page_indices[batch.page_indptr[1] - 1]
                    copy = np.array([[unused, last, max(page_size // 2, 1)]])
                    pool.copy_pages(copy)
                    pool32.copy_pages(copy)
                backends = {
                    "flashinfer": backend("flashinfer", pool, heads, kv_heads, windows),
                    "torch": backend("torch", pool, heads, kv_heads, windows),
                    "fp32": backend("torch", pool32, heads, kv_heads, windows),
                }
                for b in backends.values():
                    b.plan(batch)
                for layer, window in enumerate(windows):
                    q, k, v = (torch.randn(batch.num_tokens, h, HEAD_DIM, device="cuda").bfloat16()
                               for h in (heads, kv_heads, kv_heads))
                    out = {n: b.forward(layer, *(t.float() if n == "fp32" else t
                                                 for t in (q, k, v)))
                           for n, b in backends.items()}
                    fi_err = (out["flashinfer"].float() - out["fp32"]).abs().max().item()
                    torch_err = (out["torch"].float() - out["fp32"]).abs().max().item()
                    ok = fi_err <= max(2 * torch_err, 1e-2)
                    all_ok &= ok
                    print(f"| {heads}/{kv_heads} | {window or '-'} | {page_size} | {name} | "
                          f"{batch.num_tokens} | {fi_err:.2e} | {torch_err:.2e} | "
                          f"{'ok' if ok else 'FAIL'} |", flush=True)
    return all_ok


def cuda_time(fn, repeats: int = 10) -> float:
    """Median seconds of fn() on the GPU, after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def attention_step(b, batch: BatchInput, qkv, layers: int) -> None:
    b.plan(batch)
    for _ in range(layers):
        b.forward(0, *qkv)


def run_batches(runner, batches: list[BatchInput]) -> None:
    """Steps one after another, each read back before the next is planned, as the sampler's
    copy does: a ``plan()`` rewrites FlashInfer's pinned plan buffer, which the previous
    step's copy to the device may not have read yet."""
    for b in batches:
        runner.forward(b).argmax(-1).cpu()


def count_syncs(fn) -> int:
    """Host syncs ``fn`` makes (torch's sync debug mode warns at each)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def time_decode_attention(context: int, layers: int = 32) -> None:
    heads, kv_heads, page_size = 32, 8, 16
    print(f"\n## decode attention, {heads}/{kv_heads} heads of {HEAD_DIM}, context {context}, "
          f"page {page_size}: ms per step (plan + {layers} layer calls)\n")
    with_fa3 = fa3_built()
    print("| batch | torch ms | flashinfer FA2 ms | flashinfer FA3 ms | FA3 / FA2 | "
          "FA2 vs torch |")
    print("|---:|---:|---:|---:|---:|---:|")
    for batch_size in (1, 32, 128):
        pages = batch_size * (-(-(context + 1) // page_size)) + 1
        pool = make_pool(1, pages, page_size, kv_heads, torch.bfloat16)
        batch = random_batch(page_size, pages, [(context, 1)] * batch_size)
        q, k, v = (torch.randn(batch_size, h, HEAD_DIM, device="cuda").bfloat16()
                   for h in (heads, kv_heads, kv_heads))
        ms = {}
        for name, decode in (("torch", "fa2"), ("fa2", "fa2"), ("fa3", "fa3")):
            if name == "fa3" and not with_fa3:
                continue  # not built in phase 1: building it here would take the step's time
            b = backend("torch" if name == "torch" else "flashinfer", pool, heads, kv_heads,
                        (None,), decode)
            ms[name] = cuda_time(partial(attention_step, b, batch, (q, k, v), layers)) * 1e3
        fa3 = (f"{ms['fa3']:.2f} | {ms['fa3'] / ms['fa2']:.2f}" if with_fa3
               else "not built | -")
        print(f"| {batch_size} | {ms['torch']:.2f} | {ms['fa2']:.2f} | {fa3} | "
              f"{ms['torch'] / ms['fa2']:.1f}x |", flush=True)
        del pool


def check_model_runners(options: dict) -> dict:
    """A bf16 dummy-weight runner of the check model per ``options`` entry, all the same weights."""
    from engine.worker.runner import ModelRunner
    from scripts.bench_gpu import CHECK_MODEL, write_config

    with tempfile.TemporaryDirectory() as tmp:
        write_config(Path(tmp), CHECK_MODEL)
        return {key: ModelRunner(EngineConfig(model=tmp, load_format="dummy", dtype="bfloat16",
                                              **fields))
                for key, fields in options.items()}


def prefill_for_decode(runner, batch_size: int, context: int, steps: int,
                       vocab: int) -> list[BatchInput]:
    """Prefills random prompts, each on pages of its own; the ``steps`` decode steps after them."""
    tables = np.arange(batch_size * (-(-(context + steps) // 16))).reshape(batch_size, -1)
    prompt = np.random.default_rng(0).integers(0, vocab, (batch_size, context))
    runner.forward(BatchInput.build(list(zip(tables, [0] * batch_size, prompt, strict=True)),
                                    16)).cpu()
    return [BatchInput.build([(t, context + s, [s + 3]) for t in tables], 16)
            for s in range(steps)]


def check_model(context: int, steps: int) -> bool:
    runners = check_model_runners({name: {"num_pages": 12288, "attention_backend": name}
                                   for name in ("torch", "flashinfer")})
    c = runners["torch"].config
    print(f"\n## ModelRunner, dummy-weight Llama: {c.num_layers} layers, hidden {c.hidden_size}, "
          f"{c.num_heads}/{c.num_kv_heads} heads of {c.head_dim}, bfloat16, page 16\n")
    mixed = random_batch(16, 12288, SHAPES["mixed"])
    logits = {}
    for name, runner in runners.items():
        # the cached parts of "mixed" must exist: prefill them first, on the same pages
        prefix = [(mixed.page_indices[mixed.page_indptr[b] : mixed.page_indptr[b + 1]], 0,
                   np.arange(n) % 999)
                  for b, n in enumerate(mixed.seq_lens - mixed.extend_lens) if n > 0]
        runner.forward(BatchInput.build(prefix, 16)).cpu()
        logits[name] = runner.forward(mixed).clone()
    diff = (logits["torch"] - logits["flashinfer"]).abs().max().item()
    agree = (logits["torch"].argmax(-1) == logits["flashinfer"].argmax(-1)).float().mean().item()
    ok = agree >= 0.9  # bf16 noise may flip a near-tie; part 1 is the exact check
    print(f"mixed batch, {mixed.num_tokens} tokens: max |logit diff| {diff:.3f}, argmax "
          f"agreement {agree:.1%} {'ok' if ok else 'FAIL'}\n")
    ok &= check_step_syncs(runners)
    print(f"| batch | torch tok/s | flashinfer tok/s | speedup |   (decode @{context}, {steps} "
          "steps)")
    print("|---:|---:|---:|---:|")
    for batch_size in (1, 32, 128):
        rates = {}
        for name, runner in runners.items():
            batches = prefill_for_decode(runner, batch_size, context, steps, c.vocab_size)
            rates[name] = batch_size * steps / cuda_time(partial(run_batches, runner, batches), 3)
        print(f"| {batch_size} | {rates['torch']:,.0f} | {rates['flashinfer']:,.0f} | "
              f"{rates['flashinfer'] / rates['torch']:.1f}x |", flush=True)
    return ok


def check_step_syncs(runners: dict) -> bool:
    """Host syncs inside a copy-on-write step and a shared-prefix decode step (the torch
    backend plans a cascade for it), per backend: 0 expected."""
    print("| backend | copy-on-write step syncs | shared-prefix decode syncs |")
    print("|---|---:|---:|")
    ok = True
    rng = np.random.default_rng(3)
    shared = list(range(11000, 11008))  # 8 pages of a common 128-token prefix
    for name, runner in runners.items():
        runner.forward(BatchInput.build([(shared, 0, rng.integers(0, 999, 128))], 16)).cpu()
        own = [[11100 + 2 * i, 11101 + 2 * i] for i in range(4)]
        runner.forward(BatchInput.build([(shared + o, 128, rng.integers(0, 999, 20))
                                         for o in own], 16)).cpu()
        cow = BatchInput.build([([*shared[:7], 11200], 120, rng.integers(0, 999, 5))], 16,
                               copies=[(shared[7], 11200, 8)])
        decode = BatchInput.build([(shared + o, 148, [5]) for o in own], 16)
        counts = []
        for step in (cow, decode):
            runner.check(step)
            counts.append(count_syncs(partial(runner.forward, step, checked=True)))
            torch.cuda.synchronize()
        ok &= counts == [0, 0]
        print(f"| {name} | {counts[0]} | {counts[1]} |", flush=True)
    print()
    return ok


def check_fp8(context: int, model_context: int, steps: int) -> bool:
    """Part 4: fp8 pages through FlashInfer, against float32 over their values; time; runner."""
    heads, kv_heads = FP8_SHAPES[0]
    print(f"\n## fp8 KV, {heads}/{kv_heads} heads of {HEAD_DIM}, bf16 queries, page 16: max abs "
          "error vs torch float32 over the pages' values\n")
    print("| KV dtype | batch | tokens | flashinfer err | torch bf16 err | ok |")
    print("|---|---|---:|---:|---:|---|")
    ok, pages = True, 16384 // 16
    for kv_dtype in kv_quant.FP8_DTYPES:
        pool = make_pool(1, pages, 16, kv_heads, torch.bfloat16, kv_dtype)
        pool.kv.copy_(kv_quant.encode(torch.randn(pool.kv.shape, device="cuda"), kv_dtype))
        pool32 = make_pool(1, pages, 16, kv_heads, torch.float32)
        pool32.kv.copy_(kv_quant.decode(pool.kv, kv_dtype, torch.float32))
        for name, shapes in SHAPES.items():
            batch = random_batch(16, pages, shapes)
            q, k, v = (torch.randn(batch.num_tokens, h, HEAD_DIM, device="cuda")
                       for h in (heads, kv_heads, kv_heads))
            # this step's K and V as fp8 values, so that every backend stores the same
            k, v = (kv_quant.decode(kv_quant.encode(t, kv_dtype), kv_dtype, torch.float32)
                    for t in (k, v))
            out = {}
            for label, b_pool, dtype in (("flashinfer", pool, torch.bfloat16),
                                         ("torch", pool, torch.bfloat16),
                                         ("fp32", pool32, torch.float32)):
                b = backend("torch" if label != "flashinfer" else "flashinfer", b_pool, heads,
                            kv_heads, (None,))
                b.plan(batch)
                out[label] = b.forward(0, *(t.to(dtype) for t in (q, k, v))).float()
            fi_err = (out["flashinfer"] - out["fp32"]).abs().max().item()
            torch_err = (out["torch"] - out["fp32"]).abs().max().item()
            row_ok = fi_err <= max(2 * torch_err, 1e-2)
            ok &= row_ok
            print(f"| {str(kv_dtype).removeprefix('torch.')} | {name} | {batch.num_tokens} | "
                  f"{fi_err:.2e} | {torch_err:.2e} | {'ok' if row_ok else 'FAIL'} |", flush=True)
    print(f"\n| batch | bf16 KV ms | fp8_e4m3 KV ms | bf16 / fp8 |   (decode attention @{context}, "
          "32 layer calls)")
    print("|---:|---:|---:|---:|")
    for batch_size in (32, 128):
        num_pages = batch_size * (-(-(context + 1) // 16)) + 1
        batch = random_batch(16, num_pages, [(context, 1)] * batch_size)
        qkv = [torch.randn(batch_size, h, HEAD_DIM, device="cuda").bfloat16()
               for h in (heads, kv_heads, kv_heads)]
        ms = {}
        for label, kv_dtype in (("bf16", None), ("fp8", torch.float8_e4m3fn)):
            b = backend("flashinfer", make_pool(1, num_pages, 16, kv_heads, torch.bfloat16,
                                                kv_dtype), heads, kv_heads, (None,))
            ms[label] = cuda_time(partial(attention_step, b, batch, qkv, 32)) * 1e3
        print(f"| {batch_size} | {ms['bf16']:.2f} | {ms['fp8']:.2f} | "
              f"{ms['bf16'] / ms['fp8']:.2f}x |", flush=True)
    runners = check_model_runners({
        (name, kv): {"num_pages": 4096, "attention_backend": name, "kv_cache_dtype": kv,
                     "enable_cuda_graph": name == "flashinfer"}
        for name, kv in (("torch", "fp8_e4m3"), ("flashinfer", "fp8_e4m3"),
                         ("flashinfer", "auto"))})
    graphs = runners[("flashinfer", "fp8_e4m3")].graphs
    print(f"\nModelRunner on an fp8_e4m3 cache, CUDA graphs "
          f"{'captured' if graphs is not None else 'OFF'}")
    ok &= graphs is not None
    logits, rates = {}, {}
    for key, runner in runners.items():
        batches = prefill_for_decode(runner, 8, model_context, steps, 999)
        logits[key] = runner.forward(batches[0]).float().cpu()
        rates[key] = 8 * (steps - 1) / cuda_time(partial(run_batches, runner, batches[1:]), 3)
    agree = (logits[("torch", "fp8_e4m3")].argmax(-1)
             == logits[("flashinfer", "fp8_e4m3")].argmax(-1)).float().mean().item()
    ok &= agree >= 0.9
    print(f"decode logits, flashinfer (graphs) vs torch over fp8 pages: argmax agreement "
          f"{agree:.0%} {'ok' if agree >= 0.9 else 'FAIL'}; decode at batch 8 @{model_context}: "
          f"bf16 KV {rates[('flashinfer', 'auto')]:,.0f} tok/s, fp8 KV "
          f"{rates[('flashinfer', 'fp8_e4m3')]:,.0f} tok/s\n", flush=True)
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=2048, help="decode context for part 2")
    parser.add_argument("--model-context", type=int, default=512, help="decode context for part 3")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed in part 3")
    parser.add_argument("--parts", default="parity,decode,model",
                        help="comma-separated parts to run, of prebuild, parity, decode, model, "
                             "fp8 (default: parity, decode, model)")
    parser.add_argument("--kernels", choices=("fa2", "fa3"), default="fa2",
                        help="the kernel family the prebuild part builds (default fa2)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA device")
    import flashinfer

    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}, "
          f"flashinfer {getattr(flashinfer, '__version__', '?')}\n")
    ok = True
    if "prebuild" in parts:
        ok &= prebuild_kernels(args.kernels)
    if "parity" in parts:
        ok &= check_parity()
    if "decode" in parts:
        time_decode_attention(args.context)
    if "model" in parts:
        ok &= check_model(args.model_context, args.steps)
    if "fp8" in parts:
        ok &= check_fp8(args.context, args.model_context, args.steps)
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
