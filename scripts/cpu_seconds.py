"""CPU seconds that each process of a running server spends while a command runs.

    python scripts/cpu_seconds.py --pid PID -- python scripts/bench_serving.py --url ...

PID is the ``radixserve serve`` process (``pgrep -f 'serve .*--port 30781'``); its whole process
tree is counted (frontend, tokenizers, schedulers, workers), each process's user + system time
read from /proc before and after the command, and the command's own (the client's) from its
rusage. Prints one line per process and the total. On a machine whose cores are all busy for
the whole run, the ratio of two servers' totals for the same requests is their throughput ratio
(docs/benchmarks.md, "How far dispatch can lift throughput here" under "Data parallel").
Linux only.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def tree(root: int) -> list[int]:
    """``root`` and its descendants, parents first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    order, stack = [], [root]
    while stack:
        pid = stack.pop()
        order.append(pid)
        stack.extend(sorted(children.get(pid, []), reverse=True))
    return order


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` so far, or None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS


def name(pid: int) -> str:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [a.decode(errors="replace") for a in args if a]
    if "engine.runtime.child" in words:  # a child process: its role (worker-0, scheduler-0, ...)
        return words[words.index("engine.runtime.child") + 1]
    return " ".join(words)[:60]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pid", type=int, required=True, help="the server's root process")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    pids = tree(args.pid)
    before = {pid: cpu_seconds(pid) for pid in pids}
    waited = resource.getrusage(resource.RUSAGE_CHILDREN)  # children reaped before this run
    code = subprocess.call(command)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = 0.0
    for pid in pids:
        after = cpu_seconds(pid)
        if after is None or before[pid] is None:
            print(f"{'gone':>8}  {pid} {name(pid)}")
            continue
        total += after - before[pid]
        print(f"{after - before[pid]:8.2f}  {pid} {name(pid)}")
    client_seconds = (reaped.ru_utime + reaped.ru_stime) - (waited.ru_utime + waited.ru_stime)
    print(f"{client_seconds:8.2f}  client ({command[0]})")
    print(f"{total + client_seconds:8.2f}  total CPU seconds (server {total:.2f})")
    return code


if __name__ == "__main__":
    sys.exit(main())
