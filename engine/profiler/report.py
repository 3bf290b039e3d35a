"""What ``radixserve profile`` prints and writes: one summary dict, rendered as aligned text
tables for the terminal and saved as ``summary.json`` beside per-request, per-session,
per-namespace, per-window and per-cache-size CSV files."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engine.profiler.attribution import attribute, per_request
from engine.profiler.kv_bytes import KVBytes, format_bytes
from engine.profiler.simulate import Profile, SweepPoint
from engine.profiler.sliding import pools_bytes, sliding_lines, sliding_summary


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to their widest cell; the first column left-aligned, the rest right."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for row in cells:
        parts = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:],
                                                                         strict=True)]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _n(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def timeline(profile: Profile, windows: int) -> list[dict[str, Any]]:
    """Hit rates per window of arrival time, for the configured cache and the baselines."""
    arrivals = profile.arrivals
    start, end = float(arrivals.min()), float(arrivals.max())
    edges = np.linspace(start, end if end > start else start + 1.0, windows + 1)
    index = np.clip(np.searchsorted(edges, arrivals, side="right") - 1, 0, windows - 1)
    prompt = np.bincount(index, weights=profile.prompt_tokens, minlength=windows)
    count = np.bincount(index, minlength=windows)
    hits = {run.label: np.bincount(index, weights=run.cached, minlength=windows)
            for run in profile.runs[:4]}
    rows = []
    for w in range(windows):
        row: dict[str, Any] = {"start_s": round(float(edges[w]), 3),
                               "end_s": round(float(edges[w + 1]), 3),
                               "requests": int(count[w]), "prompt_tokens": int(prompt[w])}
        for label, hit in hits.items():
            row[label] = float(hit[w] / prompt[w]) if prompt[w] else None
        rows.append(row)
    return rows


def trace_blocks(profile: Profile, block_tokens: int) -> dict[str, Any]:
    """What a trace hashed in ``block_tokens``-token blocks hides from every cache replaying it.

    A match stops at the first block two prompts hash differently, though they may share up to
    ``block_tokens - 1`` more tokens inside it: at most that many per request (and never the
    always-recomputed last token) is reuse the trace cannot show."""
    prompt, unlimited = profile.prompt_tokens, profile.unlimited.cached
    hidden = int(np.minimum(block_tokens - 1, prompt - 1 - unlimited).sum())
    total = int(prompt.sum())
    return {
        "block_tokens": block_tokens,
        "note": f"this trace hashes {block_tokens}-token blocks: reuse shorter than a block, or "
                "past the last shared block, is invisible to any cache here",
        "hidden_tokens_at_most": hidden,
        "unlimited_hit_rate_at_most": (int(unlimited.sum()) + hidden) / total if total else 0.0,
    }


def summarize(profile: Profile, trace_name: str, windows: int = 10,
              sweep: list[SweepPoint] | None = None,
              trace_block_tokens: int | None = None, service_label: str | None = None,
              host_tokens: int | None = None, kv: KVBytes | None = None,
              disk_tokens: int | None = None) -> dict[str, Any]:
    """Everything the report shows, as plain JSON-ready data; ``trace_block_tokens`` is the
    block size of a trace given as block hashes (Mooncake, Bailian), None for token traces;
    ``service_label`` says how overlapping requests were timed, ``host_tokens`` and
    ``disk_tokens`` the tiers' sizes; ``kv`` the bytes of a cached token, when known (every size in bytes too)."""

    def in_bytes(tokens: int | None) -> int | None:
        return None if kv is None or tokens is None else tokens * kv.bytes_per_token

    prompt = profile.prompt_tokens
    cached = profile.radix.cached
    sliding = sliding_summary(profile.sliding, profile.radix, profile.full_kv, prompt,
                              profile.num_pages, profile.page_size, kv)
    # with sliding-window layers, the two pools' bytes (a token of the full pool holds fewer
    # layers)
    radix_bytes = pools_bytes(sliding) or in_bytes(profile.num_pages * profile.page_size)
    requests = profile.requests
    attribution = attribute(profile)
    total = max(1, int(prompt.sum()))
    concurrency = host_tier = disk_tier = None
    all_tiers = (attribution.hit + attribution.host_hit + attribution.disk_hit) / total
    if profile.radix.visible is not None:
        concurrency = {"model": service_label, "peak_running": profile.radix.peak_running,
                       "waited_s": round(profile.radix.waited_s, 3)}
    if profile.radix.host_cached is not None:
        host_tier = {"capacity_tokens": host_tokens,
                     "capacity_bytes": pools_bytes(sliding, "host_") or in_bytes(host_tokens),
                     "host_hit_tokens": attribution.host_hit,
                     "host_hit_rate": attribution.host_hit / total,
                     "total_hit_rate": all_tiers}
    if profile.radix.disk_cached is not None:
        disk_tier = {"capacity_tokens": disk_tokens, "capacity_bytes": in_bytes(disk_tokens),
                     "disk_hit_tokens": attribution.disk_hit,
                     "disk_hit_rate": attribution.disk_hit / total, "total_hit_rate": all_tiers}
    return {
        "trace": trace_name,
        "requests": len(requests),
        "prompt_tokens": int(prompt.sum()),
        "output_tokens": int(sum(len(r.output) for r in requests)),
        "sessions": len({r.session_id for r in requests if r.session_id is not None}),
        "namespaces": len({r.namespace for r in requests}),
        "duration_s": round(float(profile.arrivals.max() - profile.arrivals.min()), 3),
        "config": {"page_size": profile.page_size, "num_pages": profile.num_pages,
                   "cache_tokens": profile.num_pages * profile.page_size,
                   "cache_bytes": radix_bytes,
                   "policy": profile.policy},
        "kv": None if kv is None else kv.to_json(),
        "caches": [{"cache": run.label, "capacity_tokens": run.capacity_tokens,
                    "capacity_bytes": (radix_bytes if run is profile.radix
                                       else in_bytes(run.capacity_tokens)),
                    "hit_tokens": int(run.cached.sum()), "hit_rate": run.hit_rate(prompt),
                    "evicted_tokens": run.evicted_tokens, "peak_kv_tokens": run.peak_tokens,
                    "dropped_matches": run.dropped_matches}
                   for run in profile.runs],
        "attribution": attribution.to_json(),
        "concurrency": concurrency,
        "host_tier": host_tier,
        "disk_tier": disk_tier,
        "sliding": sliding,
        "trace_blocks": (trace_blocks(profile, trace_block_tokens)
                         if trace_block_tokens is not None else None),
        "cached_tokens_per_request": {
            "mean": float(cached.mean()), "p50": float(np.percentile(cached, 50)),
            "p90": float(np.percentile(cached, 90)), "max": int(cached.max()),
            "zero_hit_requests": int(np.count_nonzero(cached == 0)),
        },
        "timeline": timeline(profile, windows),
        "sweep": [p.to_json() for p in sweep] if sweep else [],
    }


