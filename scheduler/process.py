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
    LoraUpdate,
    LoraUpdated,
    Ready,
    SchedulerStats,
    SessionClose,
    SessionOpen,
    Shutdown,
    TokenizedRequest,
    TokenOutputs,
    decode,
    encode,
)
from engine.contracts.worker_messages import BatchResult, ForwardBatch, WorkerReady
from scheduler.kv_events import BlockEvents, KVEventPublisher
from scheduler.refill import RefillWait, ends_next_step
from scheduler.scheduler import Scheduler

logger = logging.getLogger("radixserve.scheduler")

STATS_INTERVAL = 0.25  # seconds between stats messages while the scheduler is busy


class SchedulerLoop:
    """The sockets around one ``Scheduler``: what arrives goes in, batches and outputs go out.
    The policy is the Scheduler's; this class moves messages, and holds a step back while
    finished requests' replacements are awaited (scheduler/refill.py: when, and how long)."""

    def __init__(self, spec: LaunchSpec, ctx: zmq.Context) -> None:
        ep, config = spec.endpoints, spec.config
        self.inbox = ctx.socket(zmq.PULL)
        self.inbox.bind(ep.scheduler_in)
        self.from_worker = ctx.socket(zmq.PULL)
        self.from_worker.bind(ep.worker_out)
        self.to_worker = ctx.socket(zmq.PUSH)
        self.to_worker.connect(ep.worker_in)
        self.to_tokenizers = []
        for address in ep.tokenizer_from_scheduler:
            sock = ctx.socket(zmq.PUSH)
            sock.connect(address)
            self.to_tokenizers.append(sock)
        self.control = ctx.socket(zmq.PUSH)
        self.control.connect(ep.control)

        hello = decode(self.from_worker.recv())
        assert isinstance(hello, WorkerReady), f"expected WorkerReady, got {type(hello).__name__}"
        self.sched = Scheduler(config, hello.info)
        self.kv_events: BlockEvents | None = None
        self.publisher: KVEventPublisher | None = None
        if config.kv_events_endpoint:
            self.kv_events = BlockEvents(config.kv_events_block, loras=self.sched.adapters.of_namespace)
            self.kv_events.attach(self.sched.tree)
            self.publisher = KVEventPublisher(ctx, config.kv_events_endpoint)
        self.control.send(encode(Ready("scheduler", os.getpid(), hello.info)))
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)
        self.poller.register(self.from_worker, zmq.POLLIN)
        self.aborts: list[AbortRequest] = []
        self.checked = True  # the accounting was checked since the last request arrived
        self.last_stats: SchedulerStats | None = None
        self.next_stats = 0.0
        self.refill = RefillWait(config.refill_wait_ms / 1000)

    def _hold(self) -> float:
        """Seconds the next step still waits for finished requests' replacements, while
        nothing runs or is in flight (scheduler/refill.py)."""
        sched = self.sched
        if sched.running or sched.inflight or not sched.waiting:
            return 0.0
        return self.refill.hold_seconds()

    def _settling(self) -> bool:
        """Every running request ends at its next step (True when none runs)."""
        context_len = self.sched.info.context_len
        return all(ends_next_step(r, context_len) for r in self.sched.running)

    def _admits(self) -> bool:
        """Whether the next step may admit waiting requests: not while the running ones all
        end at it and their replacements are awaited (scheduler/refill.py)."""
        sched = self.sched
        return not (sched.waiting and sched.running and not sched.inflight
                    and self.refill.hold_seconds() and self._settling())

    def run(self) -> None:
        sched = self.sched
        while True:
            hold = self._hold()
            runnable = not hold and sched.can_schedule()
            timeout = 0.0 if runnable else sched.sessions.seconds_to_next_expiry(time.monotonic())
            if hold:
                timeout = hold if timeout is None else min(timeout, hold)
            events = dict(self.poller.poll(None if timeout is None else math.ceil(1000 * timeout)))
            sched.sessions.expire(time.monotonic())
            if self.inbox in events and not self._receive_requests():
                if self.publisher is not None:
                    self.publisher.close()
                return
            if self.from_worker in events and (result_at := self._receive_results()):
                # A step's tokens go out before the next step is planned and sent: with none
                # in flight, the tokenizer and frontend turn them into replies while the
                # worker waits for its batch, not while its threads hold every core
                # (docs/benchmarks.md, "Prefill on AMX").
                self._flush(result_at)
            if len(sched.inflight) <= 1 and not self._hold():
                self._step()
            self._flush()

    def _receive_requests(self) -> bool:
        """Take every waiting message from the tokenizers; False on Shutdown."""
        for msg in _drain(self.inbox):
            if isinstance(msg, TokenizedRequest):
                self.sched.add_request(msg)
                self.refill.arrived()
                self.checked = False
            elif isinstance(msg, AbortRequest):
                self.aborts.append(msg)
            elif isinstance(msg, SessionOpen):
                self.sched.sessions.open(msg.session_id, msg.ttl, msg.parent)
            elif isinstance(msg, SessionClose):
                self.sched.sessions.close(msg.session_id)
            elif isinstance(msg, LoraUpdate):
                # behind the batches already sent: the worker never changes adapters mid-step
                checked = self.sched.update_lora(msg)
                sock = self.to_worker if isinstance(checked, LoraUpdate) else (
                    self.to_tokenizers[msg.reply_to])
                sock.send(encode(checked))
            elif isinstance(msg, Shutdown):
                return False
        return True

    def _receive_results(self) -> float:
        """Apply every batch result waiting; when the last arrived (monotonic seconds)."""
        result_at = 0.0
        for result in _drain(self.from_worker):
            if isinstance(result, LoraUpdated):
                answer = self.sched.adapters.updated(result)
                self.to_tokenizers[answer.reply_to].send(encode(answer))
                continue
            assert isinstance(result, BatchResult)
            result_at = time.monotonic()
            before = len(self.sched.requests)
            self.sched.process_result(result)
            self.refill.finished(before - len(self.sched.requests), self._settling())
        return result_at

    def _plan(self) -> ForwardBatch | None:
        """The next step's batch (None: nothing to run); what a step with admission open
        leaves waiting is a backlog, nobody's replacement (scheduler/refill.py)."""
        admit = self._admits()
        batch = self.sched.schedule(admit=admit)
        if admit and batch is not None:
            self.refill.admitted(len(self.sched.waiting))
        return batch

    def _step(self) -> None:
        sched = self.sched
        # An abort frees pages the batch in flight may still write: only batches sent after
        # it, which the worker runs later, can reuse them. Its tokens that batch samples are
        # not cached (Scheduler._release).
        for msg in self.aborts:
            sched.abort(msg.rid, msg.reason, msg.index)
        self.aborts.clear()
        batch = self._plan()
        if batch is not None:
            self.to_worker.send(encode(batch))
        elif sched.idle and not self.checked:
            sched.check()
            self.checked = True

    def _flush(self, result_at: float = 0.0) -> None:
        """Send the outputs (and, at most every STATS_INTERVAL or on going idle, the stats) to
        the tokenizers that own them; publish the step's KV events."""
        sched = self.sched
        if self.publisher is not None:
            self.publisher.publish(self.kv_events.take())  # one batch per step that changed it
        batches = sched.take_outputs()
        stats, now = None, time.monotonic()
        if sched.idle or now >= self.next_stats:
            current = SchedulerStats(**sched.stats())
            if current != self.last_stats:
                stats = self.last_stats = current
                self.next_stats = now + STATS_INTERVAL
                batches = batches or {0: []}
        for reply_to, outputs in batches.items():
            self.to_tokenizers[reply_to].send(encode(TokenOutputs(outputs, stats, result_at)))
            stats = None


def _drain(sock: zmq.Socket):
    """The messages waiting on ``sock``, decoded, without blocking."""
    while True:
        try:
            yield decode(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            return


def run(spec: LaunchSpec, ctx: zmq.Context) -> None:
    SchedulerLoop(spec, ctx).run()
