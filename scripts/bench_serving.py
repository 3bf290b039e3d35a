"""Serving benchmark: one or two OpenAI-compatible servers side by side, same traffic.

Every request is a token-id prompt sent to ``/v1/completions``, streamed with usage, greedy
(temperature 0), a fixed ``max_tokens`` and ``ignore_eos`` where the server accepts it.

Workloads (sizes from the flags below)::

    shared-prefix  G groups x M prompts: [ head (H, one per group) | question (Q) ]
    no-sharing     the same sizes, every head drawn fresh: nothing to share
    multi-turn     C conversations x T turns, conversations concurrent, turns sequential:
                   turn 1  [ head H | user Q ]
                   turn k  [ turn k-1 prompt | the server's reply | user Q ]

Two servers alternate ABBA (repeat 0: A then B, repeat 1: B then A, ...), each timed run after
``--pause`` idle seconds and after one untimed warm-up round per server. Each repeat draws new
random prompts, seeded by (``--seed``, workload, repeat), so no repeat hits what the one before
it cached; within a repeat both servers get the same prompts (multi-turn: the same user turns;
the replies are each server's own).

A multi-turn reply goes back into the next prompt as token ids. A server that streams them
(vLLM's ``return_token_ids``) gives them exactly; otherwise the reply's text is encoded again
with ``--tokenizer`` (default: the model directory a server names in ``/v1/models``). Both
servers always use the same way, so neither gets exact ids while the other gets re-encoded text.
Re-encoded text need not give back the same ids (a random-weight model's replies mostly do not),
so then only part of each reply is a cache hit on the next turn, for both servers alike.

Reports per server and workload, medians over repeats: req/s, output tok/s, TTFT (send to the
first streamed chunk carrying a token) mean / median / p99, TPOT (median over requests of the
time per output token after the first), prompt and cached tokens (``usage.prompt_tokens_details
.cached_tokens``), failed requests; and the ratio A / B of each.

    python scripts/bench_serving.py --url http://127.0.0.1:30000 --name radixserve \\
        --url http://127.0.0.1:8100 --name vllm --json bench.json
    python scripts/bench_serving.py --url URL --repeats 1 --groups 2 --per-group 2 \\
        --head 16 --output-len 4 --conversations 2 --turns 2 --tokenizer MODEL_DIR  # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from engine.profiler.workload import grouped_prompt_ids

WORKLOADS = ("shared-prefix", "multi-turn", "no-sharing")
DEFAULT_VOCAB = 4096  # the demo model's
# Random ids stay clear of both ends of the vocabulary, where special tokens usually sit.
LOW_IDS, HIGH_IDS = 3, 64


# ---------------------------------------------------------------------------------- prompts
def grouped_prompts(rng: np.random.Generator, groups: int, per_group: int,
                    args: argparse.Namespace, vocab: int, shared: bool) -> list[list[int]]:
    """The profiler's shared-prefix draw (groups interleaved, as real traffic arrives): a head
    per group, or with ``shared`` False one per prompt."""
    return grouped_prompt_ids(rng, groups, per_group, args.head, args.question, LOW_IDS,
                              vocab - HIGH_IDS, shared)


def user_turns(rng: np.random.Generator, args: argparse.Namespace,
               vocab: int) -> list[list[list[int]]]:
    """Per conversation, the new tokens of each turn (the first carries the head). Not the
    profiler's multi-turn draw: here each conversation has a head of its own, every turn the
    same length, and the replies are the server's."""
    return [[rng.integers(LOW_IDS, vocab - HIGH_IDS,
                          args.head + args.question if turn == 0 else args.question).tolist()
             for turn in range(args.turns)] for _ in range(args.conversations)]


# ---------------------------------------------------------------------------------- servers
@dataclass
class RequestResult:
    ttft: float = 0.0  # seconds from sending to the first chunk carrying a token
    latency: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    text: str = field(default="", repr=False)
    token_ids: list[int] = field(default_factory=list, repr=False)


