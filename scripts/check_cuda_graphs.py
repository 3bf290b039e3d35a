"""CUDA graphs against eager decode, on a GPU (phase 2 of scripts/gpu_phase.py, docs/gpu.md).

1. The runner: a dummy-weight Llama (16/4 heads of 128, 8 layers, bf16, flashinfer attention)
   built twice, eager and with decode graphs captured up to batch 128 (capture time printed),
   fed the same tokens (the eager runner's greedy choices) for a few decode steps at batch 1,
   3, 16, 50, 128 and 160 (the last past the largest graph, so eager on both). Two checks:

   - at the same padded batch, a replay equals the same fixed-buffer step run op by op
     (``DecodeGraphs.run(eager=True)``): bit for bit, since the kernels and plan are the same;
   - against the eager runner, whose batch is not padded (3 rows, not 4: its GEMMs may take
     other kernels): logits within a tolerance of their spread, and the same top-1 token on
     every row whose top-1 leads its runner-up by more than the rounding could move it
     (``compare_logits``). Dummy N(0, 0.02) weights leave many near-ties; those are not
     counted.

   Each step's logits are cloned at once: a graph's output is overwritten by its next replay.
2. The engine: 48 greedy requests of mixed lengths, eager and with ``enable_cuda_graph``: every
   request completes with its full length; identical outputs are counted and printed, not
   required (one near-tie flip changes the rest of a greedy continuation; part 1 is the exact
   check).

``--json OUT`` writes every number as JSON. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.contracts.engine_config import EngineConfig  # noqa: E402
from engine.contracts.step import BatchInput  # noqa: E402
from scripts.bench_gpu import CHECK_MODEL, write_config  # noqa: E402

NUM_PAGES = 8192  # of 16 tokens, for every sequence below at once
# Logits of two paddings may differ by this fraction of the logits' spread (their mean
# per-row standard deviation): bf16 rounding through 8 layers; the run prints the ratio seen.
LOGIT_TOLERANCE = 0.05


@dataclasses.dataclass
class LogitComparison:
    """``candidate`` logits against ``reference`` ones of the same inputs."""

    rows: int
    max_abs_diff: float
    spread: float  # mean over rows of the reference logits' standard deviation
    decisive_rows: int  # rows whose reference top-1 leads its runner-up by > 2 x tolerance
    top1_agree: int  # of the decisive rows, those with the same top-1 token

    @property
    def ok(self) -> bool:
        return (self.max_abs_diff <= LOGIT_TOLERANCE * self.spread
                and self.top1_agree == self.decisive_rows)


def compare_logits(reference: torch.Tensor, candidate: torch.Tensor) -> LogitComparison:
    """Compare float logits [rows, vocab] of the same inputs run at different paddings.

    Within tolerance: max |difference| <= ``LOGIT_TOLERANCE`` x the spread. Top-1 must agree
    on every row away from a near-tie: where the reference's top-1 leads its runner-up by more
    than twice the tolerance, no difference within it can change the argmax."""
    reference, candidate = reference.float(), candidate.float()
    spread = reference.std(dim=-1).mean().item()
    margin = 2 * LOGIT_TOLERANCE * spread
    top2 = reference.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > margin
    agree = reference.argmax(-1) == candidate.argmax(-1)
    return LogitComparison(
        rows=reference.shape[0], max_abs_diff=(reference - candidate).abs().max().item(),
        spread=spread, decisive_rows=int(decisive.sum()),
        top1_agree=int((agree & decisive).sum()))


def teacher_forced_decode(eager, graphs, seqs, steps: int) -> dict[str, Any]:
    """``steps`` decode steps of ``seqs`` ((pages, cached_len, [next id])) on both runners,
    both fed the eager runner's greedy tokens; the comparisons of every step."""
    same_padding_identical, comparisons, bucket = True, [], None
    for _ in range(steps):
        batch = BatchInput.build(seqs, 16)
        reference = eager.forward(batch).clone()
        bucket = graphs.graphs.bucket_for(batch)
        if bucket is None:
            candidate = graphs.forward(batch).clone()
        else:
            candidate = graphs.graphs.run(batch, bucket).clone()
            op_by_op = graphs.graphs.run(batch, bucket, eager=True).clone()
            same_padding_identical &= torch.equal(candidate, op_by_op)
        comparisons.append(compare_logits(reference, candidate))
        chosen = reference.argmax(-1).cpu().numpy()
        seqs = [(p, n + 1, [int(t)]) for (p, n, _), t in zip(seqs, chosen, strict=True)]
    return {"bucket": bucket, "same_padding_identical": same_padding_identical,
            "comparisons": comparisons}


