"""What quantized weights cost in accuracy: SmolLM2-135M-Instruct (or ``--model``'s GGUF file)
served with ``--quantization`` auto (SmolLM2's own Q4_1 projections and Q8_0 embedding), int8
and int4 against the same model's weights widened to float32 (``--quantization none``), over
the prompts and teacher forcing of scripts/kv_accuracy.py: greedy agreement and mean
KL(reference || quantized) of the next-token distributions, every run in float32 with a float32
KV cache.

    .venv/bin/python scripts/weight_accuracy.py            # 32 prompts of 200-1,500 tokens
    .venv/bin/python scripts/weight_accuracy.py --prompts 8 --json out.json
    .venv/bin/python scripts/weight_accuracy.py --model path/to/other.gguf --formats auto
    .venv/bin/python scripts/weight_accuracy.py --formats auto --digits 1,2   # 4-bit weights: 1 and 2 digits
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.worker.runner import ModelRunner  # noqa: E402
from scripts.kv_accuracy import accuracy_parser, report  # noqa: E402


def main() -> None:
    parser = accuracy_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="auto,int8,int4",
                        help="the --quantization settings to compare, comma-separated")
    parser.add_argument("--digits", default="",
                        help="int8 digits of the activations against 4-bit weights, comma-"
                             "separated: each format runs with each (default: "
                             "engine/worker/model/quant.py's DIGITS)")
    args = parser.parse_args()
    formats = args.formats.split(",")
    if not args.digits:
        report(args, "float32", reference={"quantization": "none"},
               candidates={fmt: {"quantization": fmt} for fmt in formats})
        return
    digits = {f"{fmt}, {d} digits": int(d) for fmt in formats for d in args.digits.split(",")}
    report(args, "float32", reference={"quantization": "none"},
           candidates={name: {"quantization": name.split(",")[0]} for name in digits},
           prepare=lambda name, runner: four_bit_digits(runner, digits[name]))


def four_bit_digits(runner: ModelRunner, digits: int) -> None:
    """Sets every 4-bit layer of ``runner`` to quantize its activations in ``digits``."""
    for module in runner.model.modules():
        for layer in getattr(module, "quantized", {}).values():
            for part in getattr(layer, "runs", [layer]):  # a mixed projection: each format's run
                if part.bits == 4:
                    part.digits = digits


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
