"""Live replay against an OpenAI-compatible server, measuring what its prefix cache really does.

Each trace request is sent at its arrival time (or at ``1 / rate`` spacing) as a streamed
``/v1/completions`` call (token ids or text as ``prompt``) or ``/v1/chat/completions`` call
(``messages``), with ``max_tokens`` = the trace's output length, temperature 0 and
``stream_options.include_usage``. From the stream it records the time to the first token and,
from the final usage chunk, ``prompt_tokens`` and ``prompt_tokens_details.cached_tokens``.

Requests overlap as they would in production (open loop, at most ``max_concurrency`` in
flight); the server, not this client, decides what stays cached.
"""

from __future__ import annotations

import asyncio
import csv
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from engine.profiler.report import table
from engine.profiler.trace import TraceError, TraceRequest


class LiveError(RuntimeError):
    """The server could not be used at all (unreachable, no model to name)."""


@dataclass
class LiveResult:
    id: str
    sent_at_s: float
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    # of those, loaded from a host / disk tier (radixserve's usage extension; None without)
    cached_tokens_host: int | None = None
    cached_tokens_disk: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    error: str | None = None


def base_url(url: str) -> str:
    """``http://host:port``, whether the user gave it with or without ``/v1``."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _body(request: TraceRequest, model: str) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": model, "max_tokens": max(1, request.output_len),
                            "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if request.messages is not None:
        return "/v1/chat/completions", {**body, "messages": request.messages}
    prompt = request.prompt_token_ids if request.prompt_token_ids is not None else request.prompt
    return "/v1/completions", {**body, "prompt": prompt}


def _has_token(chunk: dict[str, Any]) -> bool:
    return any(choice.get("text") or (choice.get("delta") or {}).get("content")
               for choice in chunk.get("choices") or ())


async def _send(client: httpx.AsyncClient, request: TraceRequest, model: str,
                sent_at: float) -> LiveResult:
    result = LiveResult(request.id, sent_at)
    path, body = _body(request, model)
    start = time.perf_counter()
    first_choice: float | None = None
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if chunk.get("error"):
                    result.error = str(chunk["error"])[:200]
                    return result
                now = time.perf_counter() - start
                if first_choice is None and chunk.get("choices"):
                    first_choice = now
                if result.ttft_s is None and _has_token(chunk):
                    result.ttft_s = now
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens")
                    result.completion_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens")
                    result.cached_tokens_host = details.get("cached_tokens_host")
                    result.cached_tokens_disk = details.get("cached_tokens_disk")
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency_s = time.perf_counter() - start
    if result.ttft_s is None:  # only empty tokens came back: the first chunk is the best proxy
        result.ttft_s = first_choice
    return result


async def _model_name(client: httpx.AsyncClient, url: str) -> str:
    try:
        response = await client.get("/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise LiveError(f"could not read a model name from {url}/v1/models ({exc}); "
                        "pass --model NAME") from None


async def _replay(trace: list[TraceRequest], url: str, model: str | None, api_key: str | None,
                  rate: float | None, max_concurrency: int, timeout_s: float,
                  progress: bool) -> tuple[str, list[LiveResult]]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency)
    async with httpx.AsyncClient(base_url=base_url(url), headers=headers, limits=limits,
                                 timeout=timeout_s) as client:
        model = model or await _model_name(client, url)
        first = trace[0].arrival
        send_at = [i / rate if rate else r.arrival - first for i, r in enumerate(trace)]
        gate = asyncio.Semaphore(max_concurrency)
        bar = tqdm(total=len(trace), desc="live", unit="req", leave=False, disable=not progress)
        start = time.perf_counter()

        async def one(request: TraceRequest, at: float) -> LiveResult:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            async with gate:
                result = await _send(client, request, model, time.perf_counter() - start)
            bar.update()
            return result

        try:
            results = await asyncio.gather(*(one(r, t) for r, t in
                                             zip(trace, send_at, strict=True)))
        finally:
            bar.close()
    return model, list(results)


def replay_live(trace: list[TraceRequest], url: str, model: str | None = None,
                api_key: str | None = None, rate: float | None = None,
                max_concurrency: int = 64, timeout_s: float = 600.0,
                progress: bool = False) -> tuple[str, list[LiveResult]]:
    """Replay ``trace`` against the server at ``url``; returns the model used and per-request
    results in trace order."""
    return asyncio.run(_replay(trace, url, model, api_key, rate, max_concurrency, timeout_s,
                               progress))


def _buckets(cached: np.ndarray, prompt: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """The TTFT table's rows: requests grouped by the cached share of their prompt."""
    share = cached / np.maximum(prompt, 1)
    return [("none", cached == 0), ("< 50%", (cached > 0) & (share < 0.5)),
            ("50-90%", (share >= 0.5) & (share < 0.9)), ("90-100%", share >= 0.9)]


