"""Starts the process group, waits for every child to be ready, supervises, tears down.

    launcher (this process: the frontend)
      ├─ worker            python -m engine.runtime.child  (role worker)
      ├─ scheduler         python -m engine.runtime.child  (role scheduler)
      └─ tokenizer-0..N-1  python -m engine.runtime.child  (role tokenizer)

With ``--tp-size N`` > 1 the worker is rank 0 of a tensor-parallel group and ranks 1..N-1 are
children too (``tp-rank-r``, python -m engine.runtime.child tp_worker; engine/worker/distributed.py). Across
machines (``--nnodes``), node 0 runs everything above plus its share of the ranks, and every
other node's launcher runs only its ranks, until the group ends.

With ``--dp-size R`` > 1 there is one scheduler and one worker per replica (``scheduler-r``,
``worker-r``), each pair with its own sockets and KV events endpoint; the tokenizers dispatch
between them (tokenizer_worker/process.py).

Children get their LaunchSpec as msgpack on stdin and talk over ``ipc://`` sockets in a fresh
0700 directory. Any child exiting while the group runs ends the whole group: ``on_death`` is
called (the frontend fails pending requests with an error), the other children are stopped and
the socket directory is removed. Children die with the launcher (PR_SET_PDEATHSIG), so no
process outlives it even on SIGKILL. The directory of a launcher killed that way stays behind
until the next launch by the same user removes it: a launcher holds a lock on its directory's
``owner.lock`` while it lives, and a directory whose lock anyone can take is stale.

Data parallel: a replica whose scheduler or worker exits is a replica down, not a group down,
while another replica serves. Its other process is stopped and every tokenizer gets a
``ReplicaDown``: the requests in flight there fail at once (503) and no more are routed there.
The last replica going down ends the group as above. A dead replica stays down until the
server restarts.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import signal
import socket
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

from engine.contracts.engine_config import Endpoints, EngineConfig, LaunchSpec, ReplicaEndpoints
from engine.contracts.protocol import Fatal, Ready, ReplicaDown, decode, encode
from engine.contracts.worker_messages import ModelInfo
from engine.worker.model.config import ModelConfig

logger = logging.getLogger("radixserve.launcher")

SOCKET_DIR_PREFIX = "radixserve-"
OWNER_LOCK = "owner.lock"
IPC_PATH_MAX = 107  # bytes of a Unix socket's path (sun_path, less its terminating NUL)
# "/radixserve-" + 8 random characters + "/" (mkdtemp) and the longest socket name
# ("r15-tokenizer-15-out")
SOCKET_PATH_ROOM = 42


class LaunchError(RuntimeError):
    """The engine could not start, or a process of it died."""


def make_endpoints(root: Path, num_tokenizers: int, dp_size: int = 1) -> Endpoints:
    def ipc(name: str) -> str:
        return f"ipc://{root / name}"

    endpoints = Endpoints(
        control=ipc("control"),
        tokenizer_in=[ipc(f"tokenizer-{i}-in") for i in range(num_tokenizers)],
        tokenizer_from_scheduler=[ipc(f"tokenizer-{i}-out") for i in range(num_tokenizers)],
        frontend_in=ipc("frontend-in"),
        scheduler_in=ipc("scheduler-in"),
        worker_in=ipc("worker-in"),
        worker_out=ipc("worker-out"),
    )
    if dp_size == 1:
        return endpoints
    endpoints.replicas = [ReplicaEndpoints(
        scheduler_in=ipc(f"r{r}-scheduler-in"),
        tokenizer_from_scheduler=[ipc(f"r{r}-tokenizer-{i}-out") for i in range(num_tokenizers)],
        worker_in=ipc(f"r{r}-worker-in"),
        worker_out=ipc(f"r{r}-worker-out"),
        kv_events=ipc(f"r{r}-kv-events"),
    ) for r in range(dp_size)]
    endpoints.dispatch_stats = ipc("dispatch-stats")
    return endpoints.for_replica(0)


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


def socket_root() -> Path:
    """Where socket directories go: the temp directory ($TMPDIR), unless an ipc:// path under it
    could pass the kernel's limit on a socket's path (107 bytes), then /tmp."""
    root = Path(tempfile.gettempdir())
    return root if len(str(root)) + SOCKET_PATH_ROOM <= IPC_PATH_MAX else Path("/tmp")


def _own_socket_dir() -> tuple[Path, int]:
    """A fresh private socket directory and the open file holding its owner lock."""
    # mkdtemp creates the directory with mode 0700: only this user can reach the sockets.
    path = Path(tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX, dir=socket_root()))
    fd = os.open(path / OWNER_LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return path, fd


def worker_threads(config: EngineConfig, cpu_count: int, sharing: int = 1) -> int:
    """OpenMP threads of one model worker: ``--worker-threads`` if given, else its share of the
    cores (``sharing`` workers on this machine). Steps too small to gain from them run on one
    (engine/worker/runner.py, ``SMALL_STEP_FLOPS``)."""
    if config.worker_threads is not None:
        return config.worker_threads
    return max(1, cpu_count // sharing)


class Launcher:
    def __init__(self, config: EngineConfig, on_death: Callable[[str], None] | None = None,
                 publish_kv_events: bool = False) -> None:
        config.validate()
        if config.tp_size > 1 and config.dist_init_addr is None:
            config = msgspec.structs.replace(config, dist_init_addr=f"127.0.0.1:{free_port()}")
        if config.context_len is None:
            # Resolved once here, so every child (the tokenizers' early length check too) reads
            # the same context from the config instead of each loading the model's own.
            model_context = ModelConfig.from_dir(config.model).max_context_len
            config = msgspec.structs.replace(config, context_len=model_context)
        self.config = config
        self.on_death = on_death
        self.ctx = zmq.Context.instance()
        remove_stale_socket_dirs(socket_root())
        self.socket_dir, self._owner_lock = _own_socket_dir()
        if publish_kv_events and config.kv_events_endpoint is None:
            # The gRPC door relays the events; nobody else needs to reach them.
            self.config = config = msgspec.structs.replace(
                config, kv_events_endpoint=f"ipc://{self.socket_dir / 'kv-events'}")
        self.endpoints = make_endpoints(self.socket_dir, config.tokenizer_workers, config.dp_size)
        self.children: dict[str, subprocess.Popen] = {}
        self.info: ModelInfo | None = None
        self.dead: str | None = None  # why the group stopped, once it has
        self.replicas_down: dict[int, str] = {}  # data parallel: replica → why it stopped
        self._to_tokenizers: list[zmq.Socket] = []  # ReplicaDown goes out on these
        self._stopping = False
        self._lock = threading.Lock()
        self._ended = threading.Event()  # the group is dead

    def start(self, timeout: float = 600.0) -> ModelInfo:
        control = self.ctx.socket(zmq.PULL)
        control.bind(self.endpoints.control)
        serves = self.config.node_rank == 0  # the other nodes of a TP group run only ranks
        try:
            if self.config.dp_size == 1:
                self._spawn_engine()
            for r in range(self.config.dp_size if self.config.dp_size > 1 else 0):
                self._spawn_replica(r)
            for i in range(self.config.tokenizer_workers if serves else 0):
                self._spawn(f"tokenizer-{i}", "tokenizer", i)
            self._wait_ready(control, timeout)
        except BaseException:
            self.shutdown()
            raise
        finally:
            control.close(linger=0)
        if self.config.dp_size > 1:
            for address in self.endpoints.tokenizer_in:
                sock = self.ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(address)
                self._to_tokenizers.append(sock)
        for name, proc in self.children.items():
            threading.Thread(target=self._watch, args=(name, proc), daemon=True,
                             name=f"watch-{name}").start()
        if not serves:
            ranks = self._local_ranks()
            logger.warning("node %d: tensor-parallel ranks %d-%d ready; serving until the group "
                           "ends", self.config.node_rank, ranks.start, ranks.stop - 1)
            self._ended.wait()
            raise LaunchError(f"node {self.config.node_rank}'s tensor-parallel ranks stopped: "
                              f"{self.dead}")
        assert self.info is not None
        return self.info

    def _local_ranks(self) -> range:
        per_node = self.config.tp_ranks_per_node
        return range(self.config.node_rank * per_node, (self.config.node_rank + 1) * per_node)

    def _worker_env(self, sharing: int) -> dict[str, str] | None:
        """The environment of a model worker whose machine's cores ``sharing`` workers share
        (tensor-parallel ranks, data-parallel replicas): OMP_NUM_THREADS set to its share, or
        to ``worker_threads``; the user's own OMP_NUM_THREADS is left alone."""
        if "OMP_NUM_THREADS" in os.environ:
            return None
        threads = worker_threads(self.config, os.cpu_count() or 1, sharing)
        return {**os.environ, "OMP_NUM_THREADS": str(threads)}

    def _spawn_engine(self) -> None:
        """One engine: on node 0 the worker (tensor-parallel rank 0) and the scheduler; on
        every node its tensor-parallel ranks."""
        env = self._worker_env(self.config.tp_ranks_per_node)
        for rank in self._local_ranks():
            if rank == 0:
                self._spawn("worker", "worker", 0, env=env)
                self._spawn("scheduler", "scheduler", 0)
            else:
                self._spawn(f"tp-rank-{rank}", "tp_worker", rank, env=env)

    def _spawn_replica(self, r: int) -> None:
        """Replica ``r``'s worker and scheduler: a single engine's processes, handed the
        replica's own addresses and a config whose KV events go to the dispatchers."""
        rep = self.endpoints.replicas[r]
        config = msgspec.structs.replace(self.config, dp_size=1, kv_events_endpoint=rep.kv_events)
        endpoints = self.endpoints.for_replica(r)
        # Each replica's worker gets its share of the cores: R workers each spinning up one
        # thread per core would fight over every core.
        env = self._worker_env(self.config.dp_size)
        self._spawn(f"worker-{r}", "worker", r, config, endpoints, env)
        self._spawn(f"scheduler-{r}", "scheduler", r, config, endpoints)

    def _spawn(self, name: str, role: str, index: int, config: EngineConfig | None = None,
               endpoints: Endpoints | None = None, env: dict[str, str] | None = None) -> None:
        spec = LaunchSpec(role=role, index=index, config=config or self.config,
                          endpoints=endpoints or self.endpoints)
        # The name in argv only labels the process for ps and tests; the spec comes on stdin.
        proc = subprocess.Popen([sys.executable, "-m", "engine.runtime.child", name], stdin=subprocess.PIPE,
                                env=env)
        assert proc.stdin is not None
        proc.stdin.write(msgspec.msgpack.encode(spec))
        proc.stdin.close()
        self.children[name] = proc
        logger.info("started %s (pid %d)", name, proc.pid)

    def _wait_ready(self, control: zmq.Socket, timeout: float) -> None:
        pending = set(self.children)
        names = {proc.pid: name for name, proc in self.children.items()}
        deadline = time.monotonic() + timeout
        while pending:
            if control.poll(200):
                msg = decode(control.recv())
                if isinstance(msg, Fatal):
                    raise LaunchError(f"{msg.name} failed to start: {msg.error}")
                if isinstance(msg, Ready):
                    name = names.get(msg.pid, msg.name)  # all replicas' schedulers say "scheduler"
                    pending.discard(name)
                    if msg.info is not None:
                        self.info = msg.info
                        # the scheduler is ready only after its worker
                        pending.discard(name.replace("scheduler", "worker"))
            for name, proc in self.children.items():
                if proc.poll() is not None:
                    raise LaunchError(f"{name} exited with code {proc.returncode} while starting")
            if time.monotonic() > deadline:
                raise LaunchError(f"timed out after {timeout:.0f}s waiting for {sorted(pending)}")

    def _watch(self, name: str, proc: subprocess.Popen) -> None:
        code = proc.wait()
        reason = f"the {name} process exited unexpectedly (exit code {code})"
        replica = _replica_of(name)
        with self._lock:
            if self._stopping or replica in self.replicas_down:
                return
            if replica is not None and len(self.replicas_down) + 1 < self.config.dp_size:
                self._replica_down(replica, reason)
                return
            self.dead = reason
        logger.error("%s; stopping the engine", self.dead)
        if self.on_death is not None:
            self.on_death(self.dead)
        self.shutdown()
        self._ended.set()

    def _replica_down(self, replica: int, reason: str) -> None:
        """Called with the lock held: the replica stops serving, the others go on."""
        self.replicas_down[replica] = reason
        logger.error("%s; data-parallel replica %d is down, %d of %d still serve", reason,
                     replica, self.config.dp_size - len(self.replicas_down), self.config.dp_size)
        for sock in self._to_tokenizers:
            sock.send(encode(ReplicaDown(replica, reason)))
        for role in ("scheduler", "worker"):
            proc = self.children[f"{role}-{replica}"]
            if proc.poll() is None:
                proc.send_signal(signal.SIGUSR1)
                threading.Thread(target=_reap, args=(proc,), daemon=True).start()

    def shutdown(self, grace: float = 5.0) -> None:
        with self._lock:
            self._stopping = True
            for sock in self._to_tokenizers:
                sock.close(linger=0)
            self._to_tokenizers = []
        for proc in self.children.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGUSR1)  # children ignore SIGTERM (see engine/runtime/child.py)
        deadline = time.monotonic() + grace
        for proc in self.children.values():
            _reap(proc, max(0.0, deadline - time.monotonic()))
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        with self._lock:
            owner_lock, self._owner_lock = self._owner_lock, -1
        if owner_lock >= 0:
            os.close(owner_lock)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel's pick)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _replica_of(name: str) -> int | None:
    """The data-parallel replica a child belongs to (``scheduler-1``: 1), None for the others."""
    role, _, index = name.rpartition("-")
    return int(index) if role in ("scheduler", "worker") else None


def _reap(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """Wait ``grace`` seconds for ``proc`` to exit, then kill it."""
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
