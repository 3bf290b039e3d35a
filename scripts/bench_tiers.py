"""The tiered prefix cache, served: one multi-turn workload whose conversations together hold
several times the device pool, sent to the same engine four ways, one server at a time:

    no tier         --num-pages N                     (what an evicted history costs: recompute)
    host tier (L2)  --num-pages N --host-cache-gb G   (big enough for the working set)
    disk tier (L3)  --num-pages N --disk-cache-dir D  (a fresh directory per server)
    disk tier shared by 2 replicas
                    --dp-size 2, each replica N pages, one directory D shared by both
    unlimited pool  --num-pages 16 N                  (the hit rate a cache could reach)

Conversations run ``--concurrency`` at a time and take turns round robin, so each one's next
turn comes after every other conversation's: its history has long left an LRU device pool of
N pages, and only a tier below can serve it. Every server gets the same user turns
(scripts/bench_serving.py, multi-turn, seeded); greedy replies are the same in every setup.

Reports per setup (medians over ``--repeats``): the hit rate (cached / prompt tokens), the
share of hit tokens each tier served (/metrics, over the whole run), TTFT median, req/s, each
as a ratio to "no tier", and whether the server logged its disk tier turning off.

    python scripts/bench_tiers.py --model demo
    python scripts/bench_tiers.py                  # SmolLM2-135M-Instruct, the default model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serving  # noqa: E402

from engine.runtime.launcher import free_port  # noqa: E402


def start(args: argparse.Namespace, extra: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "engine.cli", "serve", "--port", str(port),
               "--page-size", str(args.page_size), *(["--model", args.model] if args.model
                                                        else []), *extra]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    line = proc.stdout.readline()
    if "serving" not in line:
        proc.kill()
        raise RuntimeError(f"{' '.join(command)} did not start:\n{log.read_text()}")
    return proc, f"http://127.0.0.1:{port}"


def run(args: argparse.Namespace, name: str, extra: list[str], work: Path) -> dict:
    proc, url = start(args, extra, work / f"{name}.log")
    try:
        argv = ["--url", url, "--name", name, "--workload", "multi-turn",
                "--conversations", str(args.conversations), "--turns", str(args.turns),
                "--head", str(args.head), "--question", str(args.question),
                "--output-len", str(args.output_len), "--concurrency", str(args.concurrency),
                "--repeats", str(args.repeats), "--pause", "1", "--seed", str(args.seed)]
        report = asyncio.run(bench_serving.bench(bench_serving.parse_args(argv)))
        tiers = tier_hits(url)
    finally:
        proc.terminate()
        proc.wait(60)
    log = (work / f"{name}.log").read_text()
    return {**report["summary"][0]["medians"][name], "tier_hit_tokens": tiers,
            "disk_tier_turned_off": "the disk cache" in log and ") is off:" in log}


def tier_hits(url: str) -> dict[str, float]:
    """Prompt tokens the cache served so far, by tier (/metrics: every repeat and warm-up)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {sample.labels["tier"]: sample.value
            for family in text_string_to_metric_families(text)
            if family.name == "radixserve_prefix_cache_tier_hit_tokens"
            for sample in family.samples if sample.name.endswith("_total")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="as serve's --model (default: the default model)")
    parser.add_argument("--num-pages", type=int, default=128, help="the device pool (N)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--host-cache-gb", type=float, default=2.0)
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--head", type=int, default=768)
    parser.add_argument("--question", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1,
                        help="the traffic's seed: every setup gets the same user turns")
    parser.add_argument("--setups", help="comma-separated setups to run (default: all; "
                        "'no tier' always, as the baseline)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-tiers-"))
    pool = ["--num-pages", str(args.num_pages)]
    setups = {"no tier": pool, "host tier (L2)": [*pool, "--host-cache-gb",
                                                  str(args.host_cache_gb)],
              "disk tier (L3)": [*pool, "--disk-cache-dir", str(work / "kv")],
              "disk tier shared by 2 replicas": [*pool, "--dp-size", "2", "--disk-cache-dir",
                                        str(work / "kv")],
              "unlimited pool": ["--num-pages", str(16 * args.num_pages)]}
    chosen = args.setups.split(",") if args.setups else list(setups)
    unknown = sorted(set(chosen) - set(setups))
    if unknown or "no tier" not in chosen:
        parser.error(f"--setups takes 'no tier' and any of {', '.join(setups)}; got {unknown}")
    results = {}
    try:
        for name, extra in ((name, setups[name]) for name in chosen):
            (work / "kv").mkdir(mode=0o700, exist_ok=True)
            began = time.monotonic()
            results[name] = run(args, name.split(" (")[0].replace(" ", "-"), extra, work)
            shutil.rmtree(work / "kv", ignore_errors=True)
            print(f"{name}: {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = results["no tier"]
    rows = ["| setup | hit rate | hits by tier (device / host / disk) | TTFT median (ms) | "
            "req/s | TTFT vs no tier | req/s vs no tier | disk tier turned off |",
            "|---|---|---|---|---|---|---|---|"]
    for name, m in results.items():
        hits = m["tier_hit_tokens"]
        total = sum(hits.values()) or 1
        split = " / ".join(f"{hits.get(tier, 0) / total:.2f}" for tier in ("device", "host", "disk"))
        rows.append(f"| {name} | {m['cached_fraction']:.3f} | {split} | "
                    f"{m['ttft_median_ms']:.1f} | {m['req_per_s']:.2f} | "
                    f"{m['ttft_median_ms'] / base['ttft_median_ms']:.2f}x | "
                    f"{m['req_per_s'] / base['req_per_s']:.2f}x | "
                    f"{'yes' if m['disk_tier_turned_off'] else 'no'} |")
    print("\n".join(rows))
    if args.json:
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)},
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()
