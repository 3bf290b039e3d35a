"""``radixserve chat`` driven through a pseudo-terminal: it starts its own server, chats two
turns (the second shows the first turn's whole history as cached tokens) and leaves on Ctrl-D,
stopping the server it started."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest

from engine.cli import main
from engine.runtime.launcher import free_port

pytestmark = pytest.mark.e2e

STATS = re.compile(
    r"\[(\d+) prompt tokens, (\d+) cached, (\d+) generated; "
    r"time to first token (\d+) ms\]"
)


def expect(fd: int, pattern: str, timeout: float = 300.0) -> str:
    """Read the terminal until ``pattern`` shows up; everything read so far."""
    seen = b""
    deadline = time.monotonic() + timeout
    while pattern.encode() not in seen:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise AssertionError(f"no {pattern!r} within {timeout}s; got:\n{seen.decode()}")
        try:
            data = os.read(fd, 4096)
        except OSError:  # the other side closed
            raise AssertionError(f"the terminal closed; got:\n{seen.decode()}") from None
        seen += data
    return seen.decode(errors="replace")


@pytest.mark.parametrize("which", ["demo", "default"])
def test_two_turns_then_ctrl_d(tmp_path, request, which):
    """On the demo model, and on a GGUF the compiled kernels read in the machine's dtype (the
    default model's path: its second turn once killed the server)."""
    model = "demo" if which == "demo" else request.getfixturevalue("default_model")
    port = free_port()
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "chat", "--model", model, "--max-tokens", "6",
         "--temperature", "0", "--port", str(port)],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    os.close(slave)
    try:
        banner = expect(master, "you> ")
        assert "chatting with" in banner and "session sess-" in banner
        assert f"at http://127.0.0.1:{port} " in banner  # --port: the server it started
        os.write(master, b"Hello there!\n")
        first = STATS.search(expect(master, "you> ", 120))
        os.write(master, b"Tell me more.\n")
        second = STATS.search(expect(master, "you> ", 120))
        assert first and second
        prompt, _, generated, _ = map(int, first.groups())
        assert int(second.group(2)) == prompt + generated > 0
        os.write(master, b"\x04")  # Ctrl-D
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    assert list(tmp_path.glob("radixserve-*")) == []  # its server removed its socket directory


def test_port_and_model_are_for_the_server_it_starts(capsys):
    for extra in (["--port", "30001"], ["--model", "demo"]):
        assert main(["chat", "--url", "http://127.0.0.1:1", *extra]) == 2
        assert "with --url, give neither" in capsys.readouterr().err
    assert main(["chat", "--port", "70000"]) == 2
    assert "--port 70000 is not a port" in capsys.readouterr().err
