"""scripts/cpu_seconds.py: the CPU time of a process tree while a command runs."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "cpu_seconds.py"
_spec = importlib.util.spec_from_file_location("cpu_seconds", SCRIPT)
cpu_seconds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cpu_seconds)

# A parent that sleeps and a child that spins: the child's time must be counted, the parent's
# must stay near zero, and the command's own (a sleep) too.
PARENT = ("import subprocess, sys, time\n"
          "subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
          "time.sleep(120)\n")


def test_counts_the_whole_tree_and_the_client(capsys):
    # A child reaped before the run (CPU in this process's RUSAGE_CHILDREN) is not the client's.
    burn = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\n"
                             "while time.time() - t < 0.6: pass"])
    burn.wait()
    root = subprocess.Popen([sys.executable, "-c", PARENT])
    try:
        deadline = time.monotonic() + 30
        while len(cpu_seconds.tree(root.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        [_, spinner] = cpu_seconds.tree(root.pid)
        code = cpu_seconds.main(["--pid", str(root.pid), "--", sys.executable, "-c",
                                 "import time; time.sleep(1.0)"])
        assert code == 0
        lines = capsys.readouterr().out.splitlines()
        seconds = {int(m.group(2)): float(m.group(1)) for line in lines
                   if (m := re.match(r"\s*([\d.]+)\s+(\d+) ", line))}
        assert seconds[spinner] > 0.4  # it spun for most of the 1 s (2 cores, others running)
        assert seconds[root.pid] < 0.2  # asleep
        client = float(next(line for line in lines if "client" in line).split()[0])
        total = float(next(line for line in lines if "total" in line).split()[0])
        assert client < 0.5 and abs(total - (seconds[spinner] + seconds[root.pid] + client)) < 0.02
    finally:
        for pid in cpu_seconds.tree(root.pid)[1:]:
            subprocess.run(["kill", str(pid)], check=False)
        root.kill()
        root.wait()
