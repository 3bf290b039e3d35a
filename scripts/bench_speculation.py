"""Speculative decoding (``--speculative-config``) measured on this machine.

``--cost``: what verifying drafts costs in the model runner. For each batch size B, the median
time of a decode step (B sequences x 1 token), of verify steps (B x (1 + K) tokens, the same
sequences, K + 1 logits rows each) for each K of ``--ks`` by the compiled kernel and by the
general extend path, and of an extend of the same tokens (one logits row each), with their
ratios to the decode step: drafting pays while the tokens a verification emits per sequence
(1 + mean accepted drafts) exceed the verify's ratio.

``--serve`` (default): in-process engines, speculation off and one per ``--methods`` (ngram,
suffix), their order rotating over ``--repeats``, on workloads whose outputs repeat their
inputs, and on ordinary chat::

    repeat      "Repeat this passage exactly" + a passage (chat, greedy)
    recall      a 2-turn chat: turn 1 asks for a passage rewritten, turn 2 asks for the
                previous answer again (the second turn's output repeats the first's)
    chat        ordinary questions (a poem, tips, an explanation): answers that do not copy
                the prompt, where drafting must not make decoding slower

at each ``--in-flight`` level; reports per-request output tok/s (output tokens over the time
from the request's first to its last token; median over requests), drafts accepted, and
whether greedy outputs were identical; and the same ratio over the requests whose reply copies
its prompt (``copying``: at least 80% of the reply's word 4-grams are in the prompt; a small
model paraphrases some passages it is asked to repeat).

``--url URL`` (any OpenAI-compatible server, e.g. vLLM with its own ``--speculative-config``):
the ``repeat`` prompts one at a time over HTTP, four to warm up, then the same four passages
again; the median per-request output tokens/s (first to last streamed token).

    python scripts/bench_speculation.py --cost --batches 1 4 16 --ks 2 4 8
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

SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 4,
        "prompt_lookup_max": 4}
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


# Ordinary chat: questions whose answers do not copy the prompt (speculation must not slow it);
# each round asks questions no earlier round asked (the suffix method drafts from cached answers).
FORMS = ["Write a short poem about {}.", "Give me three practical tips about {}.",
         "Explain {} to a ten-year-old.", "What are the pros and cons of {}?"]
TOPICS = ["staying healthy in winter", "learning the guitar as an adult", "a weekend hiking trip",
          "how a bicycle works", "cooking with rice and spinach", "keeping a diary",
          "saving money on groceries", "training a puppy", "growing tomatoes on a balcony",
          "working from home", "learning a second language", "visiting a museum"]
QUESTIONS = [form.format(topic) for topic in TOPICS for form in FORMS]


# ------------------------------------------------------------------------------- --cost
def cost(args: argparse.Namespace) -> list[dict]:
    """Step times in the model runner, per batch size: a decode step, and for each K in
    ``--ks`` a verify step (K drafts + the last token a sequence, K + 1 logits rows) through
    the compiled paged kernel, the same verify through the general extend path (gather + SDPA,
    what verify steps took before), and an extend of the same K + 1 tokens with one logits
    row (a prefill chunk; the kernel's path too, as the engine runs extends of up to 17
    tokens). The step kinds of one batch size run round-robin, so that all see the same load;
    medians."""
    import torch

    from engine.checkpoints.model_source import resolve_model
    from engine.contracts.engine_config import EngineConfig
    from engine.contracts.step import StepBuilder
    from engine.worker.attention import torch_native
    from engine.worker.runner import ModelRunner

    source = resolve_model(args.model)
    runner = ModelRunner(EngineConfig(model=source.path, num_pages=4096, page_size=16,
                                      quantization=args.quantization, dtype=args.dtype))
    context, page = args.context, 16
    per_seq = -(-(context + max(args.ks) + 1) // page)
    rng = np.random.default_rng(0)
    paged_max = torch_native.PAGED_MAX_EXTEND

    def batch_of(size: int, new: int, verify: bool):
        builder = StepBuilder(page)
        for i in range(size):
            pages = list(range(i * per_seq, (i + 1) * per_seq))
            builder.add(pages, context, rng.integers(3, 1000, new).tolist(),
                        num_drafts=new - 1 if verify else 0)
        return builder.finish()

    def timed(b, path: str) -> float:
        torch_native.PAGED_MAX_EXTEND = paged_max if path == "paged" else 1
        start = time.perf_counter()
        runner.forward(b).float().sum().item()
        return time.perf_counter() - start

    if args.draft_vocab:
        from engine.worker.draft_vocab import DraftVocab

        DraftVocab(runner.model, args.draft_vocab)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    runner._max_threads = runner._threads = args.threads
    # fill the pages once: a prefill of every sequence's context
    for i in range(max(args.batches)):
        builder = StepBuilder(page)
        builder.add(list(range(i * per_seq, (i + 1) * per_seq)), 0,
                    rng.integers(3, 1000, context).tolist())
        runner.forward(builder.finish())
    head = f", LM head over the first {args.draft_vocab} ids" if args.draft_vocab else ""
    print(f"{source.name} ({', '.join(runner.weight_formats)} weights, {runner.dtype}{head}), "
          f"context {context}, {args.threads} thread(s); ms per step (median of {args.iters}); "
          "ratios to the decode step")
    rows = []
    for size in args.batches:
        kinds = {"decode": (batch_of(size, 1, False), "paged")}
        for k in args.ks:
            kinds[f"verify{k}"] = (batch_of(size, k + 1, True), "paged")
            kinds[f"verify{k}_extend_path"] = (batch_of(size, k + 1, True), "sdpa")
            kinds[f"extend{k + 1}"] = (batch_of(size, k + 1, False), "paged")
        for b, path in kinds.values():
            timed(b, path)
        times: dict[str, list[float]] = {name: [] for name in kinds}
        for _ in range(args.iters):
            for name, (b, path) in kinds.items():
                times[name].append(timed(b, path))
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        row = {"batch": size, **{f"{n}_ms": round(t, 2) for n, t in med.items()}}
        rows.append(row)
        print(f"batch {size}: decode {med['decode']:.1f} ms")
        for k in args.ks:
            d = med["decode"]
            print(f"  K={k}: verify {med[f'verify{k}']:.1f} ({med[f'verify{k}'] / d:.2f}x), "
                  f"verify by the extend path {med[f'verify{k}_extend_path']:.1f} "
                  f"({med[f'verify{k}_extend_path'] / d:.2f}x), extend of {k + 1} tokens "
                  f"{med[f'extend{k + 1}']:.1f} ({med[f'extend{k + 1}'] / d:.2f}x)", flush=True)
    torch_native.PAGED_MAX_EXTEND = paged_max
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
        elif workload == "chat":
            order = np.random.default_rng(12345).permutation(len(QUESTIONS))
            out.append([QUESTIONS[order[(seed * count + len(out)) % len(QUESTIONS)]]])
        else:
            out.append([f"Rewrite this passage in your own words:\n\n{passage}",
                        "Now write your previous answer again, exactly as you wrote it."])
    return out


COPIED = 0.8  # a reply copies its prompt when this share of its word 4-grams is in the prompt


def copied(reply: str, prompt: str, n: int = 4) -> float:
    """The share of ``reply``'s word ``n``-grams that ``prompt`` holds (0 for a short reply)."""
    def grams(text: str) -> list[tuple[str, ...]]:
        words = text.split()
        return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]

    have, want = set(grams(prompt)), grams(reply)
    return sum(g in have for g in want) / len(want) if want else 0.0


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
        results.append({"ids": ids, "tok_s": (len(ids) - 1) / span if span else None,
                        "copies": copied(reply, turn) >= COPIED})
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
    if args.worker_threads:
        common["worker_threads"] = args.worker_threads
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
                copying: dict[str, list[float]] = {name: [] for name in engines}
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
                            # the requests whose reply (without drafts) copies its prompt
                            copying[name] += [r["tok_s"] for r, off in zip(
                                outs[name], outs["off"], strict=True)
                                if r["tok_s"] and off["copies"]]
                med = {n: statistics.median(v) for n, v in speeds.items()}
                row = {"workload": workload, "in_flight": in_flight, "requests": count,
                       "off_tok_s": med["off"], "copying_requests": len(copying["off"])}
                for method in args.methods:
                    row[f"{method}_tok_s"] = med[method]
                    row[f"{method}_ratio"] = med[method] / med["off"]
                    row[f"{method}_identical"] = identical[method]
                    if copying["off"] and copying[method]:
                        row[f"{method}_copying_ratio"] = (statistics.median(copying[method])
                                                          / statistics.median(copying["off"]))
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
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8],
                    help="drafts per sequence (--cost)")
    ap.add_argument("--quantization", default="auto", help="the weights' format (--cost)")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="--cost: the LM head over this many first ids, as a draft model's "
                         "draft_vocab_size makes it (0: the whole head)")
    ap.add_argument("--k", type=int, default=5, help="drafts per sequence (--serve)")
    ap.add_argument("--context", type=int, default=300, help="tokens cached per sequence")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (--cost); one is "
                    "steadier on a machine others share")
    ap.add_argument("--workloads", nargs="+", choices=["repeat", "recall", "chat"],
                    default=["repeat", "recall"])
    ap.add_argument("--in-flight", type=int, nargs="+", default=[1, 4, 32])
    ap.add_argument("--min-requests", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2, help="timed rounds (after a warm-up)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--num-pages", type=int, default=4096)
    ap.add_argument("--pause", type=float, default=1.0, help="idle seconds before each run")
    ap.add_argument("--url", default=None, help="time this server's replies instead (remote)")
    ap.add_argument("--dtype", default=None, help="the model's dtype (default: the engine's)")
    ap.add_argument("--worker-threads", type=int, default=None,
                    help="the engines' worker threads (default: the engine's, every core)")
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
