"""Extend attention alone: the compiled extend kernel against gather + SDPA, by shape.

    python scripts/bench_extend_attention.py [--heads 9] [--kv-heads 3] [--head-dim 64]
        [--shapes 8x32+512,1x512+0,...]

One layer's attention for B sequences each adding E query rows over C cached tokens (a shape
``BxE+C``), bf16, pages of 16 drawn at random from a pool of 20,000 (as a served pool's are):
``torch.ops.radixserve.extend_attention`` (csrc/extend_attention.cpp) against the torch
backend's other path, the pages gathered dense by ``index_select`` and torch's SDPA with an
additive causal mask (its built-in causal mask when nothing is cached). ABBA, on
``torch.get_num_threads()`` threads; prints each median and the ratio, and the largest
difference between the two outputs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.worker.cpu_kernels import extend_attention_op  # noqa: E402

SHAPES = "8x32+512,8x18+512,1x32+512,8x64+512,8x32+2048,4x128+512,8x32+0,2x256+0,1x512+0,1x2048+0"
PAGE = 16


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def compare(op, heads: int, kv_heads: int, head_dim: int, seqs: int, rows: int, cached: int
            ) -> str:
    keys = cached + rows
    pages_each = -(-keys // PAGE)
    gen = torch.Generator().manual_seed(0)
    k_pages, v_pages = (torch.randn(20_000, PAGE, kv_heads, head_dim, generator=gen).bfloat16()
                        for _ in range(2))
    indices = torch.randperm(20_000, generator=gen)[: seqs * pages_each].to(torch.int32)
    indptr = torch.arange(0, seqs * pages_each + 1, pages_each, dtype=torch.int32)
    seq_lens = torch.full((seqs,), keys, dtype=torch.int32)
    q_indptr = torch.arange(0, seqs * rows + 1, rows, dtype=torch.int32)
    q = torch.randn(seqs * rows, heads, head_dim, generator=gen).bfloat16()
    scale = head_dim**-0.5
    span = pages_each * PAGE
    allowed = torch.arange(span)[None, :] <= torch.arange(keys - rows, keys)[:, None]
    mask = None if cached == 0 else torch.zeros(rows, span, dtype=torch.bfloat16).masked_fill_(
        ~allowed, float("-inf")).expand(seqs, 1, rows, span)
    q4 = q.view(seqs, rows, heads, head_dim).transpose(1, 2)
    table = indices.long()

    def sdpa() -> torch.Tensor:
        k, v = (pages.index_select(0, table).view(seqs, span, kv_heads, head_dim).transpose(1, 2)
                for pages in (k_pages, v_pages))
        out = F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, is_causal=mask is None,
                                             scale=scale, enable_gqa=kv_heads != heads)
        return out.transpose(1, 2).reshape(q.shape)

    def kernel() -> torch.Tensor:
        return op(q, k_pages, v_pages, indptr, indices, seq_lens, 0, scale, None, q_indptr)[0]

    diff = (kernel().float() - sdpa().float()).abs().max().item()
    repeats = max(5, min(200, int(2e8 / (seqs * rows * keys * heads * head_dim))))
    for fn in (kernel, sdpa):
        median_ms(fn, 3)
    a1, b1 = median_ms(kernel, repeats), median_ms(sdpa, repeats)
    b2, a2 = median_ms(sdpa, repeats), median_ms(kernel, repeats)
    a, b = (a1 + a2) / 2, (b1 + b2) / 2
    return (f"| {seqs} x {rows} over {cached} cached | {a:.3f} ms | {b:.3f} ms | {a / b:.2f}x | "
            f"{diff:.4f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--shapes", default=SHAPES, help="BxE+C, comma-separated")
    args = parser.parse_args(argv)
    op = extend_attention_op()
    if op is None:
        raise SystemExit("no extend kernel here: the CPU or torch's build has no bf16 brgemm")
    print(f"{args.heads} query heads, {args.kv_heads} KV heads, head_dim {args.head_dim}, bf16, "
          f"{torch.get_num_threads()} threads")
    print("| shape | kernel | gather + SDPA | ratio | max difference |\n|---|---:|---:|---:|---:|")
    for shape in args.shapes.split(","):
        batch, rest = shape.split("x")
        rows, cached = rest.split("+")
        print(compare(op, args.heads, args.kv_heads, args.head_dim, int(batch), int(rows),
                      int(cached)), flush=True)


if __name__ == "__main__":
    main()