class Server:
    """One server under test: its client, model name and the optional fields it accepts."""

    def __init__(self, name: str, url: str, api_key: str | None, concurrency: int,
                 timeout: float) -> None:
        self.name, self.url = name, url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=concurrency + 4)
        self.client = httpx.AsyncClient(base_url=self.url, headers=headers, limits=limits,
                                        timeout=timeout)
        self.model = ""
        self.model_root: str | None = None
        self.extras: dict[str, bool] = {}

    async def probe(self) -> None:
        """Reads the model name; finds which of ``ignore_eos`` and ``return_token_ids`` the
        server accepts (a strict server answers 400 to a field it does not know)."""
        reply = await self.client.get("/v1/models")
        reply.raise_for_status()
        card = reply.json()["data"][0]
        self.model, self.model_root = card["id"], card.get("root")
        for extras in ({"ignore_eos": True, "return_token_ids": True}, {"ignore_eos": True}, {}):
            self.extras = extras
            result = await self.complete([LOW_IDS] * 4, 2)
            if result.error is None:
                return
        raise RuntimeError(f"{self.name} ({self.url}) failed a 4-token completion: "
                           f"{result.error}")

    @property
    def returns_token_ids(self) -> bool:
        return self.extras.get("return_token_ids", False)

    async def complete(self, prompt: list[int], max_tokens: int) -> RequestResult:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                **self.extras}
        result = RequestResult()
        start = time.perf_counter()
        try:
            async with self.client.stream("POST", "/v1/completions", json=body) as reply:
                if reply.status_code != 200:
                    await reply.aread()
                    result.error = f"HTTP {reply.status_code}: {reply.text[:300]}"
                    return result
                async for line in reply.aiter_lines():
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if "error" in chunk:
                        result.error = f"error in the stream: {chunk['error']}"
                        return result
                    read_chunk(chunk, result, time.perf_counter() - start)
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            return result
        result.latency = time.perf_counter() - start
        if result.completion_tokens == 0:
            result.error = "the stream ended without usage or output tokens"
        return result

    async def close(self) -> None:
        await self.client.aclose()


def read_chunk(chunk: dict[str, Any], result: RequestResult, elapsed: float) -> None:
    for choice in chunk.get("choices") or []:
        # A chunk without a finish reason is sent for a new token even if its text is empty
        # (an incomplete UTF-8 sequence), so it counts as the first token too.
        carries_token = choice.get("text") or choice.get("token_ids") or \
            choice.get("finish_reason") is None
        if carries_token and result.ttft == 0.0:
            result.ttft = elapsed
        result.text += choice.get("text") or ""
        result.token_ids += choice.get("token_ids") or []
    usage = chunk.get("usage")
    if usage:
        result.prompt_tokens = usage["prompt_tokens"]
        result.completion_tokens = usage["completion_tokens"]
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = details.get("cached_tokens") or 0


# -------------------------------------------------------------------------------- workloads
class ReplyIds:
    """Turns a reply into the token ids the next turn re-sends: the server's own ids when every
    server streams them, else the text encoded again with one tokenizer for all servers."""

    def __init__(self, servers: list[Server], tokenizer_dir: str | None) -> None:
        self.tokenizer = None
        if all(s.returns_token_ids for s in servers):
            self.how = "token ids streamed by the server"
            return
        candidates = [tokenizer_dir] if tokenizer_dir else [s.model_root for s in servers]
        for directory in candidates:
            if directory and (Path(directory) / "tokenizer.json").is_file():
                from tokenizers import Tokenizer

                self.tokenizer = Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
                self.how = f"reply text re-encoded with {directory}/tokenizer.json"
                return
        without = ", ".join(s.name for s in servers if not s.returns_token_ids)
        raise SystemExit(f"{without} does not stream token ids (return_token_ids), so the "
                         "multi-turn workload needs a tokenizer to encode replies: pass "
                         "--tokenizer DIR (a directory holding tokenizer.json)")

    def __call__(self, result: RequestResult) -> list[int]:
        if self.tokenizer is None:
            return result.token_ids
        return self.tokenizer.encode(result.text, add_special_tokens=False).ids


async def run_prompts(server: Server, prompts: list[list[int]], args: argparse.Namespace
                      ) -> list[RequestResult]:
    slots = asyncio.Semaphore(args.concurrency)

    async def one(prompt: list[int]) -> RequestResult:
        async with slots:
            return await server.complete(prompt, args.output_len)

    return list(await asyncio.gather(*(one(p) for p in prompts)))


