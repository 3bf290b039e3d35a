"""Entry point of every child process: ``python -m engine.runtime.child`` with a LaunchSpec (msgpack)
on stdin. Sets up logging and signals, runs the role, and reports a fatal error to the launcher
before exiting non-zero."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import traceback

import msgspec
import zmq

from engine.contracts.engine_config import LaunchSpec
from engine.contracts.protocol import Fatal, encode

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Linux: the kernel sends ``sig`` to this process when its parent dies, however the parent
    dies (no orphans). The launcher's children get SIGKILL; the server that ``radixserve chat``
    starts gets SIGTERM, a clean shutdown. Also a ``preexec_fn``."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except OSError:
        pass
    if os.getppid() == 1:  # the parent was already gone before prctl took effect
        os._exit(1)


def _role(name: str):
    """The ``run(spec, ctx)`` of a role, imported only in the child that plays it (imports
    written out, so that tests/test_layout.py sees which packages the runtime reaches)."""
    if name == "worker":
        from engine.worker import process
    elif name == "tp_worker":
        from engine.worker import tp_rank as process
    elif name == "scheduler":
        from scheduler import process
    elif name == "tokenizer":
        from tokenizer_worker import process
    else:
        raise ValueError(f"unknown role {name!r}")
    return process.run


def main() -> int:
    spec = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=LaunchSpec)
    die_with_parent()
    # Ctrl-C, and a service manager's SIGTERM, reach the whole process group; only the launcher
    # decides how to shut down (it drains, then stops children with SIGUSR1).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    name = {"tokenizer": f"tokenizer-{spec.index}",
            "tp_worker": f"tp-rank-{spec.index}"}.get(spec.role, spec.role)
    logging.basicConfig(level=spec.config.log_level.upper(),
                        format=f"%(asctime)s {name} %(levelname)s %(message)s")
    ctx = zmq.Context()
    try:
        _role(spec.role)(spec, ctx)
        return 0
    except Exception:
        text = traceback.format_exc()
        logging.getLogger("radixserve").error("%s failed:\n%s", name, text)
        control = ctx.socket(zmq.PUSH)
        control.setsockopt(zmq.LINGER, 2000)
        control.connect(spec.endpoints.control)
        last = text.strip().splitlines()[-1]
        control.send(encode(Fatal(name, last)))
        control.close()
        return 1


if __name__ == "__main__":
    sys.exit(main())
