"""``radixserve serve`` as a real process for the server test modules: start it on a free port
(the demo model in fp32 unless told otherwise), read its metrics, stop it and check that no child
outlives it.

Not ``engine.server.chat_client.LocalServer``: that one is the chat's own server (its own session,
SIGTERM when the chat dies, errors only, no start timeout); the tests need more of the process:
a chosen TMPDIR and log file, a start deadline, the exit code, any signal, the child pids."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine.runtime.launcher import free_port

API_KEY = "sk-radixserve-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


class ServerProcess:
    """``radixserve serve`` on a free port, ready once it printed its URL. Its socket directory
    goes under ``tmp`` (TMPDIR), so a test can see it was removed. The demo model unless the
    args name another ``--model``; float32 unless the args name another ``--dtype`` or
    ``machine_dtype`` leaves the machine's default (bf16 where the CPU has it), as a user's
    server runs."""

    def __init__(self, tmp: Path, *args: str, timeout: float = 300.0,
                 machine_dtype: bool = False) -> None:
        if "--model" not in args:
            args = ("--model", "demo", *args)
        if "--dtype" not in args and not machine_dtype:
            args = ("--dtype", "float32", *args)  # outputs stay comparable run to run
        self.tmp = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "server.log"
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine.cli", "serve", "--port", str(self.port), *args],
            stdout=subprocess.PIPE, stderr=self.log, text=True,
            env={**os.environ, "TMPDIR": str(tmp)},
        )
        deadline = time.monotonic() + timeout
        self.ready_line = ""
        while time.monotonic() < deadline and self.proc.poll() is None:
            if select.select([self.proc.stdout], [], [], 1.0)[0]:
                self.ready_line = self.proc.stdout.readline()
                break
        if "serving" not in self.ready_line:
            self.stop(signal.SIGKILL)
            raise RuntimeError(f"the server did not start:\n{self.log_path.read_text()}")
        self.children = children_of(self.proc.pid)

    def socket_dirs(self) -> list[Path]:
        return list(self.tmp.glob("radixserve-*"))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout)
        self.log.close()
        return code


def serve_module(tmp: Path, *args: str, machine_dtype: bool = False) -> Iterator[ServerProcess]:
    """A module fixture's server: started with ``args``, then stopped by SIGTERM at the end,
    which must exit 0 and leave no child process behind."""
    srv = ServerProcess(tmp, *args, machine_dtype=machine_dtype)
    yield srv
    assert srv.stop() == 0
    assert [c for c in srv.children if Path(f"/proc/{c}").exists()] == []


def metric_values(server) -> dict[str, float]:
    """Every sample of /metrics by name (labels folded into the name as name{k=v,...})."""
    text = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=30).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values
