"""What quantized weights cost in accuracy: SmolLM2-135M-Instruct served with ``--quantization``
auto (the GGUF's own Q4_1 projections and Q8_0 embedding), int8 and int4 against the same
model's weights widened to float32 (``--quantization none``), over the prompts and teacher
forcing of scripts/kv_accuracy.py: greedy agreement and mean KL(reference || quantized) of the
next-token distributions, every run in float32 with a float32 KV cache.

    .venv/bin/python scripts/weight_accuracy.py            # 32 prompts of 200-1,500 tokens
    .venv/bin/python scripts/weight_accuracy.py --prompts 8 --json out.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.kv_accuracy import accuracy_parser, report  # noqa: E402


def main() -> None:
    parser = accuracy_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="auto,int8,int4",
                        help="the --quantization settings to compare, comma-separated")
    args = parser.parse_args()
    report(args, "float32", reference={"quantization": "none"},
           candidates={fmt: {"quantization": fmt} for fmt in args.formats.split(",")})


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
