"""The prefix cache's tiers on a device: KV written down to the host tier (pinned staging
buffer, async copies) and to the disk tier (the I/O thread, its own CUDA stream), then loaded
back, gives the outputs a run without tiers gives.

The demo model, in-process (the scheduler and the worker, as tests/test_scheduler.py drives
them), on ``--device`` (default: cuda when there is one): 8 prompts of 300 tokens asked twice
through a pool that holds about two of them, once with no tier, once with a host tier, once
with a disk tier. Prints a table (hits by tier, pages and bytes moved, seconds) and exits 1
unless every greedy output matches the no-tier run and both tiers served hits.

    python scripts/check_tiers.py                 # on the GPU (scripts/gpu_phase.py phase 2)
    python scripts/check_tiers.py --device cpu    # the same on CPU
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import numpy as np
import torch

from engine.checkpoints.demo_model import build_demo_model
from engine.contracts.engine_config import EngineConfig
from engine.contracts.protocol import TokenizedRequest, pack_ids, unpack_ids
from engine.contracts.sampling_params import SamplingParams
from engine.worker.process import Worker
from scheduler.scheduler import Scheduler

PROMPTS, PROMPT_LEN, MAX_TOKENS = 8, 300, 8


def serve(device: str, **tiers) -> tuple[dict[str, list[int]], dict, float]:
    """Every prompt twice, one at a time; outputs by request id, the scheduler's stats, and the
    seconds the second round took."""
    config = EngineConfig(model=str(build_demo_model()), device=device, dtype="float32",
                          attention_backend="torch", page_size=16, num_pages=48, **tiers)
    worker = Worker(config)
    sched = Scheduler(config, worker.info)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 4000, PROMPT_LEN) for _ in range(PROMPTS)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    began = 0.0
    for round_ in range(2):
        if round_ == 1:
            began = time.perf_counter()
        for i, prompt in enumerate(prompts):
            sched.add_request(TokenizedRequest(rid=f"{round_}.{i}", prompt_ids=pack_ids(prompt),
                                               params=params, reply_to=0))
            while not sched.idle:
                batch = sched.schedule()
                if batch is not None:
                    sched.process_result(worker.step(batch))
                for out in sched.take_outputs().get(0, []):
                    outputs.setdefault(out.rid, []).extend(unpack_ids(out.token_ids).tolist())
            sched.check()
    seconds = time.perf_counter() - began
    if worker.io is not None:
        worker.io.close()
    return outputs, sched.stats(), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    base, _, base_s = serve(args.device)
    with tempfile.TemporaryDirectory() as directory:
        runs = {"host tier": serve(args.device, host_cache_gb=0.05),
                "disk tier": serve(args.device, disk_cache_dir=directory)}
    ok = True
    print(f"| {args.device} | same outputs | hit tokens (device / tier) | moved | second round |")
    print("|---|---|---|---|---|")
    print(f"| no tier | - | - | - | {base_s:.2f} s |")
    for name, (outputs, stats, seconds) in runs.items():
        same = outputs == base
        if name == "host tier":
            tier_hits = stats["host_hit_tokens"]
            moved = f"{stats['host_pages_written']} pages down, {stats['host_pages_loaded']} up"
        else:
            tier_hits = stats["disk_hit_tokens"]
            moved = (f"{stats['disk_bytes_written'] / 2**20:.1f} MiB written, "
                     f"{stats['disk_bytes_read'] / 2**20:.1f} MiB read")
        ok &= same and tier_hits > 0
        print(f"| {name} | {'yes' if same else 'NO'} | {stats['hit_tokens'] - tier_hits:,} / "
              f"{tier_hits:,} | {moved} | {seconds:.2f} s |")
    print("\ntiers ok" if ok else "\nTIER CHECK FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