def format_text(s: dict[str, Any]) -> str:
    """The terminal report."""
    cfg, att = s["config"], s["attribution"]
    radix_label = s["caches"][0]["cache"]
    per_req = s["cached_tokens_per_request"]
    names = {"unlimited": "unlimited (upper bound)"}
    blocks = s["trace_blocks"]
    kv = s["kv"]
    unlimited_rate = s["caches"][1]["hit_rate"]
    lines = [
        f"trace {s['trace']}: {s['requests']:,} requests, {s['sessions']:,} sessions, "
        f"{s['namespaces']:,} namespace(s), {s['duration_s']:,.1f} s; "
        f"{s['prompt_tokens']:,} prompt + {s['output_tokens']:,} output tokens",
        f"cache: {cfg['cache_tokens']:,} tokens = {cfg['num_pages']:,} pages x "
        f"{cfg['page_size']}"
        + (f" = {format_bytes(cfg['cache_bytes'])}" if kv else "")
        + f", {cfg['policy'].upper()} eviction",
        *([f"KV: {kv['description']}"] if kv else []),
        "",
        table(["cache", "capacity", *(["bytes"] if kv else []), "hit tokens", "hit rate",
               "evicted", "peak KV"],
              [[names.get(c["cache"], c["cache"]), _n(c["capacity_tokens"]),
                *([format_bytes(c["capacity_bytes"])] if kv else []), _n(c["hit_tokens"]),
                _pct(c["hit_rate"]), _n(c["evicted_tokens"]), _n(c["peak_kv_tokens"])]
               for c in s["caches"]]),
        *(["", blocks["note"],
           f"so every hit rate above is a lower bound: partly shared blocks could hide at most "
           f"{blocks['hidden_tokens_at_most']:,} more hit tokens (unlimited {_pct(unlimited_rate)}"
           f", at most {_pct(blocks['unlimited_hit_rate_at_most'])}), "
           "besides replies re-sent by a later turn, which the format does not hash"]
          if blocks else []),
        "",
        f"misses of {radix_label}: {att['missed']:,} tokens = cold {att['cold']:,} "
        + (f"+ in flight {att['in_flight']:,} (still being prefilled by an earlier request) "
           if s["concurrency"] else "")
        + f"+ evicted {att['evicted']:,}",
        *([f"requests overlapping in time ({s['concurrency']['model']}): at most "
           f"{s['concurrency']['peak_running']:,} at once, waiting "
           f"{s['concurrency']['waited_s']:,.1f} s in all for room or a slot (the other caches "
           "above replay one request at a time)"]
          if s["concurrency"] else []),
        *([f"host tier of {_n(s['host_tier']['capacity_tokens'])} tokens"
           + (f" ({format_bytes(s['host_tier']['capacity_bytes'])})" if kv else "") + ": "
           f"{s['host_tier']['host_hit_tokens']:,} of the {att['evicted']:,} evicted tokens "
           f"found there (loaded, not recomputed); hit rate device "
           f"{_pct(s['caches'][0]['hit_rate'])} + host {_pct(s['host_tier']['host_hit_rate'])}"
           + (f" + disk {_pct(s['disk_tier']['disk_hit_rate'])}" if s["disk_tier"] else "")
           + f" = {_pct(s['host_tier']['total_hit_rate'])}"]
          if s["host_tier"] else []),
        *([f"disk tier of {_n(s['disk_tier']['capacity_tokens'])} tokens"
           + (f" ({format_bytes(s['disk_tier']['capacity_bytes'])})" if kv else "") + ": "
           f"{s['disk_tier']['disk_hit_tokens']:,} of the {att['evicted']:,} evicted tokens "
           f"loaded from it; hit rate in all tiers {_pct(s['disk_tier']['total_hit_rate'])}"]
          if s["disk_tier"] else []),
        f"token matching over 16-token blocks: "
        f"+{att['short_head'] + att['block_granularity']:,} hit tokens = shared head shorter "
        f"than one block {att['short_head']:,} + block granularity "
        f"{att['block_granularity']:,}; block hashing at this capacity also loses "
        f"{att['block_evicted']:,} to eviction",
        f"cached tokens per request: mean {per_req['mean']:,.0f}, p50 {per_req['p50']:,.0f}, "
        f"p90 {per_req['p90']:,.0f}, max {per_req['max']:,}; "
        f"{per_req['zero_hit_requests']:,} of {s['requests']:,} requests had no hit",
        *(sliding_lines(s["sliding"]) if s.get("sliding") else []),
        *([f"{s['caches'][0]['dropped_matches']:,} requests ran uncached: their locked match "
           "left too little room in a cache barely bigger than one request"]
          if s["caches"][0]["dropped_matches"] else []),
        "",
        "hit rate over time:",
        table(["window (s)", "requests", "prompt tokens", radix_label, "unlimited",
               "block hash 16"],
              [[f"{w['start_s']:.0f}-{w['end_s']:.0f}", _n(w["requests"]), _n(w["prompt_tokens"]),
                *("-" if w[c["cache"]] is None else _pct(w[c["cache"]])
                  for c in (s["caches"][0], s["caches"][1], s["caches"][2]))]
               for w in s["timeline"]]),
    ]
    if s["sweep"]:
        lines += ["", "hit rate vs cache size:", sweep_table(s)]
    return "\n".join(lines)


