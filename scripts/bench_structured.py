"""Structured output's cost: the same chat requests with and without a JSON schema, on one or two
OpenAI-compatible servers (radixserve, vLLM), side by side.

    python scripts/bench_structured.py --url http://127.0.0.1:30000 --name radixserve \\
        --url http://127.0.0.1:8100 --name vllm --json structured.json

Each run sends ``--requests`` chat completions, ``--concurrency`` in flight, greedy, through
``response_format: json_schema`` (both servers take it) for each schema in ``SCHEMAS`` in turn,
and the same prompts unconstrained with ``max_tokens`` set to the constrained run's median
output length and ``ignore_eos`` (so both runs produce about the same tokens: the difference is
the constraint's cost). Servers alternate ABBA over ``--repeats``; every figure is a median over
repeats. Reported per server: constrained and unconstrained req/s and output tok/s, their ratio,
the share of constrained outputs that parse and validate, and radixserve's forced tokens and
mask time from ``/metrics``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import httpx
import jsonschema

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 40},
            "skills": {"type": "array", "items": {"type": "string", "maxLength": 16},
                       "maxItems": 4},
        },
        "required": ["name", "age", "email", "skills"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
            "items": {"type": "array", "maxItems": 3, "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "maxLength": 12},
                               "quantity": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["sku", "quantity"], "additionalProperties": False}},
        },
        "required": ["id", "status", "items"],
        "additionalProperties": False,
    },
}
TOPICS = ["a software engineer", "a chef", "a pilot", "a teacher", "a doctor", "an artist",
          "a farmer", "a lawyer", "a nurse", "a musician", "a shop order", "a delivery"]


def prompt(schema: str, i: int) -> str:
    return (f"Describe {TOPICS[i % len(TOPICS)]} (example {i}) as JSON with the fields "
            f"{', '.join(SCHEMAS[schema]['properties'])}.")


async def run(client: httpx.AsyncClient, url: str, model: str, schema: str, args,
              constrained: bool, max_tokens: int) -> dict[str, Any]:
    gate = asyncio.Semaphore(args.concurrency)
    outputs: list[tuple[str, int]] = []

    async def one(i: int) -> None:
        body: dict[str, Any] = {"model": model, "temperature": 0.0, "max_tokens": max_tokens,
                                "messages": [{"role": "user", "content": prompt(schema, i)}]}
        if constrained:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": schema, "schema": SCHEMAS[schema]}}
        else:
            body["ignore_eos"] = True
        async with gate:
            reply = (await client.post(f"{url}/v1/chat/completions", json=body)).json()
        outputs.append((reply["choices"][0]["message"]["content"] or "",
                        reply["usage"]["completion_tokens"]))

    began = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(args.requests)))
    wall = time.perf_counter() - began
    valid = 0
    for text, _ in outputs:
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[schema])
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    tokens = [n for _, n in outputs]
    return {"req_s": len(outputs) / wall, "tok_s": sum(tokens) / wall, "tokens": sum(tokens),
            "median_tokens": statistics.median(tokens), "valid": valid / len(outputs)}


def forced_and_mask(metrics: str) -> tuple[float, float]:
    values = {}
    for line in metrics.splitlines():
        if line.startswith("radixserve_structured_output_"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return (values.get("radixserve_structured_output_forced_tokens_total", 0.0),
            values.get("radixserve_structured_output_mask_seconds_total", 0.0))


async def bench(args) -> dict[str, Any]:
    results: dict[str, dict[str, list[dict]]] = {}
    async with httpx.AsyncClient(timeout=args.timeout, headers={
            "Authorization": f"Bearer {args.api_key}"} if args.api_key else None) as client:
        models = {url: (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
                  for url in args.url}
        for repeat in range(args.repeats):
            order = list(zip(args.url, args.name, strict=True))
            for url, name in order[::-1] if repeat % 2 else order:  # ABBA
                for schema in SCHEMAS:
                    before = forced_and_mask((await client.get(f"{url}/metrics")).text)
                    await asyncio.sleep(args.pause)
                    on = await run(client, url, models[url], schema, args, True, args.max_tokens)
                    after = forced_and_mask((await client.get(f"{url}/metrics")).text)
                    on["forced_share"] = (after[0] - before[0]) / max(1, on["tokens"])
                    on["mask_ms_per_token"] = 1e3 * (after[1] - before[1]) / max(1, on["tokens"])
                    await asyncio.sleep(args.pause)
                    off = await run(client, url, models[url], schema, args, False,
                                    int(on["median_tokens"]) or 1)
                    results.setdefault(name, {}).setdefault(schema, []).append(
                        {"constrained": on, "unconstrained": off})
    summary: dict[str, Any] = {}
    for name, by_schema in results.items():
        for schema, runs in by_schema.items():
            def median(kind: str, key: str, runs: list[dict] = runs) -> float:
                return statistics.median(r[kind][key] for r in runs)
            row = {f"{kind}_{key}": median(kind, key) for kind in ("constrained", "unconstrained")
                   for key in ("req_s", "tok_s", "median_tokens")}
            row["valid"] = median("constrained", "valid")
            row["req_s_ratio"] = row["constrained_req_s"] / row["unconstrained_req_s"]
            row["tok_s_ratio"] = row["constrained_tok_s"] / row["unconstrained_tok_s"]
            row["forced_share"] = median("constrained", "forced_share")
            row["mask_ms_per_token"] = median("constrained", "mask_ms_per_token")
            summary[f"{name}/{schema}"] = row
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", action="append", required=True)
    ap.add_argument("--name", action="append", default=[])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pause", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.name += [f"server{i}" for i in range(len(args.name), len(args.url))]
    summary = asyncio.run(bench(args))
    print("| server/schema | constrained req/s | unconstrained req/s | ratio | constrained "
          "tok/s | unconstrained tok/s | ratio | tokens | valid | forced | mask ms/token |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for key, r in summary.items():
        print(f"| {key} | {r['constrained_req_s']:.2f} | {r['unconstrained_req_s']:.2f} | "
              f"{r['req_s_ratio']:.2f} | {r['constrained_tok_s']:.1f} | "
              f"{r['unconstrained_tok_s']:.1f} | {r['tok_s_ratio']:.2f} | "
              f"{r['constrained_median_tokens']:.0f} | {r['valid']:.0%} | "
              f"{r['forced_share']:.0%} | {r['mask_ms_per_token']:.3f} |")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(summary, out, indent=2)


if __name__ == "__main__":
    main()
