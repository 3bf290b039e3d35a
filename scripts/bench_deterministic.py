"""Where ``--deterministic``'s prefill time goes: one prompt's prefill (``max_tokens`` 1, nothing
cached) on three engines side by side, in rotating order over the repeats:

- ``default``: the default path (the extend kernel or SDPA in prefill, the faster linear form
  per row count);
- ``blocks``: the default path with ``--linear-form blocks`` (the block kernel at every row
  count, which ``--deterministic`` pins);
- ``deterministic``: ``--deterministic`` (the above, and prefill attention through the decode
  kernel).

    python scripts/bench_deterministic.py                     # the default model, 512 tokens
    python scripts/bench_deterministic.py --prompt-len 2048 --repeats 4

Prints the median seconds per prefill of each and its ratio to ``default``.

``--agreement`` instead checks what the mode promises, with and without it: eight chat prompts,
64 greedy tokens each, served one at a time (cold), sent again (cached), and together on a fresh
engine (a batch of 8); it counts the prompts whose tokens, and whose tokens' logprobs bit for
bit, equal their cold run's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from engine import Engine, SamplingParams

ENGINES = {"default": {}, "blocks": {"linear_form": "blocks"},
           "deterministic": {"deterministic": True}}
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain photosynthesis briefly.", "List three prime numbers.", "Who wrote Hamlet?",
             "How do I boil an egg?", "Translate 'good morning' to Spanish.",
             "What is 17 times 23?"]


def agreement(model: str | None) -> None:
    chats = [[{"role": "user", "content": question}] for question in QUESTIONS]
    greedy = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, logprobs=0)
    for name in ("default", "deterministic"):
        with Engine(model, **ENGINES[name]) as engine:
            cold = [engine.generate([chat], greedy)[0] for chat in chats]
            cached = [engine.generate([chat], greedy)[0] for chat in chats]
        with Engine(model, **ENGINES[name]) as engine:
            batched = engine.generate(chats, greedy)
        print(f"{name:>14}: cached = cold {_same(cold, cached, False)}/8 (logprobs "
              f"{_same(cold, cached, True)}/8), batch of 8 = alone {_same(cold, batched, False)}"
              f"/8 (logprobs {_same(cold, batched, True)}/8)")


def _same(cold: list, runs: list, exact: bool) -> int:
    """How many of ``runs`` gave their cold run's tokens (``exact``: and logprobs)."""
    return sum(a.token_ids == b.token_ids and (not exact or a.logprobs == b.logprobs)
               for a, b in zip(cold, runs, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=3, help="prefills timed per repeat")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--agreement", action="store_true",
                        help="count agreeing outputs instead of timing (above)")
    args = parser.parse_args()
    if args.agreement:
        agreement(args.model)
        return
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
