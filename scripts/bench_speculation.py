"""Speculative decoding (``--speculative-config``) measured on this machine.

``--cost``: what verifying drafts costs in the model runner. For each batch size B, the median
time of a decode step (B sequences x 1 token) and of a verify step (B x (1 + K) tokens, the
same sequences), and their ratio: drafting pays while the tokens a verification emits per
sequence (1 + mean accepted drafts) exceed it. Where the ratio passes ~2 (one accepted draft in
two no longer pays), drafting should stop: ``disable_by_batch_size``.

``--serve`` (default): in-process engines, speculation off and one per ``--methods`` (ngram,
suffix), their order rotating over ``--repeats``, on workloads whose outputs repeat their
inputs::

    repeat      "Repeat this passage exactly" + a passage (chat, greedy)
    recall      a 2-turn chat: turn 1 asks for a passage rewritten, turn 2 asks for the
                previous answer again (the second turn's output repeats the first's)

at each ``--in-flight`` level; reports per-request output tok/s (output tokens over the time
from the request's first to its last token; median over requests), drafts accepted, and
whether greedy outputs were identical.

``--url URL`` (any OpenAI-compatible server, e.g. vLLM with its own ``--speculative-config``):
the ``repeat`` prompts one at a time over HTTP, four to warm up, then the same four passages
again; the median per-request output tokens/s (first to last streamed token).

    python scripts/bench_speculation.py --cost
    python scripts/bench_speculation.py --in-flight 1 4 32 --repeats 2
    python scripts/bench_speculation.py --url http://127.0.0.1:8100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import numpy as np

SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
        "prompt_lookup_max": 5}
PASSAGES = [
    "The river bends twice before it reaches the old mill, where the water slows and turns "
    "green under the willows. Children from the village come there in summer to fish for "
    "perch, and the miller's dog watches them from the bank.",
    "To reset the router, hold the power button for ten seconds until the light blinks "
    "amber, then release it and wait two minutes. The network name and password return to "
    "the values printed on the label underneath.",
    "Our quarterly revenue grew by eight percent, driven mostly by the new subscription plan. "
    "Costs rose by three percent because of hiring in the support team, and the margin "
    "improved to twenty-one percent.",
    "def merge(left, right):\n    out = []\n    while left and right:\n        out.append("
    "left.pop(0) if left[0] <= right[0] else right.pop(0))\n    return out + left + right\n",
]


# ------------------------------------------------------------------------------- --cost
def cost(args: argparse.Namespace) -> list[dict]:
    import torch

    from engine.checkpoints.model_source import resolve_model
    from engine.contracts.engine_config import EngineConfig
    from engine.contracts.step import StepBuilder
    from engine.worker.runner import ModelRunner

    source = resolve_model(args.model)
    runner = ModelRunner(EngineConfig(model=source.path, num_pages=4096, page_size=16))
    context, k, page = args.context, args.k, 16
    rng = np.random.default_rng(0)

    def batch_of(size: int, new: int):
        builder = StepBuilder(page)
        for i in range(size):
            pages = list(range(i * 40, i * 40 + 40))
            builder.add(pages, context, rng.integers(3, 1000, new).tolist(), num_drafts=new - 1)
        return builder.finish()

    def timed(b) -> float:
        start = time.perf_counter()
        runner.forward(b).float().sum().item()
        return time.perf_counter() - start

    def pair(size: int) -> tuple[float, float]:
        """Decode and verify steps alternating (so both see the same load), medians."""
        decode_batch, verify_batch = batch_of(size, 1), batch_of(size, 1 + k)
        timed(decode_batch), timed(verify_batch)
        times = [(timed(decode_batch), timed(verify_batch)) for _ in range(args.iters)]
        return tuple(statistics.median(t[j] for t in times) for j in (0, 1))

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    runner._max_threads = runner._threads = args.threads
    # fill the pages once: a prefill of every sequence's context
    builder = StepBuilder(page)
    for i in range(max(args.batches)):
        builder.add(list(range(i * 40, i * 40 + 40)), 0, rng.integers(3, 1000, context).tolist())
    runner.forward(builder.finish())
    print(f"{source.name}, context {context}, K = {k}, {args.threads} thread(s); ms per step "
          f"(median of {args.iters})")
    print(f"{'batch':>5} {'decode':>8} {'verify':>8} {'ratio':>6}")
    rows = []
    for batch in args.batches:
        decode, verify = pair(batch)
        rows.append({"batch": batch, "decode_ms": decode * 1e3, "verify_ms": verify * 1e3,
                     "ratio": verify / decode})
        print(f"{batch:>5} {decode * 1e3:>8.1f} {verify * 1e3:>8.1f} {verify / decode:>6.2f}")
    return rows


# ------------------------------------------------------------------------------ --serve
def conversations(workload: str, count: int, seed: int) -> list[list[str]]:
    """Each conversation's user turns."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        passage = PASSAGES[int(rng.integers(len(PASSAGES)))]
        if workload == "repeat":
            out.append([f"Repeat this passage exactly, word for word:\n\n{passage}"])
        else:
            out.append([f"Rewrite this passage in your own words:\n\n{passage}",
                        "Now write your previous answer again, exactly as you wrote it."])
    return out