def check_graphs(steps: int = 8) -> tuple[bool, dict[str, Any]]:
    from engine.worker.runner import ModelRunner

    print("\n## CUDA graphs: decode replayed vs eager (dummy-weight Llama, 16/4 heads of 128, "
          "8 layers, bfloat16; both runners fed the same tokens)\n")
    report: dict[str, Any] = {"runner": []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        write_config(model_dir, CHECK_MODEL)
        options = dict(model=tmp, num_pages=NUM_PAGES, load_format="dummy", dtype="bfloat16",
                       attention_backend="flashinfer", cuda_graph_max_bs=128)
        eager = ModelRunner(EngineConfig(**options))
        start = time.perf_counter()
        graphs = ModelRunner(EngineConfig(**options, enable_cuda_graph=True))
        build_s = time.perf_counter() - start
        if graphs.graphs is None:
            print("FAIL: the runner did not capture graphs (see the log for why)")
            return False, report
        report["captured"] = graphs.graphs.buckets
        report["build_s"] = build_s
        print(f"runner built and {len(graphs.graphs.buckets)} batch sizes captured in "
              f"{build_s:.1f} s: {graphs.graphs.buckets}\n")
        print("| batch | graph bucket | replay == op by op (same padding) | max abs diff / "
              "spread | top-1 agree (rows away from ties) | ok |")
        print("|---:|---:|---|---:|---:|---|")
        ok = True
        rng = np.random.default_rng(0)
        for batch_size in (1, 3, 16, 50, 128, 160):
            lengths = rng.integers(10, 600, batch_size)
            pages_per_seq = -(-(int(lengths.max()) + steps) // 16)
            pages = rng.permutation(NUM_PAGES)[: batch_size * pages_per_seq].reshape(batch_size, -1)
            prompts = [rng.integers(0, CHECK_MODEL["vocab_size"], n) for n in lengths]
            for runner in (eager, graphs):
                runner.forward(BatchInput.build(
                    [(p, 0, ids) for p, ids in zip(pages, prompts, strict=True)], 16)).cpu()
            seqs = [(p, int(n), [7]) for p, n in zip(pages, lengths, strict=True)]
            run = teacher_forced_decode(eager, graphs, seqs, steps)
            comparisons = run["comparisons"]
            worst = max(c.max_abs_diff / c.spread for c in comparisons)
            decisive = sum(c.decisive_rows for c in comparisons)
            agree = sum(c.top1_agree for c in comparisons)
            row_ok = run["same_padding_identical"] and all(c.ok for c in comparisons)
            ok &= row_ok
            report["runner"].append({
                "batch": batch_size, "bucket": run["bucket"],
                "same_padding_identical": run["same_padding_identical"],
                "max_diff_over_spread": worst, "decisive_rows": decisive, "top1_agree": agree,
                "ok": row_ok})
            print(f"| {batch_size} | {run['bucket'] or 'eager'} | "
                  f"{run['same_padding_identical']} | {worst:.3g} | {agree}/{decisive} | "
                  f"{'ok' if row_ok else 'FAIL'} |", flush=True)
        del eager, graphs
        torch.cuda.empty_cache()
        engine_ok, report["engine"] = check_engine_graphs(model_dir)
        ok &= engine_ok
    return ok, report


def check_engine_graphs(model_dir: Path) -> tuple[bool, dict[str, Any]]:
    """The engine's greedy outputs, eager and with ``enable_cuda_graph``: all complete;
    identical ones counted."""
    import shutil

    from engine import Engine, SamplingParams
    from engine.checkpoints.demo_model import TOKENIZER_VOCAB_SIZE, build_demo_model
    from scripts.bench_gpu import TOKENIZER_FILES

    for name in TOKENIZER_FILES:
        shutil.copy(build_demo_model() / name, model_dir / name)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, TOKENIZER_VOCAB_SIZE, int(n)).tolist()
               for n in rng.integers(5, 400, 48)]
    lengths = [int(n) for n in rng.integers(4, 48, len(prompts))]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    outputs = {}
    for graphs in (False, True):
        start = time.perf_counter()
        with Engine(str(model_dir), load_format="dummy", dtype="bfloat16", num_pages=NUM_PAGES,
                    attention_backend="flashinfer", enable_cuda_graph=graphs,
                    cuda_graph_max_bs=64) as engine:
            results = engine.generate(prompts, params, use_tqdm=False)
        outputs[graphs] = [r.token_ids for r in results]
        print(f"\nengine, CUDA graphs {'on' if graphs else 'off'}: {len(prompts)} requests in "
              f"{time.perf_counter() - start:.1f} s (start-up included)", flush=True)
    complete = all(len(out) == n for run in outputs.values()
                   for out, n in zip(run, lengths, strict=True))
    same = sum(a == b for a, b in zip(outputs[False], outputs[True], strict=True))
    print(f"engine greedy outputs: all complete {complete}; identical eager vs graphs "
          f"{same}/{len(prompts)} (counted, not required)\n", flush=True)
    return complete, {"requests": len(prompts), "complete": complete, "identical": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="OUT", help="also write every number to OUT as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("check_cuda_graphs needs a CUDA device")
    ok, report = check_graphs()
    report["ok"] = ok
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print("graphs: all checks passed" if ok else "graphs: SOME CHECKS FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
