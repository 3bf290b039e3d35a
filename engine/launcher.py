"""Starts the process group, waits for every child to be ready, supervises, tears down.

    launcher (this process: the frontend)
      ├─ worker            python -m engine.child  (role worker)
      ├─ scheduler         python -m engine.child  (role scheduler)
      └─ tokenizer-0..N-1  python -m engine.child  (role tokenizer)

Children get their LaunchSpec as msgpack on stdin and talk over ``ipc://`` sockets in a fresh
0700 directory. Any child exiting while the group runs ends the whole group: ``on_death`` is
called (the frontend fails pending requests with an error), the other children are stopped and
the socket directory is removed. Children die with the launcher (PR_SET_PDEATHSIG), so no
process outlives it even on SIGKILL. The directory of a launcher killed that way stays behind
until the next launch by the same user removes it: a launcher holds a lock on its directory's
``owner.lock`` while it lives, and a directory whose lock anyone can take is stale.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq

from engine.config import Endpoints, EngineConfig, LaunchSpec
from engine.protocol import Fatal, ModelInfo, Ready, decode

logger = logging.getLogger("radixserve.launcher")

SOCKET_DIR_PREFIX = "radixserve-"
OWNER_LOCK = "owner.lock"


class EngineError(RuntimeError):
    """The engine could not start, or a process of it died."""


def make_endpoints(root: Path, num_tokenizers: int) -> Endpoints:
    def ipc(name: str) -> str:
        return f"ipc://{root / name}"

    return Endpoints(
        control=ipc("control"),
        tokenizer_in=[ipc(f"tokenizer-{i}-in") for i in range(num_tokenizers)],
        tokenizer_from_scheduler=[ipc(f"tokenizer-{i}-out") for i in range(num_tokenizers)],
        frontend_in=ipc("frontend-in"),
        scheduler_in=ipc("scheduler-in"),
        worker_in=ipc("worker-in"),
        worker_out=ipc("worker-out"),
    )


def remove_stale_socket_dirs(root: Path) -> list[Path]:
    """Remove this user's socket directories under ``root`` whose launcher is gone (its lock on
    ``owner.lock`` died with it); the ones removed."""
    removed = []
    for path in root.glob(f"{SOCKET_DIR_PREFIX}*"):
        try:
            info = path.lstat()
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                continue
            fd = os.open(path / OWNER_LOCK, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue  # not ours, not a directory, or one without a lock file: leave it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its launcher is alive
        finally:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        logger.info("removed socket directories of launchers that died: %s",
                    ", ".join(str(p) for p in removed))
    return removed


def _own_socket_dir() -> tuple[Path, int]:
    """A fresh private socket directory and the open file holding its owner lock."""
    # mkdtemp creates the directory with mode 0700: only this user can reach the sockets.
    path = Path(tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX))
    fd = os.open(path / OWNER_LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return path, fd


class Launcher:
    def __init__(self, config: EngineConfig, on_death: Callable[[str], None] | None = None) -> None:
        config.validate()
        self.config = config
        self.on_death = on_death
        self.ctx = zmq.Context.instance()
        remove_stale_socket_dirs(Path(tempfile.gettempdir()))
        self.socket_dir, self._owner_lock = _own_socket_dir()
        self.endpoints = make_endpoints(self.socket_dir, config.tokenizer_workers)
        self.children: dict[str, subprocess.Popen] = {}
        self.info: ModelInfo | None = None
        self.dead: str | None = None  # why the group stopped, once it has
        self._stopping = False
        self._lock = threading.Lock()

    @property
    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self.children.items()}

    def start(self, timeout: float = 600.0) -> ModelInfo:
        control = self.ctx.socket(zmq.PULL)
        control.bind(self.endpoints.control)
        try:
            self._spawn("worker", "worker", 0)
            self._spawn("scheduler", "scheduler", 0)
            for i in range(self.config.tokenizer_workers):
                self._spawn(f"tokenizer-{i}", "tokenizer", i)
            self._wait_ready(control, timeout)
        except BaseException:
            self.shutdown()
            raise
        finally:
            control.close(linger=0)
        for name, proc in self.children.items():
            threading.Thread(target=self._watch, args=(name, proc), daemon=True,
                             name=f"watch-{name}").start()
        assert self.info is not None
        return self.info

    def _spawn(self, name: str, role: str, index: int) -> None:
        spec = LaunchSpec(role=role, index=index, config=self.config, endpoints=self.endpoints)
        # The name in argv only labels the process for ps and tests; the spec comes on stdin.
        proc = subprocess.Popen([sys.executable, "-m", "engine.child", name], stdin=subprocess.PIPE)
        assert proc.stdin is not None
        proc.stdin.write(msgspec.msgpack.encode(spec))
        proc.stdin.close()
        self.children[name] = proc
        logger.info("started %s (pid %d)", name, proc.pid)

    def _wait_ready(self, control: zmq.Socket, timeout: float) -> None:
        pending = set(self.children)
        deadline = time.monotonic() + timeout
        while pending:
            if control.poll(200):
                msg = decode(control.recv())
                if isinstance(msg, Fatal):
                    raise EngineError(f"{msg.name} failed to start: {msg.error}")
                if isinstance(msg, Ready):
                    pending.discard(msg.name)
                    if msg.info is not None:
                        self.info = msg.info
                        pending.discard("worker")  # the scheduler is ready only after the worker
            for name, proc in self.children.items():
                if proc.poll() is not None:
                    raise EngineError(f"{name} exited with code {proc.returncode} while starting")
            if time.monotonic() > deadline:
                raise EngineError(f"timed out after {timeout:.0f}s waiting for {sorted(pending)}")

    def _watch(self, name: str, proc: subprocess.Popen) -> None:
        code = proc.wait()
        with self._lock:
            if self._stopping:
                return
            self.dead = f"the {name} process exited unexpectedly (exit code {code})"
        logger.error("%s; stopping the engine", self.dead)
        if self.on_death is not None:
            self.on_death(self.dead)
        self.shutdown()

    def shutdown(self, grace: float = 5.0) -> None:
        with self._lock:
            self._stopping = True
        for proc in self.children.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGUSR1)  # children ignore SIGTERM (see engine/child.py)
        deadline = time.monotonic() + grace
        for proc in self.children.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        with self._lock:
            owner_lock, self._owner_lock = self._owner_lock, -1
        if owner_lock >= 0:
            os.close(owner_lock)