async def converse(engine, turns: list[str], max_tokens: int) -> list[dict]:
    from engine.contracts.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    messages: list[dict] = []
    results = []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        first = last = None
        ids: list[int] = []
        text = []
        async for out in engine.stream(list(messages), params):
            now = time.perf_counter()
            if out.token_ids:
                first = first or now
                last = now
                ids.extend(np.frombuffer(out.token_ids, dtype=np.int32).tolist())
            text.append(out.text)
        reply = "".join(text)
        messages.append({"role": "assistant", "content": reply})
        span = (last - first) if first and last and last > first else None
        results.append({"ids": ids, "tok_s": (len(ids) - 1) / span if span else None})
    return results


async def serve_round(engine, convs: list[list[str]], in_flight: int,
                      max_tokens: int) -> list[dict]:
    gate = asyncio.Semaphore(in_flight)

    async def one(turns):
        async with gate:
            return await converse(engine, turns, max_tokens)

    return [r for rs in await asyncio.gather(*(one(c) for c in convs)) for r in rs]


def serve(args: argparse.Namespace) -> list[dict]:
    from engine.runtime.offline import Engine

    common = dict(num_pages=args.num_pages, dtype=args.dtype)
    engines = {"off": Engine(args.model, **common)}
    for method in args.methods:
        spec = {**SPEC, "method": method} if method == "ngram" else {"method": method}
        spec["num_speculative_tokens"] = args.k
        engines[method] = Engine(args.model, speculative_config=json.dumps(spec), **common)
    report = []
    try:
        for workload in args.workloads:
            for in_flight in args.in_flight:
                count = max(in_flight, args.min_requests)
                speeds: dict[str, list[float]] = {name: [] for name in engines}
                identical = {method: True for method in args.methods}
                for repeat in range(args.repeats + 1):  # round 0 warms up, untimed
                    convs = conversations(workload, count, seed=repeat)
                    order = list(engines)[repeat % len(engines):] + list(engines)[
                        :repeat % len(engines)]
                    outs = {}
                    for name in order:
                        time.sleep(args.pause)
                        outs[name] = engines[name]._call(
                            serve_round(engines[name], convs, in_flight, args.max_tokens))
                    for method in args.methods:
                        identical[method] &= ([r["ids"] for r in outs["off"]]
                                              == [r["ids"] for r in outs[method]])
                    if repeat:
                        for name in order:
                            speeds[name] += [r["tok_s"] for r in outs[name] if r["tok_s"]]
                med = {n: statistics.median(v) for n, v in speeds.items()}
                row = {"workload": workload, "in_flight": in_flight, "requests": count,
                       "off_tok_s": med["off"]}
                for method in args.methods:
                    row[f"{method}_tok_s"] = med[method]
                    row[f"{method}_ratio"] = med[method] / med["off"]
                    row[f"{method}_identical"] = identical[method]
                report.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    return report


def remote(args: argparse.Namespace) -> None:
    import httpx

    model = httpx.get(f"{args.url}/v1/models").json()["data"][0]["id"]
    speeds = []
    for i, passage in enumerate(PASSAGES[:4] * 2):
        body = {"model": model, "temperature": 0.0, "max_tokens": args.max_tokens,
                "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "user",
                              "content": "Repeat this passage exactly:\n\n" + passage}]}
        first = last = None
        tokens = 0
        with httpx.stream("POST", f"{args.url}/v1/chat/completions", json=body,
                          timeout=600) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    last = time.perf_counter()
                    first = first or last
        if i >= 4 and first is not None and last > first:
            speeds.append((tokens - 1) / (last - first))
    print(json.dumps({"url": args.url, "tok_s": statistics.median(speeds)}))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--cost", action="store_true", help="verify vs decode step times")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--k", type=int, default=5, help="drafts per sequence")
    ap.add_argument("--context", type=int, default=300, help="tokens cached per sequence")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (--cost); one is "
                    "steadier on a machine others share")
    ap.add_argument("--workloads", nargs="+", choices=["repeat", "recall"],
                    default=["repeat", "recall"])
    ap.add_argument("--in-flight", type=int, nargs="+", default=[1, 4, 32])
    ap.add_argument("--min-requests", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2, help="timed rounds (after a warm-up)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--num-pages", type=int, default=4096)
    ap.add_argument("--pause", type=float, default=1.0, help="idle seconds before each run")
    ap.add_argument("--url", default=None, help="time this server's replies instead (remote)")
    ap.add_argument("--dtype", default=None, help="the model's dtype (default: the engine's)")
    ap.add_argument("--methods", nargs="+", choices=["ngram", "suffix"],
                    default=["ngram", "suffix"], help="speculation methods against none")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.url:
        return remote(args)
    rows = cost(args) if args.cost else serve(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
