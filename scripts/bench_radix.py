"""Radix-tree micro-benchmark on a synthetic multi-turn chat workload.

Drives the tree the way the scheduler does, through a lease per request (radix/lease.py):
lease at most len - 1 tokens (match, lock), acquire a table for prompt + output (evicting
when short), commit the prompt once it is prefilled, release with prompt + output (insert,
unlock). Reports the median cost of each step (acquires that evicted apart), then compares
the tokens it reuses with a whole-block hash cache (vLLM's scheme: 16-token blocks chained by
hash, LRU) of the same capacity on the same requests.

    python scripts/bench_radix.py [--conversations 2400 --turns 8 --slots 786432 --page-size 16 1]

Each page size gets the same capacity in token slots (``--slots``), so eviction runs alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from engine.profiler.baselines import run_block_hash
from engine.profiler.workload import MultiTurnParams, multi_turn
from radix import Lease, PageAllocator, RadixTree


def multi_turn_workload(conversations: int, turns: int, seed: int) -> list[tuple]:
    """The profiler's multi-turn draw (engine/profiler/workload.py) in arrival order, the
    conversations interleaved: each request re-sends its conversation's history plus a new
    turn, and its reply joins the history. (prompt, prompt + reply) per request."""
    rng = np.random.default_rng(seed)
    params = MultiTurnParams(conversations=conversations, turns=turns, systems=16,
                             system_len=250, turn_len=28, output_len=36, rate=4.0)
    drafts = multi_turn(params, rng, lambda n: rng.integers(0, 32000, n, dtype=np.int32))
    drafts.sort(key=lambda d: d.arrival)
    return [(d.prompt, np.concatenate([d.prompt, d.output])) for d in drafts]


STEPS = ("lease", "acquire", "acquire+evict", "commit", "release")


def run_radix(requests, num_pages: int, page_size: int) -> dict:
    alloc = PageAllocator(num_pages, page_size)
    tree = RadixTree(alloc)
    times: dict[str, list[int]] = {step: [] for step in STEPS}
    hit_tokens = prompt_tokens = 0
    peak_nodes = 0
    clock = time.perf_counter_ns
    for prompt, full in requests:
        t0 = clock()
        lease = Lease(tree, prompt, max_len=len(prompt) - 1)
        t1 = clock()
        evicted = tree.stats.evicted_pages
        pages, copy = lease.acquire(len(full))
        t2 = clock()
        if copy is not None:
            alloc.decref([copy.src])  # the worker ran the copy
        t3 = clock()
        lease.commit(pages, prompt)
        t4 = clock()
        lease.release(pages, full)
        t5 = clock()
        times["lease"].append(t1 - t0)
        step = "acquire+evict" if tree.stats.evicted_pages > evicted else "acquire"
        times[step].append(t2 - t1)
        times["commit"].append(t4 - t3)
        times["release"].append(t5 - t4)
        hit_tokens += lease.length
        prompt_tokens += len(prompt)
        peak_nodes = max(peak_nodes, tree.num_nodes)
    tree.check()
    return {
        **times, "hit": hit_tokens, "prompt": prompt_tokens, "peak_nodes": peak_nodes,
        "cached_tokens": num_pages * page_size - alloc.num_free_pages * page_size,
        "evicted_pages": tree.stats.evicted_pages,
    }


def micros(samples: list[int]) -> tuple[float, float]:
    if not samples:
        return float("nan"), float("nan")
    return statistics.median(samples) / 1e3, float(np.percentile(samples, 99)) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=2400)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--slots", type=int, default=786432, help="cache capacity in token slots")
    ap.add_argument("--page-size", type=int, nargs="+", default=[16, 1])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    requests = multi_turn_workload(args.conversations, args.turns, args.seed)
    total_prompt = sum(len(p) for p, _ in requests)
    print(f"workload: {len(requests)} requests, {total_prompt:,} prompt tokens, "
          f"cache {args.slots:,} slots")
    results = {}
    for page_size in args.page_size:
        results[page_size] = result = run_radix(requests, args.slots // page_size, page_size)
        print(f"page {page_size}: peak {result['peak_nodes']:,} nodes, "
              f"{result['cached_tokens']:,} tokens cached at end, "
              f"{result['evicted_pages'] * page_size:,} tokens evicted")
    print()
    print("| page | op | calls | median µs | p99 µs | ops/s (1 / median) |")
    print("|---:|---|---:|---:|---:|---:|")
    for page_size, result in results.items():
        for op in STEPS:
            med, p99 = micros(result[op])
            print(f"| {page_size} | {op} | {len(result[op]):,} | {med:.1f} | {p99:.1f} | "
                  f"{1e6 / med:,.0f} |")

    block_hits = run_block_hash(requests, args.slots // 16)
    print()
    print("| cache (same capacity) | hit tokens | hit rate |")
    print("|---|---:|---:|")
    for page_size, result in results.items():
        print(f"| radix tree, page {page_size}, token-granular | {result['hit']:,} | "
              f"{result['hit'] / total_prompt:.2%} |")
    print(f"| block hash, 16-token blocks | {block_hits:,} | {block_hits / total_prompt:.2%} |")


if __name__ == "__main__":
    main()
