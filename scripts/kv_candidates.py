"""Candidate 8-bit KV caches, measured before building them: each is emulated over a cache in
the model's dtype whose writes go through the candidate's quantize-then-dequantize, and compared
with the model-dtype cache by scripts/kv_accuracy.py's measure (teacher-forced agreement, mean
KL, greedy common prefix over 48 and 128 tokens).

    int8          the served int8 cache (its compiled kernels), for reference
    per-token     emulated: int8 per token and KV head, as int8 stores it, the values then
                  rounded to bf16 (checks the emulation against int8)
    sinks+newest  per-token, but each sequence's first page (attention sinks) and the newest,
                  partial page kept in the model's dtype (a page is quantized when it fills)
    k-groups-32   K with a scale per 32 values (two per row of 64), V per token: 1.88x pages
    k-exact       V per token, K in the model's dtype: 1.33x pages (what K's rounding costs)
    v-exact       K per token, V in the model's dtype: 1.33x pages
    one-ulp       no int8: every stored value moved by one bf16 step at random, a cache as
                  close to the reference as bf16's own rounding (the measure's noise floor)

    .venv/bin/python scripts/kv_candidates.py --prompts 16 --quantization none
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.worker import kv_quant  # noqa: E402
from engine.worker.runner import ModelRunner  # noqa: E402
from scripts.kv_accuracy import PAGE_SIZE, accuracy_parser, report  # noqa: E402

EMULATED = ("per-token", "sinks+newest", "k-groups-32", "k-exact", "v-exact", "one-ulp")


def per_token(x: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """``x`` [..., D] through int8 with one float16 scale per ``group`` values (a row)."""
    shape = x.shape
    if group:
        x = x.reshape(*shape[:-1], shape[-1] // group, group)
    return kv_quant.dequantize(kv_quant.quantize(x), x.dtype).reshape(shape)


def one_ulp(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``x`` (bf16) with each value's last mantissa bit flipped at random."""
    bits = torch.randint(0, 2, x.shape, generator=generator, dtype=torch.int16)
    return (x.contiguous().view(torch.int16) ^ bits).view(x.dtype)


def emulate(name: str, runner: ModelRunner, pages_per_seq: int) -> None:
    """Route ``runner``'s KV writes through candidate ``name`` (its pool in the model's dtype;
    sequence i holds pages [i * pages_per_seq, (i + 1) * pages_per_seq), kv_accuracy's
    layout)."""
    if name not in EMULATED:
        return
    runner.attention._rope_store = None  # the torch path, which stores through pool.write
    pool, generator = runner.pool, torch.Generator().manual_seed(0)
    k_form = {"k-groups-32": lambda k: per_token(k, 32), "k-exact": lambda k: k}.get(
        name, per_token)
    v_form = (lambda v: v) if name == "v-exact" else per_token

    def write(layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k_slots, v_slots = pool.slots(layer)
        if name == "one-ulp":
            k, v = one_ulp(k, generator), one_ulp(v, generator)
        elif name != "sinks+newest":
            k, v = k_form(k), v_form(v)
        k_slots.index_copy_(0, slots, k)
        v_slots.index_copy_(0, slots, v)
        if name == "sinks+newest":  # pages that fill now are quantized, but not first pages
            for last in slots[slots % PAGE_SIZE == PAGE_SIZE - 1].tolist():
                if (last // PAGE_SIZE) % pages_per_seq:
                    rows = slice(last - PAGE_SIZE + 1, last + 1)
                    k_slots[rows] = per_token(k_slots[rows])
                    v_slots[rows] = per_token(v_slots[rows])

    pool.write = write


def main() -> None:
    parser = accuracy_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--candidates", default=",".join(("int8",) + EMULATED))
    parser.add_argument("--quantization", default="auto",
                        help="the weights every runner uses (the server's --quantization)")
    args = parser.parse_args()
    names = args.candidates.split(",")
    weights = {"quantization": args.quantization}
    longest = args.max_len + max([args.steps] + [int(n) for n in args.prefix.split(",") if n])
    pages_per_seq = -(-longest // PAGE_SIZE)
    report(args, "bfloat16", reference=weights,
           candidates={n: {**weights, "kv_cache_dtype": "int8" if n == "int8" else "auto"}
                       for n in names},
           prepare=lambda name, runner: emulate(name, runner, pages_per_seq))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