async def run_conversations(server: Server, turns: list[list[list[int]]],
                            args: argparse.Namespace, reply_ids: ReplyIds
                            ) -> list[RequestResult]:
    slots = asyncio.Semaphore(args.concurrency)

    async def conversation(new_tokens: list[list[int]]) -> list[RequestResult]:
        history: list[int] = []
        results = []
        for tokens in new_tokens:
            prompt = history + tokens
            async with slots:
                result = await server.complete(prompt, args.output_len)
            results.append(result)
            if result.error is not None:
                break  # the rest of this conversation has no history to build on
            history = prompt + reply_ids(result)
        return results

    per_conversation = await asyncio.gather(*(conversation(c) for c in turns))
    return [r for results in per_conversation for r in results]


# ---------------------------------------------------------------------------------- metrics
METRICS = {  # key: (label, digits)
    "req_per_s": ("req/s", 2),
    "output_tok_per_s": ("output tok/s", 1),
    "ttft_mean_ms": ("TTFT mean (ms)", 1),
    "ttft_median_ms": ("TTFT median (ms)", 1),
    "ttft_p99_ms": ("TTFT p99 (ms)", 1),
    "tpot_median_ms": ("TPOT median (ms)", 2),
    "prompt_tokens": ("prompt tokens", 0),
    "cached_tokens": ("cached tokens", 0),
    "cached_fraction": ("cached fraction", 3),
    "failed": ("failed requests", 0),
}


def summarize(results: list[RequestResult], wall: float) -> dict[str, float]:
    done = [r for r in results if r.error is None]
    ttfts = np.array([r.ttft for r in done] or [np.nan]) * 1000
    tpots = [(r.latency - r.ttft) / (r.completion_tokens - 1) * 1000
             for r in done if r.completion_tokens > 1]
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    return {
        "req_per_s": len(done) / wall,
        "output_tok_per_s": sum(r.completion_tokens for r in done) / wall,
        "ttft_mean_ms": float(np.mean(ttfts)),
        "ttft_median_ms": float(np.median(ttfts)),
        "ttft_p99_ms": float(np.percentile(ttfts, 99)),
        "tpot_median_ms": statistics.median(tpots) if tpots else float("nan"),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_fraction": cached / prompt if prompt else 0.0,
        "failed": len(results) - len(done),
    }


def describe(workload: str, args: argparse.Namespace) -> str:
    if workload == "multi-turn":
        size = (f"{args.conversations} conversations x {args.turns} turns, {args.head}-token "
                f"head, {args.question}-token user turns")
    else:
        size = (f"{args.groups} groups x {args.per_group} prompts, {args.head}-token "
                f"{'shared ' if workload == 'shared-prefix' else ''}head + "
                f"{args.question}-token question")
    return (f"{workload}: {size}, {args.output_len} out, {args.concurrency} in flight; "
            f"medians of {args.repeats} repeats")