def sweep_table(s: dict[str, Any]) -> str:
    """Hit rate at each swept size; with a model's shape, also the tokens the same bytes hold
    in the model's dtype or int8, whichever the cache is not, and the hit rate there."""
    kv = s["kv"]
    per_token = kv["compared_bytes_per_token"] if kv else {}
    compared = [dtype for dtype in per_token if dtype != kv["kv_dtype"]]
    header = ["cache tokens", *(["cache bytes"] if kv else []), s["caches"][0]["cache"],
              "block hash 16", "evicted"]
    for dtype in compared:
        header += [f"{dtype} tokens", f"{dtype} hit rate"]
    rows = []
    for p in s["sweep"]:
        row = [_n(p["cache_tokens"]), *([format_bytes(p["cache_bytes"])] if kv else []),
               _pct(p["radix_hit_rate"]), _pct(p["block_hit_rate"]), _n(p["radix_evicted_tokens"])]
        for dtype in compared:
            rate = p[f"{dtype}_hit_rate"]
            row += [_n(p[f"{dtype}_tokens"]), "-" if rate is None else _pct(rate)]
        rows.append(row)
    lines = [table(header, rows)]
    if len(per_token) == 2:
        (full, full_bytes), (eight, eight_bytes) = per_token.items()
        lines.append(f"at the same bytes, {eight} KV holds {full_bytes / eight_bytes:.2f}x the "
                     f"tokens of {full} KV ({full_bytes:,} and {eight_bytes:,} bytes a token)")
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        if not rows:
            return
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


