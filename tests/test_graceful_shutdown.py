"""SIGTERM under load on a real ``radixserve serve``: new requests (HTTP and ZMQ) and /health get
a JSON 503 at once, running requests finish within ``--shutdown-timeout`` or then get a JSON
503, the server exits 0 with no traceback and no socket directory left. And a frontend killed
by SIGKILL leaves a socket directory that the next start removes."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from engine.server.zmq_client import ZmqAPIError, ZmqClient
from tests.server_process import ServerProcess, free_port, metric_values

pytestmark = pytest.mark.e2e

LONG = {"prompt": "Tell a long story:", "ignore_eos": True}


class Load:
    """Streaming and whole completions over HTTP plus one ZMQ stream, each on its own thread,
    their outcomes kept for the test to check."""

    def __init__(self, server: ServerProcess, max_tokens: int, streams: int = 3,
                 wholes: int = 2) -> None:
        self.server = server
        self.body = {**LONG, "max_tokens": max_tokens}
        self.events: list[list[str]] = [[] for _ in range(streams)]
        self.wholes: list[httpx.Response | None] = [None] * wholes
        self.zmq_chunks: list = []
        self.zmq_error: ZmqAPIError | None = None
        self.threads = [threading.Thread(target=self._stream, args=(i,)) for i in range(streams)]
        self.threads += [threading.Thread(target=self._whole, args=(i,)) for i in range(wholes)]
        self.threads.append(threading.Thread(target=self._zmq))
        for thread in self.threads:
            thread.start()
        self.total = streams + wholes + 1
        deadline = time.monotonic() + 60
        while (metric_values(server)["radixserve_num_requests_pending"] < self.total
               or not all(self.events) or not self.zmq_chunks):
            assert time.monotonic() < deadline, "the load did not start"
            time.sleep(0.02)

    def _stream(self, i: int) -> None:
        with httpx.stream("POST", f"{self.server.url}/v1/completions", timeout=120,
                          json={**self.body, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.events[i].append(line[6:])

    def _whole(self, i: int) -> None:
        self.wholes[i] = httpx.post(f"{self.server.url}/v1/completions", json=self.body,
                                    timeout=120)

    def _zmq(self) -> None:
        with ZmqClient(self.server.zmq_url, timeout=120) as client:
            try:
                for chunk in client.completion(self.body):
                    self.zmq_chunks.append(chunk)
            except ZmqAPIError as exc:
                self.zmq_error = exc

    def join(self) -> None:
        for thread in self.threads:
            thread.join(120)


def start(tmp: Path, *args: str) -> ServerProcess:
    zmq_port = free_port()
    server = ServerProcess(tmp, "--num-pages", "1024", "--zmq-port", str(zmq_port), *args)
    server.zmq_url = f"tcp://127.0.0.1:{zmq_port}"
    return server


def assert_refused_while_draining(server: ServerProcess) -> None:
    refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, timeout=30)
    assert refused.status_code == 503
    assert refused.headers["content-type"] == "application/json"
    assert "shutting down" in refused.json()["error"]["message"]
    health = httpx.get(f"{server.url}/health", timeout=30)
    assert health.status_code == 503 and "shutting down" in health.json()["error"]["message"]
    with ZmqClient(server.zmq_url, timeout=30) as client, pytest.raises(ZmqAPIError) as zmq:
        list(client.completion({"prompt": "x"}))
    assert zmq.value.status == 503


def assert_clean_exit(server: ServerProcess) -> None:
    assert server.proc.wait(60) == 0
    server.stop()
    time.sleep(0.2)
    assert [p for p in server.children if Path(f"/proc/{p}").exists()] == []
    assert server.socket_dirs() == []
    log = server.log_path.read_text()
    assert "Traceback" not in log and "ZMQError" not in log


def test_sigterm_lets_running_requests_finish(tmp_path):
    server = start(tmp_path, "--shutdown-timeout", "60")
    load = Load(server, max_tokens=600)
    server.proc.send_signal(signal.SIGTERM)
    assert_refused_while_draining(server)
    load.join()
    for events in load.events:
        assert events[-1] == "[DONE]"
        finals = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
        assert finals[-1] == "length"
    for response in load.wholes:
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 600
    assert load.zmq_error is None
    assert load.zmq_chunks[-1].choices[0].finish_reason == "length"
    assert_clean_exit(server)


def test_sigterm_fails_what_outlives_the_timeout_with_a_json_503(tmp_path):
    server = start(tmp_path, "--shutdown-timeout", "1")
    load = Load(server, max_tokens=3000)
    signalled = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert_refused_while_draining(server)
    load.join()
    assert time.monotonic() - signalled < 15
    for events in load.events:
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "service_unavailable" and "shut down" in error["message"]
    for response in load.wholes:
        assert response.status_code == 503
        assert response.headers["content-type"] == "application/json"
        assert "shut down before this request finished" in response.json()["error"]["message"]
    assert load.zmq_error is not None and load.zmq_error.status == 503
    assert_clean_exit(server)


def test_the_next_start_removes_the_socket_directory_of_a_killed_frontend(tmp_path):
    killed = ServerProcess(tmp_path, "--num-pages", "256")
    (left_behind,) = killed.socket_dirs()
    killed.stop(signal.SIGKILL)
    deadline = time.monotonic() + 30
    while [p for p in killed.children if Path(f"/proc/{p}").exists()]:
        assert time.monotonic() < deadline, "the children outlived their parent"
        time.sleep(0.05)
    assert left_behind.exists()

    # A directory of another process that still runs is not stale: this test's own.
    alive = tmp_path / "radixserve-alive"
    alive.mkdir(mode=0o700)
    lock = os.open(alive / "owner.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        server = ServerProcess(tmp_path, "--num-pages", "256")
        assert not left_behind.exists()
        assert alive.exists()
        assert len(server.socket_dirs()) == 2  # its own and the live one
        assert server.stop() == 0
    finally:
        os.close(lock)


def test_sigterm_to_the_whole_process_group_still_drains(tmp_path):
    """A service manager (systemd's default) signals every process of the group: the children
    ignore SIGTERM, so the launcher still drains and stops them itself."""
    server = start(tmp_path, "--shutdown-timeout", "60")
    load = Load(server, max_tokens=300)
    for pid in [server.proc.pid, *server.children]:
        os.kill(pid, signal.SIGTERM)
    load.join()
    for events in load.events:
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert all(response.status_code == 200 for response in load.wholes)
    assert_clean_exit(server)
