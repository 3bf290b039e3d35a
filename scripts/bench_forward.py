"""Forward throughput of ModelRunner against transformers on the same model and inputs.

    python scripts/bench_forward.py [--model DIR] [--batch-sizes 1,16,64] [--repeats 5]

Prefill: every sequence of the batch prefills ``--prompt-len`` tokens in one forward.
Decode: every sequence holds ``--context-len`` cached tokens and adds one token per step for
``--decode-steps`` steps. Both sides get the same token ids, fp32 on CPU by default, and compute
only the logits a server needs (the last token of each sequence). transformers runs its own
forward with its dense ``DynamicCache``; ModelRunner runs over paged KV (batches are built before
the clock starts: that is the scheduler's work). Each figure is the median over ``--repeats``;
ratios are the median of per-repeat ModelRunner / transformers ratios (the two sides alternate). Prints a markdown table.

Without ``--model`` the demo model (engine.checkpoints.demo_model) is built offline and used.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.checkpoints.demo_model import build_demo_model  # noqa: E402
from engine.contracts.engine_config import EngineConfig  # noqa: E402
from engine.contracts.step import BatchInput  # noqa: E402
from engine.worker.runner import ModelRunner  # noqa: E402


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Ours:
    def __init__(self, runner: ModelRunner, batch_size: int, max_len: int) -> None:
        self.runner, self.page_size = runner, runner.page_size
        pages_per_seq = -(-max_len // self.page_size)
        order = np.random.default_rng(0).permutation(runner.num_pages)
        if len(order) < batch_size * pages_per_seq:
            raise SystemExit("KV pool too small for this batch; raise --kv-cache-gb")
        self.pages = order[: batch_size * pages_per_seq].reshape(batch_size, pages_per_seq)

    def prefill(self, ids: np.ndarray) -> float:
        batch = BatchInput.build([(p, 0, row) for p, row in zip(self.pages, ids, strict=True)],
                                 self.page_size)
        return timed(lambda: self.runner.forward(batch))

    def decode(self, context: np.ndarray, steps: np.ndarray) -> float:
        self.prefill(context)
        batches = [BatchInput.build([(p, context.shape[1] + s, [tok])
                                     for p, tok in zip(self.pages, steps[:, s], strict=True)],
                                    self.page_size)
                   for s in range(steps.shape[1])]
        return sum(timed(lambda b=b: self.runner.forward(b)) for b in batches)


class Reference:
    def __init__(self, model_dir: Path, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM, DynamicCache

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.cache_cls = DynamicCache
        # transformers 5 renamed past_key_values to cache; older releases know only the former.
        params = inspect.signature(self.model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    @torch.inference_mode()
    def prefill(self, ids: np.ndarray) -> float:
        inputs = torch.from_numpy(ids.astype(np.int64))
        return timed(lambda: self.model(inputs, use_cache=True, logits_to_keep=1))

    @torch.inference_mode()
    def decode(self, context: np.ndarray, steps: np.ndarray) -> float:
        cache = {self.cache_arg: self.cache_cls(config=self.model.config)}
        self.model(torch.from_numpy(context.astype(np.int64)), use_cache=True, **cache)
        tokens = torch.from_numpy(steps.astype(np.int64))
        return sum(timed(lambda s=s: self.model(tokens[:, s : s + 1], use_cache=True,
                                                logits_to_keep=1, **cache))
                   for s in range(steps.shape[1]))


def compare(tokens: int, ours: Callable[[], float], reference: Callable[[], float],
            repeats: int) -> tuple[float, float, float]:
    """Median tokens/s of each side and the median of per-repeat ratios. The two sides take
    turns so that load from other processes hits both alike."""
    ours(), reference()  # warm-up: allocator, thread pool, lazily built kernels
    pairs = [(tokens / ours(), tokens / reference()) for _ in range(repeats)]
    return (statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs),
            statistics.median(a / b for a, b in pairs))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path,
                        help="HF checkpoint directory (default: the demo model)")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--context-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--kv-cache-gb", type=float, default=1.0)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model or build_demo_model()
    runner = ModelRunner(EngineConfig(model=str(model_dir), page_size=args.page_size,
                                      kv_cache_gb=args.kv_cache_gb, device=args.device,
                                      dtype=args.dtype, attention_backend=args.attention_backend))
    if runner.device.type != "cpu":
        raise SystemExit("the transformers baseline here runs on CPU; on GPUs see docs/gpu.md")
    reference = Reference(model_dir, runner.dtype)
    vocab = runner.config.vocab_size
    rng = np.random.default_rng(0)
    c = runner.config
    print(f"model {model_dir.name}: {c.architecture}, {c.num_layers} layers, hidden "
          f"{c.hidden_size}, {c.num_heads}/{c.num_kv_heads} heads of {c.head_dim}; "
          f"{runner.dtype}, {torch.get_num_threads()} threads, "
          f"attention={runner.attention_backend}, page_size={args.page_size}, median of "
          f"{args.repeats}\n")
    print("| phase | batch | tokens/step | radixserve tok/s | transformers tok/s | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        ours = Ours(runner, batch_size, max(args.prompt_len, args.context_len + args.decode_steps))
        prompt = rng.integers(0, vocab, (batch_size, args.prompt_len)).astype(np.int32)
        context = rng.integers(0, vocab, (batch_size, args.context_len)).astype(np.int32)
        steps = rng.integers(0, vocab, (batch_size, args.decode_steps)).astype(np.int32)
        phases = [  # (name, tokens per step, tokens, ours, transformers)
            (f"prefill {args.prompt_len}", batch_size * args.prompt_len, prompt.size,
             partial(ours.prefill, prompt), partial(reference.prefill, prompt)),
            (f"decode @{args.context_len}", batch_size, steps.size,
             partial(ours.decode, context, steps), partial(reference.decode, context, steps)),
        ]
        for phase, per_step, tokens, run_ours, run_reference in phases:
            ours_rate, ref_rate, ratio = compare(tokens, run_ours, run_reference, args.repeats)
            print(f"| {phase} | {batch_size} | {per_step} | {ours_rate:,.0f} | {ref_rate:,.0f} | "
                  f"{ratio:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
