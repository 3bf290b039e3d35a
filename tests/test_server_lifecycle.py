"""How ``radixserve serve`` ends: a taken port fails fast, SIGINT / SIGTERM shut down cleanly,
and a dying child process fails pending requests, then ends the server with a non-zero exit;
never an orphan process or a leftover socket directory."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server_process import ServerProcess, free_port

pytestmark = pytest.mark.e2e


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if Path(f"/proc/{p}").exists()]


def test_a_taken_port_fails_before_the_engine_starts():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--port", str(port),
                               "--model", "demo"],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_shuts_down_cleanly(tmp_path, sig):
    server = ServerProcess(tmp_path, "--num-pages", "256", "--zmq-port", str(free_port()))
    assert len(server.children) == 3 and server.socket_dirs()
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                          timeout=60)
    assert response.status_code == 200
    assert server.stop(sig) == 0
    time.sleep(0.2)
    assert _alive(server.children) == []
    assert server.socket_dirs() == []
    assert "Traceback" not in server.log_path.read_text()


def test_a_dying_child_fails_pending_requests_then_exits_nonzero(tmp_path):
    server = ServerProcess(tmp_path, "--num-pages", "1024")
    scheduler = next(p for p in server.children if "engine.runtime.child scheduler" in _cmdline(p))
    body = {"prompt": "on and on", "max_tokens": 3000, "ignore_eos": True}
    whole: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: whole.append(
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)))
    events = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True},
                      timeout=60) as response:
        lines = response.iter_lines()
        events.append(next(line for line in lines if line.startswith("data: ")))
        waiting.start()
        time.sleep(0.5)
        killed_at = time.monotonic()
        os.kill(scheduler, signal.SIGKILL)
        events += [line for line in lines if line.startswith("data: ")]
    waiting.join(30)
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert "scheduler process exited unexpectedly" in error["message"]
    assert whole[0].status_code == 503
    assert "scheduler process exited unexpectedly" in whole[0].json()["error"]["message"]
    assert server.proc.wait(30) == 1
    assert time.monotonic() - killed_at < 20
    assert "scheduler process exited unexpectedly" in server.log_path.read_text()
    time.sleep(0.2)
    assert _alive(server.children) == []
    assert server.socket_dirs() == []
