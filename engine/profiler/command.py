"""``radixserve profile TRACE``: how much prompt work prefix caching skips on a trace.

Offline (default): replays the trace through the radix tree at the given cache size, page size
and eviction policy, beside an unlimited cache, 16-token block hashing and no cache; prints the
tables, and with ``--out DIR`` writes CSV/JSON files and PNG plots. With a model's shape
(``--checkpoint``) or ``--kv-bytes-per-token``, sizes are given (``--cache-gb``) and shown in
bytes too, and a sweep adds the hit rate an int8 KV cache gets from the same bytes. With ``--url`` it replays
the trace against an OpenAI-compatible server and compares what it measures with the offline
simulation. docs/profiler.md describes the trace format and the report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

HELP = "measure prefix-cache hit rates of a request trace, offline or against a live server"

DEFAULT_CACHE_TOKENS = 131072  # fp16 KV of a Llama-3-8B-sized model in 16 GiB
# Formats that give prompts as hash ids of token blocks, with the block size of their releases
# (mooncake.py and bailian.py default to the same; a test checks).
BLOCK_TOKENS = {"mooncake": 512, "bailian": 16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.contracts.engine_config import EngineConfig
    from engine.contracts.options import declared_options
    from engine.profiler.kv_bytes import KV_CACHE_DTYPES
    from radix.eviction import POLICIES
    from radix.host import WRITE_POLICIES

    parser.add_argument("trace", type=Path, help="JSONL trace (docs/profiler.md)")
    parser.add_argument("--format", choices=("radixserve", *BLOCK_TOKENS), default="radixserve",
                        help="the trace's format: radixserve's own (token ids, text or chat), "
                             "Mooncake's or Alibaba Bailian's (hash_ids of token blocks)")
    parser.add_argument("--block-tokens", type=int, default=None,
                        help="tokens per hash id in a block-hash trace (default: the format's "
                             "own, " + ", ".join(f"{f} {n}" for f, n in BLOCK_TOKENS.items())
                             + ")")
    parser.add_argument("--tokenizer", metavar="DIR|FILE.gguf",
                        help="the tokenizer of traces with text prompts: a Hugging Face "
                             "directory or a .gguf file (default: none)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--cache-tokens", type=int, default=None,
                      help=f"KV cache size in tokens (default {DEFAULT_CACHE_TOKENS:,})")
    size.add_argument("--num-pages", type=int, help="KV cache size in pages")
    size.add_argument("--cache-gb", type=float, metavar="G",
                      help="KV cache size in GiB, in whole pages of the bytes a token takes "
                           "(needs --checkpoint or --kv-bytes-per-token)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    parser.add_argument("--policy", choices=tuple(POLICIES), default="lru",
                        help="eviction policy (default lru)")
    parser.add_argument("--sweep", nargs="?", const="auto", metavar="TOKENS,...",
                        help="also replay at several cache sizes: a comma-separated list of "
                             "token counts, or none for 8 sizes up to the trace's footprint")
    timing = parser.add_argument_group(
        "requests overlapping in time, and a host tier (offline; docs/profiler.md)")
    timing.add_argument("--prefill-tps", type=float,
                        help="requests overlap: each holds its pages while it prefills its "
                             "uncached prompt tokens at this many tokens/s")
    timing.add_argument("--decode-tps", type=float,
                        help="requests overlap: ... and decodes its output at this many tokens/s")
    timing.add_argument("--durations", type=Path, metavar="CSV",
                        help="requests overlap as they did in a live replay: the send time, TTFT "
                             "and latency of each request from its live_requests.csv")
    timing.add_argument("--no-head-wait", action="store_true",
                        help="admit a request at once even when another one is prefilling its "
                             "shared head (vLLM does; radixserve and SGLang hold it back)")
    timing.add_argument("--cache-write-policy", default="write_back",
                        choices=WRITE_POLICIES,
                        help="when the host tier gets a copy, as serve's flag (default "
                             "write_back: when the device evicts it)")
    for tier, tokens_help in (
            ("disk", "a disk tier of this many tokens, as serve's --disk-cache-dir (written "
                     "through in whole blocks, loaded past the tree's match)"),
            ("host", "a host tier of this many tokens behind the cache, filled as "
                     "--cache-write-policy says (hits split into device and host)")):
        tier_size = timing.add_mutually_exclusive_group()
        tier_size.add_argument(f"--{tier}-cache-tokens", type=int, help=tokens_help)
        tier_size.add_argument(f"--{tier}-cache-gb", type=float, metavar="G",
                               help=f"the {tier} tier's size in GiB instead (needs --checkpoint "
                                    "or --kv-bytes-per-token)")
    kv = parser.add_argument_group(
        "cache sizes in bytes, and what an 8-bit KV cache buys (docs/profiler.md)")
    shape = kv.add_mutually_exclusive_group()
    shape.add_argument("--checkpoint", type=Path, metavar="DIR|FILE.gguf",
                       help="the model whose KV shape sets the bytes of a cached token: a "
                            "checkpoint directory or a .gguf file (its config or metadata is "
                            "read, never its weights); adds int8 to --sweep")
    shape.add_argument("--kv-bytes-per-token", type=int, metavar="N",
                       help="the bytes of a cached token, given outright")
    kv.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                    help="what the cache stores, as the engine's --kv-cache-dtype (with "
                         "--checkpoint): auto is the model's dtype (bfloat16 when its config "
                         "names none), int8 a byte a value plus a 2-byte scale per token and KV "
                         "head (default auto)")
    chunk = next(option.default for option in declared_options(EngineConfig)
                 if option.name == "chunked_prefill_size")
    swa = parser.add_argument_group(
        "sliding-window layers in pools of their own, as serve's --sliding-kv-ratio "
        "(docs/profiler.md)")
    swa.add_argument("--sliding-kv-ratio", type=float, metavar="R",
                     help="replay the engine's two pools: the sliding layers' KV in R pages per "
                          "cache page, the full layers' in the cache; reports the hit rate and "
                          "each pool's memory beside full KV in the same memory (default: off)")
    swa.add_argument("--sliding-window", type=int, metavar="W",
                     help="the sliding layers' window when --checkpoint does not give it "
                          "(default: the checkpoint's)")
    swa.add_argument("--sliding-layers", metavar="K/L",
                     help="K of every L layers slide, with --sliding-window (default: the "
                          "checkpoint's)")
    swa.add_argument("--chunked-prefill-size", type=int, default=chunk,
                     help=f"prompt tokens a prefill step computes, as serve's (default {chunk})")
    parser.add_argument("--windows", type=int, default=10,
                        help="time windows in the hit-rate-over-time table (default 10)")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="write summary.json, CSV files and PNG plots here")
    live = parser.add_argument_group("live replay against an OpenAI-compatible server")
    live.add_argument("--url", help="server base URL, e.g. http://127.0.0.1:30000")
    live.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    live.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                      help="bearer token (default $OPENAI_API_KEY)")
    live.add_argument("--rate", type=float,
                      help="send at this many requests/s instead of the trace's arrival times")
    live.add_argument("--max-concurrency", type=int, default=64,
                      help="most requests in flight at once, live and in an offline replay "
                           "whose requests overlap (default 64)")
    live.add_argument("--timeout", type=float, default=600.0,
                      help="seconds before one request is given up (default 600)")


def _fail(message: str, code: int = 2) -> int:
    print(f"radixserve profile: {message}", file=sys.stderr)
    return code


def _kv_bytes(args: argparse.Namespace) -> Any:
    """The bytes of a cached token (a ``KVBytes``), or None when neither a model nor a count
    gives them; a ValueError when an option needs them."""
    from engine.profiler.kv_bytes import KVBytes, read_shape

    if args.checkpoint is not None:
        return KVBytes.of_model(read_shape(args.checkpoint), args.kv_cache_dtype)
    if args.kv_cache_dtype != "auto":
        raise ValueError(f"--kv-cache-dtype {args.kv_cache_dtype} sizes a model's KV rows: pass "
                         "--checkpoint DIR|FILE.gguf too"
                         + (" (--kv-bytes-per-token already gives the bytes of a token)"
                            if args.kv_bytes_per_token else ""))
    if args.kv_bytes_per_token is not None:
        return KVBytes(args.kv_bytes_per_token)
    for flag, value in (("--cache-gb", args.cache_gb), ("--host-cache-gb", args.host_cache_gb),
                        ("--disk-cache-gb", args.disk_cache_gb)):
        if value is not None:
            raise ValueError(f"{flag} needs the bytes of a cached token: pass --checkpoint "
                             "DIR|FILE.gguf (a model's config is read, not its weights) or "
                             "--kv-bytes-per-token N")
    return None


def _pages_in(kv: Any, gib: float, flag: str, page_size: int, sliding: Any = None) -> int:
    """Whole pages in ``gib`` GiB: of every layer's KV, or with ``sliding`` (a
    ``SlidingPools``) of the full layers' and their share of the sliding pool's."""
    from engine.profiler.kv_bytes import format_bytes

    if sliding is not None:
        pages = sliding.pages_in(kv, gib, page_size)
        if pages < 1:
            raise ValueError(f"{flag} {gib:g} holds no page of both pools")
        return pages
    pages = kv.pages(gib, page_size)
    if pages < 1:
        raise ValueError(f"{flag} {gib:g} holds no page: a page of {page_size} tokens takes "
                         f"{format_bytes(kv.bytes_per_token * page_size)}")
    return pages


def _sliding(args: argparse.Namespace) -> Any:
    """The two pools of ``--sliding-kv-ratio`` (a ``SlidingPools``), or None without it."""
    from engine.profiler.sliding import NO_DISK, SlidingLayers, SlidingPools, read_layers

    given = args.sliding_window is not None or args.sliding_layers is not None
    if args.sliding_kv_ratio is not None and not 0 <= args.sliding_kv_ratio <= 1:
        raise ValueError(f"--sliding-kv-ratio is from 0 to 1, as serve's; got "
                         f"{args.sliding_kv_ratio:g}")
    if not args.sliding_kv_ratio:
        if given:
            raise ValueError("--sliding-window and --sliding-layers describe the model for "
                             "--sliding-kv-ratio R: pass it too")
        return None
    if args.sweep or args.url:
        raise ValueError("--sliding-kv-ratio replays one cache size offline: drop "
                         + ("--sweep" if args.sweep else "--url"))
    if args.disk_cache_tokens or args.disk_cache_gb:
        raise ValueError(NO_DISK)
    if given:
        if args.sliding_window is None or args.sliding_layers is None:
            raise ValueError("--sliding-window W and --sliding-layers K/L go together")
        layers = SlidingLayers.parse(args.sliding_layers, args.sliding_window)
    elif args.checkpoint is not None:
        layers = read_layers(args.checkpoint)
    else:
        raise ValueError("--sliding-kv-ratio needs the model's sliding layers: pass "
                         "--checkpoint DIR|FILE.gguf, or --sliding-window W and "
                         "--sliding-layers K/L")
    return SlidingPools(layers, args.sliding_kv_ratio, args.chunked_prefill_size)


def _num_pages(args: argparse.Namespace, kv: Any, sliding: Any = None) -> int:
    if args.num_pages is not None:
        return args.num_pages
    if args.cache_gb is not None:
        return _pages_in(kv, args.cache_gb, "--cache-gb", args.page_size, sliding)
    cache_tokens = DEFAULT_CACHE_TOKENS if args.cache_tokens is None else args.cache_tokens
    return max(1, cache_tokens // args.page_size)


def _tier_tokens(args: argparse.Namespace, kv: Any, tier: str, sliding: Any = None) -> int | None:
    """A tier's size in tokens (``tier``: host or disk), whole pages when given in GiB (a host
    page with ``sliding`` as the engine's: its share of window pages too); None: no such
    tier."""
    gb = getattr(args, f"{tier}_cache_gb")
    if gb is not None:
        return _pages_in(kv, gb, f"--{tier}-cache-gb", args.page_size,
                         sliding if tier == "host" else None) * args.page_size
    return getattr(args, f"{tier}_cache_tokens")


def _parse_sweep(spec: str | None) -> list[int] | str | None:
    """None (no sweep), "auto", or the listed cache sizes in tokens."""
    if spec is None or spec == "auto":
        return spec
    try:
        sizes = sorted({int(size.replace("_", "")) for size in spec.split(",")})
    except ValueError:
        raise ValueError(f"--sweep takes token counts like 4096,16384, not {spec!r}") from None
    if sizes[0] < 1:
        raise ValueError("--sweep sizes must be positive token counts")
    return sizes


def _offline(args: argparse.Namespace, requests: list, sizes: list[int] | str | None,
             progress: bool, kv: Any, sliding: Any = None) -> Any:
    """Replay, print the report, write the files; returns the profile."""
    from engine.profiler.live import read_measured
    from engine.profiler.replay import ServiceModel, Tiers
    from engine.profiler.report import format_text, summarize, write_outputs
    from engine.profiler.simulate import run_profile, run_sweep, sweep_sizes

    # Serial unless rates or a live replay's timings are given.
    measured = read_measured(args.durations) if args.durations else None
    service = ServiceModel(args.prefill_tps, args.decode_tps, measured, args.max_concurrency,
                           head_wait=not args.no_head_wait)
    host_tokens = _tier_tokens(args, kv, "host", sliding)
    disk_tokens = _tier_tokens(args, kv, "disk")
    tiers = Tiers(-(-(host_tokens or 0) // args.page_size), args.cache_write_policy,
                  disk_tokens or 0)
    profile = run_profile(requests, _num_pages(args, kv, sliding), args.page_size, args.policy,
                          progress, service, tiers, sliding)
    profile.tiers = tiers
    sweep = None
    if sizes == "auto":
        sizes = sweep_sizes(requests, args.page_size, profile.unlimited.peak_tokens)
    if sizes:
        sweep = run_sweep(requests, sizes, args.page_size, args.policy, progress, service, kv)
    summary = summarize(profile, args.trace.name, args.windows, sweep, args.block_tokens,
                        service.describe(), host_tokens, kv, disk_tokens)
    print(format_text(summary))
    if args.out:
        from engine.profiler.plots import write_plots

        written = write_outputs(args.out, profile, summary)
        written += write_plots(args.out, summary, profile.radix.cached, profile.unlimited.cached)
        print(f"\nwrote {', '.join(str(p) for p in written)}")
    return profile


def _live(args: argparse.Namespace, trace: list, profile: Any, progress: bool) -> int:
    import numpy as np

    from engine.profiler.live import (
        LiveError,
        format_live,
        replay_live,
        result_rows,
        summarize_live,
    )
    from engine.profiler.report import write_csv

    try:
        model, results = replay_live(trace, args.url, args.model, args.api_key, args.rate,
                                     args.max_concurrency, args.timeout, progress)
    except LiveError as exc:
        return _fail(str(exc), 1)
    # every tier's hits: what the server's cached_tokens counts
    simulated = sum(profile.radix.by_tier().values()) if profile is not None else None
    local = profile.prompt_tokens if profile is not None else None
    label = profile.radix.label if profile is not None else None
    summary = summarize_live(results, model, args.url, simulated, label, local)
    if profile is not None:
        summary["timed_simulation"] = _timed_simulation(args, profile, results, summary)
    print(format_live(summary))
    if profile is None:
        print("(no offline comparison: this trace has text prompts; pass --tokenizer DIR)")
    if args.out:
        from engine.profiler.plots import ttft_vs_cached

        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "live_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        write_csv(args.out / "live_requests.csv", result_rows(results, simulated))
        timed = [r for r in results if r.ttft_s is not None and r.prompt_tokens is not None]
        if timed:
            ttft_vs_cached(np.array([r.cached_tokens or 0 for r in timed]),
                           np.array([r.prompt_tokens for r in timed]),
                           np.array([r.ttft_s for r in timed]), args.out / "ttft_vs_cached.png")
    return 0 if summary["succeeded"] else 1


def _timed_simulation(args: argparse.Namespace, profile: Any, results: list,
                      summary: dict[str, Any]) -> dict[str, Any]:
    """The offline replay again, on the live run's own timeline (each request sent, prefilled
    and finished when the server did it): what is left of the gap is the server's doing."""
    import numpy as np

    from engine.profiler.live import measured_times, tier_tokens
    from engine.profiler.replay import ServiceModel
    from engine.profiler.simulate import replay_radix

    service = ServiceModel(measured=measured_times(results), max_concurrency=args.max_concurrency)
    run = replay_radix(profile.requests, profile.num_pages, profile.page_size, profile.policy,
                       "radix on the live timeline", service=service, tiers=profile.tiers)
    ok = np.array([r.error is None and r.prompt_tokens is not None for r in results])
    total = max(1, profile.prompt_tokens[ok].sum())
    replayed = {tier: float(cached[ok].sum() / total) for tier, cached in run.by_tier().items()}
    measured = {tier: float(cached[ok].sum() / total)
                for tier, cached in tier_tokens(results).items() if tier in replayed}
    hit_rate = sum(replayed.values())
    return {"hit_rate": hit_rate, "gap_points": 100 * (summary["hit_rate"] - hit_rate),
            "peak_running": run.peak_running,
            "tiers": {tier: {"live": measured[tier], "replay": replayed[tier],
                             "gap_points": 100 * (measured[tier] - replayed[tier])}
                      for tier in replayed}}


