"""Where ``--deterministic``'s prefill time goes: one prompt's prefill (``max_tokens`` 1, nothing
cached) on three engines side by side, in rotating order over the repeats:

- ``default``: the default path (SDPA prefill, the faster linear form per row count);
- ``blocks``: the default path with ``--linear-form blocks`` (the block kernel at every row
  count, which ``--deterministic`` pins);
- ``deterministic``: ``--deterministic`` (the above, and prefill attention through the decode
  kernel).

    python scripts/bench_deterministic.py                     # the default model, 512 tokens
    python scripts/bench_deterministic.py --prompt-len 2048 --repeats 4

Prints the median seconds per prefill of each and its ratio to ``default``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from engine import Engine, SamplingParams

ENGINES = {"default": {}, "blocks": {"linear_form": "blocks"},
           "deterministic": {"deterministic": True}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=3, help="prefills timed per repeat")
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    engines = {name: Engine(args.model, **options) for name, options in ENGINES.items()}
    try:
        seconds: dict[str, list[float]] = {name: [] for name in engines}
        once = SamplingParams(max_tokens=1, temperature=0.0)
        for repeat in range(args.repeats + 1):  # repeat 0 warms up
            names = list(engines)
            names = names[repeat % len(names):] + names[: repeat % len(names)]
            for name in names:
                rng = random.Random(f"{repeat}-{name}")  # fresh prompts: no cache hit
                started = time.perf_counter()
                for _ in range(args.prompts):
                    prompt = rng.choices(range(100, 10_000), k=args.prompt_len)
                    engines[name].generate([prompt], once)
                if repeat:
                    seconds[name].append((time.perf_counter() - started) / args.prompts)
    finally:
        for engine in engines.values():
            engine.close()
    base = statistics.median(seconds["default"])
    for name, values in seconds.items():
        median = statistics.median(values)
        print(f"{name:>14}: {1000 * median:7.1f} ms per {args.prompt_len}-token prefill "
              f"({median / base:.2f}x default)")


if __name__ == "__main__":
    main()
