"""The ``radixserve`` command: one subcommand per module, each with its own ``--help``.

A subcommand module exposes ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``; it imports nothing heavy at module level, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "serve": "engine.commands.serve",
    "generate": "engine.commands.generate",
    "chat": "engine.commands.chat",
    "profile": "engine.profiler.command",
    "workload": "engine.profiler.workload_command",
    "bench": "engine.commands.bench",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description=(
        "A prefix-caching LLM serving engine (paged KV, token-granular radix tree)."))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub_parser = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
