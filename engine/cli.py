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


class DefaultsFormatter(argparse.HelpFormatter):
    """Each flag's help ends with its default unless it says one already (switches, which are
    off unless given, excepted)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or not action.option_strings or action.nargs == 0
                or action.default is argparse.SUPPRESS):
            return text
        return f"{text} (default: {'not set' if action.default is None else '%(default)s'})"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose --help gives defaults; subcommands' parsers are of this class."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="radixserve", description=(
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
