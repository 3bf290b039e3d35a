"""What each vocabulary-sized operation costs a decode step, per model, side by side.

    python scripts/bench_vocab.py --model ~/.cache/radixserve/models/gemma-3-270m-q4_k_m.gguf \\
        --model default --batch-sizes 1,8

Each model loads as ``radixserve serve`` loads it (``--quantization auto``, bf16, the
machine's threads). Its batch prefills ``--context-len`` tokens of text, then decodes
``--steps`` greedy steps through ``ModelRunner.forward``; every step's logits [B, V] are kept.
The served sampler (engine/worker/sampler.py ``sample``) then runs each configuration in
``CONFIGS`` over those same logits, the configurations taking turns (ABBA over ``--repeats``),
and the median milliseconds per step are reported beside plain greedy's: what each adds to a
decode step (forward + greedy sample). Structured output runs the worker's own ``Grammars``
(llguidance) step by step on the logits: the bitmask fill, its expansion to a [B, V] mask, the
masked sample and the matchers' advance. Prompt logprobs (``echo``) time the prefill with every
prompt row's logits against the last row's, and the worker's ``_prompt_logprobs``. Stop handling
times the tokenizer worker's per-token work (``IncrementalDetokenizer`` and ``StopChecker``) and
the scheduler's stop-token test. One-time costs: the grammar engine's view of the vocabulary,
each grammar's compile, the detokenizer's vocabulary facts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.checkpoints.model_source import resolve_model  # noqa: E402
from engine.contracts.engine_config import EngineConfig  # noqa: E402
from engine.contracts.sampling_params import SamplingParams  # noqa: E402
from engine.contracts.step import BatchInput  # noqa: E402
from engine.contracts.structured import StructuredOutputs  # noqa: E402
from engine.contracts.tokenizer import load_tokenizer  # noqa: E402
from engine.contracts.worker_messages import RowSampling  # noqa: E402
from engine.worker.grammar import Grammars  # noqa: E402
from engine.worker.process import _prompt_logprobs  # noqa: E402
from engine.worker.runner import ModelRunner  # noqa: E402
from engine.worker.sampler import RowState, sample  # noqa: E402

GREEDY = {"temperature": 0.0}
CONFIGS: dict[str, dict] = {  # name: SamplingParams fields; every row of the batch takes them
    "greedy": GREEDY,
    "greedy, logprobs=0": {**GREEDY, "logprobs": 0},
    "greedy, top_logprobs=5": {**GREEDY, "logprobs": 5},
    "greedy, top_logprobs=20": {**GREEDY, "logprobs": 20},
    "temperature 0.8": {"temperature": 0.8},
    "temperature 0.8, seeded (n>1 rows)": {"temperature": 0.8, "seed": 7},
    "top_k 40": {"temperature": 0.8, "top_k": 40},
    "top_p 0.95": {"temperature": 0.8, "top_p": 0.95},
    "min_p 0.05": {"temperature": 0.8, "min_p": 0.05},
    "top_k 40 + top_p 0.95 + min_p 0.05": {"temperature": 0.8, "top_k": 40, "top_p": 0.95,
                                           "min_p": 0.05},
    "repetition_penalty 1.1": {**GREEDY, "repetition_penalty": 1.1},
    "presence 0.5 + frequency 0.5": {**GREEDY, "presence_penalty": 0.5,
                                     "frequency_penalty": 0.5},
}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4}},
    "required": ["name", "age", "skills"], "additionalProperties": False}
GRAMMARS = {
    "json_schema": StructuredOutputs(json=json.dumps(PERSON)),
    "regex": StructuredOutputs(regex=r"[a-z ]{1,200}\."),
    "choice": StructuredOutputs(choice=["positive", "negative", "neutral"]),
}
TEXT = ("The harbour was quiet that morning. Fishing boats rocked against the pier while gulls "
        "argued over scraps, and the old lighthouse keeper walked the length of the sea wall, "
        "counting the ropes as he had done for forty years. ")


def ms(seconds: list[float]) -> float:
    return 1e3 * statistics.median(seconds)


def clock(fn: Callable[[], object]) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def decode_logits(runner: ModelRunner, context: np.ndarray, steps: int
                  ) -> tuple[list[torch.Tensor], list[float], list[list[int]]]:
    """Greedy decoding of ``context`` [B, C]: each step's logits, forward seconds and tokens."""
    batch_size, page_size = context.shape[0], runner.page_size
    pages_per_seq = -(-(context.shape[1] + steps) // page_size)
    pages = np.arange(batch_size * pages_per_seq).reshape(batch_size, pages_per_seq)
    logits = runner.forward(BatchInput.build(
        [(p, 0, row) for p, row in zip(pages, context, strict=True)], page_size))
    kept, seconds, tokens = [], [], [[] for _ in range(batch_size)]
    for s in range(steps):
        last = logits.argmax(-1).tolist()
        for row, token in zip(tokens, last, strict=True):
            row.append(token)
        batch = BatchInput.build([(p, context.shape[1] + s, [t])
                                  for p, t in zip(pages, last, strict=True)], page_size)
        began = time.perf_counter()
        logits = runner.forward(batch)
        seconds.append(time.perf_counter() - began)
        kept.append(logits.clone())
    return kept, seconds, tokens


def sampling_rows(fields: dict, context: np.ndarray, outputs: list[list[int]], step: int
                  ) -> list[RowState]:
    return [RowState(SamplingParams(**{**fields, "seed": fields["seed"] + i}
                                    if "seed" in fields else fields),
                     row, np.asarray(out[:step], dtype=np.int32))
            for i, (row, out) in enumerate(zip(context, outputs, strict=True))]


def time_sampling(logits: list[torch.Tensor], context: np.ndarray, outputs: list[list[int]],
                  repeats: int) -> dict[str, float]:
    """Median ms per step of ``sample`` for each configuration, configurations taking turns."""
    rows = {name: [sampling_rows(fields, context, outputs, s) for s in range(len(logits))]
            for name, fields in CONFIGS.items()}
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    names = list(CONFIGS)
    for repeat in range(repeats + 1):
        for name in names[::-1] if repeat % 2 else names:
            spent = [clock(lambda s=s, x=x, name=name: sample(x, rows[name][s]))
                     for s, x in enumerate(logits)]
            if repeat:  # the first round warms up
                times[name] += spent
    return {name: ms(spent) for name, spent in times.items()}


def time_grammar(grammars: Grammars, spec: StructuredOutputs, logits: list[torch.Tensor],
                 tag: str) -> dict[str, float]:
    """One constrained row per batch row, stepping over ``logits``: ms per step of each part.
    A row whose grammar ends starts a fresh one (its compile lands in that step's fill)."""
    params = SamplingParams(temperature=0.0, max_tokens=10_000, structured_outputs=spec)
    batch_size = logits[0].shape[0]
    keys = [f"{tag}-{i}-0" for i in range(batch_size)]
    consumed = [0] * batch_size
    parts: dict[str, list[float]] = {"fill": [], "allowed": [], "sample": [], "advance": []}
    for step_logits in logits:
        rows = [RowSampling(params, consumed[i], grammar_key=keys[i]) for i in range(batch_size)]
        began = time.perf_counter()
        masks = grammars.start_masks(rows)
        masks.done.result()
        parts["fill"].append(time.perf_counter() - began)
        began = time.perf_counter()
        allowed = grammars.allowed(masks, step_logits.device, step_logits.shape[-1])
        parts["allowed"].append(time.perf_counter() - began)
        states = [RowState(params, np.zeros(0, np.int32), np.zeros(c, np.int32))
                  for c in consumed]
        began = time.perf_counter()
        out = sample(step_logits, states, (masks.rows, allowed))
        parts["sample"].append(time.perf_counter() - began)
        began = time.perf_counter()
        advanced = grammars.advance(rows, masks, out.token_ids)
        parts["advance"].append(time.perf_counter() - began)
        for i in range(batch_size):
            consumed[i] += 1 + len(advanced.forced.get(i, ()))
            if i in advanced.ended:
                grammars.release([keys[i]])
                keys[i] = f"{keys[i].rsplit('-', 1)[0]}-{int(keys[i].rsplit('-', 1)[1]) + 1}"
                consumed[i] = 0
    grammars.release(keys)
    return {part: ms(spent) for part, spent in parts.items()}


def one_time_costs(model_dir: str, vocab_size: int, eos_ids: list[int]):
    import llguidance

    from engine.contracts.structured import grammar_text, grammar_tokenizer, parser_limits
    from tokenizer_worker.detokenize import _vocab_facts

    tokenizer = load_tokenizer(model_dir)
    costs = {"detokenizer vocabulary facts": clock(lambda: _vocab_facts(tokenizer)),
             "longest token (get_vocab)": clock(lambda: max(map(len, tokenizer.get_vocab())))}
    grammars = Grammars(model_dir, vocab_size, eos_ids)
    began = time.perf_counter()
    grammars._tokenizer = grammar_tokenizer(tokenizer, vocab_size, eos_ids)
    costs["grammar engine's view of the vocabulary (llguidance)"] = time.perf_counter() - began
    for kind, spec in GRAMMARS.items():
        costs[f"compile {kind}"] = clock(lambda spec=spec: llguidance.LLMatcher(
            grammars.tokenizer, grammar_text(spec), log_level=0, limits=parser_limits()))
    return {name: 1e3 * seconds for name, seconds in costs.items()}, grammars, tokenizer


def time_stop(tokenizer, tokens: list[int], eos_ids: set[int]) -> dict[str, float]:
    """µs per token of the tokenizer worker's detokenize + stop-string check, and of the
    scheduler's stop-token test."""
    from tokenizer_worker.detokenize import IncrementalDetokenizer
    from tokenizer_worker.stop import StopChecker

    def detok(stops: list[str]) -> None:
        detokenizer, checker = IncrementalDetokenizer(tokenizer, tokens[:8]), StopChecker(stops)
        for token in tokens[8:]:
            checker.feed(detokenizer.add([token]))

    stop_ids = [*eos_ids, 106]
    n = len(tokens) - 8
    runs = {"detokenize": [], "detokenize + 2 stop strings": [], "stop token ids": []}
    for _ in range(5):
        runs["detokenize"].append(clock(lambda: detok([])) / n)
        runs["detokenize + 2 stop strings"].append(
            clock(lambda: detok(["\n\nUser:", "<end_of_turn>"])) / n)
        runs["stop token ids"].append(clock(lambda: [t in eos_ids or t in stop_ids
                                                     for t in tokens]) / len(tokens))
    return {name: 1e6 * statistics.median(spent) for name, spent in runs.items()}


def prompt_logprobs_cost(runner: ModelRunner, prompt: np.ndarray) -> dict[str, float]:
    """ms to prefill ``prompt`` with the last row's logits, with every row's, and the worker's
    log-softmax and top-5 over those rows."""
    length, page_size = len(prompt), runner.page_size
    pages = np.arange(-(-length // page_size))
    def prefill(rows: np.ndarray | None):
        batch = BatchInput.build([(pages, 0, prompt)], page_size)
        batch.logits_rows = rows
        return runner.forward(batch)
    every = np.arange(length, dtype=np.int32)
    times: dict[str, list[float]] = {"prefill, last row's logits": [],
                                     "prefill, every row's logits": [],
                                     "prompt logprobs (top 0)": [], "prompt logprobs (top 5)": []}
    from engine.contracts.worker_messages import BatchResult

    for _ in range(3):
        times["prefill, last row's logits"].append(clock(lambda: prefill(None)))
        began = time.perf_counter()
        logits = prefill(every)
        times["prefill, every row's logits"].append(time.perf_counter() - began)
        targets = np.append(prompt[1:], 0)
        for top in (0, 5):
            times[f"prompt logprobs (top {top})"].append(clock(
                lambda top=top, x=logits, y=targets: _prompt_logprobs(
                    BatchResult(batch_id=0), x, y, top)))
        del logits
    return {name: ms(spent) for name, spent in times.items()}


def bench_model(name: str, args) -> dict:
    source = resolve_model(None if name == "default" else name)
    runner = ModelRunner(EngineConfig(model=source.path, kv_cache_gb=args.kv_cache_gb))
    mc = runner.config
    eos_ids = list(mc.eos_token_ids)
    one_time, grammars, tokenizer = one_time_costs(source.path, mc.vocab_size, eos_ids)
    text_ids = tokenizer(TEXT * 40)["input_ids"]
    report = {"model": Path(source.path).name, "vocab": mc.vocab_size, "one_time_ms": one_time,
              "stop_us_per_token": time_stop(tokenizer, text_ids[:400], set(eos_ids)),
              "prompt_logprobs_ms": prompt_logprobs_cost(
                  runner, np.asarray(text_ids[: args.prompt_len], dtype=np.int32)),
              "batches": {}}
    for batch_size in args.batch_sizes:
        context = np.stack([np.asarray(text_ids[i * 7: i * 7 + args.context_len], np.int32)
                            for i in range(batch_size)])
        logits, forward, outputs = decode_logits(runner, context, args.steps)
        entry = {"forward_ms": ms(forward), "sample_ms": time_sampling(
            logits, context, outputs, args.repeats), "grammar_ms": {}}
        for kind, spec in GRAMMARS.items():
            entry["grammar_ms"][kind] = time_grammar(grammars, spec, logits,
                                                     f"{kind}-{batch_size}")
        report["batches"][batch_size] = entry
        del logits
    return report


def print_report(reports: list[dict]) -> None:
    for report in reports:
        print(f"\n### {report['model']} (vocabulary {report['vocab']:,})\n")
        print("| one-time | ms |\n|---|---:|")
        for name, value in report["one_time_ms"].items():
            print(f"| {name} | {value:,.1f} |")
        print("\n| per output token (tokenizer worker / scheduler) | µs |\n|---|---:|")
        for name, value in report["stop_us_per_token"].items():
            print(f"| {name} | {value:,.1f} |")
        print("\n| prompt logprobs / echo | ms |\n|---|---:|")
        for name, value in report["prompt_logprobs_ms"].items():
            print(f"| {name} | {value:,.1f} |")
        for batch_size, entry in report["batches"].items():
            step = entry["forward_ms"] + entry["sample_ms"]["greedy"]
            print(f"\nbatch {batch_size}: forward {entry['forward_ms']:.2f} ms, greedy sample "
                  f"{entry['sample_ms']['greedy']:.2f} ms, decode step {step:.2f} ms\n")
            print("| per step | sample ms | added ms | added / step |\n|---|---:|---:|---:|")
            base = entry["sample_ms"]["greedy"]
            for name, value in entry["sample_ms"].items():
                print(f"| {name} | {value:.3f} | {value - base:+.3f} | "
                      f"{(value - base) / step:+.1%} |")
            for kind, parts in entry["grammar_ms"].items():
                added = parts["allowed"] + parts["sample"] - base + parts["advance"]
                print(f"| {kind}: fill {parts['fill']:.3f} (beside the forward), to mask "
                      f"{parts['allowed']:.3f}, advance {parts['advance']:.3f} | "
                      f"{parts['sample']:.3f} | {added:+.3f} | {added / step:+.1%} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", default=None,
                        help="a GGUF file or checkpoint directory, or 'default' (repeatable; "
                             "default: default)")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--context-len", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=256,
                        help="prompt tokens for the prompt-logprobs rows")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--kv-cache-gb", type=float, default=0.5)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    torch.manual_seed(0)
    reports = []
    with torch.inference_mode():
        for model in args.model or ["default"]:
            reports.append(bench_model(model, args))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; medians over "
          f"{args.steps} steps x {args.repeats} repeats")
    print_report(reports)
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=2))


if __name__ == "__main__":
    main()