# The per-request miss categories (attribution.py) that the CSV files carry, in column order.
_PARTS = ("cold", "in_flight", "evicted", "host_hit", "short_head", "block_granularity",
          "block_evicted")


def request_rows(profile: Profile) -> list[dict[str, Any]]:
    parts = per_request(profile)
    return [{
        "id": r.id, "arrival": r.arrival, "session_id": r.session_id or "",
        "namespace": r.namespace or "", "prompt_tokens": len(r.prompt),
        "output_tokens": len(r.output), "cached_tokens": int(profile.radix.cached[i]),
        "cached_unlimited": int(profile.unlimited.cached[i]),
        "cached_block16": int(profile.block.cached[i]),
        "cached_block16_unlimited": int(profile.block_unlimited.cached[i]),
        **{name: int(parts[name][i]) for name in _PARTS},
        "kv_tokens_after": int(profile.radix.kv_tokens[i]),
    } for i, r in enumerate(profile.requests)]


def group_rows(profile: Profile, key: str) -> list[dict[str, Any]]:
    """Per-request figures summed per distinct ``key`` (``session_id`` or ``namespace``), one
    row per key in the order of its first request; requests without a key (None) form the row
    keyed "". Grouped with numpy: a trace's millions of requests cost no Python work each."""
    parts = per_request(profile)
    keys = ["" if k is None else k for k in (getattr(r, key) for r in profile.requests)]
    names, first, group = np.unique(np.array(keys), return_index=True, return_inverse=True)

    def total(values: np.ndarray) -> np.ndarray:
        return np.bincount(group, weights=values, minlength=len(names)).astype(np.int64)

    requests = np.bincount(group, minlength=len(names))
    prompt, hit, block_hit = (total(profile.prompt_tokens), total(profile.radix.cached),
                              total(profile.block.cached))
    sums = {name: total(parts[name]) for name in _PARTS}
    return [{
        key: str(names[g]), "requests": int(requests[g]),
        "prompt_tokens": int(prompt[g]), "hit_tokens": int(hit[g]),
        "hit_rate": float(hit[g] / prompt[g]) if prompt[g] else 0.0,
        **{name: int(sums[name][g]) for name in ("cold", "in_flight", "evicted", "host_hit")},
        "block16_hit_tokens": int(block_hit[g]),
        "block16_hit_rate": float(block_hit[g] / prompt[g]) if prompt[g] else 0.0,
        "short_head": int(sums["short_head"][g]),
        "block_granularity": int(sums["block_granularity"][g]),
        "block16_evicted": int(sums["block_evicted"][g]),
    } for g in np.argsort(first, kind="stable")]


def write_outputs(out_dir: Path, profile: Profile, summary: dict[str, Any]) -> list[Path]:
    """``summary.json``, ``requests.csv``, ``sessions.csv``, ``namespaces.csv``,
    ``timeline.csv`` and (with a sweep) ``sweep.csv``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    tables = {"requests.csv": request_rows(profile),
              "sessions.csv": group_rows(profile, "session_id"),
              "namespaces.csv": group_rows(profile, "namespace"),
              "timeline.csv": summary["timeline"]}
    if summary["sweep"]:
        tables["sweep.csv"] = summary["sweep"]
    for name, rows in tables.items():
        write_csv(out_dir / name, rows)
    return [out_dir / name for name in ("summary.json", *tables)]
