"""Offline throughput: the engine against transformers' padded ``generate``, same model, same
prompts, same run.

Workloads: ``shared`` (G groups x P prompts, each a shared prefix + its own question) and a
``control`` with no sharing (every prompt a fresh random sequence of the same length).
Reports output tokens/s of each and their ratio, the engine's prefix hit rate, KV utilisation
sampled every step of an in-process run of the same workload (physical: distinct slots holding
live tokens / distinct slots held, a shared page counted once; per sequence: each sequence's
computed tokens / the slots of its page table, summed) and the serving overhead (engine tokens/s over the model
runner alone replaying the same batch shapes).

    python scripts/bench_offline.py                      # 16 x 16, 1024 + 64 prompt, 64 out
    python scripts/bench_offline.py --groups 4 --per-group 8 --prefix 256   # quick
    python scripts/bench_offline.py --model demo         # the tiny random-weight demo model

The model is SmolLM2-135M-Instruct (the default model) unless ``--model`` names another
(``demo``, a checkpoint directory or a .gguf file).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from engine import Engine, SamplingParams
from engine.checkpoints.model_source import resolve_model
from engine.contracts.engine_config import EngineConfig
from engine.contracts.protocol import TokenizedRequest, pack_ids
from engine.profiler.workload import grouped_prompt_ids
from engine.worker.process import Worker
from scheduler.scheduler import Scheduler


def workload(groups: int, per_group: int, prefix: int, question: int, shared: bool,
             vocab: int, seed: int = 0) -> list[list[int]]:
    """The profiler's shared-prefix draw (groups interleaved, as real traffic arrives): a head
    per group, or with ``shared`` False one per prompt; ids from 3 up, clear of special ones."""
    # Seeded apart per workload: one engine runs both and keeps what the first one cached.
    rng = np.random.default_rng([seed, int(shared)])
    return grouped_prompt_ids(rng, groups, per_group, prefix, question, 3, vocab, shared)


def run_engine(engine: Engine, prompts, output_len: int) -> tuple[float, float]:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    results = engine.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(r.error is None for r in results), results[0].error
    hit = sum(r.cached_tokens for r in results) / sum(r.prompt_tokens for r in results)
    return len(prompts) * output_len / elapsed, hit


def run_transformers(model, prompts, output_len: int, batch_size: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, p in enumerate(chunk):  # left padding, as decoder-only generation needs
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                           min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    return len(prompts) * output_len / (time.perf_counter() - start)


def in_process(model_dir: str, prompts, output_len: int, options: dict
               ) -> tuple[float, float, float]:
    """KV utilisation sampled every step, and the runner alone replaying the same batches."""
    config = EngineConfig(model=model_dir, **options)
    worker = Worker(config)
    sched = Scheduler(config, worker.info)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        sched.add_request(TokenizedRequest(rid=str(i), prompt_ids=pack_ids(p), params=params,
                                           reply_to=0))
    page_size = worker.info.page_size
    batches, utilisation = [], []
    while not sched.idle:
        batch = sched.schedule()
        if batch is None:
            continue
        batches.append(batch)
        sched.process_result(worker.step(batch))
        sched.take_outputs()
        # A page shared by several sequences counts once, filled as far as any of them filled it.
        filled: dict[int, int] = {}
        seq_tokens = seq_slots = 0
        for req in sched.running:
            for seq in req.live_seqs():
                seq_tokens += seq.computed
                seq_slots += len(seq.pages) * page_size
                for i, page in enumerate(seq.pages):
                    used = min(page_size, seq.computed - i * page_size)
                    if page >= 0 and used > filled.get(page, 0):
                        filled[page] = used
        if filled:
            utilisation.append((sum(filled.values()) / (len(filled) * page_size),
                                seq_tokens / seq_slots))
    # The runner alone: same batches, no scheduling, no IPC; on a fresh pool, since the engine's
    # run also touched its KV pages for the first time (page faults are the runner's cost).
    del worker
    fresh = Worker(config)
    start = time.perf_counter()
    for batch in batches:
        fresh.step(batch)
    runner_tps = len(prompts) * output_len / (time.perf_counter() - start)
    physical = statistics.mean(u[0] for u in utilisation)
    per_sequence = statistics.mean(u[1] for u in utilisation)
    return physical, per_sequence, runner_tps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--per-group", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--question", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--num-pages", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--model", help="demo, a checkpoint directory or a .gguf file "
                                    "(default: the default model, SmolLM2-135M-Instruct)")
    args = ap.parse_args()

    source = resolve_model(args.model)
    model_dir, model_name = source.path, source.name or args.model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    options = {"num_pages": args.num_pages, "max_running_requests": 256}
    rows = []
    with Engine(model_dir, **options) as engine:
        for name, shared in (("shared prefix", True), ("no sharing", False)):
            # Every repeat draws new prompts (its own seed): a repeat of the same prompts would
            # hit what the previous one cached.
            runs = [workload(args.groups, args.per_group, args.prefix, args.question, shared,
                             vocab, seed=r) for r in range(args.repeats)]
            engine_runs = [run_engine(engine, prompts, args.output_len) for prompts in runs]
            hf_tps = statistics.median(run_transformers(hf, prompts, args.output_len,
                                                        args.hf_batch_size) for prompts in runs)
            eng_tps = statistics.median(r[0] for r in engine_runs)
            hit = statistics.median(r[1] for r in engine_runs)
            # The overhead compares the first run (cold KV pool, like the replay's fresh one).
            rows.append((name, eng_tps, hf_tps, hit, runs[0], engine_runs[0][0]))
    print(f"workload: {args.groups} groups x {args.per_group} prompts, prefix {args.prefix} + "
          f"question {args.question} tokens, {args.output_len} output tokens; {model_name}, CPU")
    print()
    print("| workload | engine tok/s | transformers tok/s | ratio | hit rate | KV util "
          "(physical / per sequence) | overhead |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, eng_tps, hf_tps, hit, prompts, first_tps in rows:
        physical, per_seq, runner_tps = in_process(model_dir, prompts, args.output_len, options)
        print(f"| {name} | {eng_tps:,.0f} | {hf_tps:,.0f} | {eng_tps / hf_tps:.2f}x | {hit:.1%} | "
              f"{physical:.2%} / {per_seq:.2%} | {first_tps / runner_tps:.2f} |")


if __name__ == "__main__":
    main()
