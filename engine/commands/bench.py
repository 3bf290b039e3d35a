"""``radixserve bench``: offline throughput of the engine on a synthetic workload or a trace.

Every request of the workload is submitted at once (a batch job), decoded greedily to its
trace's output length; the report gives throughput and how much prompt work the prefix cache
skipped. For serving latency against a running server, see ``radixserve profile --url``.
"""

from __future__ import annotations

import argparse
import sys
import time

from engine.commands.options import add_engine_arguments, config_from_args

HELP = "measure offline throughput and prefix-cache hits on a synthetic workload or a trace"
KINDS = ("shared-prefix", "multi-turn", "tree", "few-shot", "random")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--workload", choices=KINDS, default="shared-prefix",
                        help="a synthetic workload with its default shape (radixserve workload "
                             "gen KIND --help lists it; token ids within the model's vocabulary; "
                             "default: shared-prefix)")
    source.add_argument("--trace", help="a JSONL trace (docs/profiler.md)")
    parser.add_argument("--workload-seed", type=int, default=0,
                        help="seed of the synthetic workload (default: 0)")
    parser.add_argument("--max-requests", type=int, default=None,
                        help="use only the first N requests (default: all of them)")
    add_engine_arguments(parser)


def _requests(args: argparse.Namespace, vocab_size: int):
    from engine.profiler.trace import read_trace
    from engine.profiler.workload import KINDS as WORKLOADS
    from engine.profiler.workload import generate

    if args.trace:
        trace = read_trace(args.trace)
    else:
        trace = generate(args.workload, WORKLOADS[args.workload].params(), args.workload_seed,
                         vocab_size=vocab_size)
    trace = trace[: args.max_requests] if args.max_requests else trace
    prompts = [r.prompt_token_ids or r.prompt or r.messages for r in trace]
    return prompts, [max(r.output_len, 1) for r in trace]


def run(args: argparse.Namespace) -> int:
    import msgspec

    from engine.contracts.sampling_params import SamplingParams
    from engine.runtime.offline import Engine, EngineDead, LaunchError

    config = config_from_args(args)
    try:
        with Engine(**msgspec.structs.asdict(config)) as engine:
            prompts, lengths = _requests(args, engine.info.vocab_size)
            params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                      for n in lengths]
            start = time.perf_counter()
            results = engine.generate(prompts, params)
            elapsed = time.perf_counter() - start
            weights = engine.info.weight_bytes
    except (EngineDead, LaunchError) as exc:
        print(f"radixserve bench: {exc}", file=sys.stderr)
        return 1
    failed = [r for r in results if r.error is not None]
    if failed:
        print(f"radixserve bench: {len(failed)} requests failed, e.g. {failed[0].error}",
              file=sys.stderr)
        return 1
    prompt = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    output = sum(len(c.token_ids) for r in results for c in r.outputs)
    formats = ", ".join(f"{name} {size / 2**20:,.1f} MiB" for name, size in weights.items())
    print(f"weights           {formats} (--quantization {config.quantization})")
    print(f"requests          {len(results):,}")
    print(f"prompt tokens     {prompt:,} ({cached:,} cached: {cached / max(prompt, 1):.1%})")
    print(f"output tokens     {output:,}")
    print(f"time              {elapsed:.2f} s")
    print(f"throughput        {len(results) / elapsed:.2f} req/s, {output / elapsed:,.0f} output "
          f"tok/s, {(prompt + output) / elapsed:,.0f} total tok/s")
    return 0
