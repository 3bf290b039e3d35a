"""The scheduler process: sockets around ``Scheduler``. Blocks on its sockets when idle."""

from __future__ import annotations

import logging
import os

import zmq

from engine.config import LaunchSpec
from engine.protocol import (
    AbortRequest,
    BatchResult,
    Ready,
    Shutdown,
    TokenizedRequest,
    TokenOutputs,
    WorkerReady,
    decode,
    encode,
)
from scheduler.scheduler import Scheduler

logger = logging.getLogger("radixserve.scheduler")


def run(spec: LaunchSpec, ctx: zmq.Context) -> None:
    ep = spec.endpoints
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(ep.scheduler_in)
    from_worker = ctx.socket(zmq.PULL)
    from_worker.bind(ep.worker_out)
    to_worker = ctx.socket(zmq.PUSH)
    to_worker.connect(ep.worker_in)
    to_tokenizers = []
    for address in ep.tokenizer_from_scheduler:
        sock = ctx.socket(zmq.PUSH)
        sock.connect(address)
        to_tokenizers.append(sock)
    control = ctx.socket(zmq.PUSH)
    control.connect(ep.control)

    hello = decode(from_worker.recv())
    assert isinstance(hello, WorkerReady), f"expected WorkerReady, got {type(hello).__name__}"
    sched = Scheduler(spec.config, hello.info)
    control.send(encode(Ready("scheduler", os.getpid(), hello.info)))

    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    poller.register(from_worker, zmq.POLLIN)
    aborts: list[AbortRequest] = []
    checked = True

    def flush() -> None:
        for reply_to, outputs in sched.take_outputs().items():
            to_tokenizers[reply_to].send(encode(TokenOutputs(outputs)))

    while True:
        runnable = sched.inflight is None and (sched.waiting or sched.running)
        events = dict(poller.poll(0 if runnable else None))
        if inbox in events:
            while True:
                try:
                    msg = decode(inbox.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if isinstance(msg, TokenizedRequest):
                    sched.add_request(msg)
                    checked = False
                elif isinstance(msg, AbortRequest):
                    aborts.append(msg)
                elif isinstance(msg, Shutdown):
                    return
        if from_worker in events:
            result = decode(from_worker.recv())
            assert isinstance(result, BatchResult)
            sched.process_result(result)
        if sched.inflight is None:
            # Aborts wait for the batch in flight: its sequences' pages are in use until it ends.
            for msg in aborts:
                sched.abort(msg.rid, msg.reason, msg.index)
            aborts.clear()
            batch = sched.schedule()
            if batch is not None:
                to_worker.send(encode(batch))
            elif sched.idle and not checked:
                sched.check()
                checked = True
        flush()
