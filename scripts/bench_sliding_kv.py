"""Sliding-window layers holding only their window (``--sliding-kv-ratio R``) against full KV in
those layers (``0``), in-process (the scheduler and the model worker, no server), on one model.

Three measurements, each run for both settings side by side:

    capacity  N prompts of L random tokens at one --kv-cache-gb: the most sequences decoding
              at once (every one of them past its whole prompt), and the preemptions
    hits      C conversations x T turns ([head H | user Q], then the previous prompt + the
              reply's ids + Q), then every first turn sent again: the prefix cache's hit rate
              (hit / looked-up prompt tokens) for the turns and for the resends
    decode    B prompts of L tokens decoding D tokens together: output tok/s over the steps
              where every sequence decodes, in ABBA order (full, sliding, sliding, full)
    disk      one prompt of L tokens served with --disk-cache-dir, then sent to a new
              scheduler and worker on the directory (a restart): the bytes of its block files
              and window files, and the tokens the restart reads back from disk

    python scripts/bench_sliding_kv.py --model ~/.cache/radixserve/models/gemma-3-270m-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from engine.checkpoints.model_source import resolve_model
from engine.contracts.engine_config import EngineConfig
from engine.contracts.protocol import TokenizedRequest, pack_ids, unpack_ids
from engine.contracts.sampling_params import SamplingParams
from engine.worker.process import Worker
from scheduler.request import Status
from scheduler.scheduler import Scheduler


class Engine:
    """The scheduler and the worker in one process, one step at a time."""

    def __init__(self, model: str, ratio: float, **options) -> None:
        self.config = EngineConfig(model=model, sliding_kv_ratio=ratio, **options)
        self.config.validate()
        self.worker = Worker(self.config)
        self.sched = Scheduler(self.config, self.worker.info)
        self.outputs: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}
        self.next_id = 0

    def add(self, prompt: list[int], max_tokens: int) -> str:
        rid = f"r{self.next_id}"
        self.next_id += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.sched.add_request(TokenizedRequest(rid=rid, prompt_ids=pack_ids(prompt),
                                                params=params, reply_to=0))
        return rid

    def step(self) -> tuple[int, float] | None:
        """One step: (sequences in it, all decoding: 1 else 0 in the sign) and its seconds."""
        batch = self.sched.schedule()
        if batch is None:
            return None
        started = time.perf_counter()
        result = self.worker.step(batch)
        seconds = time.perf_counter() - started
        self.sched.process_result(result)
        for out in self.sched.take_outputs().get(0, []):
            self.outputs.setdefault(out.rid, []).extend(unpack_ids(out.token_ids).tolist())
            if out.finish_reason is not None:
                self.cached[out.rid] = out.cached_tokens
                self.cached[f"{out.rid}.disk"] = out.cached_tokens_disk or 0
        decoding = bool(np.all(batch.step.extend_lens == 1))
        return batch.step.num_seqs if decoding else -batch.step.num_seqs, seconds

    def decoding_now(self) -> int:
        return sum(1 for req in self.sched.running for seq in req.live_seqs()
                   if seq.status is Status.RUNNING and seq.settled >= req.prompt_len)

    def run(self) -> list[tuple[int, float]]:
        steps = []
        while not self.sched.idle:
            got = self.step()
            if got is not None:
                steps.append(got)
        self.sched.check()
        return steps


def capacity(args, rng, ratio: float) -> dict:
    engine = Engine(args.model, ratio, kv_cache_gb=args.kv_cache_gb,
                    chunked_prefill_size=args.chunk, max_prefill_tokens=args.chunk)
    for _ in range(args.requests if ratio else args.full_requests):
        engine.add(rng.integers(10, 20000, args.length).tolist(), args.capacity_tokens)
    peak = 0
    while not engine.sched.idle:
        engine.step()
        peak = max(peak, engine.decoding_now())
    info = engine.worker.info
    return {"peak_decoding": peak, "preemptions": engine.sched.num_preemptions,
            "kv_cache_bytes": info.kv_cache_bytes, "full_pages": info.num_pages,
            "sliding_pages": info.num_sliding_pages}


def hits(args, ratio: float) -> dict:
    rng = np.random.default_rng(args.seed)
    engine = Engine(args.model, ratio, kv_cache_gb=args.hits_kv_cache_gb)
    prompts = [rng.integers(10, 20000, args.head + args.question).tolist()
               for _ in range(args.conversations)]
    firsts = list(prompts)
    turn_hit = turn_queried = 0
    for _ in range(args.turns):
        rids = [engine.add(p, args.reply) for p in prompts]
        engine.run()
        for p, rid in zip(prompts, rids, strict=True):
            turn_hit += engine.cached[rid]
            turn_queried += len(p)
        prompts = [p + engine.outputs[rid] + rng.integers(10, 20000, args.question).tolist()
                   for p, rid in zip(prompts, rids, strict=True)]
    rids = [engine.add(p, args.reply) for p in firsts]
    engine.run()
    resend_hit = sum(engine.cached[rid] for rid in rids)
    stats = engine.sched.stats()
    return {"turns_hit_rate": turn_hit / turn_queried,
            "resend_hit_rate": resend_hit / sum(len(p) for p in firsts),
            "sliding_evicted_pages": engine.sched.tree.stats.sliding_evicted_pages,
            # what keeping every prompt's and turn's last window costs: the sliding pages the
            # cache holds at the end, and the full pages beside them
            "kept_sliding_pages": stats.get("sliding_pages_cached", 0),
            "cached_full_pages": stats["kv_pages_cached"]}


def decode(args, ratio: float) -> float:
    rng = np.random.default_rng(args.seed + 1)
    engine = Engine(args.model, ratio, kv_cache_gb=args.hits_kv_cache_gb)
    for _ in range(args.batch):
        engine.add(rng.integers(10, 20000, args.decode_length).tolist(), args.decode_tokens)
    steps = engine.run()
    full = [s for n, s in steps if n == args.batch]
    return args.batch * len(full) / sum(full)


def disk(args, ratio: float) -> dict:
    from engine.contracts.disk_blocks import block_hashes, window_name

    prompt = np.random.default_rng(args.seed + 2).integers(10, 20000, args.length).tolist()
    with tempfile.TemporaryDirectory() as directory:
        report = {}
        for run in ("first", "restart"):
            engine = Engine(args.model, ratio, kv_cache_gb=args.hits_kv_cache_gb,
                            chunked_prefill_size=args.chunk, max_prefill_tokens=args.chunk,
                            disk_cache_dir=directory)
            rid = engine.add(prompt, args.reply)
            engine.run()
            engine.worker.io.close()  # what a stopping server does: write what is queued
            if run == "first":  # what the prompt and its reply left on disk
                store = engine.sched.disk.store
                blocks = block_hashes(store.fingerprint, None, prompt + engine.outputs[rid],
                                      engine.sched.disk.block)
                windows = [f for f in (store.path(window_name(n)) for n in blocks)
                           if f.exists()]
                files = list(Path(directory).glob("*/*/*.kv"))
                window_bytes = sum(f.stat().st_size for f in windows)
                report = {"block_files": len(files) - len(windows), "window_files": len(windows),
                          "block_mib": (sum(f.stat().st_size for f in files) - window_bytes)
                          / 2**20, "window_mib": window_bytes / 2**20,
                          "prompt_tokens": len(prompt)}
        report["restart_disk_tokens"] = engine.cached[f"{rid}.disk"]
        return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--ratio", type=float, default=0.2, help="--sliding-kv-ratio to test")
    parser.add_argument("--kv-cache-gb", type=float, default=0.25)
    parser.add_argument("--length", type=int, default=3000, help="capacity: prompt tokens")
    parser.add_argument("--requests", type=int, default=16, help="capacity: prompts sent")
    parser.add_argument("--full-requests", type=int, default=8,
                        help="capacity: prompts sent to full KV (more than fit)")
    parser.add_argument("--capacity-tokens", type=int, default=160,
                        help="capacity: tokens each decodes (long enough for all to overlap)")
    parser.add_argument("--chunk", type=int, default=512, help="--chunked-prefill-size")
    parser.add_argument("--hits-kv-cache-gb", type=float, default=1.0)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--head", type=int, default=900)
    parser.add_argument("--question", type=int, default=40)
    parser.add_argument("--reply", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="decode: sequences in flight")
    parser.add_argument("--decode-length", type=int, default=1200)
    parser.add_argument("--decode-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=["capacity", "hits", "decode", "disk"],
                        action="append")
    args = parser.parse_args()
    args.model = resolve_model(args.model).path
    only = set(args.only or ["capacity", "hits", "decode", "disk"])
    report: dict = {"ratio": args.ratio}
    if "capacity" in only:
        report["capacity"] = {
            name: capacity(args, np.random.default_rng(args.seed), ratio)
            for name, ratio in (("full", 0.0), ("sliding", args.ratio))}
    if "hits" in only:
        report["hits"] = {name: hits(args, ratio)
                          for name, ratio in (("full", 0.0), ("sliding", args.ratio))}
    if "decode" in only:
        order = [("full", 0.0), ("sliding", args.ratio), ("sliding", args.ratio), ("full", 0.0)]
        runs: dict[str, list[float]] = {"full": [], "sliding": []}
        for name, ratio in order:
            runs[name].append(decode(args, ratio))
        report["decode_tok_s"] = {name: float(np.mean(v)) for name, v in runs.items()}
        report["decode_tok_s"]["sliding_over_full"] = (
            report["decode_tok_s"]["sliding"] / report["decode_tok_s"]["full"])
    if "disk" in only:
        report["disk"] = {name: disk(args, ratio)
                          for name, ratio in (("full", 0.0), ("sliding", args.ratio))}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
