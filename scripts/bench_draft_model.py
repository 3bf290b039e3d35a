"""Speculative decoding with a draft model (``--speculative-config '{"model": ...}'``) against
none, side by side in one run: in-process engines of the same model, one request at a time,
coding prompts that rewrite given code and that write new code, greedy, ``--max-tokens`` out
(``--in-flight`` N: N prompts sent at once, the list wrapping around).
The engines take turns request by request (ABBA over the repeats); each request's output
tok/s is its tokens over the time from sending it to its last token, its decode tok/s over the
time from its first token to its last; medians by prompt kind, the ratios, and whether the
greedy outputs were identical. The same prompts over HTTP to running servers (radixserve's,
llama.cpp's): scripts/bench_draft_servers.py.

    python scripts/bench_draft_model.py \\
        --model ~/.cache/radixserve/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --draft ~/.cache/radixserve/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CODE = [
    "def mean(xs):\n    total = 0\n    for x in xs:\n        total = total + x\n"
    "    return total / len(xs)\n",
    "def find_user(users, name):\n    for u in users:\n        if u['name'] == name:\n"
    "            return u\n    return None\n",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n"
    "        if word in counts:\n            counts[word] += 1\n        else:\n"
    "            counts[word] = 1\n    return counts\n",
    "def read_config(path):\n    f = open(path)\n    lines = f.readlines()\n    f.close()\n"
    "    config = {}\n    for line in lines:\n        key, value = line.strip().split('=')\n"
    "        config[key] = value\n    return config\n",
]
REWRITE = ["Rewrite this Python function with type hints and a docstring:\n\n{}",
           "Rewrite this function to be more idiomatic Python, keeping its behaviour:\n\n{}"]
NEW = ["Write a Python function that checks whether a string is a palindrome, ignoring case "
       "and punctuation.",
       "Write a Python class for a stack with push, pop, peek and is_empty methods.",
       "Write a Python function that merges two sorted lists into one sorted list.",
       "Write a Python function that returns the n-th Fibonacci number iteratively.",
       "Write a JavaScript function that debounces another function.",
       "Write a Python function that parses an ISO date string into a datetime.date."]


def prompts() -> list[tuple[str, str]]:
    """(kind, prompt): rewrites of given code, then new code."""
    rewrite = [("rewrite", form.format(code)) for code in CODE for form in REWRITE]
    return rewrite + [("new", text) for text in NEW]


def group(engine, prompts: list[str], max_tokens: int) -> list[dict]:
    """``prompts`` sent at once; each one's tokens and speeds."""
    from engine.contracts.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)

    async def run(prompt: str) -> dict:
        sent = time.perf_counter()
        first = last = None
        ids: list[int] = []
        async for out in engine.stream([{"role": "user", "content": prompt}], params):
            if out.token_ids:
                last = time.perf_counter()
                first = first or last
                ids.extend(np.frombuffer(out.token_ids, dtype=np.int32).tolist())
        return {"ids": ids, "out_tok_s": len(ids) / (last - sent),
                "decode_tok_s": (len(ids) - 1) / (last - first) if last > first else None}

    async def every() -> list[dict]:
        return list(await asyncio.gather(*(run(p) for p in prompts)))

    return engine._call(every())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True, help="the draft model (checkpoint or .gguf)")
    ap.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    ap.add_argument("--extra", default="{}", help="more --speculative-config keys, as JSON")
    ap.add_argument("--engine", default="{}",
                    help="more engine options of both engines (EngineConfig keys), as JSON, "
                         "e.g. '{\"linear_form\": \"blocks\"}'")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="passes over the prompts")
    ap.add_argument("--limit", type=int, default=None, help="prompts of each kind at most")
    ap.add_argument("--in-flight", type=int, default=1, help="requests sent at once")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from engine.runtime.offline import Engine

    spec = {"model": args.draft, "num_speculative_tokens": args.k, **json.loads(args.extra)}
    options = json.loads(args.engine)
    engines = {"off": Engine(args.model, **options), "draft": Engine(
        args.model, speculative_config=json.dumps(spec), **options)}
    work = prompts()
    if args.limit:
        work = [p for kind in ("rewrite", "new")
                for p in [q for q in work if q[0] == kind][: args.limit]]
    results: dict[str, dict[str, list[dict]]] = {n: {"rewrite": [], "new": []} for n in engines}
    try:
        for name in engines:  # warm-up, untimed
            group(engines[name], [work[0][1]], 16)
        width = args.in_flight
        for repeat in range(args.repeats):
            for i in range(0, len(work), width):
                part = [work[(i + j) % len(work)] for j in range(width)]
                order = list(engines) if (i // width + repeat) % 2 == 0 else list(engines)[::-1]
                for name in order:
                    outs = group(engines[name], [p for _, p in part], args.max_tokens)
                    for (kind, _), out in zip(part, outs, strict=True):
                        results[name][kind].append(out)
        time.sleep(1.5)  # the scheduler's counters reach the client between steps
        stats = {k: v for k, v in msgspec.structs.asdict(engines["draft"].client.stats).items()
                 if k.startswith("spec_")}
    finally:
        for engine in engines.values():
            engine.close()
    report = []
    for kind in ("rewrite", "new", "all"):
        def pick(name: str, key: str, kind: str = kind) -> float:
            rows = [r for k, v in results[name].items() if kind in (k, "all") for r in v]
            return statistics.median(r[key] for r in rows if r[key])
        same = all(a["ids"] == b["ids"] for k in results["off"] if kind in (k, "all")
                   for a, b in zip(results["off"][k], results["draft"][k], strict=True))
        row = {"kind": kind, "requests": sum(len(v) for k, v in results["off"].items()
                                             if kind in (k, "all")), "identical": same}
        for key in ("out_tok_s", "decode_tok_s"):
            off, draft = pick("off", key), pick("draft", key)
            row.update({f"off_{key}": round(off, 2), f"draft_{key}": round(draft, 2),
                        f"{key}_ratio": round(draft / off, 3)})
        report.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps(stats))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