def table(workload: str, args: argparse.Namespace, servers: list[Server],
          medians: dict[str, dict[str, float]]) -> str:
    names = [s.name for s in servers]
    header = names + ([f"{names[0]} / {names[1]}"] if len(names) == 2 else [])
    lines = [f"### {describe(workload, args)}", "",
             "| metric | " + " | ".join(header) + " |", "|---" * (len(header) + 1) + "|"]
    for key, (label, digits) in METRICS.items():
        values = [medians[n][key] for n in names]
        cells = [f"{v:,.{digits}f}" for v in values]
        if len(values) == 2:
            cells.append(f"{values[0] / values[1]:.2f}x" if values[1] else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- main
def read_vocab(args: argparse.Namespace, servers: list[Server]) -> int:
    if args.vocab:
        return args.vocab
    for directory in [s.model_root for s in servers] + [args.tokenizer]:
        config = Path(directory) / "config.json" if directory else None
        if config and config.is_file():
            return int(json.loads(config.read_text())["vocab_size"])
    return DEFAULT_VOCAB


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    servers = [Server(name, url, args.api_key, args.concurrency, args.timeout)
               for name, url in zip(args.name, args.url, strict=True)]
    try:
        for server in servers:
            await server.probe()
        vocab = read_vocab(args, servers)
        reply_ids = ReplyIds(servers, args.tokenizer) if "multi-turn" in args.workload else None
        if reply_ids is None or reply_ids.tokenizer is not None:
            for server in servers:  # ids nobody reads would only lengthen one server's stream
                server.extras.pop("return_token_ids", None)
        # One untimed round of full-size requests, drawn apart from every repeat's prompts:
        # the first batched steps of a fresh server (allocation, compilation) are not traffic.
        warmup = grouped_prompts(np.random.default_rng([args.seed, len(WORKLOADS), 0]), 1,
                                 args.concurrency, args, vocab, shared=False)
        for server in servers:
            await run_prompts(server, warmup, args)
        runs, report = [], []
        for workload in args.workload:
            for repeat in range(args.repeats):
                rng = np.random.default_rng([args.seed, WORKLOADS.index(workload), repeat])
                if workload == "multi-turn":
                    traffic: Any = user_turns(rng, args, vocab)
                else:
                    traffic = grouped_prompts(rng, args.groups, args.per_group, args, vocab,
                                              workload == "shared-prefix")
                order = servers if repeat % 2 == 0 else servers[::-1]  # ABBA
                for server in order:
                    await asyncio.sleep(args.pause)
                    start = time.perf_counter()
                    if workload == "multi-turn":
                        results = await run_conversations(server, traffic, args, reply_ids)
                    else:
                        results = await run_prompts(server, traffic, args)
                    wall = time.perf_counter() - start
                    runs.append({"workload": workload, "repeat": repeat, "server": server.name,
                                 "wall_s": wall, "metrics": summarize(results, wall),
                                 "requests": [asdict(r) for r in results]})
            medians = {s.name: {key: statistics.median(
                run["metrics"][key] for run in runs
                if run["workload"] == workload and run["server"] == s.name)
                for key in METRICS} for s in servers}
            text = table(workload, args, servers, medians)
            print(text + "\n", flush=True)
            report.append({"workload": workload, "description": describe(workload, args),
                           "medians": medians, "table": text})
    finally:
        for server in servers:
            await server.close()
    return {"settings": {**vars(args), "vocab": vocab},
            "servers": [{"name": s.name, "url": s.url, "model": s.model, "extras": s.extras}
                        for s in servers],
            "multi_turn_replies": reply_ids.how if reply_ids else None,
            "summary": report, "runs": runs}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", action="append", required=True,
                    help="a server's base URL; give it once or twice (A, B)")
    ap.add_argument("--name", action="append", default=[],
                    help="a name per --url, in the same order (default: the URL)")
    ap.add_argument("--workload", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight at most")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--head", type=int, default=512, help="tokens of a group's shared head")
    ap.add_argument("--question", type=int, default=32, help="tokens of a question / user turn")
    ap.add_argument("--output-len", type=int, default=32, help="max_tokens of every request")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=None,
                    help="random ids are drawn below this (default: vocab_size of the first "
                         "model directory a server names in /v1/models (vLLM's root) or of "
                         f"--tokenizer's directory, else "
                         f"{DEFAULT_VOCAB}; {HIGH_IDS} ids below it are left out)")
    ap.add_argument("--tokenizer", default=None,
                    help="a directory with tokenizer.json, to re-encode multi-turn replies of "
                         "servers that do not stream token ids")
    ap.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    ap.add_argument("--seed", type=int, default=None,
                    help="base seed of the prompts (default: a new one each run, printed; a "
                         "fixed seed against a server that stayed up hits the last run's cache)")
    ap.add_argument("--pause", type=float, default=2.0,
                    help="idle seconds before each timed run: vLLM's engine keeps polling a core "
                         "for about a second after its last request, which would slow the run "
                         "after it")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--json", default=None, help="save every number to this file")
    args = ap.parse_args(argv)
    if len(args.url) > 2:
        ap.error("give one or two --url")
    if args.name and len(args.name) != len(args.url):
        ap.error("give one --name per --url, or none")
    args.name = args.name or list(args.url)
    if len(set(args.name)) != len(args.name):
        ap.error("the two servers need different --name values")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.seed is None:
        args.seed = secrets.randbelow(1 << 31)
    print(f"prompt seed {args.seed}\n", flush=True)
    report = asyncio.run(bench(args))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
