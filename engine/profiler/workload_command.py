"""``radixserve workload gen KIND --seed S --out FILE ...``: write a synthetic trace.

Each KIND's flags are the fields of its parameter dataclass in ``engine.profiler.workload``;
``radixserve workload gen KIND --help`` lists them with their defaults. ``--format mooncake``
writes the same draw as Mooncake's hash ids of ``--block-tokens``-token blocks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.profiler.trace import TraceRequest

HELP = "generate synthetic request traces (JSONL) for `radixserve profile`"


def _positive(kind: type, zero_ok: bool = False) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        value = kind(text)
        if value < 0 or (value == 0 and not zero_ok):
            raise argparse.ArgumentTypeError(f"must be {'>= 0' if zero_ok else 'positive'}, "
                                             f"got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error messages
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.profiler.workload import KINDS

    actions = parser.add_subparsers(dest="workload_action", metavar="ACTION", required=True)
    gen = actions.add_parser("gen", help="write a synthetic trace of one KIND",
                             description="Write a synthetic trace (JSONL, docs/profiler.md).")
    kinds = gen.add_subparsers(dest="kind", metavar="KIND", required=True)
    for name, kind in KINDS.items():
        sub = kinds.add_parser(name, help=kind.help, description=kind.help)
        sub.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
        sub.add_argument("--out", type=Path, required=True, metavar="FILE",
                         help="trace file to write")
        sub.add_argument("--tokenizer", metavar="DIR|FILE.gguf", help="write text (prompt / "
                         "messages) through this tokenizer (a Hugging Face directory or a .gguf "
                         "file) instead of token ids (default: token ids)")
        sub.add_argument("--format", choices=("radixserve", "mooncake"), default="radixserve",
                         help="radixserve's JSONL (token ids or text) or Mooncake's hash_ids "
                              "of fixed-size token blocks (default radixserve)")
        sub.add_argument("--block-tokens", type=_positive(int), default=512,
                         help="tokens per hash id with --format mooncake (default 512)")
        sub.add_argument("--vocab-size", type=_positive(int), default=32000,
                         help="token ids are drawn from [0, vocab size) (without --tokenizer; "
                              "default 32000)")
        for field in dataclasses.fields(kind.params):
            if isinstance(field.default, str):
                parse = str
            elif field.name == "sigma":
                parse = _positive(float, zero_ok=True)  # sigma 0: every turn has the median length
            else:
                parse = _positive(type(field.default))
            sub.add_argument(f"--{field.name.replace('_', '-')}", dest=field.name, type=parse,
                             default=field.default, choices=field.metadata.get("choices"),
                             help=f"{field.metadata['help']} (default {field.default})")


def _write_mooncake(path: Path, lines: Iterable[dict[str, Any]]) -> tuple[int, int]:
    """Lines and prompt tokens written."""
    count = tokens = 0
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(json.dumps(line, separators=(",", ":")) + "\n")
            count += 1
            tokens += line["input_length"]
    return count, tokens


def run(args: argparse.Namespace) -> int:
    from engine.profiler.trace import load_tokenizer, write_trace
    from engine.profiler.workload import KINDS, iter_mooncake, iter_trace

    kind = KINDS[args.kind]
    params = kind.params(**{f.name: getattr(args, f.name) for f in dataclasses.fields(kind.params)})
    if args.format == "mooncake" and args.tokenizer:
        print("radixserve workload: --format mooncake hashes token ids: drop --tokenizer",
              file=sys.stderr)
        return 2
    try:
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
        if args.format == "mooncake":
            lines = iter_mooncake(args.kind, params, args.seed, args.vocab_size,
                                  args.block_tokens)
        else:
            trace = iter_trace(args.kind, params, args.seed, tokenizer, args.vocab_size)
    except ValueError as exc:
        print(f"radixserve workload: {exc}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.format == "mooncake":
        count, tokens = _write_mooncake(args.out, lines)
        described = f", {tokens:,} prompt tokens in {args.block_tokens}-token blocks"
    else:
        tokens = 0

        def counted(requests: Iterable[TraceRequest]) -> Iterator[TraceRequest]:
            nonlocal tokens
            for request in requests:
                tokens += len(request.prompt_token_ids or ())
                yield request

        count = write_trace(args.out, counted(trace))
        described = f", {tokens:,} prompt tokens" if tokens else " (text)"
    print(f"wrote {count:,} {args.kind} requests{described} to {args.out}")
    return 0