def summarize_live(results: list[LiveResult], model: str, url: str,
                   simulated: np.ndarray | None, simulated_label: str | None,
                   local_prompt: np.ndarray | None) -> dict[str, Any]:
    """Measured hit rate, TTFT against cached tokens, and the gap to the offline simulation
    (``simulated``: per-request cached tokens of the same trace, or None)."""
    ok = [i for i, r in enumerate(results) if r.error is None and r.prompt_tokens is not None]
    prompt = np.array([results[i].prompt_tokens for i in ok], dtype=np.int64)
    cached = np.array([results[i].cached_tokens or 0 for i in ok], dtype=np.int64)
    ttft = np.array([np.nan if results[i].ttft_s is None else results[i].ttft_s for i in ok])
    summary: dict[str, Any] = {
        "url": url, "model": model, "requests": len(results), "succeeded": len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "missing_usage": sum(r.error is None and r.prompt_tokens is None for r in results),
        "missing_cached_tokens": sum(results[i].cached_tokens is None for i in ok),
        "prompt_tokens": int(prompt.sum()), "cached_tokens": int(cached.sum()),
        "hit_rate": float(cached.sum() / prompt.sum()) if prompt.sum() else 0.0,
        "ttft_by_cached_fraction": [], "ttft_fit": None, "simulation": None,
    }
    for name, mask in _buckets(cached, prompt):
        times = ttft[mask & ~np.isnan(ttft)]
        if times.size:
            summary["ttft_by_cached_fraction"].append({
                "cached": name, "requests": int(mask.sum()),
                "median_prompt_tokens": float(np.median(prompt[mask])),
                "median_cached_tokens": float(np.median(cached[mask])),
                "median_ttft_ms": float(1e3 * np.median(times)),
                "p90_ttft_ms": float(1e3 * np.percentile(times, 90)),
            })
    timed = ~np.isnan(ttft)
    uncached = (prompt - cached)[timed]
    if timed.sum() >= 3 and np.ptp(uncached) > 0:
        slope, intercept = np.polyfit(uncached, 1e3 * ttft[timed], 1)
        summary["ttft_fit"] = {"ms": float(intercept), "ms_per_1k_uncached": float(1e3 * slope)}
    if simulated is not None:
        sim = simulated[ok]
        local = local_prompt[ok] if local_prompt is not None else prompt
        summary["simulation"] = {
            "cache": simulated_label,
            "hit_rate": float(sim.sum() / local.sum()) if local.sum() else 0.0,
            "mean_gap_tokens": float((sim - cached).mean()) if ok else 0.0,
            "requests_below_simulation": int(np.count_nonzero(cached < sim)),
            "prompt_length_mismatches": int(np.count_nonzero(local != prompt)),
        }
    return summary


def format_live(s: dict[str, Any]) -> str:
    lines = [f"live: {s['url']} model {s['model']}: {s['succeeded']:,} of {s['requests']:,} "
             f"requests succeeded",
             f"measured hit rate: {100 * s['hit_rate']:.1f}% ({s['cached_tokens']:,} of "
             f"{s['prompt_tokens']:,} prompt tokens cached, as the server reports them)"]
    if s["missing_usage"]:
        lines.append(f"{s['missing_usage']:,} streams ended without usage (does the server "
                     "support stream_options.include_usage?)")
    if s["missing_cached_tokens"]:
        lines.append(f"{s['missing_cached_tokens']:,} responses had no "
                     "usage.prompt_tokens_details.cached_tokens (counted as 0)")
    for error in s["errors"]:
        lines.append(f"error: {error}")
    if s["ttft_by_cached_fraction"]:
        lines += ["", "TTFT by cached share of the prompt:",
                  table(["cached", "requests", "prompt tokens", "cached tokens", "TTFT p50 ms",
                         "TTFT p90 ms"],
                        [[b["cached"], b["requests"], f"{b['median_prompt_tokens']:,.0f}",
                          f"{b['median_cached_tokens']:,.0f}", f"{b['median_ttft_ms']:,.1f}",
                          f"{b['p90_ttft_ms']:,.1f}"] for b in s["ttft_by_cached_fraction"]])]
    if s["ttft_fit"]:
        fit = s["ttft_fit"]
        lines.append(f"TTFT ~ {fit['ms']:,.1f} ms + {fit['ms_per_1k_uncached']:,.1f} ms per "
                     "1k uncached prompt tokens (least squares)")
    sim = s["simulation"]
    if sim:
        lines += ["", f"offline simulation ({sim['cache']}): {100 * sim['hit_rate']:.1f}%; "
                      f"measured - simulated = {100 * (s['hit_rate'] - sim['hit_rate']):+.1f} "
                      f"points; {sim['requests_below_simulation']:,} requests got fewer cached "
                      f"tokens than simulated (mean gap {sim['mean_gap_tokens']:,.1f} tokens)"]
        timed = s.get("timed_simulation")
        if timed:
            lines.append(f"offline simulation on the live timeline (each request holding its "
                         f"pages from send to finish, {timed['peak_running']} at most at once): "
                         f"{100 * timed['hit_rate']:.1f}%; measured - simulated = "
                         f"{timed['gap_points']:+.1f} points")
            if len(timed["tiers"]) > 1:
                lines.append("by tier, measured / simulated on the live timeline: " + ", ".join(
                    f"{tier} {100 * t['live']:.1f}% / {100 * t['replay']:.1f}% "
                    f"({t['gap_points']:+.1f} points)" for tier, t in timed["tiers"].items()))
        if sim["prompt_length_mismatches"]:
            lines.append(f"{sim['prompt_length_mismatches']:,} prompts were counted with a "
                         "different length by the server than by the local tokenizer")
    return "\n".join(lines)


