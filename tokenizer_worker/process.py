"""The tokenizer process's loop: the frontend's messages and the schedulers' outputs through a
``TokenizerWorker`` (tokenizer_worker/core.py), each tokenized request routed to a scheduler.

    frontend ─▶ tokenizer i ──TokenizedRequest──▶ scheduler r   (r = Dispatcher.route; 0 for
                    ▲  ◀──TokenOutputs──────────  scheduler r    a single engine)
                    └──KV event batches (SUB) ──  scheduler r   (--dp-size > 1: its ipc://
                                                                 kv-events endpoint)
    launcher ──ReplicaDown──▶ tokenizer i: the replica's requests that had output fail with
                              503 at once; those that had none go to another replica

Event sockets are read before outputs and requests, so a request sees every event its
replica published before the outputs it answers (a turn is sent after the previous turn's
last output, which its scheduler sent after the events of caching it). With replicas the
dispatcher's per-replica state goes to the frontend's metrics on its own socket, at most every
``STATS_INTERVAL`` seconds; a single engine's scheduler stats pass straight through.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

import zmq

from engine.contracts.engine_config import LaunchSpec, ReplicaEndpoints
from engine.contracts.protocol import (
    AbortRequest,
    DetokenizeRequest,
    GenerateRequest,
    LoraUpdate,
    LoraUpdated,
    Ready,
    ReplicaDown,
    RequestOutput,
    SessionClose,
    SessionOpen,
    Shutdown,
    TokenizedRequest,
    TokenizeRequest,
    TokenOutputs,
    decode,
    encode,
)
from engine.contracts.tokenizer import load_tokenizer
from tokenizer_worker.core import TokenizerWorker
from tokenizer_worker.dispatch import Dispatcher, NoReplica, OneReplica
from tokenizer_worker.lora_updates import LoraFanOut

STATS_INTERVAL = 0.1  # seconds between the dispatcher's reports to the frontend


class TokenizerLoop:
    """The sockets around one ``TokenizerWorker`` and its router: a ``Dispatcher`` over the
    data-parallel replicas, or ``OneReplica`` for a single engine (then the scheduler's stats
    go straight to the frontend)."""

    def __init__(self, spec: LaunchSpec, ctx: zmq.Context, worker: TokenizerWorker) -> None:
        ep, c, i = spec.endpoints, spec.config, spec.index
        self.index = i
        self.worker = worker
        replicas = ep.replicas or [ReplicaEndpoints(
            scheduler_in=ep.scheduler_in, tokenizer_from_scheduler=ep.tokenizer_from_scheduler,
            worker_in=ep.worker_in, worker_out=ep.worker_out)]
        self.dispatcher: Dispatcher | OneReplica = OneReplica()
        if ep.replicas:
            self.dispatcher = Dispatcher(len(ep.replicas), c.kv_events_block, policy=c.dp_policy,
                                         cache_threshold=c.dp_cache_threshold,
                                         balance_abs=c.dp_balance_abs,
                                         balance_rel=c.dp_balance_rel)
        self.from_frontend = ctx.socket(zmq.PULL)
        self.from_frontend.bind(ep.tokenizer_in[i])
        self.events, self.outputs, self.schedulers = [], [], []
        for rep in replicas:
            if rep.kv_events is not None:
                sub = ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.RCVHWM, 100_000)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.connect(rep.kv_events)
                self.events.append(sub)
            pull = ctx.socket(zmq.PULL)
            pull.bind(rep.tokenizer_from_scheduler[i])
            self.outputs.append(pull)
            push = ctx.socket(zmq.PUSH)
            push.connect(rep.scheduler_in)
            self.schedulers.append(push)
        self.to_frontend = ctx.socket(zmq.PUSH)
        self.to_frontend.connect(ep.frontend_in)
        self.to_metrics = None
        if ep.dispatch_stats is not None:
            self.to_metrics = ctx.socket(zmq.PUSH)
            self.to_metrics.setsockopt(zmq.SNDHWM, 16)  # a report only replaces the one before
            self.to_metrics.connect(ep.dispatch_stats)
        self.poller = zmq.Poller()
        for sock in (*self.events, *self.outputs, self.from_frontend):
            self.poller.register(sock, zmq.POLLIN)
        self.next_report = 0.0
        self.lora_updates = LoraFanOut()

    def run(self, control: zmq.Socket) -> None:
        control.send(encode(Ready(f"tokenizer-{self.index}", os.getpid())))
        while True:
            timeout = None
            if self.dispatcher.changed:
                timeout = max(0, int(1000 * (self.next_report - time.monotonic())) + 1)
            polled = dict(self.poller.poll(timeout))
            for r, sub in enumerate(self.events):
                if sub in polled:
                    for _, sequence, payload in _drain(sub.recv_multipart):
                        self.dispatcher.on_events(r, int.from_bytes(sequence, "big"), payload)
            for r, pull in enumerate(self.outputs):
                if pull in polled:
                    for data in _drain(pull.recv):
                        self.on_outputs(r, decode(data))
            if self.from_frontend in polled:
                for data in _drain(self.from_frontend.recv):
                    if not self.on_frontend(decode(data)):
                        return
            now = time.monotonic()
            if self.dispatcher.changed and now >= self.next_report:
                try:
                    self.to_metrics.send(encode(self.dispatcher.snapshot(self.index)),
                                         zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the frontend is not reading: the next report carries the same
                self.next_report = now + STATS_INTERVAL

    def on_outputs(self, replica: int, msg: TokenOutputs | LoraUpdated) -> None:
        if isinstance(msg, LoraUpdated):
            self._lora_settled(*self.lora_updates.answer(replica, msg))
            return
        if msg.stats is not None and self.to_metrics is None:
            self.to_frontend.send(encode(msg.stats))  # a single engine's: the frontend's metrics
        elif msg.stats is not None:
            self.dispatcher.on_stats(replica, msg.stats)
        for out in msg.outputs:
            self.dispatcher.on_output(out)
        outputs, aborts = self.worker.on_outputs(msg)
        for abort in aborts:
            self._to_replica(replica, abort)
        for out in outputs:
            self.to_frontend.send(encode(out))
            if out.rid not in self.worker.states:
                self.dispatcher.finish(out.rid)

    def on_frontend(self, msg: object) -> bool:
        """Handle one message from the frontend (or the launcher); False on Shutdown."""
        if isinstance(msg, GenerateRequest):
            reply = self.worker.on_request(msg)
            if isinstance(reply, TokenizedRequest):
                self._dispatch(reply)
            else:
                self.to_frontend.send(encode(reply))
        elif isinstance(msg, TokenizeRequest | DetokenizeRequest):
            self.to_frontend.send(encode(self.worker.on_tokenize(msg)))
        elif isinstance(msg, AbortRequest):
            self.worker.on_abort(msg)
            self._to_replica(self.dispatcher.finish(msg.rid), msg)
        elif isinstance(msg, SessionOpen):
            self.worker.on_session(msg)
            try:
                self._to_replica(self.dispatcher.open_session(msg.session_id, msg.ttl,
                                                              msg.parent), msg)
            except NoReplica:
                pass  # its first turn gets the error
        elif isinstance(msg, SessionClose):
            self.worker.on_session(msg)
            self._to_replica(self.dispatcher.close_session(msg.session_id), msg)
        elif isinstance(msg, LoraUpdate):
            msg.reply_to = self.index
            live = [r for r in range(len(self.schedulers)) if self.dispatcher.is_alive(r)]
            self._lora_settled(self.lora_updates.start(msg, live), [])
            for r in live:
                self._to_replica(r, msg)
        elif isinstance(msg, ReplicaDown):
            for settled in self.lora_updates.replica_down(msg.replica):
                self._lora_settled(*settled)
            lost, again = self.dispatcher.replica_down(msg.replica)
            for req in again:
                self._dispatch(req)
            for rid in lost:
                self.worker.states.pop(rid, None)
                self.to_frontend.send(encode(RequestOutput(
                    rid=rid, finish_reason="error", status=503,
                    error=f"data-parallel replica {msg.replica} stopped while serving this "
                          f"request ({msg.reason}); retry it")))
        elif isinstance(msg, Shutdown):
            return False
        return True

    def _lora_settled(self, answer: LoraUpdated | None,
                      undo: list[tuple[int, LoraUpdate]]) -> None:
        for replica, unload in undo:
            self._to_replica(replica, unload)
        if answer is not None:
            self.to_frontend.send(encode(answer))

    def _dispatch(self, req: TokenizedRequest) -> None:
        """Send a tokenized request to its replica, or its error to the frontend if none serves."""
        try:
            replica, reopen = self.dispatcher.route(req)
        except NoReplica as exc:
            self.worker.states.pop(req.rid, None)
            self.to_frontend.send(encode(RequestOutput(rid=req.rid, finish_reason="error",
                                                       status=503, error=str(exc))))
            return
        if reopen is not None:
            self._to_replica(replica, SessionOpen(req.session_id, reopen))
        self._to_replica(replica, req)

    def _to_replica(self, replica: int | None, msg: object) -> None:
        """Send ``msg`` to ``replica``; None (a request or session no replica holds) sends
        nothing, and neither does a dead replica (its socket would only queue)."""
        if replica is not None and self.dispatcher.is_alive(replica):
            self.schedulers[replica].send(encode(msg))


def _drain(recv: Callable[[int], object]) -> Iterator:
    """What ``recv`` (a socket's recv or recv_multipart) has waiting, without blocking."""
    while True:
        try:
            yield recv(zmq.NOBLOCK)
        except zmq.Again:
            return


def run(spec: LaunchSpec, ctx: zmq.Context) -> None:
    tokenizer = load_tokenizer(spec.config.model, spec.config.chat_template)
    tokenizer.model_max_length = 1 << 30  # the scheduler checks lengths against the context
    # The launcher resolved the context (--context-len, else the model's) into the config.
    worker = TokenizerWorker(tokenizer, spec.index, context_len=spec.config.context_len,
                             special_in_content=spec.config.allow_special_tokens_in_content)
    worker.prepare_grammar()  # beside the worker's weight load, before this process is ready
    control = ctx.socket(zmq.PUSH)
    control.connect(spec.endpoints.control)
    TokenizerLoop(spec, ctx, worker).run(control)
