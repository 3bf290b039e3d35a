"""Whether radixserve reads a GGUF file exactly: its greedy tokens with ``--quantization none
--dtype float32`` against transformers' float32 model of the same file
(``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)``), over eight chat prompts in the
file's chat template as radixserve's tokenizer renders it. Two of the prompts hold a long text
(2,000 tokens by default), past a sliding window such as Gemma 3's 512. Reported: how many
prompts, and how many of all greedy tokens, agree; for a prompt that differs, its first
differing step and the reference's logit margin (top-1 minus top-2) there.

    .venv/bin/python scripts/gguf_parity.py --model ~/.cache/radixserve/models/x.gguf
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.checkpoints.gguf import gguf_checkpoint  # noqa: E402
from engine.contracts.engine_config import EngineConfig  # noqa: E402
from engine.contracts.tokenizer import load_tokenizer  # noqa: E402
from engine.worker.runner import ModelRunner  # noqa: E402
from scripts.kv_accuracy import PAGE_SIZE, greedy, reference_text  # noqa: E402

QUESTIONS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "What is the capital of France, and why is it famous?",
    "Explain the difference between a list and a tuple in Python in three sentences.",
    "Write a haiku about autumn leaves.",
    "How do I reverse a linked list in C? Show the code.",
    "List five prime numbers greater than 100.",
]


def chat_prompts(tokenizer, long_tokens: int) -> list[list[int]]:
    """Six short questions and two long texts to summarise, each one user turn."""
    text_ids = tokenizer(reference_text())["input_ids"]
    texts = [tokenizer.decode(text_ids[start:start + long_tokens])
             for start in (1000, len(text_ids) // 2)]
    messages = QUESTIONS + [f"Summarise this text in two sentences.\n\n{t}" for t in texts]
    prompts = []
    for message in messages:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                            add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if isinstance(ids, Mapping) else ids))
    return prompts


def reference(gguf: Path, prompts: list[list[int]], steps: int
              ) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' float32 greedy tokens and each step's top-1 minus top-2 logit."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32)
    tokens, margins = [], []
    for prompt in prompts:
        ids, past, out, gaps = torch.tensor([prompt]), None, [], []
        for _ in range(steps):
            res = model(ids if past is None else ids[:, -1:], past_key_values=past,
                        use_cache=True)
            past = res.past_key_values
            top = res.logits[0, -1].topk(2)
            out.append(int(top.indices[0]))
            gaps.append(float(top.values[0] - top.values[1]))
            ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
        tokens.append(out)
        margins.append(gaps)
    return tokens, margins


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a GGUF file")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    checkpoint = str(gguf_checkpoint(args.model))
    prompts = chat_prompts(load_tokenizer(checkpoint), args.long_tokens)
    wanted, margins = reference(args.model, prompts, args.steps)
    gc.collect()
    pages_per_seq = -(-(max(map(len, prompts)) + args.steps) // PAGE_SIZE)
    runner = ModelRunner(EngineConfig(model=checkpoint, dtype="float32", quantization="none",
                                      page_size=PAGE_SIZE,
                                      num_pages=pages_per_seq * len(prompts)))
    tables = [list(range(i * pages_per_seq, (i + 1) * pages_per_seq))
              for i in range(len(prompts))]
    got = greedy(runner, tables, prompts, args.steps)
    same = got == np.array(wanted)
    differing = {}
    for i in np.flatnonzero(~same.all(1)):
        step = int(np.argmin(same[i]))
        differing[int(i)] = {"prompt_tokens": len(prompts[i]), "first_step": step,
                             "reference_margin": round(margins[i][step], 4)}
    result = {"model": args.model.name, "prompts": len(prompts), "steps": args.steps,
              "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
              "prompts_equal": int(same.all(1).sum()), "tokens_equal": float(same.mean()),
              "differing": differing}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
