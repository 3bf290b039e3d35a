"""Extend attention alone: the compiled extend kernel against gather + SDPA, by shape.

    python scripts/bench_extend_attention.py [--heads 9] [--kv-heads 3] [--head-dim 64]
        [--shapes 8x32+512,1x512+0,...] [--baseline REV]

One layer's attention for B sequences each adding E query rows over C cached tokens (a shape
``BxE+C``), bf16, pages of 16 drawn at random from a pool of 20,000 (as a served pool's are):
``torch.ops.radixserve.extend_attention`` (csrc/extend_attention.cpp) against the torch
backend's other path, the pages gathered dense by ``index_select`` and torch's SDPA with an
additive causal mask (its built-in causal mask when nothing is cached). ABBA, on
``torch.get_num_threads()`` threads; prints each median and the ratio, and the largest
difference between the two outputs. ``--baseline REV`` also times the extend kernel of git
revision REV (its csrc/extend_attention.cpp and the headers it includes, built into a temporary
directory) in the same ABBA rounds, and prints the current kernel's time over it.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.worker.cpu_kernels import _CFLAGS, _LDFLAGS, extend_attention_op  # noqa: E402

SHAPES = "8x32+512,8x18+512,1x32+512,8x64+512,8x32+2048,4x128+512,8x32+0,2x256+0,1x512+0,1x2048+0"
PAGE = 16


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def baseline_op(rev: str):
    """``extend_attention`` as revision ``rev`` wrote it, under ops namespace
    ``radixserve_baseline``."""
    root = Path(__file__).resolve().parents[1]
    source = Path(tempfile.mkdtemp(prefix="extend-baseline-"))
    wanted, seen = ["extend_attention.cpp"], set()
    while wanted:
        name = wanted.pop()
        seen.add(name)
        text = subprocess.run(["git", "show", f"{rev}:engine/worker/csrc/{name}"], cwd=root,
                              capture_output=True, text=True, check=True).stdout
        (source / name).write_text(text)
        wanted += [h for h in re.findall(r'^#include "([^"]+)"', text, re.M) if h not in seen]
    from torch.utils.cpp_extension import load

    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
    load(name="extend_baseline", sources=[str(source / "extend_attention.cpp")],
         build_directory=str(source), is_python_module=False,
         extra_cflags=[*_CFLAGS, "-DRADIXSERVE_OPS_NAMESPACE=radixserve_baseline"],
         extra_ldflags=list(_LDFLAGS))
    return torch.ops.radixserve_baseline.extend_attention


def compare(op, heads: int, kv_heads: int, head_dim: int, seqs: int, rows: int, cached: int,
            baseline=None) -> str:
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

    def before() -> torch.Tensor:
        return baseline(q, k_pages, v_pages, indptr, indices, seq_lens, 0, scale, None,
                        q_indptr)[0]

    diff = (kernel().float() - sdpa().float()).abs().max().item()
    repeats = max(5, min(200, int(2e8 / (seqs * rows * keys * heads * head_dim))))
    fns = [kernel, sdpa] + ([before] if baseline is not None else [])
    for fn in fns:
        median_ms(fn, 3)
    times = {fn: [] for fn in fns}
    for order in (fns, fns[::-1]):
        for fn in order:
            times[fn].append(median_ms(fn, repeats))
    a, b = (sum(times[fn]) / 2 for fn in (kernel, sdpa))
    line = (f"| {seqs} x {rows} over {cached} cached | {a:.3f} ms | {b:.3f} ms | {a / b:.2f}x | "
            f"{diff:.4f} |")
    if baseline is not None:
        c = sum(times[before]) / 2
        line += f" {c:.3f} ms | {a / c:.2f}x |"
    return line


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--shapes", default=SHAPES, help="BxE+C, comma-separated")
    parser.add_argument("--baseline", default=None, metavar="REV",
                        help="a git revision whose kernel to time too (default: none)")
    args = parser.parse_args(argv)
    op = extend_attention_op()
    if op is None:
        raise SystemExit("no extend kernel here: the CPU or torch's build has no bf16 brgemm")
    print(f"{args.heads} query heads, {args.kv_heads} KV heads, head_dim {args.head_dim}, bf16, "
          f"{torch.get_num_threads()} threads")
    baseline = baseline_op(args.baseline) if args.baseline else None
    head = "| shape | kernel | gather + SDPA | ratio | max difference |"
    rule = "|---|---:|---:|---:|---:|"
    if baseline is not None:
        head, rule = head + f" kernel at {args.baseline} | kernel / it |", rule + "---:|---:|"
    print(f"{head}\n{rule}")
    for shape in args.shapes.split(","):
        batch, rest = shape.split("x")
        rows, cached = rest.split("+")
        print(compare(op, args.heads, args.kv_heads, args.head_dim, int(batch), int(rows),
                      int(cached), baseline), flush=True)


if __name__ == "__main__":
    main()
