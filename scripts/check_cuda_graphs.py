"""CUDA graphs against eager decode, on a GPU (run by scripts/gpu_check.sh).

1. The runner: a dummy-weight Llama (16/4 heads of 128, 8 layers, bf16, flashinfer attention)
   built twice, eager and with decode graphs captured up to batch 128 (capture time printed);
   greedy decode of the same sequences on both at batch 1, 3, 16, 50, 128 and 160 (the last past
   the largest graph, so eager on both): tokens identical, logits' largest difference.
2. The engine: 48 greedy requests of mixed lengths, eager and with ``enable_cuda_graph``:
   identical token ids.

Exit status 1 when either differs: graphs become the default only once this passes.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.contracts.step import BatchInput  # noqa: E402
from scripts.bench_gpu import CHECK_MODEL, write_config  # noqa: E402

NUM_PAGES = 8192  # of 16 tokens, for every sequence below at once

def greedy_decode(runner, seqs, steps: int) -> tuple[np.ndarray, list[torch.Tensor]]:
    """``steps`` greedy decode steps of ``seqs`` ((pages, cached_len, [next id])); the tokens
    [steps, B] and each step's logits."""
    tokens, logits = [], []
    for _ in range(steps):
        out = runner.forward(BatchInput.build(seqs, 16))
        logits.append(out)
        chosen = out.argmax(-1).cpu().numpy()
        tokens.append(chosen)
        seqs = [(p, n + 1, [int(t)]) for (p, n, _), t in zip(seqs, chosen, strict=True)]
    return np.array(tokens), logits


def check_graphs(steps: int = 8) -> bool:
    from engine.worker.runner import ModelRunner

    print("\n## CUDA graphs: greedy decode replayed vs eager (dummy-weight Llama, "
          "16/4 heads of 128, 8 layers, bfloat16)\n")
    options = dict(num_pages=NUM_PAGES, load_format="dummy", dtype="bfloat16",
                   attention_backend="flashinfer")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        write_config(model_dir, CHECK_MODEL)
        eager = ModelRunner(model_dir, **options)
        start = time.perf_counter()
        graphs = ModelRunner(model_dir, **options, cuda_graph_max_bs=128)
        build_s = time.perf_counter() - start
        if graphs.graphs is None:
            print("FAIL: the runner did not capture graphs (see the log for why)")
            return False
        print(f"runner built and {len(graphs.graphs.buckets)} batch sizes captured in "
              f"{build_s:.1f} s\n")
        print("| batch | graph bucket | sequences identical | max abs logit diff |")
        print("|---:|---:|---:|---:|")
        ok = True
        rng = np.random.default_rng(0)
        for batch_size in (1, 3, 16, 50, 128, 160):
            lengths = rng.integers(10, 600, batch_size)
            pages_per_seq = -(-(int(lengths.max()) + steps) // 16)
            pages = rng.permutation(NUM_PAGES)[: batch_size * pages_per_seq].reshape(batch_size, -1)
            prompts = [rng.integers(0, CHECK_MODEL["vocab_size"], n) for n in lengths]
            results = []
            for runner in (eager, graphs):
                runner.forward(BatchInput.build(
                    [(p, 0, ids) for p, ids in zip(pages, prompts, strict=True)], 16))
                seqs = [(p, int(n), [7]) for p, n in zip(pages, lengths, strict=True)]
                results.append(greedy_decode(runner, seqs, steps))
            (tokens_e, logits_e), (tokens_g, logits_g) = results
            same = int((tokens_e == tokens_g).all(axis=0).sum())
            diff = max((a - b).abs().max().item() for a, b in zip(logits_e, logits_g,
                                                                  strict=True))
            bucket = graphs.graphs.bucket_for(BatchInput.build(seqs, 16))
            ok &= same == batch_size
            print(f"| {batch_size} | {bucket or 'eager'} | {same}/{batch_size} | {diff:.3g} |",
                  flush=True)
        del eager, graphs
        torch.cuda.empty_cache()
        ok &= check_engine_graphs(model_dir)
    return ok


def check_engine_graphs(model_dir: Path) -> bool:
    """The engine's greedy outputs, eager and with ``enable_cuda_graph``."""
    import shutil

    from engine import Engine, SamplingParams
    from engine.checkpoints.demo_model import TOKENIZER_VOCAB_SIZE, build_demo_model
    from scripts.bench_gpu import TOKENIZER_FILES

    for name in TOKENIZER_FILES:
        shutil.copy(build_demo_model() / name, model_dir / name)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, TOKENIZER_VOCAB_SIZE, int(n)).tolist()
               for n in rng.integers(5, 400, 48)]
    params = [SamplingParams(max_tokens=int(n), temperature=0.0, ignore_eos=True)
              for n in rng.integers(4, 48, len(prompts))]
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
    same = sum(a == b for a, b in zip(outputs[False], outputs[True], strict=True))
    print(f"engine greedy outputs identical eager vs graphs: {same}/{len(prompts)} "
          f"{'ok' if same == len(prompts) else 'FAIL'}\n", flush=True)
    return same == len(prompts)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("check_cuda_graphs needs a CUDA device")
    sys.exit(0 if check_graphs() else 1)