# First tokens the client sees less than this far apart came out of the same scheduler step.
SAME_STEP_S = 0.002


def server_timeline(sent: dict[str, tuple[float, float, float]]
                    ) -> dict[str, tuple[float, float, float]]:
    """``(admitted_at_s, prefill_s, total_s)`` by id from ``(sent_at_s, ttft_s, latency_s)``.

    A server admits requests between steps, so a request sent while a step ran is matched
    against the tree only when that step is over: after the prefixes it prefilled were cached.
    The client sees the end of a step as first tokens; a request is taken as admitted at the
    later of its send time and the last first token (of any request) seen before its own step
    ended. Requests whose first tokens arrive together ran in one step and matched together."""
    ids = list(sent)
    first = np.array([sent[i][0] + sent[i][1] for i in ids])
    ends = np.sort(first)
    timeline = {}
    for i, id_ in enumerate(ids):
        sent_at, _, latency = sent[id_]
        before = np.searchsorted(ends, first[i] - SAME_STEP_S)  # step ends before its own
        admitted = max(sent_at, float(ends[before - 1])) if before else sent_at
        admitted = min(admitted, float(first[i]))
        timeline[id_] = (admitted, float(first[i]) - admitted, sent_at + latency - admitted)
    return timeline


def measured_times(results: list[LiveResult]) -> dict[str, tuple[float, float, float]]:
    """The server's timeline (``server_timeline``) of the requests that completed: what an
    offline replay follows as ``ServiceModel.measured``."""
    return server_timeline({r.id: (r.sent_at_s, r.ttft_s, r.latency_s) for r in results
                            if r.error is None and r.ttft_s is not None
                            and r.latency_s is not None})


def read_measured(path: str | Path) -> dict[str, tuple[float, float, float]]:
    """``measured_times`` from the ``live_requests.csv`` a live replay wrote."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = {"id", "sent_at_s", "ttft_s", "latency_s"} - set(reader.fieldnames or ())
        if missing:
            raise TraceError(f"{path}: not a live_requests.csv (no {', '.join(sorted(missing))} "
                             "column); write one with --url URL --out DIR")
        try:
            sent = {row["id"]: (float(row["sent_at_s"]), float(row["ttft_s"]),
                                float(row["latency_s"]))
                    for row in reader if not row.get("error") and row["ttft_s"]
                    and row["latency_s"]}
        except ValueError as exc:
            raise TraceError(f"{path}: {exc}") from None
    return server_timeline(sent)


def tier_tokens(results: list[LiveResult]) -> dict[str, np.ndarray]:
    """Measured cached tokens per request by the tier that served them (device, and host /
    disk when the server reports them); failed requests count 0."""
    host = np.array([r.cached_tokens_host or 0 for r in results], dtype=np.int64)
    disk = np.array([r.cached_tokens_disk or 0 for r in results], dtype=np.int64)
    total = np.array([r.cached_tokens or 0 for r in results], dtype=np.int64)
    return {"device": total - host - disk, "host": host, "disk": disk}


def result_rows(results: list[LiveResult], simulated: np.ndarray | None) -> list[dict[str, Any]]:
    return [{**asdict(r), "sim_cached_tokens": None if simulated is None else int(simulated[i])}
            for i, r in enumerate(results)]
