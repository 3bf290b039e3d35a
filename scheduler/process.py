"""The scheduler process: sockets around ``Scheduler``. Blocks on its sockets when idle, waking
only for the next session pin to expire. Its stats ride on the outputs to the tokenizer workers
(at most every ``STATS_INTERVAL`` seconds while busy, and once when it goes idle), which forward
them to the frontend's metrics.
"""

from __future__ import annotations

import logging
import math
import os
import time

import zmq

from engine.contracts.engine_config import LaunchSpec
from engine.contracts.protocol import (
    AbortRequest,
    BatchResult,
    Ready,
    SchedulerStats,
    SessionClose,
    SessionOpen,
    Shutdown,
    TokenizedRequest,
    TokenOutputs,
    WorkerReady,
    decode,
    encode,
)
from scheduler.kv_events import BlockEvents, KVEventPublisher
from scheduler.scheduler import Scheduler

logger = logging.getLogger("radixserve.scheduler")

STATS_INTERVAL = 0.25  # seconds between stats messages while the scheduler is busy


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
    kv_events = publisher = None
    if spec.config.kv_events_endpoint:
        kv_events = BlockEvents(spec.config.kv_events_block)
        kv_events.attach(sched.tree)
        publisher = KVEventPublisher(ctx, spec.config.kv_events_endpoint)
    control.send(encode(Ready("scheduler", os.getpid(), hello.info)))

    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    poller.register(from_worker, zmq.POLLIN)
    aborts: list[AbortRequest] = []
    checked = True
    last_stats: SchedulerStats | None = None
    next_stats = 0.0

    def flush(result_at: float = 0.0) -> None:
        nonlocal last_stats, next_stats
        if publisher is not None:
            publisher.publish(kv_events.take())  # one batch per step that changed the tree
        batches = sched.take_outputs()
        stats, now = None, time.monotonic()
        if sched.idle or now >= next_stats:
            current = SchedulerStats(**sched.stats())
            if current != last_stats:
                stats = last_stats = current
                next_stats = now + STATS_INTERVAL
                batches = batches or {0: []}
        for reply_to, outputs in batches.items():
            to_tokenizers[reply_to].send(encode(TokenOutputs(outputs, stats, result_at)))
            stats = None

    while True:
        runnable = sched.can_schedule()
        timeout = 0.0 if runnable else sched.sessions.seconds_to_next_expiry(time.monotonic())
        events = dict(poller.poll(None if timeout is None else math.ceil(1000 * timeout)))
        sched.sessions.expire(time.monotonic())
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
                elif isinstance(msg, SessionOpen):
                    sched.sessions.open(msg.session_id, msg.ttl)
                elif isinstance(msg, SessionClose):
                    sched.sessions.close(msg.session_id)
                elif isinstance(msg, Shutdown):
                    if publisher is not None:
                        publisher.close()
                    return
        result_at = 0.0
        if from_worker in events:
            while True:
                try:
                    result = decode(from_worker.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                assert isinstance(result, BatchResult)
                result_at = time.monotonic()
                sched.process_result(result)
        if result_at and sched.inflight:
            # The worker already has its next batch (overlap): the tokens go out before the
            # step after it is planned. Without a batch in flight, planning comes first.
            flush(result_at)
            result_at = 0.0
        if len(sched.inflight) <= 1:
            # An abort frees pages the batch in flight may still write: only batches sent after
            # it, which the worker runs later, can reuse them. Its tokens that batch samples are
            # not cached (Scheduler._release).
            for msg in aborts:
                sched.abort(msg.rid, msg.reason, msg.index)
            aborts.clear()
            batch = sched.schedule()
            if batch is not None:
                to_worker.send(encode(batch))
            elif sched.idle and not checked:
                sched.check()
                checked = True
        flush(result_at)