def run(args: argparse.Namespace) -> int:
    from engine.profiler.replay import CacheTooSmall
    from engine.profiler.trace import (
        TraceError,
        load_requests,
        load_tokenizer,
        needs_tokenizer,
        read_requests,
        read_trace,
    )

    positive = ("page_size", "windows", "max_concurrency", "num_pages", "cache_tokens", "cache_gb",
                "rate", "block_tokens", "prefill_tps", "decode_tps", "host_cache_tokens",
                "host_cache_gb", "disk_cache_tokens", "disk_cache_gb", "kv_bytes_per_token",
                "chunked_prefill_size", "sliding_window")
    if any(getattr(args, name) is not None and getattr(args, name) <= 0 for name in positive):
        flags = [f"--{name.replace('_', '-')}" for name in positive]
        return _fail(f"{', '.join(flags[:-1])} and {flags[-1]} must be positive")
    try:
        kv = _kv_bytes(args)
        sizes = _parse_sweep(args.sweep)
        sliding = _sliding(args)
    except ValueError as exc:
        return _fail(str(exc))
    progress = sys.stderr.isatty()
    if args.format in BLOCK_TOKENS:
        if args.url:
            return _fail(f"a {args.format.capitalize()} trace's token ids are its block hashes, "
                         "not the model's vocabulary: replay it offline (without --url)")
        from engine.profiler.bailian import read_bailian
        from engine.profiler.mooncake import read_mooncake

        read = read_mooncake if args.format == "mooncake" else read_bailian
        if args.block_tokens is None:
            args.block_tokens = BLOCK_TOKENS[args.format]
        try:
            _offline(args, read(args.trace, args.block_tokens), sizes, progress, kv, sliding)
        except (OSError, TraceError, ValueError, CacheTooSmall) as exc:
            return _fail(str(exc))
        return 0
    if args.block_tokens is not None:
        return _fail("--block-tokens is for block-hash traces (--format mooncake or bailian): "
                     "a radixserve trace gives its tokens")
    try:
        # The live client sends lines as written; offline, read_requests streams them.
        trace = read_trace(args.trace) if args.url else None
    except (OSError, TraceError, ValueError) as exc:
        return _fail(str(exc))
    try:
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    except ValueError as exc:
        return _fail(str(exc))
    profile = None
    if trace is None or tokenizer is not None or not needs_tokenizer(trace):
        try:
            requests = (read_requests(args.trace, tokenizer) if trace is None
                        else load_requests(trace, tokenizer))
            profile = _offline(args, requests, sizes, progress, kv, sliding)
        except (OSError, TraceError, ValueError, CacheTooSmall) as exc:
            return _fail(str(exc))
    if args.url:
        print()
        return _live(args, trace, profile, progress)
    return 0
