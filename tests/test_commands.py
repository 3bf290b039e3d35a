"""The `radixserve` command line: every subcommand is there with its --help, and bench runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.cli import SUBCOMMANDS, main


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_subcommand_has_help(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--help"])
    assert exit_info.value.code == 0
    assert "usage: radixserve " + name in capsys.readouterr().out


@pytest.mark.e2e
def test_bench_reports_throughput_and_hits():
    out = subprocess.run(
        [sys.executable, "-m", "engine.cli", "bench", "--workload", "shared-prefix",
         "--max-requests", "12", "--num-pages", "1024", "--model", "demo"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(None, 1) for line in out.stdout.splitlines() if line.strip()
                 and line.split()[0] in ("requests", "output", "throughput"))
    assert lines["requests"].strip() == "12"
    assert "cached" in out.stdout and "output tok/s" in lines["throughput"]
    assert "MiB (--quantization auto)" in out.stdout  # the weights' format and bytes


def _flags_without_a_default(parser) -> list[str]:
    """Flags whose --help, as printed, does not say their default (switches, off unless given,
    are exempt), in every subcommand below ``parser``."""
    import argparse

    formatter = parser._get_formatter()
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                missing += [f"{name} {flag}" for flag in _flags_without_a_default(sub)]
        elif (action.option_strings and action.help is not argparse.SUPPRESS
              and action.nargs != 0 and "default" not in formatter._expand_help(action)):
            missing.append(action.option_strings[-1])
    return missing


def test_every_flags_help_says_its_default():
    """docs/api.md: every command's --help prints each flag's default."""
    from engine.cli import build_parser

    assert _flags_without_a_default(build_parser()) == []
