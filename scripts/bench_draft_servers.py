"""Speculative decoding over HTTP: the coding prompts of scripts/bench_draft_model.py sent one at
a time to servers that are already running, taking turns request by request, so one run
measures radixserve with and without ``--speculative-config`` beside another server (llama.cpp's
``llama-server`` with and without ``-md``) given the same pair of models.

Each request goes to ``/v1/chat/completions`` (streamed, usage included, temperature 0,
``--max-tokens``); its output tok/s is its completion tokens over the time from sending it to its
last token, its decode tok/s over the time from its first token to its last. The order of the
servers turns by one each request and reverses every other round, so each server takes each place
in turn. Prints, by prompt kind, each server's medians, their ratios to the first server's, and
which servers answered every request with the same text.

    radixserve serve --model $M/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --port 30101 &
    radixserve serve --model $M/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --port 30102 \\
        --speculative-config '{"model": "'$M'/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                               "num_speculative_tokens": 3}' &
    llama-server -m $M/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf -t 2 --port 30103 &
    llama-server -m $M/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf -t 2 --port 30104 \\
        -md $M/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --spec-draft-n-max 3 &
    python scripts/bench_draft_servers.py --server radixserve=http://127.0.0.1:30101 \\
        --server radixserve+draft=http://127.0.0.1:30102 \\
        --server llama.cpp=http://127.0.0.1:30103 --server llama.cpp+draft=http://127.0.0.1:30104
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_draft_model import prompts  # noqa: E402


def parse_server(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep or not name or not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(
            f"--server takes NAME=URL (e.g. llama.cpp=http://127.0.0.1:8080), not {text!r}")
    return name, url.rstrip("/")


def ask(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed chat completion: its text, token count, speeds and the server's draft
    counts where its last chunk carries them (llama.cpp's ``timings``)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first = last = None
    text, tokens, drafts = [], 0, {}
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            reply.read()
            raise RuntimeError(f"{url} answered HTTP {reply.status_code}: {reply.text[:300]}")
        for line in reply.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"{url} sent an error in the stream: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    last = time.perf_counter()
                    first = first or last
                    text.append(choice["delta"]["content"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            timings = chunk.get("timings") or {}
            if "draft_n" in timings:
                drafts = {"drafted": timings["draft_n"],
                          "accepted": timings.get("draft_n_accepted", 0)}
    if not tokens or first is None:
        raise RuntimeError(f"{url}'s stream ended without output tokens or usage")
    return {"text": "".join(text), "tokens": tokens, "out_tok_s": tokens / (last - sent),
            "decode_tok_s": (tokens - 1) / (last - first) if last > first else None, **drafts}


def report(results: dict[str, dict[str, list[dict]]]) -> list[dict]:
    """By prompt kind: each server's medians, ratios to the first server's, and the servers
    whose text was the same on every request."""
    names = list(results)
    rows = []
    for kind in ("rewrite", "new", "all"):
        def runs(name: str, kind: str = kind) -> list[dict]:
            return [r for k, v in results[name].items() if kind in (k, "all") for r in v]

        row: dict = {"kind": kind, "requests": len(runs(names[0]))}
        for name in names:
            for key in ("out_tok_s", "decode_tok_s"):
                row[f"{name} {key}"] = round(statistics.median(
                    r[key] for r in runs(name) if r[key]), 2)
                row[f"{name} {key} ratio"] = round(row[f"{name} {key}"] / row[f"{names[0]} {key}"], 3)
            if any("drafted" in r for r in runs(name)):
                drafted = sum(r.get("drafted", 0) for r in runs(name))
                row[f"{name} drafts accepted"] = (
                    f"{sum(r.get('accepted', 0) for r in runs(name))} of {drafted}")
        row["same text"] = [[a, b] for i, a in enumerate(names) for b in names[i + 1:]
                            if all(x["text"] == y["text"] for x, y in
                                   zip(runs(a), runs(b), strict=True))]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", type=parse_server, action="append", required=True,
                    help="NAME=URL of a running OpenAI-compatible server; repeat it (the first "
                         "is the one the ratios are to)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens out a request (default: 128)")
    ap.add_argument("--repeats", type=int, default=1, help="passes over the prompts (default: 1)")
    ap.add_argument("--limit", type=int, default=None,
                    help="prompts of each kind at most (default: all, 8 rewrite and 6 new)")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds one request may take (default: 600)")
    ap.add_argument("--json", default=None, help="write the rows here too (default: none)")
    args = ap.parse_args(argv)
    servers = dict(args.server)
    if len(servers) != len(args.server):
        ap.error("each --server needs a name of its own")
    work = prompts()
    if args.limit:
        work = [p for kind in ("rewrite", "new")
                for p in [q for q in work if q[0] == kind][: args.limit]]
    results: dict[str, dict[str, list[dict]]] = {n: {"rewrite": [], "new": []} for n in servers}
    # A connection for each request: llama-server may close a kept-alive one as the next
    # request goes out (``RemoteProtocolError``).
    with httpx.Client(timeout=args.timeout, headers={"Connection": "close"}) as client:
        models = {}
        for name, url in servers.items():
            reply = client.get(f"{url}/v1/models")
            reply.raise_for_status()
            models[name] = reply.json()["data"][0]["id"]
            ask(client, url, models[name], work[0][1], 16)  # warm-up, untimed
        names = list(servers)
        turn = 0
        for _ in range(args.repeats):
            for kind, prompt in work:
                shift = turn % len(names)
                order = names[shift:] + names[:shift]
                if (turn // len(names)) % 2:
                    order.reverse()
                for name in order:
                    out = ask(client, servers[name], models[name], prompt, args.max_tokens)
                    results[name][kind].append(out)
                turn += 1
    rows = report(results)
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "requests": results}, f, indent=1)


if __name__ == "__main__":
    main()
