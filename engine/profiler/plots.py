"""PNG plots of a profile (matplotlib, Agg backend: no display needed).

matplotlib is imported inside each function: it takes about a second to load, and the CLI's
``--help`` and the table-only runs should not pay for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _figure() -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def hit_rate_over_time(summary: dict[str, Any], path: Path) -> Path:
    fig, ax = _figure()
    windows = summary["timeline"]
    mid = [(w["start_s"] + w["end_s"]) / 2 for w in windows]
    for cache, style in zip(summary["caches"][:3], ("-o", "--", ":s"), strict=True):
        rates = [np.nan if w[cache["cache"]] is None else 100 * w[cache["cache"]] for w in windows]
        ax.plot(mid, rates, style, label=cache["cache"], markersize=3)
    ax.set(xlabel="arrival time (s)", ylabel="prompt tokens from cache (%)", ylim=(0, 100),
           title=f"Hit rate over time: {summary['trace']}")
    ax.legend(loc="lower right", fontsize=8)
    return _save(fig, path)


def cached_tokens_histogram(cached: np.ndarray, unlimited: np.ndarray, label: str,
                            path: Path) -> Path:
    fig, ax = _figure()
    top = max(int(unlimited.max()), 1)
    bins = np.linspace(0, top, min(40, top) + 1)
    ax.hist(unlimited, bins=bins, alpha=0.45, label="unlimited (upper bound)")
    ax.hist(cached, bins=bins, histtype="step", linewidth=1.5, label=label)
    ax.set(xlabel="cached prompt tokens", ylabel="requests", title="Cached tokens per request")
    ax.legend(fontsize=8)
    return _save(fig, path)


def hit_rate_vs_cache_size(summary: dict[str, Any], path: Path) -> Path:
    """Hit rate against the cache's size: in tokens, or in GiB when the bytes of a token are
    known, with a curve for the model's dtype or int8 at the same bytes, whichever the
    configured cache is not."""
    fig, ax = _figure()
    sweep, kv = summary["sweep"], summary["kv"]
    if kv:
        sizes = [p["cache_bytes"] / 2**30 for p in sweep]
        radix_label = f"{summary['caches'][0]['cache']}, {kv['kv_dtype']} KV"
    else:
        sizes = [p["cache_tokens"] for p in sweep]
        radix_label = summary["caches"][0]["cache"]
    ax.plot(sizes, [100 * p["radix_hit_rate"] for p in sweep], "-o", label=radix_label)
    for dtype in (kv["compared_bytes_per_token"] if kv else {}):
        if dtype != kv["kv_dtype"]:
            rates = [np.nan if p[f"{dtype}_hit_rate"] is None else 100 * p[f"{dtype}_hit_rate"]
                     for p in sweep]
            ax.plot(sizes, rates, "-^", label=f"{summary['caches'][0]['cache']}, {dtype} KV")
    ax.plot(sizes, [100 * p["block_hit_rate"] for p in sweep], ":s", label="block hash 16")
    ax.axhline(100 * summary["caches"][1]["hit_rate"], color="gray", linestyle="--",
               label="unlimited")
    ax.set_xscale("log")
    ax.set(xlabel="cache size (GiB of KV)" if kv else "cache size (tokens)",
           ylabel="hit rate (%)", ylim=(0, 100),
           title=f"Hit rate vs cache size: {summary['trace']}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="lower right", fontsize=8)
    return _save(fig, path)


def ttft_vs_cached(cached: np.ndarray, prompt: np.ndarray, ttft_s: np.ndarray,
                   path: Path) -> Path:
    """Live mode: each request's time to first token against its cached prompt tokens."""
    fig, ax = _figure()
    points = ax.scatter(cached, 1e3 * ttft_s, c=prompt, s=12, cmap="viridis")
    fig.colorbar(points, ax=ax, label="prompt tokens")
    ax.set(xlabel="cached prompt tokens (server)", ylabel="TTFT (ms)",
           title="Time to first token vs cached tokens")
    return _save(fig, path)


def write_plots(out_dir: Path, summary: dict[str, Any], cached: np.ndarray,
                unlimited: np.ndarray) -> list[Path]:
    """The offline plots: hit rate over time, the cached-token histogram, and (with a sweep)
    hit rate vs cache size."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [hit_rate_over_time(summary, out_dir / "hit_rate_over_time.png"),
               cached_tokens_histogram(cached, unlimited, summary["caches"][0]["cache"],
                                       out_dir / "cached_tokens_hist.png")]
    if summary["sweep"]:
        written.append(hit_rate_vs_cache_size(summary, out_dir / "hit_rate_vs_cache_size.png"))
    return written
