"""Prefix-hit-rate profiling: request traces, workload generators, and replays of a trace
through the radix tree (offline) or against an OpenAI-compatible server (live).

    trace.py        the JSONL trace format, reading, writing, tokenizing
    mooncake.py, bailian.py   Mooncake's and Alibaba Bailian's traces of hashed token blocks
    block_trace.py  what those two share: line checks, blocks expanded into token ids
    workload.py     synthetic traces: shared-prefix, multi-turn, tree, few-shot, random
    simulate.py     offline replay through ``radix`` at a cache size, page size and policy
    baselines.py    whole-block hash caching (vLLM's scheme)
    attribution.py  misses split into cold, evicted, short heads and block granularity
    kv_bytes.py     bytes per cached token from a model's shape: sizes in GiB, int8 vs 16-bit
    sliding.py      sliding-window layers' own pool beside the cache (--sliding-kv-ratio)
    report.py       terminal tables, CSV (per request, session, namespace, window) and JSON
    plots.py        PNG plots
    live.py         replay against a server; measured hit rate and TTFT
    command.py, workload_command.py   the ``radixserve profile`` / ``workload`` subcommands

Nothing here imports torch: profiling runs where no model can. (Text traces load a tokenizer
through transformers, which imports torch where it is installed.)
"""
