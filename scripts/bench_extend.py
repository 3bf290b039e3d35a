"""Time of one model step that extends cached heads: what a wave of follow-up questions costs.

    python scripts/bench_extend.py [--model PATH] [--seqs 8] [--head 512] [--question 32]
        [--decodes 0] [--shared] [--repeats 7] [--profile] [--unfused | --sdpa-extends]
        [--extra JSON]

Each of ``--seqs`` sequences holds ``--head`` cached tokens (its own, or with ``--shared`` one
head every sequence shares, as a wave of questions over one system prompt) and prefills a
``--question``-token question over it in one step, beside ``--decodes`` sequences decoding one
token over ``--head`` cached tokens. The model is the server's (``EngineConfig`` defaults:
the default model, its dtype and linear forms, unless ``--model``/``--extra`` say otherwise),
in process, on ``torch.get_num_threads()`` threads. Prints the median step time over
``--repeats`` (after two warm-up steps); ``--profile`` adds torch's profiler table (self CPU
time by op over the repeats). ``--unfused`` times each repeat a second time with the model's
fused elementwise ops off (SiLU(gate) * up and the residual add with the next RMSNorm as torch
ops: engine/worker/model/layer_ops.py's ``silu_mul`` and ``add_rms_norm_``), in ABBA order, and
prints both medians and their ratio. ``--sdpa-extends`` does the same with the compiled extend
kernel off (extends on gather + SDPA, as on CPUs without a bf16 brgemm:
engine/worker/attention/torch_native.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.checkpoints.model_source import resolve_model  # noqa: E402
from engine.contracts.engine_config import EngineConfig  # noqa: E402
from engine.contracts.step import BatchInput  # noqa: E402
from engine.worker.model import layer_ops  # noqa: E402
from engine.worker.runner import ModelRunner  # noqa: E402


@contextlib.contextmanager
def unfused() -> Iterator[None]:
    """The model's elementwise work as torch ops (its fused CPU ops reported unavailable)."""
    ops = layer_ops.silu_mul_op, layer_ops.add_rms_norm_op
    layer_ops.silu_mul_op = layer_ops.add_rms_norm_op = lambda: None
    try:
        yield
    finally:
        layer_ops.silu_mul_op, layer_ops.add_rms_norm_op = ops


@contextlib.contextmanager
def sdpa_extends(runner: ModelRunner) -> Iterator[None]:
    """Extends on gather + SDPA: the torch backend's extend kernel off for the steps planned
    inside."""
    attention = runner.attention
    kernel = getattr(attention, "_extend_attention", None)
    if kernel is None:
        raise SystemExit("--sdpa-extends: this runner's extends do not take the extend kernel")
    attention._extend_attention = None
    try:
        yield
    finally:
        attention._extend_attention = kernel


def build_batches(runner: ModelRunner, args: argparse.Namespace
                  ) -> tuple[BatchInput | None, BatchInput]:
    """The step that caches the heads (None with ``--head 0``: a whole prefill), then the
    measured step over them."""
    page = runner.page_size
    rng = np.random.default_rng(0)
    vocab = runner.config.vocab_size
    head_pages = -(-args.head // page)
    own_pages = -(-(args.question + 1) // page) + 1
    heads = 1 if args.shared else args.seqs + args.decodes
    order = rng.permutation(runner.num_pages)
    need = heads * head_pages + (args.seqs + args.decodes) * own_pages
    if need > len(order):
        raise SystemExit("KV pool too small for this batch; raise kv_cache_gb in --extra")
    head_tables = order[: heads * head_pages].reshape(heads, head_pages)
    own = order[heads * head_pages : need].reshape(args.seqs + args.decodes, own_pages)
    head_ids = rng.integers(0, vocab, (heads, head_pages * page)).astype(np.int32)
    # Heads end on a page boundary here, so each sequence's own pages follow its head's.
    prefill = BatchInput.build([(head_tables[i], 0, head_ids[i, : args.head])
                                for i in range(heads)], page) if args.head else None
    seqs = []
    for i in range(args.seqs + args.decodes):
        h = 0 if args.shared else i
        table = np.concatenate([head_tables[h], own[i]])
        new = args.question if i < args.seqs else 1
        seqs.append((table, args.head, rng.integers(0, vocab, new).astype(np.int32)))
    return prefill, BatchInput.build(seqs, page)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the server's default model")
    parser.add_argument("--seqs", type=int, default=8, help="sequences prefilling a question")
    parser.add_argument("--head", type=int, default=512, help="cached tokens (a page multiple; 0: a whole prefill)")
    parser.add_argument("--question", type=int, default=32)
    parser.add_argument("--decodes", type=int, default=0, help="sequences decoding beside")
    parser.add_argument("--shared", action="store_true", help="one head for every sequence")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--unfused", action="store_true",
                        help="also time every repeat with the fused elementwise ops off (ABBA)")
    parser.add_argument("--sdpa-extends", action="store_true",
                        help="also time every repeat with the extend kernel off (ABBA)")
    parser.add_argument("--extra", default="{}", help="more EngineConfig fields, as JSON")
    args = parser.parse_args(argv)
    if args.unfused and args.sdpa_extends:
        parser.error("--unfused and --sdpa-extends each take the baseline: choose one")
    config = EngineConfig(model=resolve_model(args.model).path, **json.loads(args.extra))
    runner = ModelRunner(config)
    if args.head % runner.page_size:
        raise SystemExit(f"--head must be a multiple of the page size ({runner.page_size})")
    prefill, step = build_batches(runner, args)
    if prefill is not None:
        runner.forward(prefill)
    baseline_mode = (unfused if args.unfused
                     else (lambda: sdpa_extends(runner)) if args.sdpa_extends else None)
    for _ in range(2):
        runner.forward(step)
        if baseline_mode is not None:
            with baseline_mode():
                runner.forward(step)

    def timed() -> float:
        start = time.perf_counter()
        runner.forward(step)
        return time.perf_counter() - start

    times, baseline = [], []
    profiler = torch.profiler.profile() if args.profile else None
    if profiler is not None:
        profiler.__enter__()
    for repeat in range(args.repeats):
        if baseline_mode is not None and repeat % 2:  # ABBA: the baseline first every other
            with baseline_mode():
                baseline.append(timed())
        times.append(timed())
        if baseline_mode is not None and not repeat % 2:
            with baseline_mode():
                baseline.append(timed())
    c = runner.config

    def summary(samples: list[float]) -> str:
        return (f"median {statistics.median(samples) * 1e3:.1f} ms (min {min(samples) * 1e3:.1f}"
                f", max {max(samples) * 1e3:.1f}) over {args.repeats}")

    print(f"{c.architecture}, {c.num_layers} layers, {runner.dtype}, "
          f"{torch.get_num_threads()} threads: {args.seqs} x {args.question} tokens over "
          f"{'one shared' if args.shared else 'their own'} {args.head}-token heads, "
          f"{args.decodes} decodes beside: {summary(times)}")
    if args.unfused:
        ratio = statistics.median(times) / statistics.median(baseline)
        print(f"unfused elementwise ops: {summary(baseline)}; fused / unfused {ratio:.3f}")
    if args.sdpa_extends:
        ratio = statistics.median(times) / statistics.median(baseline)
        print(f"extends on gather + SDPA: {summary(baseline)}; kernel / SDPA {ratio:.3f}")
    if profiler is not None:
        profiler.__exit__(None, None, None)
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
